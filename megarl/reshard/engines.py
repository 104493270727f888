"""Every policy engine's weight sync, as one (EngineSyncs): the trainer pushes its weights into each engine that is
not retired, restores the engines that lost them (restarted: megarl.rollout.client), and retires an engine that
cannot take them after its restarts, going on while rollout.min_engines remain."""
from __future__ import annotations

import logging
import os
import socket

import torch
import torch.distributed as dist

from ..errors import UserError
from ..rollout.client import engine_unavailable
from .adapter import AdapterTransport
from .sync import SyncConfig, WeightSync
from .transports import TransportOptions, resolve_transport

logger = logging.getLogger(__name__)


class EngineSyncs:
    """One WeightSync per policy engine (engine i: syncs[i]); `retired` is the same on every rank."""

    def __init__(self, syncs: list[WeightSync], min_engines: int = 1):
        self.syncs, self.min_engines = syncs, min_engines
        self.retired: set[int] = set()

    def __iter__(self):
        return iter(self.syncs)

    def __len__(self) -> int:
        return len(self.syncs)

    def push(self, step: int, version: str, verify: bool | None = None, defer_verify: bool = False,
             restore: bool = False) -> tuple[dict, list[WeightSync]]:
        """The weights after `step`, tagged `version`, into every engine that is not retired (a collective).
        verify: None: when due (WeightSync.due(step)); defer_verify: none now (the engines are paused): the syncs to
        verify once they generate again are returned. restore: only the engines that do not hold the weights pushed
        last (restarted), each sent every weight and verified. Returns the stats (the last engine's) and the syncs
        whose verification is deferred."""
        stats, deferred = {}, []
        for i, sync in enumerate(self.syncs):
            if i in self.retired or (restore and sync.current()):
                continue
            check = sync.due(step) if verify is None else verify
            try:
                stats = sync.sync(version, verify=False if defer_verify else (check or restore))
            except UserError as e:
                if not engine_unavailable(e):
                    raise
                self._retire(i, e)
                continue
            if defer_verify and (check or restore or stats.get("restored")):
                deferred.append(sync)
        return stats, deferred

    def _retire(self, engine: int, error: UserError) -> None:
        """An engine that could not take the weights (dead past its restart budget, or unreachable): never used again;
        the run goes on while min_engines remain (one line, the same on every rank)."""
        self.retired.add(engine)
        left = len(self.syncs) - len(self.retired)
        line = str(error).splitlines()[0]
        if left < self.min_engines:
            raise UserError(f"policy engine {engine} could not take the trainer's weights ({line}) and is retired: "
                            f"{left} of {len(self.syncs)} engines remain, fewer than rollout.min_engines="
                            f"{self.min_engines}. Fix: read the engine's log; lower rollout.min_engines to go on with "
                            "fewer")
        if dist.get_rank() == 0:
            logger.error("policy engine %d retired (%s); %d of %d engines remain", engine, line, left,
                         len(self.syncs))

    def close(self) -> None:
        for sync in self.syncs:
            sync.close()


def with_engines(collective, restore, tries: int):
    """collective() (run by every rank), run again after restore() (a collective: the trainer's weights pushed into
    the engines that lost them) when no engine could generate (EnginesDown, or another engine failure a rank saw),
    at most `tries` times. Each engine restart counts against its restart budget, so a few tries end it."""
    for attempt in range(tries + 1):
        try:
            return collective()
        except UserError as e:
            if not engine_unavailable(e) or attempt == tries:
                raise
            if dist.get_rank() == 0:
                logger.warning("no policy engine could generate (%s): pushing the weights into the restarted ones, "
                               "then generating again", str(e).splitlines()[0])
        restore()


def engine_syncs(clients: list, bridge, chunks: list, reshard, engine, run_dir: str, rank: int,
                 local: bool, adapter=None, min_engines: int = 1) -> EngineSyncs:
    """One WeightSync per policy engine client: reshard (the reshard config section) picks the transport, bucket size
    and verification; engine (rollout.engine) gives the engine's TP size and dtype. local: the engines run on rank 0's
    node (else they join the distributed transport's group at rank 0's host name). adapter: model.lora when the run
    syncs its LoRA adapters only (reshard.lora_sync=adapter, megarl.trainer.config.adapter_sync): reshard.transport
    is then not used (megarl.reshard.adapter). min_engines: rollout.min_engines."""
    syncs = []
    for i, client in enumerate(clients):
        transport = AdapterTransport(client, adapter, engine.tp_size) if adapter is not None else \
            resolve_transport(reshard.transport)(client, TransportOptions(
                engine_tp=engine.tp_size, folder=os.path.join(run_dir, "engine", f"weights-{i}"),
                master_address=reshard.master_address or ("127.0.0.1" if local else socket.gethostname())))
        syncs.append(WeightSync(bridge, chunks, transport, client if rank == 0 else None,
                                SyncConfig(bucket_bytes=reshard.bucket_mb << 20, verify_every=reshard.verify_every,
                                           verify_checksums=reshard.verify_checksums, probe_atol=reshard.probe_atol,
                                           engine_dtype=getattr(torch, engine.dtype) if engine.dtype else None,
                                           mode=reshard.mode, full_every=reshard.full_every)))
    return EngineSyncs(syncs, min_engines)
