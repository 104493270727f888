"""Data-parallel rollout over several SGLang servers: split a batch across engines, round-robin or least-loaded.

Partial rollouts (asynchronous RL): a weight update does not wait for long generations. `pause_for_update()` holds
this router's new requests, makes every engine abort its in-flight requests (each returns what it generated so far),
waits for this router's to come back, then pauses the engines (SGLang's /pause_generation, mode "abort", which holds
every other client's new requests and aborts whatever still runs); the trainer pushes the new weights while the
engines are paused; `continue_after_update()` resumes them. (SGLang's abort-mode pause alone polls its request lock
once a second: waiting for our own requests first makes the common case, one router per engine, return at once.) A
`generate(..., resume_aborted=True)` call continues each aborted request from its own tokens (prompt + output so far,
the remaining token budget) under the new weights, and joins the pieces: the completion's `segments` say which
weight version sampled which tokens, and every token keeps the log-prob of the distribution it was sampled from.
SGLang's in-place pause would keep the KV cache but cannot say at which token the weights changed; abort-and-continue
recomputes the prefix once and keeps every token's version exact.

Engine failures: a request whose engine is unavailable (dead, restarting, waiting for the trainer's weights: the
client's EngineUnavailable) or that comes back sampled by weights this run never pushed (its weight_version is not in
`versions`, e.g. a remote engine restarted by its own supervisor) is sent again to a live engine, and that engine is
left out until the trainer has pushed its weights into it again (`weights_pushed()`, after a weight sync). With no live
engine left the call raises EnginesDown: the trainer then pushes its weights into the restarted engines and generates
the step again (megarl.trainer). A retired engine (past its restart budget) never comes back; fewer than `min_engines`
left is the end of the run, with one line.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from .client import Completion, EngineClient, EngineRetired, EngineUnavailable
from .server import EngineError

logger = logging.getLogger(__name__)
POLICIES = ("round_robin", "least_loaded")
MAX_CONTINUATIONS = 64  # an engine that keeps aborting one request is failing: its last piece is returned as aborted


class EnginesDown(EngineUnavailable):
    """No engine of the router can generate now (each is restarting, waiting for the trainer's weights, or
    retired)."""


def _continued(first: Completion, rest: Completion) -> Completion:
    """`first` (aborted) followed by `rest`, the continuation sampled from prompt + first's output."""
    return Completion(
        prompt_ids=first.prompt_ids, output_ids=first.output_ids + rest.output_ids,
        output_log_probs=first.output_log_probs + rest.output_log_probs, finish_reason=rest.finish_reason,
        weight_version=rest.weight_version, routed_experts=rest.routed_experts,  # rest's covers every position
        segments=[s for s in first.segments + rest.segments if s[0]])


class EngineRouter:
    def __init__(self, clients: list[EngineClient], policy: str = "least_loaded", min_engines: int = 1):
        if not clients:
            raise ValueError("EngineRouter needs at least one engine client")
        if policy not in POLICIES:
            raise ValueError(f"rollout.router_policy={policy!r} is unknown; choose one of {POLICIES}")
        self.clients, self.policy, self.min_engines = clients, policy, min_engines
        # the weight versions this run pushed into the engines (empty: the engines serve their own weights and any
        # version is theirs); a completion sampled by another version is generated again elsewhere
        self.versions: set[str] = set()
        self.down: dict[int, str] = {}  # engine index -> why it is left out until weights_pushed()
        self.retired: set[int] = set()
        self.in_flight = [0] * len(clients)  # prompts currently being generated per engine
        self._next = 0
        self._lock = threading.Condition()  # guards in_flight; notified when a call returns
        self._open = threading.Event()  # cleared while a weight update holds new requests
        self._open.set()
        self._pool = ThreadPoolExecutor(max_workers=4 * len(clients))

    def _assign(self, n: int) -> list[int]:
        """Engine index for each of n prompts, over the live engines (and count them in flight)."""
        with self._lock:
            live = self.live()
            if not live:
                raise EnginesDown("no policy engine can generate: " + "; ".join(
                    f"engine {i} ({self.clients[i].url}): {why}" for i, why in sorted(self.down.items())))
            picks = []
            for _ in range(n):
                if self.policy == "round_robin":
                    while self._next not in live:
                        self._next = (self._next + 1) % len(self.clients)
                    engine, self._next = self._next, (self._next + 1) % len(self.clients)
                else:
                    engine = min(live, key=lambda i: (self.in_flight[i], i))
                self.in_flight[engine] += 1
                picks.append(engine)
            return picks

    def generate(self, prompts: list[list[int]], sampling_params: dict | list[dict], resume_aborted: bool = False,
                 **kwargs) -> list[Completion]:
        """Completions in prompt order; each engine gets one batched request with its share of the prompts.
        sampling_params: one dict for all prompts, or one per prompt (e.g. per-request sampling seeds).
        resume_aborted: requests a weight update aborted are continued (see the module docstring)."""
        results = self._generate_once(prompts, sampling_params, **kwargs)
        if not resume_aborted:
            return results
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        for piece in range(1, MAX_CONTINUATIONS + 1):
            todo = [i for i, c in enumerate(results)
                    if c.finish_reason == "abort" and len(c.output_ids) < params[i]["max_new_tokens"]]
            if not todo:
                break
            more = self._generate_once([list(prompts[i]) + results[i].output_ids for i in todo],
                                       [_continuation(params[i], piece, len(results[i].output_ids)) for i in todo],
                                       **kwargs)
            for i, c in zip(todo, more):
                results[i] = _continued(results[i], c)
        for i, c in enumerate(results):  # aborted exactly at its budget: the budget ended it
            if c.finish_reason == "abort" and len(c.output_ids) >= params[i]["max_new_tokens"]:
                c.finish_reason = "length"
        return results

    def _generate_once(self, prompts: list[list[int]], sampling_params: dict | list[dict],
                       **kwargs) -> list[Completion]:
        def call(client: EngineClient, indices: list[int]) -> list[Completion]:
            params = [sampling_params[i] for i in indices] if isinstance(sampling_params, list) else sampling_params
            return client.generate([prompts[i] for i in indices], params, **kwargs)

        return self._spread(len(prompts), call)

    def prefill(self, sequences: list[list[int]], top_k: int = 0) -> list[Completion]:
        """Each sequence scored by an engine (EngineClient.prefill: log-probs of every token after the first, with
        top_k the k most likely tokens at each position), in sequence order; spread over the engines like generate
        (one batched request per engine)."""
        return self._spread(len(sequences), lambda client, indices: client.prefill(
            [sequences[i] for i in indices], top_k))

    def prompt_log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t >= 1 of each sequence (EngineClient.prompt_log_probs: prefill only)."""
        return [c.input_log_probs for c in self.prefill(sequences)]

    def _spread(self, n: int, call) -> list:
        """call(client, indices) -> one result per index, for the n items split over the live engines by the policy
        (each engine's share in one concurrent call); the results in item order. The share of an engine that fails
        (EngineUnavailable) or answers from weights this run did not push goes to the others (see the module
        docstring)."""
        self._open.wait()
        results: list = [None] * n
        todo = list(range(n))
        while todo:
            by_engine: dict[int, list[int]] = {}
            for index, engine in zip(todo, self._assign(len(todo))):
                by_engine.setdefault(engine, []).append(index)
            futures = {engine: self._pool.submit(self._run, engine, indices, call)
                       for engine, indices in by_engine.items()}
            todo = []
            for engine, future in futures.items():
                try:
                    answers = future.result()
                except EngineUnavailable as e:
                    self._leave_out(engine, e)
                    todo += by_engine[engine]
                    continue
                for index, result in zip(by_engine[engine], answers):
                    if self._foreign(result):
                        self._leave_out(engine, f"it answered with weight version {result.weight_version!r}, not "
                                                f"one this run pushed")
                        todo.append(index)
                    else:
                        results[index] = result
            todo.sort()
        return results

    def _run(self, engine: int, indices: list[int], call) -> list:
        try:
            return call(self.clients[engine], indices)
        finally:
            with self._lock:
                self.in_flight[engine] -= len(indices)
                self._lock.notify_all()

    def _foreign(self, result) -> bool:
        """A completion sampled (in part) by weights this run never pushed."""
        return bool(self.versions) and isinstance(result, Completion) and \
            any(version not in self.versions for _, version in result.segments)

    def _leave_out(self, engine: int, why) -> None:
        with self._lock:
            if isinstance(why, EngineRetired):
                self.retired.add(engine)
            self.down[engine] = str(why).splitlines()[0]
            left = len(self.clients) - len(self.retired)
        logger.warning("engine %d (%s) left out of the rollout: %s", engine, self.clients[engine].url,
                       self.down[engine])
        if left < self.min_engines:
            raise EngineError(f"only {left} of {len(self.clients)} policy engines remain (the others retired after "
                              f"repeated failures; last: {self.down[engine]}), fewer than rollout.min_engines="
                              f"{self.min_engines}. Fix: read the engines' logs; lower rollout.min_engines to go on "
                              "with fewer")

    def live(self) -> list[int]:
        """The engines that take requests now."""
        return [i for i in range(len(self.clients)) if i not in self.down]

    def weights_pushed(self, version: str) -> None:
        """The trainer pushed `version` into every engine that is not retired: those generate again."""
        with self._lock:
            self.versions.add(version)
            self.down = {i: why for i, why in self.down.items() if i in self.retired}

    def retire(self, engines) -> None:
        """Engines the weight sync found retired (on the rank that owns them): never used again."""
        for engine in engines:
            if engine not in self.retired:
                self._leave_out(engine, EngineRetired(f"retired (past its restart budget)"))

    def pause_for_update(self) -> None:
        """Every engine aborts its in-flight requests and holds new ones until continue_after_update() (see the
        module docstring)."""
        self._open.clear()
        try:
            while True:  # again if a request that passed the gate reached its engine after the abort
                self.broadcast("call", "/abort_request", {"abort_all": True})
                with self._lock:
                    if self._lock.wait_for(lambda: not any(self.in_flight), timeout=1.0):
                        break
            self.broadcast("pause", "abort")
        except BaseException:
            self._open.set()
            raise

    def continue_after_update(self) -> None:
        try:
            self.broadcast("resume")
        finally:
            self._open.set()

    def broadcast(self, method: str, *args, **kwargs) -> list:
        """Call a control method (pause, flush_cache, ...) on every live engine (one found unavailable is left
        out)."""
        out = []
        for engine in self.live():
            try:
                out.append(getattr(self.clients[engine], method)(*args, **kwargs))
            except EngineUnavailable as e:
                self._leave_out(engine, e)
        return out


def _continuation(params: dict, piece: int, generated: int) -> dict:
    """The sampling params of a continuation: the remaining budget, and its own sampling seed (the first piece's seed
    would replay the first piece's random stream)."""
    out = dict(params, max_new_tokens=params["max_new_tokens"] - generated)
    if "sampling_seed" in out:
        out["sampling_seed"] = (out["sampling_seed"] * 1_000_003 + piece) % (1 << 63)
    return out
