"""Reward functions, chosen by name in config (reward.name), and a process pool that scores responses off the training
ranks' critical path.

A reward function is `fn(response: str, answer: str | None, **kwargs) -> float`. Built in: `math` (math-verify:
parses the reference and the response, LaTeX or plain, and checks mathematical equivalence), `exact_match`
(whitespace/case-normalised string, or numeric, equality). `reward.name: "my_pkg.rewards:score"` loads a user
function by dotted path.
"""
from .functions import REWARDS, exact_match, math_reward, register_reward, resolve_reward
from .pool import RewardPool

__all__ = ["REWARDS", "RewardPool", "exact_match", "math_reward", "register_reward", "resolve_reward"]
