"""A real SGLang server on a tiny local model, for tests (started and always stopped)."""
from __future__ import annotations

from contextlib import contextmanager

from ..rollout import ServerConfig, SGLangServer
from .models import tiny_model_dir


@contextmanager
def tiny_engine(family: str, log_dir: str, tp_size: int = 1, extra_args: tuple = (), **model_overrides):
    server = SGLangServer(ServerConfig(model_path=tiny_model_dir(family, **model_overrides), log_dir=log_dir,
                                       tp_size=tp_size, extra_args=list(extra_args))).start()
    try:
        yield server
    finally:
        server.stop()


@contextmanager
def run_engine(config: str, model_path: str, log_dir: str):
    """The SGLang server a `megarl train <config>` run would start for itself (engine_server_config: dtype, seed, MoE
    routing flags, ...), started and always stopped. Several runs given its URL (rollout.engine.urls=[url]) share it
    instead of each starting one (~25 s per start on CPU); each run first pushes its own weights into it."""
    from ..rollout.server import engine_server_config
    from ..trainer.config import fleet_spec, load_train_config

    with SGLangServer(engine_server_config(fleet_spec(load_train_config(config)), model_path, log_dir=log_dir)) as server:
        yield server
