"""Evaluation math for `megarl eval` and the trainer's held-out evaluation: pure functions on plain Python lists.

    pass_at_k(n=16, c=3, k=4)                  # unbiased pass@k of one prompt (Chen et al. 2021)
    pass_at_k_curve(correct)                   # {k: mean pass@k over prompts} for k = 1..n
    mean_at_n(correct)                         # mean correctness over all samples (= pass@1)
    majority_at_n(groups)                      # majority-vote accuracy (maj@n) over prompts
    perplexity(log_probs), mean_entropy(entropies)   # token-weighted over all responses
    plot_pass_at_k({"before": c0, "after": c1}, "pass_at_k.png")

`correct[p][s]` is whether sample s of prompt p is correct; `groups[p][s]` is (final answer text or None, correct).
"""
from __future__ import annotations

import math
import os
from typing import Sequence

from .rewards.functions import normalise_answer  # noqa: F401  (one normaliser: rewards and voting)


def _check_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i) (in log space, so no huge binomials); exactly 1.0 when n - c < k
    (every k-subset then holds a correct sample) and exactly 0.0 when c == 0.
    """
    for name, value in (("n", n), ("c", c), ("k", k)):
        _check_int(name, value)
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n (correct samples among n), got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n (cannot pick {k} of {n} samples), got n={n}, k={k}")
    if n - c < k:
        return 1.0
    if c == 0:
        return 0.0
    # i > n - c >= k, so every factor 1 - k/i lies in (0, 1): log1p is finite and expm1 keeps small results accurate.
    return -math.expm1(math.fsum(math.log1p(-k / i) for i in range(n - c + 1, n + 1)))


def _samples_per_prompt(correct: Sequence[Sequence[bool]], what: str) -> int:
    """The common number of samples per prompt; ValueError naming the first prompt that differs."""
    if len(correct) == 0:
        raise ValueError(f"{what} needs at least one prompt")
    n = len(correct[0])
    if n == 0:
        raise ValueError(f"{what}: prompt 0 has no samples")
    for index, samples in enumerate(correct):
        if len(samples) != n:
            raise ValueError(f"{what} needs the same number of samples for every prompt: prompt {index} has "
                             f"{len(samples)}, prompt 0 has {n}")
    return n


def pass_at_k_curve(correct: Sequence[Sequence[bool]]) -> dict[int, float]:
    """{k: mean over prompts of pass_at_k(n, c_p, k)} for k = 1..n; every prompt must have the same n samples."""
    n = _samples_per_prompt(correct, "pass_at_k_curve")
    counts = [sum(1 for ok in samples if ok) for samples in correct]
    return {k: math.fsum(pass_at_k(n, c, k) for c in counts) / len(counts) for k in range(1, n + 1)}


def mean_at_n(correct: Sequence[Sequence[bool]]) -> float:
    """Mean correctness over all samples of all prompts (= pass@1 when every prompt has the same n)."""
    total = sum(len(samples) for samples in correct)
    if total == 0:
        raise ValueError("mean_at_n needs at least one sample")
    return sum(1 for samples in correct for ok in samples if ok) / total


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most frequent normalised answer (None/unparseable excluded); ties go to the first to occur; None if no
    answer parses."""
    counts: dict[str, int] = {}  # insertion order = first occurrence, and max() keeps the first of equal counts
    for answer in answers:
        key = normalise_answer(answer)
        if key is not None:
            counts[key] = counts.get(key, 0) + 1
    if not counts:
        return None
    return max(counts, key=counts.__getitem__)


def majority_at_n(groups: Sequence[Sequence[tuple[str | None, bool]]]) -> float:
    """Majority-vote accuracy: mean over prompts of whether the voted answer is correct.

    Each prompt is a list of (final answer text or None, correct) per sample. The vote is `majority_answer` of the
    texts; the prompt scores the fraction of samples carrying the voted answer that are correct (1 or 0 whenever the
    grader is consistent on equal answers), and 0 when no sample has a parseable answer.
    """
    if len(groups) == 0:
        raise ValueError("majority_at_n needs at least one prompt")
    scores = []
    for index, samples in enumerate(groups):
        if len(samples) == 0:
            raise ValueError(f"majority_at_n: prompt {index} has no samples")
        voted = majority_answer([answer for answer, _ in samples])
        if voted is None:
            scores.append(0.0)
            continue
        verdicts = [bool(ok) for answer, ok in samples if normalise_answer(answer) == voted]
        scores.append(sum(verdicts) / len(verdicts))
    return math.fsum(scores) / len(scores)


def _token_mean(values: Sequence[Sequence[float]], what: str) -> float:
    total = sum(len(v) for v in values)
    if total == 0:
        raise ValueError(f"{what} needs at least one token")
    return math.fsum(x for v in values for x in v) / total


def perplexity(log_probs: Sequence[Sequence[float]]) -> float:
    """exp(-mean log-prob), the mean taken over all tokens of all responses (longer responses weigh more)."""
    mean = _token_mean(log_probs, "perplexity")
    try:
        return math.exp(-mean)
    except OverflowError:
        return math.inf


def mean_entropy(entropies: Sequence[Sequence[float]]) -> float:
    """Mean per-token entropy over all tokens of all responses (token-weighted, like `perplexity`)."""
    return _token_mean(entropies, "mean_entropy")


def plot_pass_at_k(curves: dict[str, dict[int, float]], path: str, title: str = "pass@k") -> str:
    """Write a PNG of pass@k (percent) against k, one line per labelled curve; log2 x axis once k reaches 8.

    `curves` maps a label ("before", "after") to a `pass_at_k_curve` result. Returns `path`.
    """
    if not curves or not any(curves.values()):
        raise ValueError("plot_pass_at_k needs at least one non-empty curve")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator

    ks = sorted({k for curve in curves.values() for k in curve})
    fig, ax = plt.subplots(figsize=(6, 4))
    try:
        for label, curve in curves.items():
            x = sorted(curve)
            ax.plot(x, [100.0 * curve[k] for k in x], marker="o", markersize=3, label=label)
        if ks[-1] >= 8:
            ax.set_xscale("log", base=2)
            ticks = [k for k in ks if k & (k - 1) == 0] + ([ks[-1]] if ks[-1] & (ks[-1] - 1) else [])
            ax.xaxis.set_major_locator(FixedLocator(ticks))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.set_xticklabels([str(k) for k in ticks])
        else:
            ax.set_xticks(ks)
        ax.set_ylim(0, 100)
        ax.set_xlabel("k (samples per prompt)")
        ax.set_ylabel("pass@k (%)")
        ax.set_title(title)
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="lower right")
        fig.tight_layout()
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        fig.savefig(path, dpi=90)
    finally:
        plt.close(fig)
    return path
