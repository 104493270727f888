"""Scoring in worker processes: rank 0 submits each chunk of completions as soon as the engine returns it, so rewards
are computed while the rest of the batch is still generating; the training ranks only wait for what is not done yet.

A reward function that raises or runs past reward.timeout_s scores 0.0 for that response, with the reason logged and
counted (metric reward/errors) — one bad sample never stops a run. Each response is scored in a process forked from
the worker for it, so a reward that hangs (even in C code, or with signals blocked) is killed at its timeout and the
next response gets a fresh process: a thread or `future.cancel()` could not stop it. The exception is
SandboxUnavailable (a reward that executes code and cannot isolate it): that stops the run, never scores unisolated.
"""
from __future__ import annotations

import logging
import multiprocessing
import threading
from concurrent.futures import Future, ProcessPoolExecutor, TimeoutError as FutureTimeout
from concurrent.futures.process import BrokenProcessPool

from ..lifetime import die_with_parent, forkserver_context
from .functions import RewardFn, check_reward_call, resolve_reward
from ..sandbox import SandboxUnavailable, cgroups, check_sandbox

logger = logging.getLogger(__name__)


def _score_stream(fn: RewardFn, items: list[tuple[str, str | None]], kwargs: dict, conn) -> None:
    """In the forked child: score the responses in order, sending each result as soon as it is known."""
    for response, answer in items:
        try:
            conn.send((float(fn(response, answer, **kwargs)), None, False))
        except SandboxUnavailable as e:
            conn.send((0.0, str(e), True))
            return
        except BaseException as e:  # a user reward function may raise anything; the sample scores 0
            conn.send((0.0, f"{type(e).__name__}: {e}", False))


def _score(name: str, kwargs: dict, items: list[tuple[str, str | None]], timeout_s: float = 10.0
           ) -> list[tuple[float, str | None]]:
    """Score a chunk in a child forked from this worker, each response within timeout_s of the previous result. A
    response that runs past it (hangs, even in C code or with signals blocked) is killed with the child (its
    sandbox, if any, dies with it) and scores 0; a new child goes on with the next response. One fork per chunk in
    the common case, not per response."""
    fn = resolve_reward(name)
    ctx = multiprocessing.get_context("fork")  # the worker is single-threaded, so fork is safe and cheap
    results: list[tuple[float, str | None]] = []
    while len(results) < len(items):
        recv, send = ctx.Pipe(duplex=False)
        child = ctx.Process(target=_score_stream, args=(fn, items[len(results):], kwargs, send))
        child.start()
        send.close()
        try:
            while len(results) < len(items):
                if not recv.poll(timeout_s):
                    results.append((0.0, f"timed out (> {timeout_s:g} s per response); the reward process was "
                                         "killed"))
                    break
                try:
                    score, error, unavailable = recv.recv()
                except EOFError:
                    child.join(1.0)
                    results.append((0.0, f"the reward process died (exit code {child.exitcode})"))
                    break
                if unavailable:
                    raise SandboxUnavailable(error)  # no isolation is an infrastructure failure: stop the run
                results.append((score, error))
        finally:
            if child.is_alive():
                child.kill()
            child.join()
            recv.close()
            if child.exitcode != 0:  # killed or died: its sandbox's cgroups outlive it (removed in its `finally`)
                cgroups.remove_left_by(child.pid)
    return results


class RewardPool:
    """rounds: how many times a chunk whose worker died (killed from outside: the OOM killer, an operator) or stopped
    answering is scored again on fresh workers before its responses score 0 with the reason counted. A worker's death
    is the machine's fault, not the response's: the chunk is scored again rather than trained on with reward 0."""

    def __init__(self, name: str, workers: int = 2, timeout_s: float = 10.0, kwargs: dict | None = None,
                 field: str = "reward.name", rounds: int = 3):
        fn = resolve_reward(name, field)  # fail at start-up, not inside a worker
        check_reward_call(fn, dict(kwargs or {}), field)
        self.name, self.kwargs, self.timeout_s, self.workers = name, dict(kwargs or {}), timeout_s, workers
        self.rounds = rounds
        # The rollout's chunk threads submit and wait concurrently; one worker's death breaks the whole executor for
        # all of them, so the executor is replaced once (by whichever thread sees it first) under this lock.
        self._lock = threading.Lock()
        self.pool = self._new_pool()
        self.errors: list[str] = []
        self.worker_failures = 0  # executors replaced because a worker died or stopped answering
        if getattr(fn, "requires_sandbox", False):  # code execution: prove isolation works here, in a worker
            self.pool.submit(check_sandbox).result()

    def _new_pool(self) -> ProcessPoolExecutor:
        # forkserver: workers never inherit the trainer's threads or process groups; the server and each worker die
        # with their parent (megarl.lifetime), so a killed trainer leaves no reward worker behind
        return ProcessPoolExecutor(max_workers=self.workers, mp_context=forkserver_context(),
                                   initializer=die_with_parent)

    def _replace_workers(self, broken: ProcessPoolExecutor) -> None:
        """Kill every worker of `broken` and start fresh ones, unless another thread did already. ProcessPoolExecutor
        has no public way to kill its workers, hence its `_processes`."""
        with self._lock:
            if self.pool is not broken:
                return
            for process in list((getattr(broken, "_processes", None) or {}).values()):
                process.kill()
            broken.shutdown(wait=False, cancel_futures=True)
            self.pool = self._new_pool()
            self.worker_failures += 1

    def submit(self, items: list[tuple[str, str | None]]) -> Future:
        for round_ in range(self.rounds + 1):
            with self._lock:
                pool = self.pool
            try:
                future = pool.submit(_score, self.name, self.kwargs, items, self.timeout_s)
                break
            except BrokenProcessPool:  # a worker died while the pool was idle: the executor refuses new work
                logger.warning("reward %s: a worker died between chunks; workers replaced", self.name)
                self._replace_workers(pool)
                if round_ == self.rounds:
                    raise
        future.megarl_chunk = (pool, items)  # what result() scores again if this executor breaks
        return future

    def result(self, future: Future, n: int) -> list[float]:
        """The scores of a chunk `submit` returned, or of a Future in its form from elsewhere (the judge's weighted or
        precomputed scores: those are not scored again)."""
        for round_ in range(self.rounds + 1):
            pool, items = getattr(future, "megarl_chunk", (None, None))
            # each response has its own killable timeout in the worker; this wait is only the backstop behind it
            try:
                scored = future.result(timeout=(self.timeout_s + 5) * max(n, 1) + 30)
                break
            except (FutureTimeout, BrokenProcessPool) as e:
                reason = f"reward {self.name}: a worker died or stopped answering ({type(e).__name__})"
                self._replace_workers(pool if pool is not None else self.pool)
                if round_ == self.rounds or items is None:
                    logger.warning("%s; %d responses score 0 after %d rounds", reason, n, self.rounds + 1)
                    self.errors += [reason] * n
                    return [0.0] * n
                logger.warning("%s: its chunk of %d responses is scored again on fresh workers", reason, n)
                future = self.submit(items)
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

    def take_worker_failures(self) -> int:
        """Executors replaced (a worker died or stopped answering) since the last call."""
        n, self.worker_failures = self.worker_failures, 0
        return n

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
