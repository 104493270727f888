"""Metrics out of a run: <run_dir>/metrics.jsonl (one line per step, written by rank 0 and flushed at once), wandb
(offline by default: files under <run_dir>/wandb, `wandb sync` later; online when logging.wandb=online), per-phase
timings, and a progress bar."""
from __future__ import annotations

import json
import logging
import os
import time
from contextlib import contextmanager

logger = logging.getLogger("megarl")


class PhaseTimer:
    """timer("rollout") as a context manager; .take() returns {"time/rollout_s": ...} and resets."""

    def __init__(self):
        self.times: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.times[f"time/{phase}_s"] = self.times.get(f"time/{phase}_s", 0.0) + time.perf_counter() - start

    def take(self) -> dict:
        out, self.times = self.times, {}
        return out


class MetricsLog:
    def __init__(self, run_dir: str, cfg_dict: dict, wandb_mode: str = "offline", project: str = "megarl",
                 name: str | None = None, progress_total: int | None = None, progress: bool = True,
                 filename: str = "metrics.jsonl"):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, filename)
        self.run = None
        if wandb_mode != "disabled":
            import wandb

            os.environ.setdefault("WANDB_SILENT", "true")
            self.run = wandb.init(project=project, name=name or os.path.basename(os.path.abspath(run_dir)),
                                  dir=run_dir, mode=wandb_mode, config=cfg_dict, reinit="finish_previous")
        self.bar = None
        if progress and progress_total:
            from tqdm import tqdm

            self.bar = tqdm(total=progress_total, desc=filename.split(".")[0], unit="step", dynamic_ncols=True)

    def truncate_after(self, step: int) -> None:
        """Drop lines of steps after `step` (a resumed run rewrites them)."""
        if not os.path.isfile(self.path):
            return
        with open(self.path) as f:
            lines = [ln for ln in f if ln.strip() and json.loads(ln).get("step", 0) <= step]
        with open(self.path, "w") as f:
            f.writelines(lines)

    def log(self, step: int, metrics: dict, show: tuple = ()) -> None:
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        if self.run is not None:
            self.run.log(record, step=step)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3g}" for k in show if k in metrics})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.finish()


def _plain(v):
    try:
        return float(v) if not isinstance(v, (str, int, bool)) else v
    except (TypeError, ValueError):
        return str(v)
