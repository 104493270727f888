"""Real SGLang servers for tests and benchmarks: a tiny local model's (started and always stopped), and the one a run's
config would start (run_server_config; launched ahead in tests by megarl.testing.fixtures.early_run_engine)."""
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


def run_server_config(config: str, model_path: str, log_dir: str) -> ServerConfig:
    """The ServerConfig of the SGLang server a `megarl train <config>` run would start for itself
    (engine_server_config: dtype, seed, MoE routing and LoRA flags, ...), serving `model_path`."""
    from ..rollout.server import engine_server_config
    from ..trainer.config import fleet_spec, load_train_config

    return engine_server_config(fleet_spec(load_train_config(config)), model_path, log_dir=log_dir)
