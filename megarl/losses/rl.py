"""RL and SFT objectives as Megatron loss functions.

A batch is a `TokenBatch` of [batch, seq] tensors, already shifted: position t holds the token the model reads
(`input_ids[t]`) and the token it must predict (`targets[t] = input_ids[t + 1]`), with `loss_mask[t] = 1` where that
prediction is trained (response tokens). Per-token RL inputs (advantages, old/ref/rollout log-probs) sit at the same
positions. `loss_weight` is the aggregation weight from megarl.algorithms.aggregation, fixed for the whole global batch
before it is split (see `prepare_global_batch`), so every micro-batch contributes sum_t loss_t * loss_weight_t and the
gradient does not depend on the TP/PP/DP/CP layout or the micro-batch split.

Megatron's schedules divide a loss function's output by the number of micro-batches and multiply it by the CP size;
DDP then divides gradients by DP*CP. `make_loss_func` multiplies by num_microbatches * DP to cancel that, so the
total gradient is exactly d/dtheta of sum over the global batch of loss_t * loss_weight_t. This needs
`config.calculate_per_token_loss = False` (Megatron's default), which it checks.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..algorithms import (AlgorithmConfig, POLICY_LOSSES, global_counts, kl_estimate, loss_weights, mismatch_weights,
                          topk_kl, value_loss)
from .fused_linear import logprob_entropy


_WIDE_FIELDS = ("routed_experts", "teacher_top_ids", "teacher_top_log_probs")  # [b, s, ...]: more than one value


@dataclass
class TokenBatch:
    input_ids: torch.Tensor  # [b, s] int64
    targets: torch.Tensor  # [b, s] int64, input_ids shifted left by one
    loss_mask: torch.Tensor  # [b, s] float, 1 where targets[t] is trained
    loss_weight: Optional[torch.Tensor] = None  # [b, s] aggregation weights (prepare_global_batch)
    advantages: Optional[torch.Tensor] = None
    old_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    rollout_log_probs: Optional[torch.Tensor] = None
    segment_ids: Optional[torch.Tensor] = None  # [b, s] packed samples numbered from 1 (0: padding); None: one per row
    returns: Optional[torch.Tensor] = None  # critic targets (GAE returns)
    old_values: Optional[torch.Tensor] = None  # the critic's values at rollout time (value clipping anchor)
    routed_experts: Optional[torch.Tensor] = None  # [b, s, layers, top-k] the engine's MoE routing (R3 replay)
    selected: Optional[torch.Tensor] = None  # [b, s] 0/1 tokens chosen before the loss (clip_cov / kl_cov; loss_phases)
    # opd with algorithm.opd_top_k: the teacher's k most likely tokens for targets[t] at each position ([b, s, k] int64)
    # and their teacher log-probs ([b, s, k] float): the loss adds the top-k KL there (topk_kl)
    teacher_top_ids: Optional[torch.Tensor] = None
    teacher_top_log_probs: Optional[torch.Tensor] = None

    def __post_init__(self):
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"TokenBatch.input_ids has shape {list(shape)}; it must be [batch, seq] (one row per "
                             "sequence). Fix: stack the sequences, e.g. with shift_sequences()")
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if value is not None and (tuple(value.shape[:2]) != shape or
                                      (value.dim() != 2 and f.name not in _WIDE_FIELDS)):
                raise ValueError(f"TokenBatch.{f.name} has shape {list(value.shape)}; it must be [batch, seq] = "
                                 f"{list(shape)} like input_ids, one value per position t (the prediction of "
                                 "targets[t]; see docs/losses.md). Fix: build it on the same rows and padded length")

    def rows(self, index) -> "TokenBatch":
        return replace(self, **{f.name: getattr(self, f.name)[index] for f in fields(self)
                                if getattr(self, f.name) is not None})

    def split(self, num_micro_batches: int) -> list["TokenBatch"]:
        size = self.input_ids.shape[0]
        if size % num_micro_batches:
            raise ValueError(f"a batch of {size} sequences cannot be split into {num_micro_batches} equal "
                             "micro-batches")
        step = size // num_micro_batches
        return [self.rows(slice(i, i + step)) for i in range(0, size, step)]

    def pad_to_multiple(self, multiple: int) -> "TokenBatch":
        """This batch with the sequence dimension right-padded to a multiple of `multiple` (itself if it is one).

        Sequence parallelism (on at TP > 1) splits the sequence over the TP ranks, so Megatron needs seq % TP == 0.
        Padded positions are inert: loss_mask 0 (and segment 0), so no loss, gradient or metric sees them, and
        causal attention keeps them out of the real positions' outputs."""
        extra = -self.input_ids.shape[1] % multiple
        if not extra:
            return self

        def pad(name: str, t: torch.Tensor) -> torch.Tensor:
            if name == "routed_experts":  # a valid routing for the padding: the last position's experts
                tail = t[:, -1:].expand(-1, extra, *t.shape[2:])
            else:
                tail = t.new_zeros((t.shape[0], extra, *t.shape[2:]))
            return torch.cat([t, tail], dim=1)

        return replace(self, **{f.name: pad(f.name, getattr(self, f.name)) for f in fields(self)
                                if getattr(self, f.name) is not None})


def shift_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int, seq_len: int | None = None):
    """(input_ids, targets, loss_mask) [b, s] for prompt+response sequences, right-padded with pad_id.

    The response token at absolute position p is predicted at position p - 1, so loss_mask covers
    [len(prompt) - 1, len(prompt) + len(response) - 2].
    """
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    seq_len = seq_len or max(lengths)
    ids = torch.full((len(prompts), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), seq_len)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not p:
            raise ValueError(f"sequence {i}: empty prompt (the first response token needs a token to predict it)")
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        mask[i, len(p) - 1: len(p) + len(r) - 1] = 1
    targets = torch.cat([ids[:, 1:], torch.full((len(prompts), 1), pad_id, dtype=torch.long)], dim=1)
    return ids, targets, mask


def place_response_values(values: list[list[float]], prompt_lengths: list[int], seq_len: int) -> torch.Tensor:
    """Per-response-token values (e.g. rollout log-probs) at their loss_mask positions, 0 elsewhere."""
    out = torch.zeros(len(values), seq_len)
    for i, (v, p) in enumerate(zip(values, prompt_lengths)):
        out[i, p - 1: p - 1 + len(v)] = torch.as_tensor(v, dtype=torch.float32)
    return out


def prepare_global_batch(batch: TokenBatch, aggregation: str = "token-mean", norm_length: int | None = None,
                         dp_group=None, seq_multiple: int | None = None, *, pg=None) -> TokenBatch:
    """Set loss_weight for this data-parallel rank's share of the global batch (whole sequences, before micro-batch
    and context-parallel splits), and right-pad the sequence to a multiple of `seq_multiple` (which sequence
    parallelism needs; see TokenBatch.pad_to_multiple). Global counts are summed over dp_group.

    pg: megatron-core's ProcessGroupCollection of the model: dp_group defaults to pg.dp and seq_multiple to the TP
    size pg.tp.size(). Without pg (and without dp_group / seq_multiple) the batch is the whole global batch and is
    not padded: pass pg in a distributed run."""
    if dp_group is None and pg is not None:
        dp_group = pg.dp
    if seq_multiple is None:
        seq_multiple = pg.tp.size() if pg is not None else 1
    batch = batch.pad_to_multiple(seq_multiple)
    num_tokens, num_seqs = global_counts(batch.loss_mask, dp_group)
    return replace(batch, loss_weight=loss_weights(batch.loss_mask, aggregation, num_tokens, num_seqs, norm_length))


# ------------------------------------------------------------------------------------------------------ objectives
def _seq_sum(cp_group):
    def seq_sum(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            total = x.detach().float().sum(-1)
            if cp_group is not None and dist.get_world_size(cp_group) > 1:
                dist.all_reduce(total, group=cp_group)
            return total
    return seq_sum


def _mean_stat(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.stack([(values.detach().float() * mask).sum(), mask.sum()])


def rl_objective(log_prob: torch.Tensor, entropy: torch.Tensor, batch: TokenBatch, cfg: AlgorithmConfig,
                 cp_group=None, student_top_log_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """sum_t loss_t * loss_weight_t for one micro-batch (or CP shard of it), and its metrics. student_top_log_probs
    [b, s, k]: the policy's log-probs of the teacher's top-k tokens (batch.teacher_top_ids; opd with opd_top_k): the
    top-k KL to the teacher (algorithm.opd_top_k_kl's direction) joins each token's loss.

    Metrics: "mean/<name>" -> tensor([sum, count]) over response tokens; "max/<name>" -> scalar; "hist/log_ratio" ->
    the response tokens' log-ratios as a mergeable histogram (log_histogram, for percentiles).
    """
    mask = batch.loss_mask
    seq_sum = _seq_sum(cp_group)
    rollout = batch.rollout_log_probs if batch.rollout_log_probs is not None else batch.old_log_probs
    is_weight, kept = mismatch_weights(batch.old_log_probs, rollout, mask, cfg.mismatch.mode, seq_sum,
                                       cap=cfg.mismatch.cap, low=cfg.mismatch.low, high=cfg.mismatch.high)
    selected = {"selected": batch.selected} if batch.selected is not None else {}  # clip_cov / kl_cov
    pg_loss, stats = POLICY_LOSSES[cfg.policy_loss](log_prob, batch.old_log_probs, batch.advantages, kept, cfg,
                                                    seq_sum, **selected)
    per_token = pg_loss * is_weight
    metrics = {"mean/pg_loss": _mean_stat(pg_loss, kept), "mean/entropy": _mean_stat(entropy, mask),
               "mean/ppo_kl": _mean_stat(batch.old_log_probs - log_prob, kept),
               "mean/masked_frac": _mean_stat(1 - kept.float(), mask), "mean/is_weight": _mean_stat(is_weight, mask)}
    for name, value in stats.items():
        metrics[f"mean/{name}"] = _mean_stat(value, kept)
    if batch.ref_log_probs is not None:
        kl = kl_estimate(log_prob, batch.ref_log_probs, cfg.kl_estimator)
        metrics["mean/kl"] = _mean_stat(kl, mask)
        if cfg.kl_coef and not cfg.kl_in_reward:
            per_token = per_token + cfg.kl_coef * kl
    elif cfg.kl_coef and not cfg.kl_in_reward:
        raise ValueError("algorithm.kl_coef > 0 (KL in the loss) needs ref_log_probs in the batch")
    if cfg.entropy_coef:
        per_token = per_token - cfg.entropy_coef * entropy
    if student_top_log_probs is not None:
        distill = topk_kl(student_top_log_probs, batch.teacher_top_log_probs, cfg.opd_top_k_kl)
        metrics["mean/opd_topk_kl"] = _mean_stat(distill, mask)
        per_token = per_token + distill
    # Train vs rollout engine: |difference| and k3 KL(rollout || train), from the rollout's samples.
    with torch.no_grad():
        diff = (log_prob - rollout).abs() * mask
        metrics["mean/logprob_abs_diff"] = _mean_stat(diff, mask)
        metrics["max/logprob_abs_diff"] = diff.max() if diff.numel() else torch.zeros(())
        metrics["mean/k3_kl_rollout_train"] = _mean_stat(kl_estimate(rollout, log_prob, "k3"), mask)
        ratio = stats.get("ratio", torch.exp(log_prob - batch.old_log_probs))[mask > 0].detach()
        metrics["hist/log_ratio"] = log_histogram(torch.log(ratio.double().clamp(min=1e-300)))
    loss = (per_token * kept * batch.loss_weight).sum()
    return loss, metrics


def sft_objective(log_prob: torch.Tensor, entropy: torch.Tensor, batch: TokenBatch, cfg=None, cp_group=None):
    """Cross-entropy on the masked targets: sum_t -log p(target_t) * loss_weight_t."""
    mask = batch.loss_mask
    loss = (-log_prob * mask * batch.loss_weight).sum()
    return loss, {"mean/nll": _mean_stat(-log_prob, mask), "mean/entropy": _mean_stat(entropy, mask)}


def _seq_sum_with_grad(x: torch.Tensor, cp_group) -> torch.Tensor:
    """Per-row sums of x [b, s] over the whole sequence (summed over the CP group, whose ranks hold pieces of it), with
    the gradient of this rank's piece scaled by the CP size. A loss f(sum) / cp on every CP rank then adds up to f(sum)
    and its gradients to f'(sum) * d(sum): Megatron multiplies the loss by cp and DDP averages over DP x CP, so each
    rank's share of a nonlinear sequence-level loss needs exactly this (an all-reduce with autograd would need its own
    backward collective)."""
    local = x.sum(-1)
    if cp_group is None or dist.get_world_size(cp_group) == 1:
        return local
    total = local.detach().clone()
    dist.all_reduce(total, group=cp_group)
    cp = dist.get_world_size(cp_group)
    return total + cp * (local - local.detach())


def preference_objective(log_prob: torch.Tensor, entropy: torch.Tensor, batch: TokenBatch, cfg, cp_group=None):
    """DPO / IPO on preference pairs: rows 2k and 2k + 1 of the micro-batch are the chosen and the rejected response
    of pair k (the same prompt), batch.ref_log_probs the frozen reference's log-probs of the same tokens.

    h = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)), each a sum over the response's
    tokens (summed over the CP group). Loss per pair: dpo (arXiv:2305.18290) -(1 - eps) log sigmoid(beta h)
    - eps log sigmoid(-beta h) (eps = cfg.label_smoothing, conservative DPO; 0: plain DPO); ipo (arXiv:2310.12036)
    (h - 1 / (2 beta))^2. Each pair's weight is the sum of its two rows' loss_weight (seq-mean-token-mean gives
    1 / pairs in the global batch), so the loss is the mean over the global batch's pairs whatever the layout; pairs
    of padding rows (no response tokens) weigh 0. Metrics per pair: the implicit rewards beta * (log pi - log ref) of
    chosen and rejected, their margin, and the reward accuracy (chosen rewarded above rejected)."""
    if batch.ref_log_probs is None:
        raise ValueError("the preference objective needs ref_log_probs (the frozen reference's log-probs)")
    if batch.input_ids.shape[0] % 2:
        raise ValueError(f"a preference micro-batch holds pairs as adjacent rows; got {batch.input_ids.shape[0]} rows")
    mask = batch.loss_mask
    log_ratio = _seq_sum_with_grad((log_prob - batch.ref_log_probs) * mask, cp_group).view(-1, 2)
    weight = _seq_sum(cp_group)(batch.loss_weight * mask).view(-1, 2).sum(-1)
    h = log_ratio[:, 0] - log_ratio[:, 1]
    if cfg.loss_type == "ipo":
        per_pair = (h - 1 / (2 * cfg.beta)) ** 2
    else:
        eps = cfg.label_smoothing
        per_pair = -(1 - eps) * torch.nn.functional.logsigmoid(cfg.beta * h) \
            - eps * torch.nn.functional.logsigmoid(-cfg.beta * h)
    cp = dist.get_world_size(cp_group) if cp_group is not None else 1
    loss = (per_pair * weight).sum() / cp
    with torch.no_grad():
        real = (weight > 0).float()
        rewards = cfg.beta * log_ratio.detach()

        def stat(values):
            return torch.stack([(values.float() * real).sum(), real.sum()])

        metrics = {"mean/chosen_reward": stat(rewards[:, 0]), "mean/rejected_reward": stat(rewards[:, 1]),
                   "mean/margin": stat(rewards[:, 0] - rewards[:, 1]),
                   "mean/reward_accuracy": stat(rewards[:, 0] > rewards[:, 1]),
                   "mean/pair_loss": stat(per_pair.detach()), "mean/entropy": _mean_stat(entropy, mask)}
    return loss, metrics


def value_objective(values: torch.Tensor, batch: TokenBatch, cfg: AlgorithmConfig, cp_group=None
                    ) -> tuple[torch.Tensor, dict]:
    """Critic: sum_t clipped value loss_t * loss_weight_t over the response tokens (per token: no CP reduction)."""
    mask = batch.loss_mask
    per_token, stats = value_loss(values, batch.old_values, batch.returns, cfg.value_clip)
    metrics = {"mean/value_loss": _mean_stat(per_token, mask), "mean/values": _mean_stat(values, mask),
               "mean/returns": _mean_stat(batch.returns, mask)}
    for name, value in stats.items():
        metrics[f"mean/{name}"] = _mean_stat(value, mask)
    return (per_token * mask * batch.loss_weight).sum(), metrics


def values_from_head(output: torch.Tensor) -> torch.Tensor:
    """[b, s] values from a critic's output ([b, s, 1] from megarl.models.bridge.ValueHead, complete on every TP rank)."""
    return output[..., 0].float()


@dataclass(frozen=True)
class Objective:
    """An objective of the loss functions: fn(inputs, batch, cfg, cp_group=..., ...) -> (sum of the micro-batch's
    weighted per-token losses, metrics). reads: "log_probs", the LM head's output turned into each target token's
    log-prob and the entropy (fn(log_prob, entropy, batch, cfg, ...)); "values", a value head's output, [b, s, 1]
    complete on every TP rank (fn(values, batch, cfg, ...))."""
    fn: Callable
    reads: str = "log_probs"


OBJECTIVES: dict[str, Objective] = {"rl": Objective(rl_objective), "sft": Objective(sft_objective),
                                    "preference": Objective(preference_objective),
                                    "value": Objective(value_objective, reads="values")}


# ---------------------------------------------------------------------------------------------- Megatron adapter
def make_loss_func(batch: TokenBatch, cfg: AlgorithmConfig | None, *, num_microbatches: int, pg,
                   vocab_size: int | None = None,
                   objective: str = "rl", temperature: float | None = None, tp_group=None, cp_group=None,
                   dp_size: int | None = None, model_config=None, packing=None):
    """The loss_func a forward_step_func returns to Megatron's schedule, for one micro-batch.

    Groups and the DP size come from pg, megatron-core's ProcessGroupCollection (megarl.parallel.groups().mcore, or
    megarl.parallel.user_groups() in your own Megatron loop), unless overridden one by one. Returns
    loss_func(output) -> (scaled loss, metrics), output being the last pipeline stage's: this TP rank's logits
    [b, s, vocab/tp], or the final hidden states + output weight (a HeadInput, megarl.losses.fused_linear) when run
    with the fused output layer.
    packing: the micro-batch's megarl.models.forward.PackedLayout when the model ran on its rows packed into one
    (algorithm.pack_sequences): the output is then [1, total, ...]; log-probs and entropy are computed there and
    unpacked to [b, s] before the objective, which sees exactly what the padded forward gives.
    objective: a name in OBJECTIVES (rl, sft, preference; value: the critic's, on its value head's output, which
    needs no vocab_size).
    """
    if model_config is not None and getattr(model_config, "calculate_per_token_loss", False):
        raise ValueError("megarl's loss functions normalise by global counts themselves; set "
                         "TransformerConfig.calculate_per_token_loss=False")
    if batch.loss_weight is None:
        raise ValueError("batch.loss_weight is not set: call prepare_global_batch() on the global batch first")
    tp_group = tp_group if tp_group is not None else pg.tp
    if cp_group is None and pg.cp.size() > 1:
        cp_group = pg.cp
    dp_size = dp_size if dp_size is not None else pg.dp.size()
    temperature = temperature if temperature is not None else (cfg.temperature if cfg is not None else 1.0)
    if objective not in OBJECTIVES:
        raise ValueError(f"objective={objective!r} is unknown; choose one of {sorted(OBJECTIVES)}")
    fn = OBJECTIVES[objective].fn
    if OBJECTIVES[objective].reads == "values":
        def value_loss_func(output: torch.Tensor):
            values = values_from_head(output if packing is None else packing.unpack(output))
            loss, metrics = fn(values, batch, cfg, cp_group=cp_group)
            metrics["loss"] = torch.stack([loss.detach(), torch.ones(())])
            return loss * (num_microbatches * dp_size), metrics

        return value_loss_func
    if vocab_size is None:
        raise ValueError(f"objective={objective!r} computes log-probs over the vocabulary: pass vocab_size")

    def loss_func(output):
        token_ids, extra = batch.targets, {}  # [b, s]
        top_k = batch.teacher_top_ids is not None and objective == "rl"
        if top_k:  # opd_top_k: the policy's log-probs of the teacher's top-k tokens too, from the same vocabulary pass
            token_ids = torch.cat([token_ids[..., None], batch.teacher_top_ids], dim=-1)  # [b, s, 1 + k]
        log_prob, entropy = logprob_entropy(output, token_ids if packing is None else packing.pack(token_ids),
                                            vocab_size=vocab_size, temperature=temperature, group=tp_group)
        if packing is not None:
            log_prob, entropy = packing.unpack(log_prob), packing.unpack(entropy)
        if top_k:
            log_prob, extra["student_top_log_probs"] = log_prob[..., 0], log_prob[..., 1:]
        loss, metrics = fn(log_prob, entropy, batch, cfg, cp_group=cp_group, **extra)
        metrics["loss"] = torch.stack([loss.detach(), torch.ones(())])
        return loss * (num_microbatches * dp_size), metrics

    return loss_func


HISTOGRAM_BINS, HISTOGRAM_RANGE = 4096, 4.0  # log-ratio bins of width 2e-3 over [-4, 4]; outside: the edge bins


def log_histogram(values: torch.Tensor, bins: int = HISTOGRAM_BINS, bound: float = HISTOGRAM_RANGE) -> torch.Tensor:
    """[2, bins] float64: the count and the sum of the values falling in each of `bins` equal bins over
    [-bound, bound] (values beyond go to the edge bins). Histograms of disjoint sets add up to the histogram of their
    union, so per-rank histograms merge with one all-reduce of a fixed size."""
    values = values.double().reshape(-1)
    index = ((values + bound) * (bins / (2 * bound))).floor().clamp(0, bins - 1).long()
    out = torch.zeros(2, bins, dtype=torch.float64)
    out[0].index_add_(0, index, torch.ones_like(values))
    out[1].index_add_(0, index, values)
    return out


def histogram_quantile(hist: torch.Tensor, q: float) -> torch.Tensor:
    """The q-quantile of the values behind a log_histogram: the mean of the values in the bin where the cumulative
    count reaches q of the total (exact when that bin holds one distinct value, within one bin width otherwise)."""
    counts, sums = hist
    target = q * counts.sum()
    index = int(torch.searchsorted(counts.cumsum(0), target.reshape(1)).clamp(max=counts.numel() - 1))
    while counts[index] == 0:  # q = 0 lands before the first filled bin
        index += 1
    return sums[index] / counts[index]


def reduce_metrics(per_microbatch: list[dict] | None, pg) -> dict[str, float]:
    """Global metrics from the loss functions' outputs (a collective over all ranks; call it on every rank).

    Means are sums over micro-batches, DP and CP ranks divided by the global token count; maxima and ratio
    percentiles are global too. Only the last pipeline stage computed them: the result is shared with every stage.
    pg: megatron-core's ProcessGroupCollection.
    """
    holder = None
    if per_microbatch:
        dp_cp = pg.dp_cp
        keys = sorted(per_microbatch[0])
        means = [k for k in keys if k.startswith("mean/") or k == "loss"]
        maxes = [k for k in keys if k.startswith("max/")]
        sums = torch.stack([sum(m[k].double() for m in per_microbatch) for k in means]) if means else None
        mx = torch.stack([torch.stack([m[k].double() for m in per_microbatch]).max() for k in maxes]) if maxes \
            else None
        if sums is not None:
            dist.all_reduce(sums, group=dp_cp)
        if mx is not None:
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=dp_cp)
        hists = [m["hist/log_ratio"] for m in per_microbatch if "hist/log_ratio" in m]
        result = {}
        for k, (total, count) in zip(means, sums if sums is not None else []):
            name = k.split("/", 1)[-1]
            result[name] = float(total) if k == "loss" else float(total / count.clamp(min=1))
        for k, value in zip(maxes, mx if mx is not None else []):
            result[k.split("/", 1)[1] + "_max"] = float(value)
        if hists:  # a fixed-size sketch per rank, summed: the cost does not grow with the tokens
            hist = torch.stack(hists).sum(0)
            dist.all_reduce(hist, group=dp_cp)
            if hist[0].sum() > 0:
                for q in (0.05, 0.5, 0.95):
                    result[f"ratio_p{int(q * 100)}"] = float(torch.exp(histogram_quantile(hist, q)))
        holder = result
    # Share the last stage's result with the other pipeline stages.
    pp_group = pg.pp
    last = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)
    box = [holder]
    dist.broadcast_object_list(box, src=last, group=pp_group)
    return box[0] or {}
