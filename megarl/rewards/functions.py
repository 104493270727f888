"""Built-in reward functions and the name -> function registry."""
from __future__ import annotations

import importlib
import re
from typing import Callable

from ..algorithms.registry import registrar

REWARDS: dict[str, Callable] = {}
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


def resolve_reward(name: str, field: str = "reward.name") -> Callable:
    """A registered reward, or "package.module:function" imported by dotted path (`field`: the config key named in
    the error)."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"{field}={name!r}: cannot import {attr!r} from {module!r} ({e})") from None
        if not callable(fn):
            raise ValueError(f"{field}={name!r} is not callable")
        return fn
    raise ValueError(f"{field}={name!r} is unknown; choose one of {sorted(REWARDS)} or give "
                     "'package.module:function'")
