"""The reward interface, the built-in reward functions and the name -> function registry."""
from __future__ import annotations

import inspect
import logging
import re
from typing import Protocol

from ..algorithms.registry import registrar, resolve


class RewardFn(Protocol):
    """A reward: the response's text and its prompt's reference answer (None when the data has none), plus
    reward.kwargs as keyword arguments -> a float (1.0 counts as solved in pass@1, above 0.5 in held-out pass@1). It
    runs in a reward worker process (it must be importable there: registered, or "package.module:function"), one
    response at a time, within reward.timeout_s; raising scores that response 0. A reward that executes the
    response's code sets `fn.requires_sandbox = True`: the pool then proves isolation works at start-up."""

    def __call__(self, response: str, answer: str | None, **kwargs) -> float: ...


REWARDS: dict[str, RewardFn] = {}
register_reward = registrar(REWARDS)

_NUMBER = re.compile(r"^[-+]?\d+(\.\d+)?$")


def normalise_answer(text: str | None) -> str | None:
    """Canonical form of a final answer for voting, or None when there is none.

    Strips surrounding whitespace and trailing periods, collapses inner whitespace, lowercases; a plain decimal
    number is written by value ("042" -> "42", "4.0" -> "4", "-0.50" -> "-0.5", "+3" -> "3"). Empty -> None.
    """
    if text is None:
        return None
    s = " ".join(text.strip().rstrip(".").split()).lower()
    if not s:
        return None
    if _NUMBER.match(s):
        s = _canonical_number(s)
    return s


def _canonical_number(s: str) -> str:
    """A decimal literal written by value, exactly (no float rounding): "-007.50" -> "-7.5", "-0.0" -> "0"."""
    sign = "-" if s[0] == "-" else ""
    whole, _, frac = s.lstrip("+-").partition(".")
    whole, frac = whole.lstrip("0") or "0", frac.rstrip("0")
    if whole == "0" and not frac:
        return "0"
    return sign + whole + ("." + frac if frac else "")


@register_reward("exact_match")
def exact_match(response: str, answer: str | None, **_) -> float:
    """1.0 when the response equals the answer after `normalise_answer` (whitespace, a final period and case; numbers
    by value: "042" == "42", "4.0" == "4"), the normaliser majority voting uses too."""
    if answer is None:
        raise ValueError("reward exact_match needs an answer for every prompt (data.answer_key)")
    return float(normalise_answer(response) == normalise_answer(str(answer)))


class _WeTimeMathVerify(logging.Filter):
    """math-verify warns once per process that its timeouts are off; here the reward pool times each response."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_WeTimeMathVerify())


@register_reward("math")
def math_reward(response: str, answer: str | None, **_) -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the reference answer."""
    from math_verify import parse, verify

    if answer is None:
        raise ValueError("reward math needs an answer for every prompt (data.answer_key)")
    # No math-verify timeouts: its signal alarms would also time its first call's lazy set-up (5 s measured on a
    # loaded 2-core machine), scoring a correct answer 0. The reward pool already kills a response that runs past
    # reward.timeout_s (megarl.rewards.pool).
    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$", parsing_timeout=None)
    pred = parse(response, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=None))


def resolve_reward(name: str, field: str = "reward.name") -> RewardFn:
    """A registered reward, or "package.module:function" imported by dotted path (`field`: the config key named in
    the error)."""
    return resolve(REWARDS, name, field)


def check_reward_call(fn: RewardFn, kwargs: dict, field: str = "reward.name") -> None:
    """Raise ValueError when `fn(response, answer, **kwargs)` cannot be called (a signature that does not take the
    response and the answer positionally, or reward.kwargs it does not accept): at start-up, rather than every
    response scoring 0 with a TypeError."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return
    try:
        signature.bind("response", None, **kwargs)
    except TypeError as e:
        raise ValueError(f"{field}: the reward function {getattr(fn, '__name__', fn)!r}{signature} cannot be called "
                         f"as fn(response, answer, **reward.kwargs) with reward.kwargs={sorted(kwargs)} ({e}). Fix: "
                         "def fn(response, answer, **kwargs) -> float, and only the keyword arguments it takes in "
                         "reward.kwargs") from None
