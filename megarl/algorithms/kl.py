"""KL estimators between the trained policy and a reference, per token, from samples of the policy.

Definitions follow Schulman's note (http://joschu.net/blog/kl-approx.html) and verl's `kl_penalty` names, with
x = log pi - log ref:

  k1    x                                   unbiased value; its expected gradient is not the KL's gradient
  k2    x^2 / 2                             biased value; its gradient is an unbiased estimate of grad KL
  k3    exp(-x) + x - 1                     unbiased, >= 0, low variance (verl's low_var_kl)
  abs   |x|
  k1+, k3+, abs+                            straight-through: the value of k1 / k3 / abs, the gradient of k2
                                            (k2 - sg(k2) + sg(value)), so the penalty reports the chosen
                                            estimator while its gradient is the unbiased one of k2

k3 is clamped as verl clamps it: the log-ratio to [-20, 20] (so exp cannot overflow) and the estimate to at most 10
(one very unlikely token cannot dominate the penalty; a token whose k3 exceeds 10 gets no KL gradient).
"""
from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+")
K3_LOG_RATIO_CLAMP = 20.0
K3_MAX = 10.0


def _estimate(log_ratio: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio ** 2
    if kind == "k3":
        neg = (-log_ratio).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return (torch.exp(neg) - neg - 1).clamp(max=K3_MAX)
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"algorithm.kl_estimator={kind!r} is unknown; choose one of {list(KL_ESTIMATORS)}")


def kl_estimate(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (see the module docstring for each `kind`)."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"algorithm.kl_estimator={kind!r} is unknown; choose one of {list(KL_ESTIMATORS)}")
    log_ratio = log_prob - ref_log_prob
    if not kind.endswith("+"):
        return _estimate(log_ratio, kind)
    k2 = 0.5 * log_ratio ** 2
    return k2 - k2.detach() + _estimate(log_ratio, kind[:-1]).detach()
