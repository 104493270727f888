"""What the offline trainers (SFT, DPO / IPO) share: the set-up (process groups, model folder, tokenizer, the policy with
the section's optimizer and schedule), resume from the section's latest checkpoint, the seeded epoch-by-epoch data
order, the metrics log, periodic and final checkpoints, the HF export and the summary. A subclass says what its items
are and what one step does with a batch of them."""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

from .. import parallel
from ..config import to_dict
from ..data import ChatTokenizer
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .logging import MetricsLog
from .numerics import SkippedSteps
from .setup import Policy, build_policy, init_parallel, prepare_model_folder, resolve_load


class OfflineTrainer:
    """One offline run under torchrun: `OfflineTrainer(cfg).run()` -> its summary.

    Subclasses set `name` (the output folder <run_dir>/<name>, <name>_metrics.jsonl, <name>_summary.json) and `show`
    (the metrics the progress line shows), and implement load_items, train_on and counts."""

    name: str = ""
    show: tuple = ()

    def __init__(self, cfg):
        self.started = time.perf_counter()
        self.cfg = cfg
        self.section = getattr(cfg, self.name)  # steps, batch_size, lr, min_lr, weight_decay, warmup_steps, ...
        parallel.init_distributed(parallel=cfg.parallel)  # the groups: once the model shape is known
        self.rank = dist.get_rank()
        self.model_path = prepare_model_folder(cfg)
        self.folder = init_parallel(cfg, self.model_path)
        self.pg = parallel.groups().mcore  # megatron-core's ProcessGroupCollection, passed to every step
        self.tok = ChatTokenizer.from_pretrained(self.model_path)
        self.out_dir = os.path.join(cfg.run_dir, self.name)

    # ------------------------------------------------------------------------------------------ what a subclass says
    def load_items(self) -> list:
        """The training items (samples, pairs), in file order."""
        raise NotImplementedError

    def load_path(self) -> str | None:
        """The megarl checkpoint the policy starts from (None: the model folder's weights)."""
        return resolve_load(self.cfg)

    def build(self, policy: Policy) -> None:
        """Anything else built from the initial policy, before a resumed checkpoint loads (e.g. a frozen reference)."""

    def train_on(self, items: list) -> dict:
        """One optimizer step (and scheduler step) on this step's items, all ranks; its metrics."""
        raise NotImplementedError

    def counts(self) -> dict:
        """What the summary says about the data (e.g. {"samples": n})."""
        return {}

    def summarize(self, history: list[dict]) -> dict:
        """Extra summary entries from the steps' metrics."""
        return {}

    # ---------------------------------------------------------------------------------------------------- the run
    def optim_config(self):
        """cfg.optim with the section's learning rate and schedule."""
        s = self.section
        return type(self.cfg.optim)(**{**to_dict(self.cfg.optim), "lr": s.lr, "min_lr": s.min_lr,
                                       "weight_decay": s.weight_decay, "warmup_steps": s.warmup_steps,
                                       "decay_style": s.decay_style})

    def run(self) -> dict:
        cfg, s = self.cfg, self.section
        self.items = self.load_items()[: s.max_samples]
        self.policy = policy = build_policy(self.folder, self.optim_config(), s.steps, load=self.load_path(),
                                            lora=cfg.model.lora, pg=self.pg)
        self.build(policy)
        ckpt_root = os.path.join(self.out_dir, "checkpoints")
        step = 0
        latest = latest_checkpoint(ckpt_root) if cfg.checkpoint.resume and os.path.isdir(ckpt_root) else None
        if latest:
            step = load_checkpoint(latest, policy.chunks, policy.optimizer, policy.scheduler)["step"]
        log = MetricsLog(self.out_dir, to_dict(cfg), cfg.logging.wandb, cfg.logging.project, progress_total=s.steps,
                         progress=cfg.logging.progress, filename=f"{self.name}_metrics.jsonl") \
            if self.rank == 0 else None
        if log is not None:
            log.truncate_after(step)
        per_epoch = max(1, len(self.items) // s.batch_size)
        history, skips = [], SkippedSteps(cfg.rl.max_skipped_steps)  # train_step skips a non-finite step
        while step < s.steps:
            step += 1
            epoch, index = divmod(step - 1, per_epoch)
            order = torch.randperm(len(self.items), generator=torch.Generator().manual_seed(cfg.seed + epoch)).tolist()
            metrics = self.train_on([self.items[i] for i in order[index * s.batch_size:(index + 1) * s.batch_size]])
            history.append(metrics)
            if log is not None:
                log.log(step, metrics, show=self.show)
            skips.count(metrics, f"{self.name} step {step}")  # after the log: the stopping step is in the metrics too
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < s.steps:
                save_checkpoint(ckpt_root, step, policy.chunks, policy.optimizer, policy.scheduler, {},
                                keep=cfg.checkpoint.keep)
        final = save_checkpoint(ckpt_root, step, policy.chunks, policy.optimizer, policy.scheduler, {},
                                keep=cfg.checkpoint.keep)
        if cfg.checkpoint.export_hf:
            policy.bridge.save_hf(policy.chunks, os.path.join(self.out_dir, "hf"))
        summary = {"checkpoint": final, "steps": step, **self.counts(), "wall_s": time.perf_counter() - self.started,
                   **self.summarize(history)}
        if log is not None:
            log.close()
            with open(os.path.join(self.out_dir, f"{self.name}_summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
        return summary
