"""A real SGLang server on a tiny local model, for tests (started and always stopped)."""
from __future__ import annotations

from contextlib import contextmanager

from ..rollout import ServerConfig, SGLangServer
from .models import tiny_model_dir


@contextmanager
def tiny_engine(family: str, log_dir: str, tp_size: int = 1, **model_overrides):
    server = SGLangServer(ServerConfig(model_path=tiny_model_dir(family, **model_overrides), log_dir=log_dir,
                                       tp_size=tp_size)).start()
    try:
        yield server
    finally:
        server.stop()
