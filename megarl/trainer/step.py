"""The phases of one RL step, in the order `RLTrainer.step_once` runs them. Each is a function of the parts it needs
(models, its config section, the process groups) and of what the phase before returned:

    dispatch_rank_batch   the step's rollout (held by the rollout workers) -> this DP rank's rows, as tensors
    log_probs             reference / old-policy log-probs (and entropies) of the engine's tokens, on every stage
    critic_values         a critic's values at rollout time (algorithm.use_critic)
    advantages            algorithm.advantage_estimator over this rank's whole groups (batch statistics over DP)
    update                rl.ppo_epochs x rl.mini_batches optimizer steps through Megatron's pipeline schedule

The metrics of a step are reductions of what these return (megarl.trainer.metrics).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..algorithms import compute_advantages, kl_estimate, loss_phases
from ..algorithms.dynamics import UpdateSparsity
from ..losses import compute_log_probs, compute_values, prepare_global_batch, train_step
from .async_rollout import RolloutBatch
from .batching import RankBatch
from .dispatch import dispatch
from .metrics import mean_of_updates
from .numerics import SkippedSteps


def dispatch_rank_batch(rollout: RolloutBatch | None, step: int, groups, sources, pad_id: int,
                        routing_shape) -> tuple[RankBatch, int]:
    """This DP rank's rows of the step (megarl.trainer.dispatch; `rollout` is None off the rollout workers) and the
    bytes it received."""
    held = rollout or RolloutBatch(step, [], None, None, {}, {}, {})
    got = dispatch(held.packed, held.plan, groups, sources=tuple(sources))
    return RankBatch(got.share.token_batch(got.rows, got.seq_len, pad_id, routing_shape), got.share,
                     got.num_microbatches), got.bytes_received


def _on_every_stage(per_token: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Forward-only results exist on the last pipeline stage; the other stages, which compute no loss, get zeros."""
    return per_token if per_token is not None else torch.zeros_like(like)


def from_last_stage(values: torch.Tensor | None, like: torch.Tensor, pg) -> torch.Tensor:
    """The last pipeline stage's per-token values on every stage: token selections (loss_phases) must agree on all
    ranks of a DP replica."""
    out = values.contiguous() if values is not None else torch.zeros_like(like)
    if pg.pp.size() > 1:
        dist.broadcast(out, src=dist.get_global_rank(pg.pp, pg.pp.size() - 1), group=pg.pp)
    return out


def log_probs(model, rank_batch: RankBatch, algo, vocab_size: int, pg, entropy: bool = False):
    """Log-probs [b, s] of the batch's tokens under `model` (zeros off the last stage); entropy=True: (log-probs,
    entropies), both the last stage's on every stage. algo: the algorithm section (temperature, fused, packing)."""
    out = compute_log_probs(model, rank_batch.batch, rank_batch.num_microbatches, vocab_size,
                            temperature=algo.temperature, entropy=entropy, fused=algo.fused_logprobs,
                            pack=algo.pack_sequences, pg=pg)
    if not entropy:
        return _on_every_stage(out, rank_batch.batch.loss_mask)
    return tuple(from_last_stage(x, rank_batch.batch.loss_mask, pg) for x in (out if out is not None else (None, None)))


def critic_values(critic_model, rank_batch: RankBatch, algo, pg) -> torch.Tensor:
    return _on_every_stage(compute_values(critic_model, rank_batch.batch, rank_batch.num_microbatches,
                                          pack=algo.pack_sequences, pg=pg), rank_batch.batch.loss_mask)


def advantages(rank_batch: RankBatch, algo, group) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns) [b, s] of the rank's rows (padding rows: zeros). group: the DP group, over which
    batch-level statistics (whitening, batch baselines) reduce; the GRPO-style groups are whole on each rank."""
    batch, samples, real = rank_batch.batch, rank_batch.samples, rank_batch.samples.num_samples
    adv_all, ret_all = torch.zeros_like(batch.loss_mask), torch.zeros_like(batch.loss_mask)
    kl = kl_estimate(batch.old_log_probs[:real], batch.ref_log_probs[:real], algo.kl_estimator) \
        if algo.kl_in_reward and batch.ref_log_probs is not None else None
    teacher = samples.teacher_log_probs  # opd: A_t = teacher - student, student = the old log-probs
    teacher = samples.per_token(teacher, *batch.loss_mask.shape)[:real] if teacher is not None else None
    adv, ret = compute_advantages(algo.advantage_estimator, scores=samples.score, group_ids=samples.group,
                                  mask=batch.loss_mask[:real], kl=kl, kl_coef=algo.kl_coef, gamma=algo.gamma,
                                  lam=algo.lam, reward_weights=algo.reward_weights,
                                  values=batch.old_values[:real] if batch.old_values is not None else None,
                                  std_normalize=algo.std_normalize, whiten_advantages=algo.whiten_advantages,
                                  group=group, baseline=samples.baseline, teacher_log_probs=teacher,
                                  student_log_probs=batch.old_log_probs[:real],
                                  opd_reward_weight=algo.opd_reward_weight, opd_top_k=algo.opd_top_k)
    adv_all[:real], ret_all[:real] = adv, ret
    return adv_all, ret_all


def _global(batch, algo, pg):
    """The batch with its global normalisers (token counts over DP: gradients independent of the layout)."""
    return prepare_global_batch(batch, algo.aggregation, algo.norm_length, pg.dp, seq_multiple=pg.tp.size())


def update(policy, critic, rank_batch: RankBatch, algo, rl, vocab_size: int, pg, seed: int,
           old_entropy: torch.Tensor | None, skips: SkippedSteps | None = None, step: int = 0) -> dict:
    """rl.ppo_epochs x rl.mini_batches optimizer steps (Lopti: two phases per mini-batch, each its own optimizer step
    normalised by its own global token count; the phases share the mini-batch's learning rate), the critic's value
    steps beside them. Returns the updates' metrics averaged (and with rl.log_update_sparsity, the share of parameters
    the updates changed), except skipped_updates: how many of the policy's updates train_step skipped for a
    non-finite loss or gradient. skips: counts those in a row and stops the run at rl.max_skipped_steps (step: the RL
    step, for its message)."""
    batch = rank_batch.batch
    tracker = UpdateSparsity(policy.chunks, pg, vocab_size).snapshot() if rl.log_update_sparsity else None
    rows, num_mb = batch.input_ids.shape[0] // rl.mini_batches, max(1, rank_batch.num_microbatches // rl.mini_batches)
    updates = []
    for epoch in range(rl.ppo_epochs):
        for k in range(rl.mini_batches):
            part = slice(k * rows, (k + 1) * rows)
            phases = loss_phases(batch.rows(part), algo, group=pg.dp,
                                 entropy=old_entropy[part] if old_entropy is not None else None,
                                 seed=(seed * 1009 + epoch) * 101 + k)
            for phase in phases:
                updates.append(train_step(policy.model, policy.optimizer, _global(phase, algo, pg), num_mb, algo,
                                          vocab_size, pg=pg))
                if skips is not None:
                    skips.count(updates[-1], f"RL step {step}, epoch {epoch + 1}, mini-batch {k + 1}")
            # a skipped update still advances the LR schedule: it is sized and resumed by the update's index
            policy.scheduler.step(1)
            if critic is not None:
                value = train_step(critic.model, critic.optimizer, _global(batch.rows(part), algo, pg), num_mb,
                                   algo, vocab_size, objective="value", pg=pg)
                critic.scheduler.step(1)
                for metrics in updates[-len(phases):]:
                    metrics.update({f"critic/{name}": v for name, v in value.items()})
    out = mean_of_updates(updates)
    out["skipped_updates"] = sum(u["skipped_updates"] for u in updates)  # a count, not a mean: a skip is a fault
    if tracker is not None:
        changed, total = tracker.changed()
        out["dynamics/update_changed_frac"] = changed / max(total, 1.0)
    return out
