"""The chaos benchmark's reward (benchmarks/chaos.py): 1.0 for the right sum (exact_match), else half the share of
digits in the response, so that a run from random weights has rewards that differ within a group, non-zero
advantages and gradients, and a fault that changed what was trained shows in the metrics. Plus two faults the
benchmark arms by creating a file in `arms`: `hang` makes the next call hang (a reward process stuck in a system call),
`nan` makes the next call return NaN (a broken reward, whose NaN reaches the loss). Each fires once: the call that
renames the armed file to `<name>.fired` is the one that fails. Unarmed, every run scores alike."""
import math
import os
import time

from megarl.rewards import exact_match


def arithmetic_with_faults(response: str, answer, arms: str, **kwargs) -> float:
    for fault in ("hang", "nan"):
        try:
            os.rename(os.path.join(arms, fault), os.path.join(arms, fault + ".fired"))
        except FileNotFoundError:  # not armed, or another call took it
            continue
        if fault == "hang":
            time.sleep(10_000)
        return math.nan
    if exact_match(response, answer, **kwargs):
        return 1.0
    return 0.5 * sum(c.isdigit() for c in response) / max(len(response), 1)
