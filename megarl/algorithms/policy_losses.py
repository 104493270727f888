"""Policy losses: per-token loss tensors, chosen by name; users register their own with @register_policy_loss.

Every loss has the signature

    fn(log_prob, old_log_prob, advantages, mask, cfg, seq_sum) -> (loss [b, s], stats)

log_prob carries the gradient; old_log_prob and advantages do not. cfg is the AlgorithmConfig. seq_sum(x) sums a
token tensor within each sequence (across context-parallel shards), for sequence-level ratios. stats maps a name to a
per-token 0/1 or value tensor; the loss function averages them over the response tokens (clip fractions, ratio).
Aggregation over tokens and sequences happens outside (megarl.algorithms.aggregation).
"""
from __future__ import annotations

from typing import Callable

import torch

from .registry import registrar

POLICY_LOSSES: dict[str, Callable] = {}
register_policy_loss = registrar(POLICY_LOSSES)


def _clipped_surrogate(ratio, advantages, eps_low, eps_high, dual_clip):
    surrogate = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = torch.maximum(surrogate, clipped)
    stats = {"clip_frac_low": ((ratio < 1 - eps_low) & (advantages < 0)).float(),
             "clip_frac_high": ((ratio > 1 + eps_high) & (advantages > 0)).float()}
    if dual_clip is not None:
        # Dual-clip PPO: for negative advantages also bound the loss by -A * c (c > 1).
        capped = torch.minimum(loss, -advantages * dual_clip)
        stats["dual_clip_frac"] = ((advantages < 0) & (capped < loss)).float()
        loss = torch.where(advantages < 0, capped, loss)
    return loss, stats


@register_policy_loss("ppo_clip")
def ppo_clip(log_prob, old_log_prob, advantages, mask, cfg, seq_sum):
    """PPO clipped surrogate with separate low/high bounds (DAPO clip-higher) and optional dual clip."""
    ratio = torch.exp(log_prob - old_log_prob)
    loss, stats = _clipped_surrogate(ratio, advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip)
    return loss, dict(stats, ratio=ratio.detach())


@register_policy_loss("gspo")
def gspo(log_prob, old_log_prob, advantages, mask, cfg, seq_sum):
    """GSPO: the ratio is per sequence, exp(mean_t log(pi/pi_old)), clipped per sequence. Token form:
    s_i(theta) = sg(s_i) * pi_t / sg(pi_t), which has the sequence ratio's value and a per-token gradient."""
    log_ratio = (log_prob - old_log_prob) * mask
    seq_log_ratio = seq_sum(log_ratio) / seq_sum(mask.float()).clamp(min=1)
    seq_ratio = torch.exp(seq_log_ratio.detach())[:, None]
    ratio = seq_ratio * torch.exp(log_prob - log_prob.detach())
    loss, stats = _clipped_surrogate(ratio, advantages, cfg.clip_eps_low, cfg.clip_eps_high, None)
    return loss, dict(stats, ratio=ratio.detach())


@register_policy_loss("cispo")
def cispo(log_prob, old_log_prob, advantages, mask, cfg, seq_sum):
    """CISPO: -sg(clip(ratio, 1-eps_low, 1+eps_high)) * A * log pi; every token keeps a gradient."""
    ratio = torch.exp(log_prob - old_log_prob)
    weight = ratio.clamp(1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high).detach()
    loss = -weight * advantages * log_prob
    stats = {"clip_frac_low": (ratio < 1 - cfg.clip_eps_low).float(),
             "clip_frac_high": (ratio > 1 + cfg.clip_eps_high).float(), "ratio": ratio.detach()}
    return loss, stats


@register_policy_loss("reinforce")
def reinforce(log_prob, old_log_prob, advantages, mask, cfg, seq_sum):
    """Plain on-policy REINFORCE: -A * log pi."""
    return -advantages * log_prob, {"ratio": torch.exp(log_prob - old_log_prob).detach()}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None):
    """Clipped value loss for the critic: 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip within +-clip of v_old."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, {}
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), {"vf_clip_frac": (clipped > unclipped).float()}
