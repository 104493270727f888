"""Asynchronous RL (rl.max_staleness = k > 0): the engines generate the rollouts of the next steps while Megatron
trains, and every token knows which weights sampled it.

Weight versions: the engines hold version v once the trainer has pushed the weights after RL step v (version 0: the
initial weights). Step t trains on the policy of version t - 1; a token sampled by version v is t - 1 - v steps stale
at step t (its *lag*). The synchronous step (k = 0) samples every token of step t from version t - 1.

The producer (one thread on each rollout worker) collects the rollout of step s only once the engines hold a version
>= s - 1 - k, and the engines' version only grows, so no token of step s is ever older than k: nothing has to be
dropped for staleness (the per-token versions in the rollout dumps and `async/max_lag` show it). Two schedules:

  partial rollouts (rl.partial_rollouts, default)   a weight update does not wait for generations in flight: the
      engines abort them, take the new weights and the requests continue from their own tokens under the new weights
      (megarl.rollout.router); a sample's tokens then carry two (or more) versions, each with the log-prob of the
      distribution that sampled it.
  fixed schedule (rl.partial_rollouts: false)   step s is generated entirely by version max(0, s - 1 - k): the update
      to version v waits until step v + k's rollout is complete. With rollout.deterministic the run is reproducible
      run to run, and a resumed run equals an uninterrupted one.

The off-policy objective is PPO's decoupled form (Hilton et al. 2021, "Batch size-invariance for policy
optimization"; AReaL): with rollout.old_log_probs = recompute the proximal policy is the current weights before the
update (the old log-probs), the behaviour policy is the engine's per-token log-probs, and algorithm.mismatch.mode =
tis (the default with max_staleness >= 1) multiplies each token's clipped surrogate by the truncated importance weight
min(pi_prox / pi_behav, cap) (megarl.algorithms.mismatch); seq_tis / mis / icepop are the other corrections, none
turns it off.

Resume: a checkpoint first lets the producer finish the step it is generating (drain), then stores the finished,
untrained rollouts of every worker with it and the prompt cursor after them; a resumed run trains those first and
continues the prompt stream where the producer stopped, so no completed sample is lost and none is trained twice.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from .batching import BatchPlan, PackedRollout, Sample

UNSAMPLED = -1  # the version of a token no engine sampled (tool observations in multi-turn episodes)


def version_name(version: int) -> str:
    """The weight_version string the trainer gives the engines for `version`."""
    return f"step-{version}"


def version_number(name: str | None) -> int:
    """The version in a weight_version string the trainer set ("step-12" -> 12); UNSAMPLED for none or another."""
    prefix = "step-"
    if name and name.startswith(prefix) and name[len(prefix):].isdigit():
        return int(name[len(prefix):])
    return UNSAMPLED


def token_versions(segments: list[tuple[int, str | None]]) -> np.ndarray:
    """Runs of (token count, weight_version) -> one int32 version per token."""
    if not segments:
        return np.zeros(0, dtype=np.int32)
    return np.repeat(np.asarray([version_number(v) for _, v in segments], dtype=np.int32),
                     [n for n, _ in segments])


def lag_stats(versions: torch.Tensor, mask: torch.Tensor, step: int, max_lag: int) -> torch.Tensor:
    """[max_lag + 2] float64: the number of trained tokens (mask > 0) of each lag 0..max_lag sampled for step `step`,
    then those older than max_lag. versions, mask: the same shape."""
    lag = (step - 1 - versions.long()).clamp(min=0)
    counts = torch.zeros(max_lag + 2, dtype=torch.float64)
    counts.index_add_(0, lag.clamp(max=max_lag + 1).reshape(-1), (mask > 0).double().reshape(-1))
    return counts


def sample_version_stats(samples: list[Sample]) -> torch.Tensor:
    """[3] float64 over this worker's samples: samples sampled by more than one weight version (partial rollouts),
    samples, the oldest version of any sampled token (a large number when there is none)."""
    partial, oldest = 0, float(2 ** 62)
    for s in samples:
        sampled = s.token_versions[s.token_versions != UNSAMPLED] if s.token_versions is not None else []
        if len(sampled):
            partial += int(sampled.min() != sampled.max())
            oldest = min(oldest, float(sampled.min()))
    return torch.tensor([partial, len(samples), oldest], dtype=torch.float64)


@dataclass
class RolloutBatch:
    """One step's rollout on one rollout worker: its samples (for metrics and dumps), packed; the step's plan; the
    rollout statistics (the same on every worker); the prompt cursor before and after it."""
    step: int
    samples: list[Sample]
    packed: PackedRollout
    plan: BatchPlan
    stats: dict
    cursor_before: dict
    cursor_after: dict


class RolloutProducer:
    """A thread that collects the rollouts of steps next_step, next_step + 1, ... ahead of the trainer, each as soon as
    the engines' weight version allows (version >= step - 1 - k); `take(step)` hands one to the trainer."""

    def __init__(self, collect: Callable[[int], RolloutBatch], next_step: int, last_step: int, max_staleness: int,
                 version: int, ready: list[RolloutBatch] = (),
                 recoverable: Callable[[BaseException], bool] = lambda error: False):
        self._collect, self.k, self._last = collect, max_staleness, last_step
        self._cond = threading.Condition()
        self._ready = {b.step: b for b in ready}
        self._next = max([b.step for b in ready], default=next_step - 1) + 1  # the next step to generate
        self._version = version
        self._error: BaseException | None = None
        # a recoverable failure (no engine could generate): the producer waits until engines_restored(), then
        # collects the same step again; take() and wait_generated() raise it meanwhile, so the trainer restores them
        self._recoverable, self._down = recoverable, None
        self._busy = self._hold = self._stopped = False
        self._busy_s, self._busy_since = 0.0, None
        self._thread = threading.Thread(target=self._run, name="megarl-rollout-producer", daemon=True)
        self._thread.start()

    def _may_start(self) -> bool:
        return self._stopped or (not self._hold and self._next <= self._last and
                                 self._version >= self._next - 1 - self.k)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._may_start)
                if self._stopped:
                    return
                step, self._busy, self._busy_since = self._next, True, time.perf_counter()
            try:
                batch = self._collect(step)
            except BaseException as e:  # handed to the trainer by take()
                with self._cond:
                    self._busy = False
                    if not self._recoverable(e):
                        self._error = e
                        self._cond.notify_all()
                        return
                    self._down = e
                    self._cond.notify_all()
                    self._cond.wait_for(lambda: self._down is None or self._stopped)
                continue
            with self._cond:
                self._ready[step] = batch
                self._next, self._busy = step + 1, False
                self._busy_s += time.perf_counter() - self._busy_since
                self._cond.notify_all()

    def _wait(self, until: Callable[[], bool]) -> None:
        self._cond.wait_for(lambda: until() or self._error is not None or self._down is not None)
        if self._error is not None:
            raise self._error
        if not until():
            raise self._down

    def engines_restored(self) -> None:
        """The engines generate again (a weight sync): a rollout that failed for want of them is collected again."""
        with self._cond:
            self._down = None
            self._cond.notify_all()

    def put_back(self, batch: RolloutBatch) -> None:
        """A rollout take() handed out that the trainer could not use (another worker's take failed)."""
        with self._cond:
            self._ready[batch.step] = batch
            self._cond.notify_all()

    def take(self, step: int) -> RolloutBatch:
        """Step `step`'s rollout (waits for it)."""
        with self._cond:
            self._wait(lambda: step in self._ready)
            return self._ready.pop(step)

    def wait_generated(self, step: int) -> None:
        """Fixed schedule: block until step `step`'s rollout is complete (before the weights it was sampled from
        change); steps after the last are never generated."""
        with self._cond:
            self._wait(lambda: self._next > min(step, self._last))

    def set_version(self, version: int) -> None:
        """The engines now hold `version`."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def drain(self) -> list[RolloutBatch]:
        """Let the rollout in progress finish, start no new one until release(); the finished, untrained rollouts."""
        with self._cond:
            self._hold = True
            self._wait(lambda: not self._busy)
            return [self._ready[s] for s in sorted(self._ready)]

    def release(self) -> None:
        with self._cond:
            self._hold = False
            self._cond.notify_all()

    def busy_s(self) -> float:
        """Seconds spent generating so far (the step in progress included)."""
        with self._cond:
            return self._busy_s + (time.perf_counter() - self._busy_since if self._busy else 0.0)

    def stop(self) -> None:
        """No new rollout starts (one in progress ends with the engines; the thread is a daemon)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
