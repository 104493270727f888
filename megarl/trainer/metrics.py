"""The RL step's metrics: each one a reduction of what a phase of the step returned, over the group that holds it.

Forward-only results (log-probs, entropies, values) exist on the last pipeline stage, where every TP rank holds the
same copy and the data x context-parallel ranks hold their own rows: `over_last_stage` sums them over that stage's
dp_cp group, then hands the totals to every stage over the pipeline group (rank 0, which logs, is on the first
stage). Per-layer MoE routing counts are the exception: every stage holds its own layers, so they reduce over the world.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..algorithms import entropy_split
from ..algorithms.dynamics import kl_sums
from ..models.moe import RoutingStats, load_balance_metrics
from ..losses.step import schedule_layouts
from .async_rollout import lag_stats


def over_last_stage(values: torch.Tensor, pg, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`values` (in place): the last pipeline stage's per-rank partial sums reduced over its dp_cp group (the TP ranks
    hold copies and are not summed), then the same totals on every stage."""
    dist.all_reduce(values, op=op, group=pg.dp_cp)
    pp = pg.pp
    if pp.size() > 1:
        dist.broadcast(values, src=dist.get_global_rank(pp, pp.size() - 1), group=pp)
    return values


def _ratio(num, den) -> float:
    return float(num / den.clamp(min=1))


def logprob_mismatch(old_log_probs, rollout_log_probs, mask, pg) -> dict:
    """Trainer vs engine on the same tokens before any update: |old log-prob - rollout log-prob| over the global
    batch, mean and max."""
    diff = (old_log_probs - rollout_log_probs).abs() * mask
    sums = over_last_stage(torch.stack([diff.sum(), mask.sum()]).double(), pg)
    peak = over_last_stage(diff.max().double().reshape(1) if diff.numel() else torch.zeros(1, dtype=torch.float64),
                           pg, op=dist.ReduceOp.MAX)
    return {"mismatch/logprob_abs_diff": _ratio(sums[0], sums[1]), "mismatch/logprob_abs_diff_max": float(peak[0])}


def entropy_dynamics(entropy, mask, pg) -> dict:
    """RL dynamics: the old policy's mean entropy over the top 20% highest-entropy response tokens of the global batch
    and over the other 80% (the threshold over all DP ranks)."""
    sums = over_last_stage(entropy_split(entropy, mask, 0.2, pg.dp), pg)
    return {"dynamics/entropy_top20": _ratio(sums[0], sums[1]), "dynamics/entropy_rest80": _ratio(sums[2], sums[3])}


def staleness(rank_batch, step: int, max_staleness: int, pg) -> dict:
    """Asynchronous RL: trained tokens per lag (steps between the weights that sampled a token and the policy the step
    updates), and the trainer-engine log-prob mismatch per lag, over the global batch."""
    k, batch = max_staleness, rank_batch.batch
    versions = rank_batch.samples.per_token(rank_batch.samples.token_versions.float(), *batch.loss_mask.shape)
    diff = (batch.old_log_probs - batch.rollout_log_probs).abs() * batch.loss_mask
    lag = (step - 1 - versions.long()).clamp(0, k + 1)
    sums = torch.zeros(2, k + 2, dtype=torch.float64)
    sums[0] = lag_stats(versions, batch.loss_mask, step, k)
    sums[1].index_add_(0, lag.reshape(-1), diff.double().reshape(-1))
    over_last_stage(sums, pg)
    total = sums[0].sum().clamp(min=1)
    out = {f"async/lag{j}_token_frac": float(sums[0, j] / total) for j in range(k + 1)}
    out["async/stale_token_frac"] = float(sums[0, k + 1] / total)  # older than allowed: 0 by construction
    out.update({f"mismatch/logprob_abs_diff_lag{j}": _ratio(sums[1, j], sums[0, j]) for j in range(k + 1)})
    return out


def opd_reverse_kl(returns, mask, pg) -> dict:
    """On-policy distillation (returns = teacher - student log-prob per token): the sampled KL(student || teacher)."""
    sums = torch.stack([-(returns * mask).sum(), mask.sum()]).double()
    dist.all_reduce(sums, group=pg.dp)
    return {"opd/reverse_kl": _ratio(sums[0], sums[1])}


def forgetting_kl(policy_log_probs, initial_log_probs, mask, pg) -> dict:
    """KL(policy || initial model) on held-out responses: k3 and k1, per token (log-probs None off the last stage)."""
    sums = kl_sums(policy_log_probs, initial_log_probs, mask) if policy_log_probs is not None else \
        torch.zeros(3, dtype=torch.float64)  # not the last stage: nothing here
    over_last_stage(sums, pg)
    return {"eval/kl_to_initial": _ratio(sums[0], sums[2]), "eval/kl_to_initial_k1": _ratio(sums[1], sums[2])}


def routing(stats: RoutingStats, engine_routing, rank_batch, model, pack, num_layers: int, num_experts: int,
            pg) -> dict:
    """MoE: how often the routing of the old-log-prob forward (the trainer's own, or the engine's under R3) picked
    the engine's experts, expert load balance and dropped tokens, over each sample's positions but its last (whose
    output is never trained, and which the engine never routed): padding never counts. Each pipeline stage holds its
    own layers, so these reduce over the world."""
    stats.close()
    batch, samples = rank_batch.batch, rank_batch.samples
    positions = (torch.arange(batch.input_ids.shape[1]) < samples.seq_lens[:, None] - 1).float()
    positions = torch.cat([positions, positions.new_zeros(batch.input_ids.shape[0] - len(positions),
                                                          positions.shape[1])])
    layouts = schedule_layouts(model, batch.split(rank_batch.num_microbatches), pack, pg=pg)  # the forward's order
    counted = (positions, rank_batch.num_microbatches, layouts)  # the samples' routed tokens, as the engine routed
    sums = torch.cat([stats.agreement(engine_routing, *counted), stats.assignments(*counted)])
    load = stats.load(num_layers, num_experts, *counted)
    dist.all_reduce(sums, group=dist.group.WORLD)
    dist.all_reduce(load, group=dist.group.WORLD)  # each stage fills its own layers' rows
    return {"moe/routing_agreement": _ratio(sums[0], sums[1]), "moe/dropped_token_frac": float(1 - _ratio(sums[2],
            sums[3])), **load_balance_metrics(load)}


def mean_of_updates(updates: list[dict]) -> dict:
    """The step's training metrics: each optimizer step's (already global) values, averaged over the step's updates."""
    return {k: sum(u[k] for u in updates) / len(updates) for k in updates[0]}
