"""The SGLang rollout engine: server process, HTTP client, router over several engines."""
from .client import Completion, EngineClient
from .router import EngineRouter
from .server import EngineError, ServerConfig, SGLangServer, server_command

__all__ = ["Completion", "EngineClient", "EngineRouter", "EngineError", "SGLangServer", "ServerConfig", "server_command"]
