"""Token selection before the loss: which response tokens an optimizer step trains, decided once per global
(mini-)batch, the same whatever the TP/PP/DP/micro-batch layout.

`loss_phases(batch, cfg, ...)` is the one entry point the trainer calls per mini-batch: it returns the ordered list of
batches that each get one optimizer step (one for every algorithm but Lopti, which gives two), with their loss_mask
narrowed to the tokens that step trains and, for clip_cov / kl_cov, `selected` set to the tokens those losses treat
apart. Normalisation: the trainer calls prepare_global_batch on each phase, so each phase's aggregation weights use
that phase's own global counts (token-mean: 1 / the phase's response tokens over all DP ranks) — the natural choice:
each step is the algorithm's loss over exactly the tokens it trains, and it stays layout-invariant because the counts
are global.

Global selections (top fraction by entropy or by covariance, a random subset) use `global_top_mask`: a two-level
histogram all-reduced over the data-parallel group (two fixed-size [4096] all-reduces, whatever the token count)
instead of gathering every token. Its choice depends only on the tokens' values and the global counts (integers), so
the same tokens are selected on every layout given the same values (the trainer's own entropies and log-probs differ
between TP layouts by float rounding, which can only move a token lying that close to the cut). It selects all
tokens above a bin edge, so ties and values within one fine bin (range / 4096^2) of the cut are kept together: at
least k tokens, at most a fine bin more.

Every rank of a data-parallel replica (its TP and PP ranks) must pass the same per-token inputs, so that all make the
same choices and run the same number of optimizer steps (a Lopti phase without tokens in the global batch is dropped):
the trainer gives every pipeline stage the last stage's old log-probs and entropies.
"""
from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist

HIST_BINS = 4096
_PRIME = 2147483647  # 2^31 - 1: products of two residues fit in int64
# The token selections loss_phases applies, by name; each is turned on by the AlgorithmConfig switch of that name.
TOKEN_SELECTIONS = ("lopti", "high_entropy_only")


def _reduce(values: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, op=op, group=group)
    return values


def global_top_mask(values: torch.Tensor, mask: torch.Tensor, k: int, group=None, bins: int = HIST_BINS):
    """0/1 [b, s]: the masked tokens of the global batch (summed over `group`) with the k largest values, by a
    two-level histogram: the coarse bin holding the k-th largest value over [global min, global max], then the fine
    bin within it; every token at or above that fine bin is selected (ties kept together). k <= 0: none."""
    m = mask > 0
    v = values.detach().double()
    picked = v[m]
    bounds = torch.stack([-picked.min(), picked.max()]) if picked.numel() else \
        torch.full((2,), -math.inf, dtype=torch.float64)
    bounds = _reduce(bounds, group, dist.ReduceOp.MAX)
    lo, hi = float(-bounds[0]), float(bounds[1])
    if k <= 0 or not math.isfinite(lo):
        return torch.zeros_like(mask, dtype=torch.float32)
    width = (hi - lo) / bins if hi > lo else 1.0
    coarse = ((v - lo) / width).floor().clamp(0, bins - 1).long()
    counts = _reduce(torch.bincount(coarse[m], minlength=bins).double(), group)
    above = counts.flip(0).cumsum(0).flip(0)  # above[i]: tokens in bins >= i
    i = int((above >= k).nonzero().max()) if bool((above >= k).any()) else 0
    need = k - (float(above[i]) - float(counts[i]))  # how many of bin i are still needed
    fine = ((v - (lo + i * width)) / (width / bins)).floor().clamp(0, bins - 1).long()
    in_bin = m & (coarse == i)
    fine_counts = _reduce(torch.bincount(fine[in_bin], minlength=bins).double(), group)
    fine_above = fine_counts.flip(0).cumsum(0).flip(0)
    j = int((fine_above >= need).nonzero().max()) if bool((fine_above >= need).any()) else 0
    return (m & ((coarse > i) | ((coarse == i) & (fine >= j)))).float()


def _global_count(mask: torch.Tensor, group) -> float:
    return float(_reduce(mask.double().sum().reshape(1), group)[0])


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, rho: float, group=None) -> torch.Tensor:
    """"Beyond the 80/20 Rule" (arXiv:2506.01939): the response tokens whose (old-policy) entropy is among the highest
    fraction rho of the global batch: ceil(rho * N) of the N tokens (a few more at a tie), selected by
    global_top_mask."""
    return global_top_mask(entropy, mask, math.ceil(rho * _global_count(mask, group)), group)


def lopti_masks(mask: torch.Tensor, old_log_probs: torch.Tensor, eta: float) -> list[torch.Tensor]:
    """Lopti, low-probability token isolation ("Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs",
    arXiv:2505.12929): [low, high] with low = tokens whose old-policy probability pi_old(o_t) < eta, high = the rest;
    the low-probability tokens are updated first."""
    low = (torch.exp(old_log_probs) < eta).float() * mask
    return [low, mask * (1 - low)]


def covariance(log_probs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token Cov term (arXiv:2505.22617): (A_t - mean A) * (log pi_t - mean log pi), the means over the response
    tokens of the global batch (reduced over `group`, the data-parallel group); 0 outside the mask."""
    sums = _reduce(torch.stack([(advantages.double() * mask).sum(), (log_probs.double() * mask).sum(),
                                mask.double().sum()]), group)
    n = sums[2].clamp(min=1)
    return ((advantages.double() - sums[0] / n) * (log_probs.double() - sums[1] / n) * mask).float()


def token_keys(input_ids: torch.Tensor, seed: int) -> torch.Tensor:
    """[b, s] pseudo-random numbers in [0, 1) that depend only on (seed, the row's tokens, the position): the same
    token gets the same number whatever the DP split, row order, micro-batch or the padding added after the row
    (padding ids 0 add nothing to the row's hash), so a random draw from them is layout-invariant and reproducible on
    resume."""
    ids = input_ids.long() % _PRIME
    positions = torch.arange(ids.shape[1], dtype=torch.long)
    powers = torch.ones_like(positions)
    for t in range(1, len(positions)):
        powers[t] = powers[t - 1] * 48271 % _PRIME
    row = (ids * powers % _PRIME).sum(-1, keepdim=True) % _PRIME
    x = (row * 16807 + (positions + 1) * 69621 + (int(seed) % _PRIME) * 40692) % _PRIME
    for a, c in ((48271, 12345), (69621, 54321), (16807, 99991)):
        x = (x * a + c) % _PRIME
    return x.double() / _PRIME


def clip_cov_select(cov: torch.Tensor, mask: torch.Tensor, keys: torch.Tensor, ratio: float, lb: float, ub: float,
                    group=None) -> torch.Tensor:
    """Clip-Cov (arXiv:2505.22617, verl's clip_cov): of the tokens with lb < Cov < ub, pick
    max(int(ratio * N), 1) at random (N the global response tokens; the draw is the largest `keys`)."""
    candidates = mask * ((cov > lb) & (cov < ub)).float()
    return global_top_mask(keys, candidates, max(int(ratio * _global_count(mask, group)), 1), group)


def kl_cov_select(cov: torch.Tensor, mask: torch.Tensor, ratio: float, group=None) -> torch.Tensor:
    """KL-Cov (arXiv:2505.22617, verl's kl_cov): the max(1, int(N * ratio)) tokens with the largest Cov."""
    return global_top_mask(cov, mask, max(1, int(_global_count(mask, group) * ratio)), group)


def loss_phases(batch, cfg, *, entropy: torch.Tensor | None = None, group=None, seed: int = 0) -> list:
    """The ordered batches of one mini-batch's optimizer steps (see the module docstring). batch: this DP rank's
    share of the mini-batch (a megarl.losses.TokenBatch with old_log_probs and advantages); entropy: the old policy's
    per-token entropy (needed for cfg.high_entropy_only); group: the data-parallel group; seed: for clip_cov's draw
    (the trainer derives it from the run seed, step, epoch and mini-batch)."""
    mask = batch.loss_mask
    if cfg.high_entropy_only:
        if entropy is None:
            raise ValueError("algorithm.high_entropy_only needs the old policy's entropies "
                             "(rollout.old_log_probs=recompute)")
        mask = high_entropy_mask(entropy, mask, cfg.high_entropy_rho, group)
    selected = None
    if cfg.policy_loss in ("clip_cov", "kl_cov"):
        cov = covariance(batch.old_log_probs, batch.advantages, mask, group)
        selected = clip_cov_select(cov, mask, token_keys(batch.input_ids, seed), cfg.clip_cov_ratio, cfg.clip_cov_lb,
                                   cfg.clip_cov_ub, group) if cfg.policy_loss == "clip_cov" else \
            kl_cov_select(cov, mask, cfg.kl_cov_ratio, group)
    masks = lopti_masks(mask, batch.old_log_probs, cfg.lopti_eta) if cfg.lopti else [mask]
    if len(masks) > 1:  # a phase without tokens in the global batch takes no optimizer step
        sizes = _reduce(torch.stack([m.double().sum() for m in masks]), group)
        masks = [m for m, n in zip(masks, sizes) if n > 0] or masks[:1]
    return [replace(batch, loss_mask=m, selected=selected) for m in masks]


def entropy_split(entropy: torch.Tensor, mask: torch.Tensor, frac: float = 0.2, group=None) -> torch.Tensor:
    """RL-dynamics metric: [sum, count] of the entropies of the top `frac` highest-entropy response tokens of the
    global batch, then [sum, count] of the rest (this rank's part; sum them over the ranks that hold results)."""
    top = high_entropy_mask(entropy, mask, frac, group)
    rest = mask * (1 - top)
    e = entropy.double()
    return torch.stack([(e * top).sum(), top.double().sum(), (e * rest).sum(), rest.double().sum()])
