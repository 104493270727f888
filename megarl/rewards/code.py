"""Reward for code generation: run the response's Python with the prompt's tests appended, in the sandbox.

`answer` is test code (e.g. "assert add(1, 2) == 3"). The response's last ```python (or bare ```) block is the
solution, or the whole response when it has none. Passing all tests scores 1.0; anything else raises
CodeRewardFailure with the sandbox's reason, which RewardPool turns into reward 0.0 with the reason logged and counted.
SandboxUnavailable is not a failure of the response and is left to propagate (fail closed).

Limits come from the reward kwargs (reward.kwargs in config): cpu_s, wall_s, memory_mb, file_mb, processes,
output_bytes (see SandboxLimits).
"""
from __future__ import annotations

import dataclasses
import re
import secrets

from .functions import register_reward
from ..sandbox import SandboxLimits, run_python

# an opening fence with an optional language tag, then everything up to the closing fence (or the end of a
# response that was cut off mid-block)
_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_TAGS = {"", "python", "py", "python3"}
_LIMIT_FIELDS = {f.name for f in dataclasses.fields(SandboxLimits)}


class CodeRewardFailure(ValueError):
    """The response's code did not pass the tests; the message is why."""


def extract_code(response: str) -> str:
    """The last Python (or untagged) fenced block, else the whole response."""
    blocks = [body for tag, body in _FENCE.findall(response) if tag.lower() in _PYTHON_TAGS]
    return blocks[-1] if blocks else response


def limits_from(kwargs: dict) -> SandboxLimits:
    unknown = sorted(set(kwargs) - _LIMIT_FIELDS)
    if unknown:
        raise ValueError(f"reward code: unknown reward.kwargs {unknown}; accepted: {sorted(_LIMIT_FIELDS)}")
    return SandboxLimits(**kwargs)


def program(solution: str, tests: str, token: str) -> str:
    """Solution, then tests, then a completion line: a solution that ends the process early with status 0
    (sys.exit(0), os._exit(0)) never prints the token, so it cannot pass without running the tests."""
    return f"{solution}\n\n{tests}\n\nprint({token!r})\n"


@register_reward("code")
def code_reward(response: str, answer: str | None, **kwargs) -> float:
    """1.0 when the response's code passes the test code in `answer`; otherwise raises CodeRewardFailure."""
    if answer is None:
        raise ValueError("reward code needs test code as the answer for every prompt (data.answer_key)")
    limits = limits_from(kwargs)
    token = f"megarl-tests-done-{secrets.token_hex(8)}"
    result = run_python(program(extract_code(response), answer, token), limits=limits)
    if not result.ok:
        raise CodeRewardFailure(result.reason)
    if token not in result.stdout:
        raise CodeRewardFailure("exited with status 0 before the tests finished (the code ended the process early)")
    return 1.0


code_reward.requires_sandbox = True  # RewardPool probes the sandbox at start-up (fail closed)
