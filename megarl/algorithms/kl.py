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

verl's other names are accepted as aliases: kl = k1, mse = k2, low_var_kl = k3 (and kl+, low_var_kl+).

k3 is clamped as verl clamps it: the log-ratio to [-20, 20] (so exp cannot overflow) and the estimate to at most 10
(one very unlikely token cannot dominate the penalty; a token whose k3 exceeds 10 gets no KL gradient).
"""
from __future__ import annotations

import torch

KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3", "kl+": "k1+", "low_var_kl+": "k3+"}  # verl's names
KL_ESTIMATORS = ("k1", "k2", "k3", "abs", "k1+", "k3+", "abs+", *KL_ALIASES)
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
    kind = KL_ALIASES.get(kind, kind)
    log_ratio = log_prob - ref_log_prob
    if not kind.endswith("+"):
        return _estimate(log_ratio, kind)
    k2 = 0.5 * log_ratio ** 2
    return k2 - k2.detach() + _estimate(log_ratio, kind[:-1]).detach()


TOP_K_REST_FLOOR = 1e-8  # the "rest of the vocabulary" probability is floored: rounding can push 1 - sum(top-k) to <= 0


def _coarsened(top_log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the k probabilities, the rest's probability 1 - their sum, floored) from [..., k] log-probs."""
    p = top_log_probs.float().exp()
    return p, (1 - p.sum(-1)).clamp(min=TOP_K_REST_FLOOR)


TOP_K_KL = ("reverse", "forward")


def topk_kl(student_top_log_probs: torch.Tensor, teacher_top_log_probs: torch.Tensor,
            direction: str = "reverse") -> torch.Tensor:
    """The student-teacher KL at each position over the teacher's top-k + the rest (see topk_reverse_kl).
    direction "reverse": KL(student || teacher), mode seeking, OPD's; "forward": KL(teacher || student) =
    sum_j q_j (log q_j - log p_j) + q_rest (log q_rest - log p_rest), the soft-label cross-entropy of supervised
    distillation (GKD's forward option): its gradient on a token the teacher likes does not shrink with the
    student's own probability of it, as the reverse KL's does."""
    if direction == "reverse":
        return topk_reverse_kl(student_top_log_probs, teacher_top_log_probs)
    if direction != "forward":
        raise ValueError(f"algorithm.opd_top_k_kl={direction!r} is unknown; choose one of {list(TOP_K_KL)}")
    student, teacher = student_top_log_probs.float(), teacher_top_log_probs.float()
    q, q_rest = _coarsened(teacher)
    _, p_rest = _coarsened(student)
    return (q * (teacher - student)).sum(-1) + q_rest * (q_rest.log() - p_rest.log())


def topk_reverse_kl(student_top_log_probs: torch.Tensor, teacher_top_log_probs: torch.Tensor) -> torch.Tensor:
    """KL(student || teacher) at each position between the two distributions coarsened to k + 1 outcomes: each of
    the teacher's top-k tokens there, and "any other token" (1 - the top-k's probability, under each model).
    [..., k] log-probs of the same k token ids under each model -> [...].

    Exact, not sampled: sum_j p_j (log p_j - log q_j) + p_rest (log p_rest - log q_rest). Coarsening never increases
    a KL (data processing), so this is a lower bound on the full-vocabulary KL, equal to it when the top-k hold both
    distributions' mass. Its gradient moves the student's probability of each top-k token toward the teacher's, and
    its mass outside them as one. On-policy distillation with algorithm.opd_top_k (the student's own samples, the
    teacher's top-k at each of their positions; GKD and MiniLLM use the full distribution the same way)."""
    student, teacher = student_top_log_probs.float(), teacher_top_log_probs.float()
    (p, p_rest), (_, q_rest) = _coarsened(student), _coarsened(teacher)
    return (p * (student - teacher)).sum(-1) + p_rest * (p_rest.log() - q_rest.log())
