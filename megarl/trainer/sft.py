"""SFT cold start: chat samples -> the model's chat template -> token ids with loss on assistant tokens only ->
packed rows -> teacher-forced cross-entropy through the same Megatron step as RL (objective "sft").

Writes <run_dir>/sft/checkpoints/step_N (the format `megarl train` loads with model.load; `model.load: sft` names
it) and, when checkpoint.export_hf is set, an HF folder <run_dir>/sft/hf. Run it under torchrun: `megarl sft CONFIG [key=value ...]`.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch
import torch.distributed as dist

from .. import parallel
from ..config import to_dict
from ..data import ChatTokenizer, load_sft_samples, pack_samples
from ..data.chat import rows_to_tensors
from ..losses import TokenBatch, prepare_global_batch, train_step
from .batching import micro_batches_for
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .logging import MetricsLog, PhaseTimer
from .setup import build_policy, init_parallel, prepare_model_folder, prompt_tools, resolve_load


def sft_dir(cfg) -> str:
    return os.path.join(cfg.run_dir, "sft")


def sft_batch(rows, dp_rank: int, dp_size: int, pad_id: int, seq_multiple: int, max_tokens: int):
    """This DP rank's packed rows as a TokenBatch (rows dealt round-robin, padded to equal counts) and its number of
    micro-batches."""
    seq_len = max(sum(len(s.input_ids) for s in row) for row in rows)
    seq_len = int(math.ceil(seq_len / seq_multiple) * seq_multiple)
    mine = rows[dp_rank::dp_size]
    per_rank = math.ceil(len(rows) / dp_size)
    num_mb = micro_batches_for(per_rank, seq_len, max_tokens)
    per_rank = int(math.ceil(per_rank / num_mb) * num_mb)
    ids, targets, mask, segments = rows_to_tensors(mine + [[]] * (per_rank - len(mine)), pad_id, seq_len)
    return TokenBatch(input_ids=ids, targets=targets, loss_mask=mask, segment_ids=segments), num_mb


def run_sft(cfg) -> dict:
    started = time.perf_counter()
    s = cfg.sft
    parallel.init_distributed(parallel=cfg.parallel)  # the groups: once the model shape is known
    rank = dist.get_rank()
    model_path = prepare_model_folder(cfg)
    folder = init_parallel(cfg, model_path)
    pg = parallel.groups().mcore  # megatron-core's ProcessGroupCollection, passed to every step below

    tok = ChatTokenizer.from_pretrained(model_path)
    samples = load_sft_samples(s.data, tok, cfg.data, tools=prompt_tools(cfg))[: s.max_samples]
    optim = type(cfg.optim)(**{**to_dict(cfg.optim), "lr": s.lr, "min_lr": s.min_lr, "weight_decay": s.weight_decay,
                               "warmup_steps": s.warmup_steps, "decay_style": s.decay_style})
    load = None if cfg.model.load == "sft" else resolve_load(cfg)  # "sft" is what this run produces
    policy = build_policy(folder, optim, s.steps, load=load, pg=pg)
    out_dir = sft_dir(cfg)
    ckpt_root = os.path.join(out_dir, "checkpoints")
    step, state = 0, {}
    latest = latest_checkpoint(ckpt_root) if cfg.checkpoint.resume and os.path.isdir(ckpt_root) else None
    if latest:
        state = load_checkpoint(latest, policy.chunks, policy.optimizer, policy.scheduler)
        step = state["step"]
    log = MetricsLog(out_dir, to_dict(cfg), cfg.logging.wandb, cfg.logging.project, progress_total=s.steps,
                     progress=cfg.logging.progress, filename="sft_metrics.jsonl") if rank == 0 else None
    if log is not None:
        log.truncate_after(step)
    dp_rank, dp_size = pg.dp.rank(), pg.dp.size()
    per_epoch = max(1, len(samples) // s.batch_size)
    while step < s.steps:
        step += 1
        timer = PhaseTimer()
        epoch, index = divmod(step - 1, per_epoch)
        order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
        chosen = [samples[i] for i in order[index * s.batch_size:(index + 1) * s.batch_size]]
        rows = pack_samples(chosen, s.max_seq_len, s.pack)
        batch, num_mb = sft_batch(rows, dp_rank, dp_size, tok.pad_id, pg.tp.size(),
                                  s.max_tokens_per_microbatch)
        with timer("train"):
            batch = prepare_global_batch(batch, "token-mean", dp_group=pg.dp, seq_multiple=pg.tp.size())
            metrics = train_step(policy.model, policy.optimizer, batch, num_mb, None, policy.bridge.vocab_size,
                                 objective="sft", pack=cfg.algorithm.pack_sequences, pg=pg)
            policy.scheduler.step(1)
        metrics.update(timer.take(), **{"sft/rows": len(rows), "sft/samples": len(chosen)})
        if log is not None:
            log.log(step, metrics, show=("nll",))
        if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < s.steps:
            save_checkpoint(ckpt_root, step, policy.chunks, policy.optimizer, policy.scheduler, {},
                            keep=cfg.checkpoint.keep)
    final = save_checkpoint(ckpt_root, step, policy.chunks, policy.optimizer, policy.scheduler, {},
                            keep=cfg.checkpoint.keep)
    if cfg.checkpoint.export_hf:
        policy.bridge.save_hf(policy.chunks, os.path.join(out_dir, "hf"))
    summary = {"checkpoint": final, "steps": step, "samples": len(samples), "wall_s": time.perf_counter() - started}
    if log is not None:
        log.close()
        with open(os.path.join(out_dir, "sft_summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return summary
