"""Scoring in worker processes: rank 0 submits each chunk of completions as soon as the engine returns it, so rewards
are computed while the rest of the batch is still generating; the training ranks only wait for what is not done yet.

A reward function that raises or runs past reward.timeout_s scores 0.0 for that response, with the reason logged and
counted (metric reward/errors) — one bad sample never stops a run. The exception is SandboxUnavailable (a reward that
executes code and cannot isolate it): that stops the run at start-up, never scores unisolated.
"""
from __future__ import annotations

import logging
import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor, TimeoutError as FutureTimeout

from .functions import resolve_reward
from ..sandbox import SandboxUnavailable, check_sandbox

logger = logging.getLogger(__name__)


def _score(name: str, kwargs: dict, items: list[tuple[str, str | None]]) -> list[tuple[float, str | None]]:
    fn = resolve_reward(name)
    out = []
    for response, answer in items:
        try:
            out.append((float(fn(response, answer, **kwargs)), None))
        except SandboxUnavailable:
            raise  # no isolation is an infrastructure failure: stop the run, never score (or run) unisolated
        except Exception as e:  # a user reward function may raise anything; the sample scores 0
            out.append((0.0, f"{type(e).__name__}: {e}"))
    return out


class RewardPool:
    def __init__(self, name: str, workers: int = 2, timeout_s: float = 10.0, kwargs: dict | None = None):
        fn = resolve_reward(name)  # fail at start-up, not inside a worker
        self.name, self.kwargs, self.timeout_s = name, dict(kwargs or {}), timeout_s
        # forkserver: workers never inherit the trainer's threads or process groups
        self.pool = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("forkserver"))
        self.errors: list[str] = []
        if getattr(fn, "requires_sandbox", False):  # code execution: prove isolation works here, in a worker
            self.pool.submit(check_sandbox).result()

    def submit(self, items: list[tuple[str, str | None]]) -> Future:
        return self.pool.submit(_score, self.name, self.kwargs, items)

    def result(self, future: Future, n: int) -> list[float]:
        try:
            scored = future.result(timeout=self.timeout_s * max(n, 1))
        except FutureTimeout:
            future.cancel()
            reason = f"reward {self.name} timed out (> {self.timeout_s} s per response)"
            logger.warning(reason)
            self.errors += [reason] * n
            return [0.0] * n
        for _, error in scored:
            if error:
                logger.warning("reward %s failed on a response: %s", self.name, error)
                self.errors.append(error)
        return [score for score, _ in scored]

    def score(self, items: list[tuple[str, str | None]]) -> list[float]:
        return self.result(self.submit(items), len(items))

    def take_errors(self) -> int:
        n, self.errors = len(self.errors), []
        return n

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
