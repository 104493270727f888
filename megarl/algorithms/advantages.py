"""Advantage estimators: small pure functions over [batch, seq] token tensors, chosen by name.

Conventions: `mask` [b, s] is 1 on response tokens whose log-prob is trained; `scores` [b] is one scalar reward per
sequence (GDPO: [b, k], one column per reward); `group_ids` [b] says which prompt a sample belongs to (the n samples of
one prompt share an id). Every estimator returns (advantages [b, s], returns [b, s]), zero outside the mask.

Batch-level statistics (the whitening of REINFORCE++, GDPO and whitened GAE; GPG's alpha) reduce over `group`, the
data-parallel process group, so the result does not depend on how the global batch is split across ranks; group
statistics need a prompt's samples on one rank.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.distributed as dist


@dataclass
class AdvantageInputs:
    """Everything an estimator may read; each one declares (as keyword-only parameters of the same names) the fields
    it reads and gets only those. [b, s] tensors are per token, [b] per sample."""
    mask: torch.Tensor  # [b, s] 1 on trained response tokens
    scores: torch.Tensor | None = None  # [b] one reward per sample (gdpo: [b, k], one column per reward)
    group_ids: torch.Tensor | None = None  # [b] the prompt each sample belongs to
    values: torch.Tensor | None = None  # [b, s] a critic's values (gae)
    token_rewards: torch.Tensor | None = None  # [b, s] per-token rewards (gae; default: the score on the last token)
    kl: torch.Tensor | None = None  # [b, s] KL(policy || reference) per token, for KL in the reward
    baseline: torch.Tensor | None = None  # [b] the score of each sample's greedy rollout (greedy_baseline)
    teacher_log_probs: torch.Tensor | None = None  # [b, s] the teacher's log-probs of the sampled tokens (needs_teacher)
    student_log_probs: torch.Tensor | None = None  # [b, s] the policy's old log-probs of them
    kl_coef: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    eps: float = 1e-6
    std_normalize: bool = True
    whiten_advantages: bool = False
    reward_weights: list | None = None
    opd_reward_weight: float = 0.0
    opd_top_k: int = 0
    group: object = None  # the data-parallel ProcessGroup batch statistics reduce over (None: this rank's batch)


INPUT_NAMES = frozenset(f.name for f in fields(AdvantageInputs))


@dataclass(frozen=True)
class Estimator:
    """A registered estimator: the function, the AdvantageInputs fields it reads (which also says which algorithm
    options apply to it: std_normalize, reward_weights, ...), and what the trainer must do for it (each flag is read
    where that is decided: the config check, the rollout, the step's metrics)."""
    fn: Callable
    reads: frozenset
    # its baseline comes from the other samples of the same prompt: rollout.n_samples must be >= 2
    needs_groups: bool = False
    # its baseline is the reward of one greedy (temperature 0) rollout of the same prompt: the rollout asks the engine
    # for it (never trained on), scores it with the same reward and hands it in as `baseline` per sample
    greedy_baseline: bool = False
    # it needs a teacher's log-probs of the sampled tokens (the teacher: section); they travel with each sample
    needs_teacher: bool = False
    # its returns are the per-token log-ratio log pi_teacher - log pi_student: the trainer logs their masked mean's
    # negative as opd/reverse_kl, the sampled KL(student || teacher)
    returns_teacher_log_ratio: bool = False


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}


def register_advantage(name: str, **capabilities):
    """@register_advantage("name", needs_groups=True, ...): a function with keyword-only parameters named after
    AdvantageInputs fields (those it reads), returning (advantages [b, s], returns [b, s]), zero outside the mask."""
    def add(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters.values()
        reads = frozenset(p.name for p in params)
        odd = [p.name for p in params if p.kind is not p.KEYWORD_ONLY] + sorted(reads - INPUT_NAMES)
        if odd:
            raise TypeError(f"advantage estimator {name!r}: parameters {odd} are not keyword-only AdvantageInputs "
                            f"fields (those are {sorted(INPUT_NAMES)})")
        ADVANTAGE_ESTIMATORS[name] = Estimator(fn, reads, **capabilities)
        return fn
    return add


def estimator(name: str) -> Estimator:
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"algorithm.advantage_estimator={name!r} is unknown; choose one of "
                         f"{sorted(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def _group_stats(scores: torch.Tensor, group_ids: torch.Tensor):
    """Per-sample mean, unbiased std and size of its group, in scores' dtype. Summed in float64: a group of equal
    rewards then has exactly its reward as mean and std 0 (in float32, 8 x 0.1 gives a std of ~1e-8, which / (std +
    eps) would turn into a non-zero advantage, and GPG would not count the group as all-equal)."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    n_groups = counts.shape[0]
    values = scores.double()
    mean = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, values) / counts
    sq = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, inverse, (values - mean[inverse]) ** 2)
    std = torch.sqrt(sq / (counts - 1).clamp(min=1))
    return mean[inverse].to(scores.dtype), std[inverse].to(scores.dtype), counts[inverse]


def _global_sum(values: torch.Tensor, group) -> torch.Tensor:
    """values summed over the data-parallel group (float64), so batch statistics do not depend on the DP split."""
    values = values.double()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(values, group=group)
    return values


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, group=None, eps: float = 1e-8,
                  shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) / sqrt(var + eps) over the masked tokens of the whole (global) batch (unbiased var, as
    verl's masked_whiten). In float64 and centred before squaring (two all-reduces): E[x^2] - E[x]^2 in float32
    cancels catastrophically when the values are large next to their spread (it can even go negative: NaN)."""
    x, mask64 = values.double(), mask.double()
    total, count = _global_sum(torch.stack([(x * mask64).sum(), mask64.sum()]), group)
    mean = total / count.clamp(min=1)
    centred = (x - mean) * mask64
    var = _global_sum((centred ** 2).sum(), group) / (count - 1).clamp(min=1)
    whitened = centred * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return (whitened * mask64).to(values.dtype)


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
        gamma: float = 1.0, lam: float = 0.95, whiten_advantages: bool = False, group=None):
    """Generalised advantage estimation (arXiv:1506.02438) with a critic's values [b, s] (value of the state before
    each token): A_t = sum_l (gamma*lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t; returns A_t + V_t.

    Rewards are token_rewards, or else the sequence scores on the last token minus kl_coef * kl on every token
    (KL in the reward). whiten_advantages (algorithm.whiten_advantages) whitens the advantages over the masked tokens
    of the global batch (mean 0, std 1, reduced over `group`), as PPO implementations usually do; the returns the
    critic regresses on are computed before whitening."""
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
    returns = (advantages + values) * mask
    if whiten_advantages:
        advantages = masked_whiten(advantages, mask, group)
    return advantages, returns


@register_advantage("grpo", needs_groups=True)
def grpo(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6,
         std_normalize: bool = True):
    """GRPO (arXiv:2402.03300): (r - group mean) / (group std + eps), the same for every token of the sample; with
    std_normalize=False, r - group mean (= dr_grpo)."""
    mean, std, _ = _group_stats(scores, group_ids)
    adv = (scores - mean) / (std + eps) if std_normalize else scores - mean
    return _broadcast(adv, mask), _broadcast(scores, mask)


@register_advantage("dr_grpo", needs_groups=True)
def dr_grpo(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor):
    """Dr. GRPO: r - group mean (no std division); pair with aggregation seq-mean-token-sum-norm."""
    mean, _, _ = _group_stats(scores, group_ids)
    return _broadcast(scores - mean, mask), _broadcast(scores, mask)


@register_advantage("rloo", needs_groups=True)
def rloo(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor):
    """RLOO: r_i - mean of the other samples of the same prompt."""
    mean, _, counts = _group_stats(scores, group_ids)
    if bool((counts < 2).any()):
        raise ValueError("rloo needs at least 2 samples per prompt (rollout.n_samples >= 2)")
    adv = (scores - mean) * counts / (counts - 1)
    return _broadcast(adv, mask), _broadcast(scores, mask)


@register_advantage("reinforce_plus_plus")
def reinforce_plus_plus(*, scores: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None,
                        kl_coef: float = 0.0, gamma: float = 1.0, group=None):
    """REINFORCE++: token rewards (score on the last token, -kl_coef*kl on every token), discounted returns,
    whitened over the global batch."""
    rewards = last_token_rewards(scores, mask)
    if kl is not None and kl_coef:
        rewards = rewards - kl_coef * kl * mask
    returns = discounted_returns(rewards, mask, gamma)
    return masked_whiten(returns, mask, group), returns


@register_advantage("reinforce_plus_plus_baseline", needs_groups=True)
def reinforce_plus_plus_baseline(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor,
                                 kl: torch.Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
                                 group=None):
    """REINFORCE++-baseline: subtract the group mean score first, then as REINFORCE++."""
    mean, _, _ = _group_stats(scores, group_ids)
    return reinforce_plus_plus(scores=scores - mean, mask=mask, kl=kl, kl_coef=kl_coef, gamma=gamma, group=group)


@register_advantage("gdpo", needs_groups=True)
def gdpo(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, reward_weights=None,
         eps: float = 1e-6, group=None, std_normalize: bool = True):
    """GDPO (multi-reward, arXiv:2601.05242): normalise each reward column k within its group,
    (r_k - mean_k) / (std_k + eps), combine with reward_weights, then whiten the combined advantage over the global
    batch. std_normalize=False keeps only the per-reward centring, r_k - mean_k (GDPO without std normalisation);
    the batch whitening stays. Scores [b] (the trainer's one reward per sample) are one reward column."""
    if scores.dim() == 1:
        scores = scores[:, None]
    if scores.dim() != 2:
        raise ValueError(f"gdpo needs scores of shape [batch, n_rewards], got {tuple(scores.shape)}")
    weights = torch.ones(scores.shape[1]) if reward_weights is None else torch.as_tensor(reward_weights,
                                                                                          dtype=scores.dtype)
    if weights.shape[0] != scores.shape[1]:
        raise ValueError(f"algorithm.reward_weights has {weights.shape[0]} entries for {scores.shape[1]} rewards")
    combined = torch.zeros(scores.shape[0], dtype=scores.dtype)
    for k in range(scores.shape[1]):
        mean, std, _ = _group_stats(scores[:, k], group_ids)
        centred = scores[:, k] - mean
        combined = combined + weights[k] * (centred / (std + eps) if std_normalize else centred)
    adv = masked_whiten(_broadcast(combined, mask), mask, group)
    return adv, _broadcast(scores @ weights, mask)


@register_advantage("maxrl", needs_groups=True)
def maxrl(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor):
    """MaxRL, Maximum Likelihood RL (arXiv:2602.02710): A_i = (r_i - mean_g) / mean_g = N r_i / K - 1 for a group of
    N samples with K = sum_i r_i successes; 0 for a group without success (mean_g = 0).

    The MaxRL estimator (1/K) sum_i r_i grad log pi(y_i) is unbiased for the gradient of
    -sum_{k<=N} (1 - p)^k / k, which interpolates between pass@1 RL (N = 1) and maximum likelihood log p (N -> inf):
    it normalises by the number of successes K instead of the number of samples N. With the zero-mean control variate
    (1/N) sum_i grad log pi(y_i) this is sum_i (r_i / K - 1/N) grad log pi(y_i); megarl multiplies by N so the scale
    matches GRPO's per-sample advantages (a constant factor per group size). Meant for rewards in [0, 1] (binary
    correctness); a group with mean <= 0 gets 0."""
    mean, _, _ = _group_stats(scores, group_ids)
    safe = torch.where(mean > 0, mean, torch.ones_like(mean))
    adv = torch.where(mean > 0, (scores - mean) / safe, torch.zeros_like(scores))
    return _broadcast(adv, mask), _broadcast(scores, mask)


@register_advantage("opo", needs_groups=True)
def opo(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor):
    """OPO, On-Policy RL with the Optimal reward baseline (arXiv:2505.23585): A_i = r_i - b_g with the
    length-weighted baseline b_g = sum_j |o_j| r_j / sum_j |o_j| over the group (|o_j| = response tokens of sample j),
    the variance-minimising baseline when the gradient norm grows with length. A group of one sample has b = 0."""
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    lengths = mask.sum(-1).to(scores.dtype)
    weighted = torch.zeros(counts.shape[0], dtype=scores.dtype).index_add_(0, inverse, lengths * scores)
    total = torch.zeros(counts.shape[0], dtype=scores.dtype).index_add_(0, inverse, lengths)
    baseline = torch.where((counts > 1) & (total > 0), weighted / total.clamp(min=1e-12), torch.zeros_like(total))
    return _broadcast(scores - baseline[inverse], mask), _broadcast(scores, mask)


@register_advantage("gpg", needs_groups=True)
def gpg(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, group=None):
    """GPG, Group Policy Gradient (arXiv:2504.02546): A_i = alpha * (r_i - group mean) (F_norm = 1: no std
    division), with alpha = B / (B - M), B the samples of the global batch and M those in groups whose rewards are
    all equal (their advantage is 0, so without alpha they would dilute the batch gradient). B and M are summed over
    `group` (the data-parallel group). Pair with policy_loss=reinforce (GPG's loss is -A log pi, no ratio or clip).

    Documented choice: alpha follows the paper's invalid-sample count; verl's gpg uses B / count_nonzero(scores)."""
    mean, std, counts = _group_stats(scores, group_ids)
    invalid = ((std == 0) | (counts < 2)).to(scores.dtype)
    total, n_invalid = _global_sum(torch.stack([torch.tensor(float(scores.shape[0])), invalid.sum()]), group)
    alpha = (total / (total - n_invalid).clamp(min=1)).to(scores.dtype)
    return _broadcast(alpha * (scores - mean), mask), _broadcast(scores, mask)


@register_advantage("grpo_passk", needs_groups=True)
def grpo_passk(*, scores: torch.Tensor, group_ids: torch.Tensor, mask: torch.Tensor, eps: float = 1e-6,
               std_normalize: bool = True):
    """GRPO pass@k (arXiv:2503.19595, verl's grpo_passk): optimise the best-of-group (pass@k with k = group size)
    instead of pass@1. Only each group's best sample gets an advantage, r_max - r_second_max (divided by the group's
    std + eps with std_normalize); every other sample gets 0. Ties at the top give 0, so which tied sample is
    "best" does not matter."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    _, std, counts = _group_stats(scores, group_ids)
    if bool((counts < 2).any()):
        raise ValueError("grpo_passk needs at least 2 samples per prompt (rollout.n_samples >= 2)")
    adv = torch.zeros_like(scores)
    for g in range(int(inverse.max()) + 1 if inverse.numel() else 0):
        members = torch.nonzero(inverse == g)[:, 0]
        top, where = torch.topk(scores[members], 2)
        gap = top[0] - top[1]
        adv[members[where[0]]] = gap / (std[members[0]] + eps) if std_normalize else gap
    return _broadcast(adv, mask), _broadcast(scores, mask)


@register_advantage("remax", greedy_baseline=True)
def remax(*, scores: torch.Tensor, mask: torch.Tensor, baseline: torch.Tensor | None = None):
    """ReMax (arXiv:2310.10505): A_i = r_i - r(greedy response of the same prompt), the greedy rollout's reward as
    the baseline (`baseline` [b], one per sample: its prompt's greedy reward, scored by the same reward function)."""
    if baseline is None or baseline.shape != scores.shape:
        raise ValueError("remax needs `baseline`, the reward of each sample's greedy rollout, shaped like scores")
    return _broadcast(scores - baseline.to(scores.dtype), mask), _broadcast(scores, mask)


@register_advantage("opd", needs_teacher=True, returns_teacher_log_ratio=True)
def opd(*, teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor, mask: torch.Tensor,
        scores: torch.Tensor | None = None, group_ids: torch.Tensor | None = None, opd_reward_weight: float = 0.0,
        opd_top_k: int = 0, eps: float = 1e-6, std_normalize: bool = True):
    """On-policy distillation (Thinking Machines' "On-Policy Distillation"; slime / verl's OPD): the per-token
    reverse-KL advantage A_t = log pi_teacher(y_t | y_<t) - log pi_student(y_t | y_<t) of each token the student
    sampled, so the policy gradient minimises the sampled reverse KL(student || teacher) token by token (no discount,
    no baseline). student_log_probs are the policy's old log-probs (the trainer's recompute pass; the engine's rollout
    log-probs with rollout.old_log_probs=rollout): the policy the tokens were sampled from, which the ratio's anchor
    also is. opd_reward_weight w > 0 adds w x the task reward's GRPO advantage (group-normalised score, the same for
    every token of a sample). opd_top_k > 0: the distillation is the loss's exact top-k KL
    (megarl.algorithms.kl.topk_kl), not an advantage: only the task reward's share remains here. Returns
    (advantages, the per-token teacher - student log-ratio)."""
    if teacher_log_probs is None or teacher_log_probs.shape != mask.shape:
        raise ValueError("opd needs `teacher_log_probs` [b, s] (the teacher's log-probs of the sampled tokens), "
                         "shaped like mask: set the teacher: section")
    log_ratio = (teacher_log_probs - student_log_probs) * mask
    advantages = torch.zeros_like(log_ratio) if opd_top_k else log_ratio
    if opd_reward_weight:
        advantages = advantages + opd_reward_weight * grpo(scores=scores, group_ids=group_ids, mask=mask, eps=eps,
                                                           std_normalize=std_normalize)[0]
    return advantages, log_ratio


def compute_advantages(name: str, **inputs):
    """(advantages, returns) of estimator `name`: `inputs` are AdvantageInputs fields (a name that is not one is a
    TypeError, not silently dropped); the estimator gets those it reads."""
    chosen = estimator(name)
    given = AdvantageInputs(**inputs)  # unknown names raise here
    return chosen.fn(**{key: getattr(given, key) for key in chosen.reads})
