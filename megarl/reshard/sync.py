"""The reshard step: trainer (Megatron TP/PP/EP shards) -> HF tensors -> buckets -> rollout engine, then verify.

    sync = WeightSync(bridge, chunks, transport, client_on_rank0, SyncConfig(bucket_bytes=512 << 20, verify_every=10))
    sync.sync()          # a collective over all trainer ranks

Owners push in turns (one owner at a time: the rank and its TP / expert-TP peers gather, the owner buckets and pushes,
everyone else waits at a barrier), so a rank holds at most one bucket plus the tensor being converted and no push can
deadlock against another rank's collective. Rank 0 opens and closes the engine's weight-update window.

A LoRA run with reshard.lora_sync=adapter syncs through megarl.reshard.adapter.AdapterTransport instead: the adapters
only, loaded as a new named adapter (no weight-update window), verified by probes that name the adapter.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .. import platform
from ..compat import sglang as sglang_compat
from ..rollout.client import EngineClient, engine_unavailable
from ..rollout.server import EngineError
from ..errors import UserError, on_rank0
from .buckets import DEFAULT_BUCKET_BYTES, BucketPacker
from .delta import DeltaEncoder
from .transports import WeightSource, WeightTransport
from .verify import WeightMismatchError, engine_dtypes, probe_sequences, verify_checksums, verify_probes

logger = logging.getLogger(__name__)
RESTORE_ATTEMPTS = 3  # syncs of one version to an engine that keeps failing (each restart also counts in its budget)


@dataclass
class SyncConfig:
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    verify_every: int = 10  # verify after the first sync and then every N syncs (0: only the first)
    verify_checksums: bool = True
    probe_atol: float | None = None  # None: 1e-3 for fp32 engines, 5e-2 otherwise
    engine_dtype: torch.dtype | None = None  # None: float32 on CPU, bfloat16 on GPU
    mode: str = "full"  # full | delta (megarl.reshard.delta: only what changed in the engine's dtype)
    full_every: int = 20  # delta: every N-th sync is full (0: only when forced)


class WeightSync:
    def __init__(self, bridge, chunks: list, transport: WeightTransport, client: EngineClient | None,
                 cfg: SyncConfig | None = None):
        self.bridge, self.chunks, self.transport, self.client = bridge, chunks, transport, client
        self.cfg = cfg or SyncConfig()
        self.dtype = self.cfg.engine_dtype or (torch.bfloat16 if platform.on_gpu() else torch.float32)
        self.count = 0
        # an adapter-only sync (megarl.reshard.adapter) leaves the engine's base weights alone: no weight-update
        # window, no checksums of them (see verify)
        self.adapter_only = bool(getattr(transport, "adapter_only", False))
        self.owners = bridge.owner_ranks(chunks)
        transport.setup(self.owners)
        self.probes = probe_sequences(bridge.vocab_size)
        # delta: this rank's shadow of what the engine holds; the version the engine must hold for a delta to apply
        self.delta = DeltaEncoder() if self.cfg.mode == "delta" else None
        self.pushed_version: str | None = None
        self.since_full = 0
        self.source = WeightSource(bridge, chunks, self.owners, BucketPacker(
            self.cfg.bucket_bytes, shared_memory=transport.shared_memory),
            engine_dtypes(bridge.hf.config, self.dtype), self.delta)
        self.last_stats: dict = {}

    def sync(self, version: str | None = None, verify: bool | None = None, full: bool = False) -> dict:
        """Push the trainer's current weights into the engine; verify when due (or as `verify` says). Returns
        timing/size stats. reshard.mode=delta sends what changed, unless the sync must be full (`full`, or
        full_sync_needed); a delta sync whose verification fails is followed by a full one, verified.

        An engine that does not hold the version this process pushed last (it restarted and serves its model folder,
        or another writer pushed to it) is restored: sent every tensor and verified, unless `verify` is False (the
        caller verifies once the engines generate again: partial rollouts). An engine that dies during the sync is
        restarted (within its restart budget) and restored the same way."""
        version = version or f"megarl-{self.count + 1}"
        reconnect = False
        for attempt in range(RESTORE_ATTEMPTS):
            try:
                return self._sync(version, verify, full, reconnect)
            except UserError as e:
                if not engine_unavailable(e) or attempt == RESTORE_ATTEMPTS - 1:
                    raise
                reconnect = on_rank0(lambda: self.client.revive())  # a dead engine this job owns starts again
                if dist.get_rank() == 0:
                    logger.warning("the weight sync to %s failed (%s): %s", self.client.url, str(e).splitlines()[0],
                                   "the engine was restarted; pushing every weight again" if reconnect else "again")
                full = True
        raise AssertionError("unreachable")

    def _sync(self, version: str, verify: bool | None, full: bool, reconnect: bool = False) -> dict:
        rank = dist.get_rank()
        start = time.perf_counter()
        restore = self.count > 0 and not self.current()
        if restore and rank == 0:
            logger.warning("the engine at %s does not hold the weights this run pushed last (%s): it gets every "
                           "weight, verified", self.client.url, self.pushed_version)
        if restore or reconnect:  # possibly a new engine process: the transport's channel to it is made again
            with contextlib.suppress(Exception):
                self.transport.close()
            self.transport.setup(self.owners)
        whole = self.delta is not None and (full or restore or self.full_sync_needed())
        if whole:
            self.delta.reset()
        window = not self.adapter_only
        try:
            if window:
                on_rank0(self._open_window)  # rank 0's failure reaches every rank
            if whole and not self.adapter_only:  # a restarted engine is only sent whole syncs (see restore above)
                on_rank0(lambda: self.client.enable_delta_loads())
            pushed_bytes, buckets = self.transport.send(self.source, version)
            if window:  # each update flushed the engine's prefix cache (transports._flush)
                on_rank0(lambda: self.client.end_weight_update())
        except BaseException:
            if self.delta is not None:  # what the engine took of this push is unknown: this rank's next one is whole
                self.delta.reset()
            if window and rank == 0:  # close the window if the engine still can; the push's error is the one to report
                with contextlib.suppress(Exception):
                    self.client.end_weight_update()
            raise
        self.count += 1
        self.pushed_version = version
        if rank == 0:
            self.client.pushed(version)  # a restarted engine generates again (the probes below first)
        stats = {"sync_s": time.perf_counter() - start, "pushed_bytes": _sum(pushed_bytes),
                 "buckets": int(_sum(buckets)), "version": version, "restored": float(restore)}
        if self.delta is not None:
            self.since_full = 0 if whole else self.since_full + 1
            stats.update(self._delta_stats(whole))
        if (self._due(self.count) or restore) if verify is None else verify:
            try:
                stats.update(self.verify())
            except UserError as e:
                # WeightMismatchError on rank 0, its RemoteUserError everywhere else (megarl.errors.on_rank0)
                mismatch = isinstance(e, WeightMismatchError) or getattr(e, "kind", "") == WeightMismatchError.__name__
                if not mismatch or self.delta is None or whole:
                    raise
                if rank == 0:
                    logger.warning("a delta weight sync failed its verification (%s): sending every tensor whole", e)
                return self._sync(version, verify=True, full=True)
        self.last_stats = stats
        return stats

    def current(self) -> bool:
        """Whether the engine holds the weights this process pushed last (a collective; False before any push)."""
        return self.count > 0 and bool(on_rank0(self._engine_holds_last))

    def _engine_holds_last(self) -> bool:
        """Rank 0: whether the engine serves the version this process pushed last (the transport asks for adapter
        syncs: the adapter's name)."""
        holds = getattr(self.transport, "holds", None)
        return holds(self.pushed_version) if holds is not None else self.client.holds(self.pushed_version)

    def full_sync_needed(self) -> bool:
        """Whether the next delta sync must send every tensor whole, besides an engine restored (see sync): nothing
        was sent yet by this process (a start or a resume), or this is the full_every-th sync since the last full
        one. The same answer on every rank."""
        return self.count == 0 or bool(self.cfg.full_every and self.since_full + 1 >= self.cfg.full_every)

    def _delta_stats(self, whole: bool) -> dict:
        counts = self.delta.take_stats()
        elements, changed = _sum(counts["elements"]), _sum(counts["changed"])
        return {"full_sync": float(whole), "changed_frac": changed / max(elements, 1.0),
                "sparse_tensors": int(_sum(counts["sparse"])), "unchanged_tensors": int(_sum(counts["unchanged"])),
                "shadow_bytes": _sum(self.delta.shadow_bytes)}

    def _open_window(self) -> None:
        """Open the engine's weight-update window. At this process's first sync, a window already open is a trainer's
        that died mid-push (a run killed and resumed on the same engine): it is closed and reopened, since this push
        replaces every weight and is verified. Later, an open window means another trainer pushes to this engine."""
        try:
            self.client.begin_weight_update()
        except EngineError as e:
            if sglang_compat.WEIGHT_WINDOW_OPEN not in str(e):
                raise
            if self.count:
                raise EngineError(f"the engine at {self.client.url} has a weight-update window this run did not open: "
                                  "another run pushes weights to it; give each run its own engines "
                                  "(rollout.engine.urls)") from None
            logger.warning("the engine at %s had a weight-update window open (a killed trainer's): closing it; this "
                           "sync replaces and verifies every weight", self.client.url)
            self.client.end_weight_update()
            self.client.begin_weight_update()

    def _due(self, count: int) -> bool:
        return count == 1 or self.cfg.verify_every == 1 or bool(self.cfg.verify_every and
                                                                count % self.cfg.verify_every == 1)

    def due(self, step: int | None = None) -> bool:
        """Whether the next sync() verifies by default: the first of this process, then every
        reshard.verify_every-th. With `step` (the training step whose weights are pushed) the schedule is every
        step divisible by verify_every, so a resumed run verifies on the same steps as an uninterrupted one."""
        if step is None or self.count == 0 or self.cfg.verify_every <= 1:
            return self._due(self.count + 1)
        return step % self.cfg.verify_every == 0

    def verify(self) -> dict:
        start = time.perf_counter()
        # Adapter-only syncs compare no checksums: SGLang's /weights_checker hashes the model's parameters, and a
        # loaded adapter lives in its LoRA memory pool, which nothing reports (its load request can check the tensors
        # it received, expected_checksums, but a mismatch there raises in the scheduler and kills the engine). The
        # base weights never change in a LoRA run. The probes, run through the adapter, check the whole.
        checked = verify_checksums(self.bridge, self.chunks, self.client, self.dtype) \
            if self.cfg.verify_checksums and not self.adapter_only else 0
        atol = self.cfg.probe_atol if self.cfg.probe_atol is not None else \
            (1e-3 if self.dtype == torch.float32 else 5e-2)
        diff = verify_probes(self.bridge, self.chunks, self.client, self.probes, atol)
        return {"verified_tensors": checked, "probe_max_abs_diff": diff, "verify_s": time.perf_counter() - start}

    def close(self) -> None:
        self.transport.close()


def _sum(value: float) -> float:
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t)
