"""HTTP client for one SGLang server: batched token-in/token-out generation with log-probs, weight-update calls.

Pooled connections; transient failures (connection refused/reset, timeouts, HTTP 5xx) are retried with exponential
back-off; HTTP 4xx is never retried (it is the request's fault, and the error quotes SGLang's answer).

An engine that dies is a weight-versioned event. When the client owns the server process and finds it dead, it restarts
it (at most `max_restarts` times within `restart_window_s`; past that the engine is retired: EngineRetired). A
restarted engine serves its model folder's weights: if the trainer had pushed its own (`serves`, set by the weight
sync), the call that found it dead raises EngineRestarted and every generation is refused until the trainer pushes its
weights again (megarl.reshard.sync), so no token is sampled from the wrong weights; the router moves the requests to
the live engines meanwhile (megarl.rollout.router). Engines that never got pushed weights (judges, teachers, `megarl
eval`) are restarted and the call retried, as their weights are their folder's.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import requests
from requests.adapters import HTTPAdapter

from .server import EngineError, SGLangServer

if TYPE_CHECKING:
    import numpy as np

logger = logging.getLogger(__name__)


class EngineUnavailable(EngineError):
    """The engine cannot generate now: it is unreachable, restarting, or waiting for the trainer's weights (the router
    moves its requests to the live engines)."""


class EngineRestarted(EngineUnavailable):
    """The engine died and was restarted: it serves its model folder's weights until the trainer pushes its own."""


class EngineRetired(EngineUnavailable):
    """The engine died more often than its restart budget allows (rollout.engine.max_restarts within
    rollout.engine.restart_window_s): it is not restarted again."""


UNAVAILABLE = {cls.__name__ for cls in (EngineUnavailable, EngineRestarted, EngineRetired)}


def engine_unavailable(error: BaseException) -> bool:
    """An EngineUnavailable here, or the one another rank raised (megarl.errors.RemoteUserError keeps its kind)."""
    return isinstance(error, EngineUnavailable) or getattr(error, "kind", None) in UNAVAILABLE | {"EnginesDown"}


@dataclass
class Completion:
    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float]  # log-prob of each output token under the engine's sampling distribution
    finish_reason: str  # "length" | "stop" | "abort"
    weight_version: str | None
    input_log_probs: list[float] | None = None  # with logprob_start_len=0: log p(prompt[t] | prompt[:t]), t >= 1
    # with return_routed_experts (server --enable-return-routed-experts): the MoE experts each position of
    # prompt + output[:-1] was routed to, flat [positions * layers * top-k] int32 (a tensor: it is large)
    routed_experts: "torch.Tensor | None" = None
    # which weights sampled which output tokens: runs of (token count, weight_version), in order. One run unless the
    # request was aborted by a weight update and continued under the new weights (EngineRouter, partial rollouts).
    segments: list[tuple[int, str | None]] | None = None
    # with top_logprobs_num k and logprob_start_len=0: for t >= 1, the k most likely tokens at position t given
    # prompt[:t] and their log-probs, [len(prompt) - 1, k] int32 / float32 (SGLang's input_top_logprobs)
    input_top_ids: "np.ndarray | None" = None
    input_top_log_probs: "np.ndarray | None" = None

    def __post_init__(self):
        if self.segments is None:
            self.segments = [(len(self.output_ids), self.weight_version)]


class EngineClient:
    HEALTH_PROBE_S = 30.0  # how long a running engine has to answer /health after one of its requests timed out
    def __init__(self, url: str | None = None, server: SGLangServer | None = None, timeout_s: float = 600.0,
                 retries: int = 4, backoff_s: float = 0.5, max_restarts: int = 3, restart_window_s: float = 3600.0):
        if url is None and server is None:
            raise ValueError("EngineClient needs a url or a server")
        self.server = server
        self.url = url or server.url
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s
        self.max_restarts, self.restart_window_s = max_restarts, restart_window_s
        self.restart_times: collections.deque[float] = collections.deque()  # time.monotonic() of each restart
        self.retired = False
        # the weight version the trainer last pushed into this engine (megarl.reshard.sync); None: it serves its model
        # folder. stale: it restarted since, and serves its folder until the next push.
        self.serves: str | None = None
        self.stale = False
        self._restart_lock = threading.Lock()  # one restart at a time, whichever thread found the engine dead
        self.session = requests.Session()
        self.session.mount("http://", HTTPAdapter(pool_connections=4, pool_maxsize=32))
        # The LoRA adapter every generation names (SGLang's lora_path), set by the adapter-only weight sync
        # (megarl.reshard.adapter) on every rank's client when it has loaded a new adapter; None: the engine's own
        # weights. Read when each request is built, so the callers (router, rollouts, probes) never name it.
        self.adapter: str | None = None

    # ------------------------------------------------------------------------------------------------ transport
    def call(self, path: str, payload: dict | None = None, method: str = "POST", timeout_s: float | None = None):
        last_error, unreachable = None, False
        with self._restart_lock:  # a restart in progress (another thread found the engine dead) is waited for
            incarnation = self._incarnation()
            if self.retired:
                raise EngineRetired(self._retired_line(path))
            if self.stale and path == "/generate":  # restarted: no token is sampled from its folder's weights
                raise EngineRestarted(f"the SGLang server at {self.url} restarted and waits for the trainer's "
                                      f"weights {self.serves!r}")
        for attempt in range(self.retries + 1):
            try:
                response = self.session.request(method, self.url + path, json=payload,
                                                timeout=timeout_s or self.timeout_s)
            except (requests.ConnectionError, requests.Timeout) as e:
                last_error, unreachable = f"{type(e).__name__}: {e}", True
                self._recover_or_raise(path, last_error, incarnation, timed_out=isinstance(e, requests.Timeout))
            else:
                if response.status_code < 400:
                    return _body(response)
                if response.status_code < 500:
                    raise EngineError(f"SGLang rejected {path} (HTTP {response.status_code}): {response.text[:2000]}")
                last_error, unreachable = f"HTTP {response.status_code}: {response.text[:500]}", False
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2 ** attempt)
        error = EngineUnavailable if unreachable else EngineError
        raise error(f"{self.url}{path} failed after {self.retries + 1} attempts: {last_error}" + self._log_hint())

    def _incarnation(self) -> int:
        return self.server.restarts if self.server is not None else 0

    def _recover_or_raise(self, path: str, error: str, incarnation: int, timed_out: bool = False) -> None:
        """A request failed to reach the engine. Not ours or still running: transient, retried. Dead, or hung (the
        request timed out and the engine is stopped or does not answer /health): restarted within the budget (once,
        whichever thread sees it first); a request to an engine that got the trainer's weights is then not retried
        (EngineRestarted), nor one sent to the engine before another thread restarted it."""
        if self.server is None:
            return
        with self._restart_lock:
            if self.retired:
                raise EngineRetired(self._retired_line(path))
            if self._incarnation() == incarnation:
                if self.server.alive() and not (timed_out and self._hung()):
                    return  # transient: retry
                now = time.monotonic()
                while self.restart_times and now - self.restart_times[0] > self.restart_window_s:
                    self.restart_times.popleft()
                if len(self.restart_times) >= self.max_restarts:
                    self.retired = True
                    logger.error("%s%s", self._retired_line(path, error), self._log_hint())
                    raise EngineRetired(self._retired_line(path, error))
                logger.warning("the SGLang server at %s %s during %s (%s): restarting it%s", self.url,
                               "stopped answering" if self.server.alive() else "died", path, error,
                               " (it then waits for the trainer's weights)" if self.serves is not None else "")
                self.restart_times.append(now)
                try:
                    self.server.restart()
                except EngineError as e:  # it does not come back: retired (the run goes on with the others)
                    self.retired = True
                    raise EngineRetired(f"{self._retired_line(path, error)}; its restart failed: "
                                        f"{str(e).splitlines()[0]}") from None
                self.url = self.server.url
                self.stale = self.serves is not None
        if self.stale:
            raise EngineRestarted(f"the SGLang server at {self.url} died during {path} and was restarted: it serves "
                                  f"its model folder's weights until the trainer pushes {self.serves!r} again")

    def _hung(self) -> bool:
        """After a request to a running engine timed out: whether it will never answer (restart() kills it)."""
        if self.server.stopped():
            return True
        try:
            return self.session.get(self.url + "/health", timeout=self.HEALTH_PROBE_S).status_code != 200
        except requests.RequestException:
            return True

    def _retired_line(self, path: str, error: str = "") -> str:
        return (f"the SGLang server at {self.url} died during {path}{f' ({error})' if error else ''} after "
                f"{len(self.restart_times)} restarts within {self.restart_window_s:.0f} s: retired. Fix: read its log "
                f"({self.server.log_path if self.server else 'the engine host'}), or raise rollout.engine.max_restarts "
                "/ rollout.engine.restart_window_s")

    def revive(self) -> bool:
        """If the engine this client owns is dead, restart it now (within the restart budget). Returns whether it was
        restarted. Raises EngineRetired past the budget."""
        incarnation = self._incarnation()
        if self.server is None or self.server.alive():
            return False
        try:
            self._recover_or_raise("revive", "the server process exited", incarnation)
        except EngineRestarted:
            pass
        return self._incarnation() != incarnation

    def holds(self, version: str | None) -> bool:
        """Whether the engine serves `version` now (its /model_info weight_version; False when it restarted or is
        unreachable)."""
        if self.stale:
            return False
        try:
            return self.weight_version() == version
        except EngineUnavailable:
            return False

    def pushed(self, version: str) -> None:
        """The trainer's weights `version` are in the engine (megarl.reshard.sync): it may generate again."""
        self.serves, self.stale = version, False

    def _log_hint(self) -> str:
        return f"\nSGLang log tail ({self.server.log_path}):\n{self.server.log_tail()}" if self.server else ""

    # ----------------------------------------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], sampling_params: dict[str, Any] | list[dict[str, Any]],
                 return_logprob: bool = True, logprob_start_len: int | None = None,
                 return_routed_experts: bool = False, top_logprobs_num: int = 0) -> list[Completion]:
        """One batched /generate; token ids in, token ids and per-token log-probs out. sampling_params: one dict for
        the batch or one per prompt."""
        payload = {"input_ids": prompts, "sampling_params": sampling_params, "return_logprob": return_logprob}
        adapter = self.adapter  # once: the sync may name the next adapter while this request runs
        if adapter is not None:
            payload["lora_path"] = adapter
        if logprob_start_len is not None:
            payload["logprob_start_len"] = logprob_start_len
        if top_logprobs_num:
            payload["top_logprobs_num"] = top_logprobs_num
        if return_routed_experts:
            payload["return_routed_experts"] = True
        outputs = self.call("/generate", payload)
        if isinstance(outputs, dict):
            outputs = [outputs]
        completions = []
        for prompt, out in zip(prompts, outputs):
            meta = out["meta_info"]
            finish = meta.get("finish_reason") or {}
            input_lp, top = None, (None, None)
            if logprob_start_len is not None and meta.get("input_token_logprobs"):
                input_lp = [x[0] for x in meta["input_token_logprobs"] if x[0] is not None]
            if logprob_start_len is not None and top_logprobs_num:
                top = _top_log_probs(meta, top_logprobs_num)
            completions.append(Completion(
                prompt_ids=list(prompt), output_ids=list(out.get("output_ids") or []),
                output_log_probs=[x[0] for x in meta.get("output_token_logprobs") or []],
                finish_reason=finish.get("type", "unknown") if isinstance(finish, dict) else str(finish),
                # an adapter's name is the version the adapter sync loaded it under: the weights that sampled these
                # tokens (the engine's own weight_version stays the base model's)
                weight_version=adapter if adapter is not None else meta.get("weight_version"),
                input_log_probs=input_lp,
                routed_experts=_routed_experts(meta) if return_routed_experts else None,
                input_top_ids=top[0], input_top_log_probs=top[1]))
        return completions

    def prefill(self, sequences: list[list[int]], top_k: int = 0) -> list[Completion]:
        """The engine's scoring of each whole sequence (one generated token, ignored): input_log_probs, and with
        top_k the k most likely tokens at each position t >= 1 (input_top_ids / input_top_log_probs)."""
        return self.generate(sequences, {"max_new_tokens": 1, "temperature": 0.0}, return_logprob=True,
                             logprob_start_len=0, top_logprobs_num=top_k)

    def prompt_log_probs(self, sequences: list[list[int]]) -> list[list[float]]:
        """log p(seq[t] | seq[:t]) for t >= 1 of each sequence, as the engine computes them (probe sequences)."""
        return [c.input_log_probs for c in self.prefill(sequences)]

    # --------------------------------------------------------------------------------------------- control
    def health(self) -> bool:
        try:
            return self.session.get(self.url + "/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def flush_cache(self):
        return self.call("/flush_cache", None)

    def pause(self, mode: str = "retract"):
        return self.call("/pause_generation", {"mode": mode})

    def resume(self):
        return self.call("/continue_generation", {})

    def abort_all(self):
        return self.call("/abort_request", {"abort_all": True})

    def begin_weight_update(self):
        return self.call("/begin_weight_update", {})

    def end_weight_update(self):
        return self.call("/end_weight_update", {})

    def weight_version(self) -> str | None:
        """The weight version the engine serves (set by the last weight update; SGLang's default at its start)."""
        return self.call("/model_info", method="GET").get("weight_version")

    def enable_delta_loads(self) -> None:
        """reshard.mode=delta, inside the weight-update window of a whole sync: make the engine's weight loads take
        megarl's delta updates (megarl.compat.sglang.load_weight_delta; once per engine process, a no-op after). The engine must
        have been started with `--custom-weight-loader` naming it: checked first, as SGLang's scheduler does not
        survive an unknown load format."""
        from sglang.srt.utils import MultiprocessingSerializer

        from ..compat.sglang import DELTA_LOADER

        info = self.call("/server_info", method="GET")
        if DELTA_LOADER not in (info.get("custom_weight_loader") or []):
            raise EngineError(f"reshard.mode=delta: the engine at {self.url} was not started with "
                              f"--custom-weight-loader {DELTA_LOADER}. Fix: add it to the engine's command line (megarl "
                              "adds it to the engines it starts), or reshard.mode=full")
        empty = MultiprocessingSerializer.serialize([], output_str=True)  # one payload per engine TP rank
        self.call("/update_weights_from_tensor", {"serialized_named_tensors": [empty] * int(info.get("tp_size") or 1),
                                                  "load_format": DELTA_LOADER, "flush_cache": False})

    def weight_checksums(self) -> dict[int, dict[str, str]]:
        """SGLang's per-tensor checksums from /weights_checker, per engine TP rank (each rank hashes its own shard of
        each tensor, under SGLang's own parameter names): {tp_rank: {name: checksum}}."""
        body = self.call("/weights_checker", {"action": "checksum"})
        checksums: dict[int, dict[str, str]] = {}
        for rank_info in body.get("ranks") or []:
            info = rank_info.get("parallelism_info") or {}
            info = info[0] if isinstance(info, list) else info  # 0.5.23 sends it as a one-element list
            if info.get("role", "target") == "target" and info.get("dp_rank", 0) == 0:  # pipeline stages: merged
                checksums.setdefault(int(info.get("tp_rank", 0)), {}).update(rank_info.get("checksums") or {})
        return checksums

    def release_memory(self):
        """Release KV cache and weights memory around training (GPU). SGLang needs a GPU for it: on CPU, a logged
        no-op."""
        return self._memory_call("/release_memory_occupation")

    def resume_memory(self):
        return self._memory_call("/resume_memory_occupation")

    def _memory_call(self, path: str):
        from .. import platform

        if platform.on_gpu():
            return self.call(path, {})
        logger.info("%s skipped: SGLang releases memory only on GPU (CPU run)", path)
        return None


def _routed_experts(meta: dict):
    """SGLang sends the routing as base64 of an int32 array (sglang/srt/state_capturer/routed_experts.py)."""
    import base64

    import numpy as np

    encoded = meta.get("routed_experts")
    if not encoded:
        raise EngineError("the engine returned no routed_experts; start it with --enable-return-routed-experts "
                          "(megarl does when rollout.return_routed_experts or rollout.routing_replay is on)")
    import torch

    return torch.from_numpy(np.frombuffer(base64.b64decode(encoded), dtype=np.int32).copy())


def _top_log_probs(meta: dict, k: int):
    """SGLang's input_top_logprobs (one entry per input position, None at position 0, else k [log-prob, token id,
    text] triples, most likely first) -> ([positions - 1, k] int32 ids, [positions - 1, k] float32 log-probs)."""
    import numpy as np

    rows = [row for row in meta.get("input_top_logprobs") or [] if row is not None]
    if any(len(row) != k for row in rows):
        raise EngineError(f"the engine returned top log-probs of another width than top_logprobs_num={k}")
    ids = np.asarray([[x[1] for x in row] for row in rows], dtype=np.int32).reshape(len(rows), k)
    log_probs = np.asarray([[x[0] for x in row] for row in rows], dtype=np.float32).reshape(len(rows), k)
    return ids, log_probs


def _body(response):
    """JSON when the endpoint answers JSON (most do), else the text (e.g. /flush_cache)."""
    if not response.content:
        return None
    try:
        return response.json()
    except ValueError:
        return response.text
