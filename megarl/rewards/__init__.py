"""Reward functions, chosen by name in config (reward.name), and a process pool that scores responses off the training
ranks' critical path.

A reward function is `fn(response: str, answer: str | None, **kwargs) -> float` (the RewardFn protocol; checked
against reward.kwargs at start-up). Built in: `math` (math-verify:
parses the reference and the response, LaTeX or plain, and checks mathematical equivalence), `exact_match`
(whitespace/case-normalised string, or numeric, equality), `code` (the response's last Python block runs in
megarl.sandbox and is judged outside it against the answer's tests: 1.0 when all pass; see megarl.rewards.code).
`reward.name: "my_pkg.rewards:score"` loads a user function by dotted path. `judge` is a generative reward: a model
served by an engine pool judges each response (megarl.rewards.judge; scored by the rollout, not in this pool);
`reasoning_gym` scores with the response's reasoning-gym task's own scorer
(megarl.rewards.reasoning_gym); `verifier_agreement` trains a verifier: 1 - |its score - the labelled score|
(megarl.rewards.judge).
"""
from . import code  # registers "code" (tests run in the sandbox)
from . import judge as _judge  # registers "judge" (a generative reward, scored by the rollout through its pool)
from . import reasoning_gym as _reasoning_gym  # registers "reasoning_gym" (each task's own score_answer)
from .functions import REWARDS, RewardFn, check_reward_call, exact_match, math_reward, register_reward, resolve_reward
from .pool import RewardPool
from ..sandbox import SandboxLimits, SandboxResult, SandboxUnavailable, check_sandbox, run_python

__all__ = ["REWARDS", "RewardFn", "RewardPool", "SandboxLimits", "SandboxResult", "SandboxUnavailable",
           "check_reward_call", "check_sandbox",
           "exact_match", "math_reward", "register_reward", "resolve_reward", "run_python"]
