"""Offline preference training: DPO or IPO (`dpo.loss_type`) on preference pairs, through the same Megatron step as RL
and SFT (objective "preference", megarl.losses.rl.preference_objective), against a frozen reference: the initial
policy (the model folder's weights, or model.load), built the way the RL trainer builds its KL reference.

Each pair is two adjacent rows, chosen then rejected, and a pair never straddles a micro-batch or a data-parallel
rank (pairs are dealt to DP ranks whole, micro-batches hold an even number of rows), so the loss, which needs both
sequences' log-prob sums at once, is the same whatever the layout. Writes <run_dir>/dpo/checkpoints/step_N (the format
`megarl train` loads with model.load), dpo_metrics.jsonl, dpo_summary.json and, with checkpoint.export_hf, an HF
folder <run_dir>/dpo/hf. Run it under torchrun: `megarl dpo CONFIG [key=value ...]`.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch
import torch.distributed as dist

from .. import parallel
from ..config import ConfigError, to_dict
from ..data import ChatTokenizer, PreferencePair, load_preference_pairs
from ..errors import about
from ..losses import compute_log_probs, prepare_global_batch, shift_sequences, train_step
from ..losses.rl import TokenBatch
from .batching import micro_batches_for
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .logging import MetricsLog, PhaseTimer
from .setup import build_policy, build_reference, init_parallel, prepare_model_folder, resolve_load


def dpo_dir(cfg) -> str:
    return os.path.join(cfg.run_dir, "dpo")


def pair_batch(pairs: list[PreferencePair], dp_rank: int, dp_size: int, pad_id: int, seq_multiple: int,
               max_seq_len: int, max_tokens: int) -> tuple[TokenBatch, int]:
    """This DP rank's pairs (dealt round-robin, whole) as a TokenBatch of adjacent rows (2k: chosen, 2k + 1:
    rejected), padded with empty pairs to the same count on every rank and a multiple of the micro-batch count, and
    that count. Rows longer than max_seq_len lose the end of their response."""
    for p in pairs:
        if len(p.prompt_ids) >= max_seq_len:
            raise ConfigError(f"dpo.max_seq_len={max_seq_len} leaves no room for a response after a prompt of "
                              f"{len(p.prompt_ids)} tokens. Fix: raise dpo.max_seq_len (or data.max_prompt_tokens "
                              "below it)")
    seq_len = max(min(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)), max_seq_len) for p in pairs)
    seq_len = int(math.ceil(seq_len / seq_multiple) * seq_multiple)
    per_rank = math.ceil(len(pairs) / dp_size)
    num_mb = micro_batches_for(per_rank, 2 * seq_len, max_tokens)  # a pair costs two rows
    per_rank = int(math.ceil(per_rank / num_mb) * num_mb)
    mine = pairs[dp_rank::dp_size]
    prompts, responses = [], []
    for p in mine:
        room = max_seq_len - len(p.prompt_ids)
        prompts += [p.prompt_ids, p.prompt_ids]
        responses += [p.chosen_ids[:room], p.rejected_ids[:room]]
    padding = 2 * (per_rank - len(mine))
    prompts += [[pad_id]] * padding  # padding rows: no response tokens, so no loss and a pair weight of 0
    responses += [[]] * padding
    ids, targets, mask = shift_sequences(prompts, responses, pad_id, seq_len)
    return TokenBatch(input_ids=ids, targets=targets, loss_mask=mask), num_mb


def run_dpo(cfg) -> dict:
    started = time.perf_counter()
    d = cfg.dpo
    parallel.init_distributed(parallel=cfg.parallel)  # the groups: once the model shape is known
    rank = dist.get_rank()
    model_path = prepare_model_folder(cfg)
    folder = init_parallel(cfg, model_path)
    pg = parallel.groups().mcore  # megatron-core's ProcessGroupCollection, passed to every step below

    tok = ChatTokenizer.from_pretrained(model_path)
    with about(f"dpo.data={d.data}"):
        pairs = load_preference_pairs(d.data, tok, cfg.data)[: d.max_samples]
    optim = type(cfg.optim)(**{**to_dict(cfg.optim), "lr": d.lr, "min_lr": d.min_lr, "weight_decay": d.weight_decay,
                               "warmup_steps": d.warmup_steps, "decay_style": d.decay_style})
    policy = build_policy(folder, optim, d.steps, load=resolve_load(cfg), pg=pg)
    ref = build_reference(policy.bridge, policy.chunks)  # the initial policy, before any resumed weights load
    out_dir = dpo_dir(cfg)
    ckpt_root = os.path.join(out_dir, "checkpoints")
    step = 0
    latest = latest_checkpoint(ckpt_root) if cfg.checkpoint.resume and os.path.isdir(ckpt_root) else None
    if latest:
        step = load_checkpoint(latest, policy.chunks, policy.optimizer, policy.scheduler)["step"]
    log = MetricsLog(out_dir, to_dict(cfg), cfg.logging.wandb, cfg.logging.project, progress_total=d.steps,
                     progress=cfg.logging.progress, filename="dpo_metrics.jsonl") if rank == 0 else None
    if log is not None:
        log.truncate_after(step)
    dp_rank, dp_size = pg.dp.rank(), pg.dp.size()
    per_epoch = max(1, len(pairs) // d.batch_size)
    history = []
    while step < d.steps:
        step += 1
        timer = PhaseTimer()
        epoch, index = divmod(step - 1, per_epoch)
        order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        chosen = [pairs[i] for i in order[index * d.batch_size:(index + 1) * d.batch_size]]
        batch, num_mb = pair_batch(chosen, dp_rank, dp_size, tok.pad_id, pg.tp.size(),
                                   d.max_seq_len, d.max_tokens_per_microbatch)
        # seq-mean-token-mean: every real row's weights sum to 1 / rows, so a pair (two rows) weighs 1 / pairs
        batch = prepare_global_batch(batch, "seq-mean-token-mean", dp_group=pg.dp, seq_multiple=pg.tp.size())
        with timer("ref"):
            ref_lp = compute_log_probs(ref, batch, num_mb, policy.bridge.vocab_size, fused=d.fused_logprobs, pg=pg)
            batch.ref_log_probs = ref_lp if ref_lp is not None else torch.zeros_like(batch.loss_mask)
        with timer("train"):
            metrics = train_step(policy.model, policy.optimizer, batch, num_mb, d, policy.bridge.vocab_size,
                                 objective="preference", pg=pg)
            policy.scheduler.step(1)
        metrics.update(timer.take(), **{"dpo/pairs": len(chosen)})
        history.append(metrics)
        if log is not None:
            log.log(step, metrics, show=("loss", "reward_accuracy", "margin"))
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < d.steps:
            save_checkpoint(ckpt_root, step, policy.chunks, policy.optimizer, policy.scheduler, {},
                            keep=cfg.checkpoint.keep)
    final = save_checkpoint(ckpt_root, step, policy.chunks, policy.optimizer, policy.scheduler, {},
                            keep=cfg.checkpoint.keep)
    if cfg.checkpoint.export_hf:
        policy.bridge.save_hf(policy.chunks, os.path.join(out_dir, "hf"))
    summary = {"checkpoint": final, "steps": step, "pairs": len(pairs), "loss_type": d.loss_type,
               "wall_s": time.perf_counter() - started}
    for key in ("loss", "reward_accuracy", "margin"):
        if history:
            summary[f"{key}_first"], summary[f"{key}_last"] = history[0].get(key), history[-1].get(key)
    if log is not None:
        log.close()
        with open(os.path.join(out_dir, "dpo_summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary
