"""Data-parallel rollout over several SGLang servers: split a batch across engines, round-robin or least-loaded."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

from .client import Completion, EngineClient

POLICIES = ("round_robin", "least_loaded")


class EngineRouter:
    def __init__(self, clients: list[EngineClient], policy: str = "least_loaded"):
        if not clients:
            raise ValueError("EngineRouter needs at least one engine client")
        if policy not in POLICIES:
            raise ValueError(f"rollout.router_policy={policy!r} is unknown; choose one of {POLICIES}")
        self.clients, self.policy = clients, policy
        self.in_flight = [0] * len(clients)  # prompts currently being generated per engine
        self._next = 0
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=4 * len(clients))

    def _assign(self, n: int) -> list[int]:
        """Engine index for each of n prompts (and count them in flight)."""
        with self._lock:
            picks = []
            for _ in range(n):
                if self.policy == "round_robin":
                    engine, self._next = self._next, (self._next + 1) % len(self.clients)
                else:
                    engine = min(range(len(self.clients)), key=lambda i: (self.in_flight[i], i))
                self.in_flight[engine] += 1
                picks.append(engine)
            return picks

    def generate(self, prompts: list[list[int]], sampling_params: dict | list[dict], **kwargs) -> list[Completion]:
        """Completions in prompt order; each engine gets one batched request with its share of the prompts.
        sampling_params: one dict for all prompts, or one per prompt (e.g. per-request sampling seeds)."""
        picks = self._assign(len(prompts))
        by_engine: dict[int, list[int]] = {}
        for index, engine in enumerate(picks):
            by_engine.setdefault(engine, []).append(index)

        def run(engine: int, indices: list[int]):
            try:
                params = [sampling_params[i] for i in indices] if isinstance(sampling_params, list) \
                    else sampling_params
                return self.clients[engine].generate([prompts[i] for i in indices], params, **kwargs)
            finally:
                with self._lock:
                    self.in_flight[engine] -= len(indices)

        futures = {engine: self._pool.submit(run, engine, indices) for engine, indices in by_engine.items()}
        results: list[Completion | None] = [None] * len(prompts)
        for engine, future in futures.items():
            for index, completion in zip(by_engine[engine], future.result()):
                results[index] = completion
        return results

    def broadcast(self, method: str, *args, **kwargs) -> list:
        """Call a control method (pause, flush_cache, ...) on every engine."""
        return [getattr(client, method)(*args, **kwargs) for client in self.clients]
