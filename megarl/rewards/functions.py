"""Built-in reward functions and the name -> function registry."""
from __future__ import annotations

import importlib
import re
from typing import Callable

from ..algorithms.registry import registrar

REWARDS: dict[str, Callable] = {}
register_reward = registrar(REWARDS)

_NUMBER = re.compile(r"^[-+]?\d+(\.\d+)?$")


def _normalise(text: str) -> str:
    return " ".join(text.strip().rstrip(".").split()).lower()


@register_reward("exact_match")
def exact_match(response: str, answer: str | None, **_) -> float:
    """1.0 when the response equals the answer after trimming whitespace, a final period and case; numbers compare by
    value ("042" == "42")."""
    if answer is None:
        raise ValueError("reward exact_match needs an answer for every prompt (data.answer_key)")
    got, want = _normalise(response), _normalise(str(answer))
    if _NUMBER.match(got) and _NUMBER.match(want):
        return float(float(got) == float(want))
    return float(got == want)


@register_reward("math")
def math_reward(response: str, answer: str | None, **_) -> float:
    """1.0 when math-verify finds the response's final answer equivalent to the reference answer."""
    from math_verify import parse, verify

    if answer is None:
        raise ValueError("reward math needs an answer for every prompt (data.answer_key)")
    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    pred = parse(response)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred))


def resolve_reward(name: str) -> Callable:
    """A registered reward, or "package.module:function" imported by dotted path."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward.name={name!r}: cannot import {attr!r} from {module!r} ({e})") from None
        if not callable(fn):
            raise ValueError(f"reward.name={name!r} is not callable")
        return fn
    raise ValueError(f"reward.name={name!r} is unknown; choose one of {sorted(REWARDS)} or give "
                     "'package.module:function'")
