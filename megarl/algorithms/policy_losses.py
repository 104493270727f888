"""Policy losses: per-token loss tensors, chosen by name; users register their own with @register_policy_loss.

Every loss has the signature

    fn(log_prob, old_log_prob, advantages, mask, cfg, seq_sum) -> (loss [b, s], stats)

log_prob carries the gradient; old_log_prob and advantages do not. cfg is the AlgorithmConfig. seq_sum(x) sums a
token tensor within each sequence (across context-parallel shards), for sequence-level ratios. stats maps a name to a
per-token 0/1 or value tensor; the loss function averages them over the response tokens (clip fractions, ratio).
Losses that treat tokens chosen before the loss apart (clip_cov, kl_cov) also take selected=[b, s] 0/1
(TokenBatch.selected, from megarl.algorithms.token_selection.loss_phases).
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
    """PPO clipped surrogate with separate low/high bounds (DAPO clip-higher) and optional dual clip. The log-ratio
    is clamped to [-20, 20] (as verl does) so exp cannot overflow into a 0 * inf gradient."""
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    loss, stats = _clipped_surrogate(ratio, advantages, cfg.clip_eps_low, cfg.clip_eps_high, cfg.dual_clip)
    return loss, dict(stats, ratio=ratio.detach())


@register_policy_loss("gspo")
def gspo(log_prob, old_log_prob, advantages, mask, cfg, seq_sum):
    """GSPO: the ratio is per sequence, exp(mean_t log(pi/pi_old)), clipped per sequence. Token form:
    s_i(theta) = sg(s_i) * pi_t / sg(pi_t), which has the sequence ratio's value and a per-token gradient. The log of
    that token ratio is clamped at 10 (as verl does): exp cannot overflow, and such a token gets no gradient."""
    log_ratio = (log_prob - old_log_prob) * mask
    seq_log_ratio = seq_sum(log_ratio) / seq_sum(mask.float()).clamp(min=1)
    ratio = torch.exp((seq_log_ratio.detach()[:, None] + log_prob - log_prob.detach()).clamp(max=10.0))
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


@register_policy_loss("gmpo")
def gmpo(log_prob, old_log_prob, advantages, mask, cfg, seq_sum):
    """GMPO, Geometric-Mean Policy Optimization (arXiv:2507.20673): maximise the geometric mean of the token-level
    clipped ratios, J_i = A_i * exp((1/|o_i|) sum_t l~_t), instead of their arithmetic mean.

    l_t = log(pi/pi_old) is clipped in log space, pessimistically for the sign of A (as PPO's min):
    l~_t = sgn(A) * min(sgn(A) * l_t, sgn(A) * clamp(l_t, -clip_eps_low, clip_eps_high)), so with GMPO
    algorithm.clip_eps_low/high bound the *log*-ratio (the paper uses 0.4 for both, i.e. ratios in
    [e^-0.4, e^0.4]). Token form, as for GSPO: loss_t = -A_t * sg(R_i) * exp(l~_t - sg(l~_t)) with
    R_i = exp(mean_t l~_t); its value is the sequence's -A R and its gradient -A R grad(l~_t), so under
    aggregation=seq-mean-token-mean the total is exactly GMPO's -mean_i A_i R_i (other aggregations weight the same
    sequence terms by their token counts). With per-token advantages (e.g. GAE) each token uses its own A_t."""
    log_ratio = log_prob - old_log_prob
    sign = torch.sign(advantages)
    clamped = log_ratio.clamp(-cfg.clip_eps_low, cfg.clip_eps_high)
    pessimistic = sign * torch.minimum(sign * log_ratio, sign * clamped)
    seq_log_ratio = seq_sum(pessimistic * mask) / seq_sum(mask.float()).clamp(min=1)
    seq_ratio = torch.exp(seq_log_ratio)[:, None]
    loss = -advantages * seq_ratio * torch.exp(pessimistic - pessimistic.detach())
    stats = {"clip_frac_low": ((log_ratio < -cfg.clip_eps_low) & (advantages < 0)).float(),
             "clip_frac_high": ((log_ratio > cfg.clip_eps_high) & (advantages > 0)).float(),
             "ratio": (seq_ratio * torch.ones_like(log_ratio)).detach()}
    return loss, stats


@register_policy_loss("sapo")
def sapo(log_prob, old_log_prob, advantages, mask, cfg, seq_sum):
    """SAPO, Soft Adaptive Policy Optimization (arXiv:2511.20347): a smooth gate instead of the hard clip,
    loss_t = -f(r_t) * A_t with f(r) = sigmoid(tau (r - 1)) * 4 / tau, tau = sapo_tau_pos for A > 0 and
    sapo_tau_neg otherwise. f'(r) = 4 sigmoid (1 - sigmoid) is 1 at r = 1 (on-policy: the plain policy gradient)
    and decays smoothly as r leaves 1, so off-policy tokens are down-weighted rather than cut off. The log-ratio is
    clamped to [-20, 20] (as verl does) so exp cannot overflow into a 0 * inf gradient."""
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    tau = torch.where(advantages > 0, torch.full_like(ratio, cfg.sapo_tau_pos),
                      torch.full_like(ratio, cfg.sapo_tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1)) * 4 / tau
    return -gate * advantages, {"ratio": ratio.detach()}


@register_policy_loss("aspo")
def aspo(log_prob, old_log_prob, advantages, mask, cfg, seq_sum):
    """ASPO, Asymmetric Importance Sampling Policy Optimization (arXiv:2510.06062).

    Negative-advantage tokens: the PPO clip, loss = -A * max(r, 1 - clip_eps_low). Positive-advantage tokens use the
    flipped ratio: with r^ = min(r, 1 + clip_eps_high), loss = -A * (r^ / sg(r^)) / sg(r^), whose gradient is
    -A * grad(log pi) / r (weight pi_old / pi instead of pi / pi_old; 0 once clipped) and value -A / r^.
    Soft dual clip (c = algorithm.dual_clip): where the weight would exceed c (r > c for A < 0, r < 1/c for A > 0)
    the token's gradient is -A * c * grad(log pi), bounded but not cut off; its value is the hard dual clip's -A * c.
    Documented choice: the authors' code (Archer2.0) writes that branch as -A * c * log pi, which has the same
    gradient; megarl uses -A * c * pi / sg(pi) so the loss value stays the dual-clip bound. Archer2.0's separate
    clip ranges for high-/low-entropy tokens are not part of ASPO and are not implemented here."""
    ratio = torch.exp((log_prob - old_log_prob).clamp(-20.0, 20.0))
    c = cfg.dual_clip
    unit = torch.exp(log_prob - log_prob.detach())  # value 1, gradient grad(log pi)
    negative = ratio.clamp(min=1 - cfg.clip_eps_low)
    positive = ratio.clamp(max=1 + cfg.clip_eps_high)
    neg_loss = torch.where(negative > c, -advantages * c * unit, -advantages * negative)
    pos_dual = 1 / positive.detach() > c
    flipped = (positive / positive.detach()) / positive.detach()
    pos_loss = torch.where(pos_dual, -advantages * c * unit, -advantages * flipped)
    loss = torch.where(advantages > 0, pos_loss, neg_loss)
    stats = {"clip_frac_low": ((ratio < 1 - cfg.clip_eps_low) & (advantages < 0)).float(),
             "clip_frac_high": ((ratio > 1 + cfg.clip_eps_high) & (advantages > 0)).float(),
             "dual_clip_frac": (((advantages < 0) & (negative > c)) | ((advantages > 0) & pos_dual)).float(),
             "ratio": ratio.detach()}
    return loss, stats


@register_policy_loss("adv_reweight")
def adv_reweight(log_prob, old_log_prob, advantages, mask, cfg, seq_sum):
    """Advantage Reweighting, from "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs"
    (arXiv:2505.12929): the PPO clip loss (ppo_clip, with its clip bounds and dual clip) on the reweighted advantage
    A~_t = (alpha * p_t + 1 - alpha) * A_t, alpha = algorithm.adv_reweight_alpha, p_t = pi_old(o_t) the token's
    probability under the policy that sampled it (at algorithm.temperature; as the authors' code, which reweights
    with the old log-probs once per batch), so low-probability tokens, whose gradients are large, no longer dominate
    the update. The weight is positive, so the clip keeps the sign logic of PPO."""
    weight = cfg.adv_reweight_alpha * torch.exp(old_log_prob.detach()) + (1 - cfg.adv_reweight_alpha)
    loss, stats = ppo_clip(log_prob, old_log_prob, advantages * weight, mask, cfg, seq_sum)
    return loss, dict(stats, adv_weight=weight)


def future_kl(log_ratio: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """FIPO's Future-KL [b, s]: sum_{k >= t} gamma^(k - t) M_k log_ratio_k within each row (one sequence per row; a
    suffix sum, so a sequence split over context-parallel ranks would need the later shards' sums: FIPO refuses CP)."""
    out = torch.zeros_like(log_ratio)
    running = torch.zeros(log_ratio.shape[0], dtype=log_ratio.dtype)
    for t in reversed(range(log_ratio.shape[1])):
        running = log_ratio[:, t] * mask[:, t] + gamma * running
        out[:, t] = running
    return out


def fipo_weights(log_ratio: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """FIPO's influence weights f_t = clip(exp(FutureKL_t), lo, 1 + fipo_clip_range), gamma = 2^(-1/decay_rate),
    lo = 1 with fipo_clip_high_only else 1 - fipo_clip_range; detached, 1 outside the mask."""
    gamma = 2.0 ** (-1.0 / cfg.fipo_decay_rate)
    low = 1.0 if cfg.fipo_clip_high_only else 1.0 - cfg.fipo_clip_range
    weight = torch.exp(future_kl(log_ratio.detach().float(), mask.float(), gamma)).clamp(low, 1 + cfg.fipo_clip_range)
    return torch.where(mask > 0, weight, torch.ones_like(weight))


@register_policy_loss("fipo")
def fipo(log_prob, old_log_prob, advantages, mask, cfg, seq_sum):
    """FIPO, Future-KL Influenced Policy Optimization (arXiv:2603.19835): the PPO clip loss (ppo_clip, with its clip
    bounds and dual clip) on the future-aware advantage A~_t = A_t * f_t, with

        Delta_t = log pi(o_t) - log pi_old(o_t),   FutureKL_t = sum_{k >= t} gamma^(k - t) M_k Delta_k,
        f_t = sg(clip(exp(FutureKL_t), 1 - eps_f, 1 + eps_f)),   gamma = 2^(-1 / fipo_decay_rate)

    (eps_f = algorithm.fipo_clip_range; with fipo_clip_high_only the lower bound is 1, as the authors' default), so
    tokens whose continuation the update is reinforcing get more credit. At the first update of a batch
    (pi = pi_old) every f_t is 1 and FIPO is ppo_clip. Not implemented: the reference code's optional filtering of
    high-IS-ratio tokens out of the Future-KL sum and its extra safety cap (ms-swift's delta /
    fipo_safety_threshold)."""
    weight = fipo_weights(log_prob - old_log_prob, mask, cfg)
    loss, stats = ppo_clip(log_prob, old_log_prob, advantages * weight, mask, cfg, seq_sum)
    return loss, dict(stats, fipo_weight=weight)


def _needs_selected(name, selected):
    if selected is None:
        raise ValueError(f"algorithm.policy_loss={name} needs the tokens chosen before the loss (TokenBatch.selected, "
                         "set by megarl.algorithms.loss_phases). Fix: build the batch with loss_phases()")


@register_policy_loss("clip_cov")
def clip_cov(log_prob, old_log_prob, advantages, mask, cfg, seq_sum, selected=None):
    """Clip-Cov ("The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models", arXiv:2505.22617;
    verl's clip_cov): the ppo_clip loss, with the gradient of a small random set of high-covariance tokens cut off:
    loss_t = ppo_clip_t * (1 - sel_t), sel chosen before the loss (token_selection.clip_cov_select) among the tokens
    with clip_cov_lb < Cov_t < clip_cov_ub, Cov_t = (A_t - mean A)(log pi_old_t - mean log pi_old) over the global
    batch, clip_cov_ratio of the response tokens. Documented choices: the covariance uses the old policy's log-probs
    and global means (verl: the current log-probs of the micro-batch, equal at the first update), so the selection
    is layout-invariant; verl also skips tokens the PPO clip already cut, which have no gradient either way."""
    _needs_selected("clip_cov", selected)
    loss, stats = ppo_clip(log_prob, old_log_prob, advantages, mask, cfg, seq_sum)
    return loss * (1 - selected), dict(stats, cov_selected_frac=selected)


@register_policy_loss("kl_cov")
def kl_cov(log_prob, old_log_prob, advantages, mask, cfg, seq_sum, selected=None):
    """KL-Cov (arXiv:2505.22617; verl's kl_cov): the unclipped surrogate -A_t r_t plus a KL penalty
    kl_cov_coef * |log r_t| on the kl_cov_ratio fraction of response tokens with the largest
    Cov_t = (A_t - mean A)(log pi_old_t - mean log pi_old) (global means and a global top-k, chosen before the loss:
    token_selection.kl_cov_select)."""
    _needs_selected("kl_cov", selected)
    log_ratio = log_prob - old_log_prob
    ratio = torch.exp(log_ratio)
    loss = -advantages * ratio + cfg.kl_cov_coef * log_ratio.abs() * selected
    return loss, {"ratio": ratio.detach(), "cov_selected_frac": selected}


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float | None):
    """Clipped value loss for the critic: 0.5 * max((v - R)^2, (v_clip - R)^2), v_clip within +-clip of v_old."""
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped, {}
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), {"vf_clip_frac": (clipped > unclipped).float()}
