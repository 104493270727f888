"""KL estimators between the trained policy and a reference, per token (Schulman's k1/k2/k3)."""
from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "k3",
                clamp: float = 10.0) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi.

    k1 = log pi - log ref (unbiased, high variance, can be negative); k2 = (log pi - log ref)^2 / 2;
    k3 = exp(log ref - log pi) - (log ref - log pi) - 1 (unbiased, >= 0, low variance), its log-ratio clamped to
    [-clamp, clamp] so one very unlikely token cannot blow it up.
    """
    log_ratio = log_prob - ref_log_prob
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio ** 2
    if kind == "k3":
        neg = (-log_ratio).clamp(-clamp, clamp)
        return torch.exp(neg) - neg - 1
    raise ValueError(f"algorithm.kl_estimator={kind!r} is unknown; choose one of {KL_ESTIMATORS}")
