"""Stop requests for preemptible jobs: checkpoint the finished step and exit, so a requeued job resumes from it.

A stop is requested by SIGUSR1 or SIGTERM to any trainer rank, or by the file <run_dir>/STOP (what slurm/train.sbatch
writes when Slurm signals the batch script: torchrun does not forward SIGUSR1 to its workers). Ranks agree at the end
of every step (one all-reduce), then save together. The trainer then writes <run_dir>/preempted.json {"step": N},
removes STOP, and exits 0; the next start resumes from that checkpoint as any resume does.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading

import torch
import torch.distributed as dist

logger = logging.getLogger("megarl")

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class StopRequest:
    def __init__(self, run_dir: str, rank: int, device: str = "cpu"):
        self.stop_file = os.path.join(run_dir, "STOP")
        self.marker = os.path.join(run_dir, "preempted.json")
        self.rank, self.device, self.signalled = rank, device, None
        if threading.current_thread() is threading.main_thread():  # signal handlers live on the main thread
            for sig in SIGNALS:
                signal.signal(sig, self._on_signal)
        if rank == 0 and os.path.exists(self.marker):
            os.remove(self.marker)  # the previous run's stop has been honoured: this run is its continuation

    def _on_signal(self, signum, _frame) -> None:
        self.signalled = signal.Signals(signum).name
        logger.warning("received %s: will checkpoint and stop after the current step", self.signalled)

    def requested(self) -> bool:
        """Collective: True on every rank when any rank was signalled or the STOP file exists."""
        local = self.signalled is not None or (self.rank == 0 and os.path.exists(self.stop_file))
        flag = torch.tensor([float(local)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def acknowledge(self, step: int) -> None:
        """After the checkpoint of `step` is saved: leave the marker the batch script requeues on."""
        if self.rank != 0:
            return
        tmp = self.marker + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"step": step, "signal": self.signalled, "stop_file": os.path.exists(self.stop_file)}, f)
        os.replace(tmp, self.marker)
        if os.path.exists(self.stop_file):
            os.remove(self.stop_file)
        logger.warning("stopped after step %d (checkpoint saved); resubmit or requeue to resume", step)
