"""Multi-turn environments (tool use): the Env interface and registry, built-in tools, and the token-in/token-out
episode runner the rollout uses when `env.name` is set."""
from .base import ENVS, Env, EnvStep, make_env, register_env
from .episode import Episode, run_episodes
from .tool_env import ToolCallParser, ToolEnv
from .tools import TOOLS, Tool, calculator, register_tool, resolve_tools

__all__ = ["ENVS", "Env", "EnvStep", "Episode", "TOOLS", "Tool", "ToolCallParser", "ToolEnv", "calculator",
           "make_env", "register_env", "register_tool", "resolve_tools", "run_episodes"]
