"""Advantage estimators: small pure functions over [batch, seq] token tensors, chosen by name.

Conventions: `mask` [b, s] is 1 on response tokens whose log-prob is trained; `scores` [b] is one scalar reward per
sequence (GDPO: [b, k], one column per reward); `group_ids` [b] says which prompt a sample belongs to (the n samples of
one prompt share an id). Every estimator returns (advantages [b, s], returns [b, s]), zero outside the mask.

Batch-level statistics (REINFORCE++ whitening) reduce over `group`, the data-parallel process group, so the result
does not depend on how the global batch is split across ranks; a prompt's samples must sit on one rank.
"""
from __future__ import annotations

from typing import Callable

import torch

from .registry import registrar
import torch.distributed as dist

ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
register_advantage = registrar(ADVANTAGE_ESTIMATORS)
# Estimators whose baseline comes from the other samples of the same prompt: with one sample per prompt every
# advantage is 0 (or, for rloo, undefined). TrainConfig.validate checks rollout.n_samples against this.
NEEDS_GROUPS = {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "gdpo"}


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor):
    """Per-sample mean, unbiased std and size of its group."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.shape[0]
    sums = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, inverse, scores)
    mean = sums / counts
    sq = torch.zeros(n_groups, dtype=scores.dtype).index_add_(0, inverse, (scores - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return mean[inverse], std[inverse], counts[inverse]


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, group=None, eps: float = 1e-8,
                  shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / std over the masked tokens of the whole (global) batch."""
    stats = torch.stack([(values * mask).sum(), mask.sum(), (values ** 2 * mask).sum()]).double()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    total, count, total_sq = stats
    mean = total / count
    var = (total_sq / count - mean ** 2) * count / (count - 1).clamp(min=1)  # unbiased
    whitened = (values - mean.to(values.dtype)) * torch.rsqrt(var.to(values.dtype) + eps)
    if not shift_mean:
        whitened = whitened + mean.to(values.dtype)
    return whitened * mask


def _broadcast(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_seq[:, None] * mask


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1}, over the masked tokens of each sequence."""
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype)
    for t in reversed(range(token_rewards.shape[1])):
        running = token_rewards[:, t] + gamma * running * mask[:, t]
        returns[:, t] = running
    return returns * mask


def last_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token rewards with the sequence score on the last response token."""
    last = (mask * torch.arange(mask.shape[1])).argmax(dim=1)
    rewards = torch.zeros_like(mask, dtype=scores.dtype)
    rewards[torch.arange(mask.shape[0]), last] = scores * (mask.sum(1) > 0)
    return rewards


@register_advantage("gae")
def gae(*, values: torch.Tensor, mask: torch.Tensor, token_rewards: torch.Tensor | None = None,
        scores: torch.Tensor | None = None, kl: torch.Tensor | None = None, kl_coef: float = 0.0,
        gamma: float = 1.0, lam: float = 0.95, **_):
    """Generalised advantage estimation with a critic's values [b, s] (value of the state before each token).

    Rewards are token_rewards, or else the sequence scores on the last token minus kl_coef * kl on every token
    (KL in the reward)."""
    if token_rewards is None:
        token_rewards = last_token_rewards(scores, mask)
        if kl is not None and kl_coef:
            token_rewards = token_rewards - kl_coef * kl * mask
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros(values.shape[0], dtype=values.dtype)
    running = torch.zeros_like(next_value)
    for t in reversed(range(token_rewards.shape[1])):
        m = mask[:, t]
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m + running * (1 - m)
        next_value = values[:, t] * m + next_value * (1 - m)
        advantages[:, t] = running
    advantages = advantages * mask
    return advantages, (advantages + values) * mask


@register_advantage("grpo")
def grpo(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6, **_):
    """GRPO: (r - group mean) / (group std + eps), the same for every token of the sample."""
    mean, std, _ = _group_stats(scores, group_ids)
    adv = (scores - mean) / (std + eps)
    return _broadcast(adv, mask), _broadcast(scores, mask)


@register_advantage("dr_grpo")
def dr_grpo(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, **_):
    """Dr. GRPO: r - group mean (no std division); pair with aggregation seq-mean-token-sum-norm."""
    mean, _, _ = _group_stats(scores, group_ids)
    return _broadcast(scores - mean, mask), _broadcast(scores, mask)


@register_advantage("rloo")
def rloo(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, **_):
    """RLOO: r_i - mean of the other samples of the same prompt."""
    mean, _, counts = _group_stats(scores, group_ids)
    if bool((counts < 2).any()):
        raise ValueError("rloo needs at least 2 samples per prompt (rollout.n_samples >= 2)")
    adv = (scores - mean) * counts / (counts - 1)
    return _broadcast(adv, mask), _broadcast(scores, mask)


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(*, scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                        kl_coef: float = 0.0, gamma: float = 1.0, group=None, **_):
    """REINFORCE++: token rewards (score on the last token, -kl_coef*kl on every token), discounted returns,
    whitened over the global batch."""
    rewards = last_token_rewards(scores, mask)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    returns = discounted_returns(rewards, mask, gamma)
    return masked_whiten(returns, mask, group), returns


@register_advantage("reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                                 kl: torch.Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
                                 group=None, **_):
    """REINFORCE++-baseline: subtract the group mean score first, then as REINFORCE++."""
    mean, _, _ = _group_stats(scores, group_ids)
    return reinforce_plus_plus(scores=scores - mean, mask=mask, kl=kl, kl_coef=kl_coef, gamma=gamma, group=group)


@register_advantage("gdpo")
def gdpo(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, reward_weights=None,
         eps: float = 1e-6, group=None, **_):
    """GDPO (multi-reward): normalise each reward column within its group, combine with reward_weights, then whiten
    the combined advantage over the global batch."""
    if scores.dim() != 2:
        raise ValueError(f"gdpo needs scores of shape [batch, n_rewards], got {tuple(scores.shape)}")
    weights = torch.ones(scores.shape[1]) if reward_weights is None else torch.as_tensor(reward_weights,
                                                                                          dtype=scores.dtype)
    if weights.shape[0] != scores.shape[1]:
        raise ValueError(f"algorithm.reward_weights has {weights.shape[0]} entries for {scores.shape[1]} rewards")
    combined = torch.zeros(scores.shape[0], dtype=scores.dtype)
    for k in range(scores.shape[1]):
        mean, std, _ = _group_stats(scores[:, k], group_ids)
        combined = combined + weights[k] * (scores[:, k] - mean) / (std + eps)
    adv = masked_whiten(_broadcast(combined, mask), mask, group)
    return adv, _broadcast(scores @ weights, mask)


def compute_advantages(name: str, **inputs):
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"algorithm.advantage_estimator={name!r} is unknown; choose one of "
                         f"{sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name](**inputs)
