"""The SGLang rollout engine: server process, HTTP client."""
from .client import Completion, EngineClient
from .server import EngineError, ServerConfig, SGLangServer, server_command

__all__ = ["Completion", "EngineClient", "EngineError", "SGLangServer", "ServerConfig", "server_command"]
