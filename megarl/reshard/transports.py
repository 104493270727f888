"""How the trainer's weights reach the rollout engine. One small class per transport, one interface:

    transport = TRANSPORTS[name](client, TransportOptions(engine_tp=2, ...))
    transport.setup(owners)                      # once, a collective
    pushed_bytes, buckets = transport.send(source, version)   # every sync, a collective (between the engine's
    transport.close()                                         # begin_weight_update and end_weight_update)

Every transport is a `WeightTransport` (the protocol below); TRANSPORTS maps reshard.transport to the class
(`register_transport` adds your own, constructed as cls(client, TransportOptions)). The bucketed transports send with
`send_buckets`: owners push in turns (the owner's HF tensors are packed into bounded buckets, each handed to the
transport's `push`, a `BucketPusher`), so a rank holds at most one bucket plus the tensor being converted.

- TensorTransport (colocated): SGLang's flattened-bucket format, serialised with SGLang's MultiprocessingSerializer and
  posted to /update_weights_from_tensor; the engine maps the shared memory (no copy through HTTP).
- DistributedTransport (engines elsewhere): each owner rank forms a process group with the engine's ranks
  (/init_weights_update_group; NCCL on GPU, gloo on CPU) and broadcasts each flattened bucket while the engine receives
  it in /update_weights_from_distributed.
- DiskTransport (fallback): the trainer writes an HF folder (ModelBridge.save_hf) and the engine reloads it with
  /update_weights_from_disk.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.distributed as dist

from .. import platform
from ..algorithms.registry import registrar, resolve
from ..errors import UserError, agree, on_rank0
from ..parallel.env import free_port
from ..rollout.client import EngineClient, EngineUnavailable
from ..rollout.server import EngineError
from .buckets import BucketPacker, FlatBucket
from .delta import DeltaEncoder


def _flush() -> dict:
    """Every update flushes the engine's prefix cache (KV computed under the old weights) itself, and fails if
    requests still run. Not SGLang's separate /flush_cache: that also empties the device allocator's cache, which on
    CPU is a full gc.collect() in the scheduler (~0.34 s per sync on the quickstart, most of the sync); here only GPUs
    empty it."""
    return {"flush_cache": True, "torch_empty_cache": platform.on_gpu()}


@dataclass
class TransportOptions:
    engine_tp: int = 1  # the engine's TP size (tensor: one payload per engine rank; distributed: group size)
    master_address: str = "127.0.0.1"  # distributed: where the engine reaches the owner rank's group
    folder: str | None = None  # disk: the HF folder the trainer writes and the engine reloads


@dataclass
class WeightSource:
    """What a transport sends: the trainer's model, the ranks that own HF tensors, the packer and the dtype each
    tensor is sent in (megarl.reshard.verify.engine_dtypes: the engine's, float32 where the engine keeps it); with
    `delta` (reshard.mode=delta), each tensor is encoded against what this rank last sent (megarl.reshard.delta)."""
    bridge: object
    chunks: list
    owners: list[int]
    packer: BucketPacker
    dtype: Callable[[str], torch.dtype]
    delta: DeltaEncoder | None = None


class WeightTransport(Protocol):
    """How weights reach one engine. Every method is called on every trainer rank (collectives are allowed);
    `client` (the engine's EngineClient) may be called from any rank."""
    shared_memory: bool  # the buckets handed to this transport may live in shared memory (the engine maps them)

    def setup(self, owners: list[int]) -> None:
        """Once, before the first send: `owners` are the trainer ranks that hold HF tensors (they push in turns)."""

    def send(self, source: WeightSource, version: str) -> tuple[int, int]:
        """Every sync, inside the engine's weight-update window: deliver the trainer's weights tagged `version`;
        returns (bytes, buckets) this rank pushed. Bucketed transports: `return send_buckets(self, source,
        version)`."""

    def close(self) -> None:
        """Release what setup made (process groups, files)."""


class BucketPusher(Protocol):
    def push(self, bucket: FlatBucket, version: str) -> None:
        """On an owner rank: deliver one bucket (bucket.flat, with bucket.names / bucket.metadata) to the engine."""


TRANSPORTS: dict[str, type] = {}


def register_transport(name: str):
    """Class decorator: reshard.transport=<name> builds cls(client, TransportOptions) for each policy engine."""
    def add(cls):
        cls.name = name
        return registrar(TRANSPORTS)(name)(cls)
    return add


def resolve_transport(name: str) -> type:
    """reshard.transport: a registered transport, or "package.module:Class" imported by dotted path."""
    return resolve(TRANSPORTS, name, "reshard.transport")


def send_buckets(transport: BucketPusher, source: WeightSource, version: str) -> tuple[int, int]:
    """Owners in turns: each packs its HF tensors into buckets and `transport.push`es them; the others wait at a
    barrier. Returns (bytes, buckets) this rank pushed."""
    pushed_bytes, buckets = 0, 0
    for owner in source.owners:
        stream, dtype = source.bridge.export_hf_weights(source.chunks, owner=owner, copy=False), source.dtype
        if source.delta is not None:  # compared with what was sent, in the engine's dtype
            stream, dtype = source.delta.encode((n, t.to(source.dtype(n))) for n, t in stream), None
        error = None
        try:
            for bucket in source.packer.pack(stream, dtype):  # only the owner's stream yields buckets
                transport.push(bucket, version)
                pushed_bytes += bucket.nbytes
                buckets += 1
        except UserError as e:  # the engine's failure (e.g. it died) reaches every rank, not just this owner
            error = e
        agree(error)
    return pushed_bytes, buckets


@register_transport("tensor")
class TensorTransport:
    def __init__(self, client: EngineClient, options: TransportOptions | None = None):
        self.client, self.engine_tp = client, (options or TransportOptions()).engine_tp

    def setup(self, owners: list[int]) -> None:
        # SGLang on CPU: CPU tensors must be shared through files, or its scheduler rejects the handle.
        if not platform.on_gpu():
            torch.multiprocessing.set_sharing_strategy("file_system")

    shared_memory = True  # the bucket buffer lives in shared memory: SGLang maps it, nothing is copied

    def send(self, source: WeightSource, version: str) -> tuple[int, int]:
        return send_buckets(self, source, version)

    def push(self, bucket: FlatBucket, version: str) -> None:
        from sglang.srt.utils import MultiprocessingSerializer

        # One serialisation per engine TP rank: on CPU (torch's file_system sharing) each serialisation takes one
        # reference on the shared-memory file that exactly one deserialisation gives back; a single payload opened by
        # two ranks drops the file after the first ("unable to open shared memory object" on the second).
        payloads = [MultiprocessingSerializer.serialize({"flattened_tensor": bucket.flat, "metadata": bucket.metadata},
                                                        output_str=True) for _ in range(self.engine_tp)]
        result = self.client.call("/update_weights_from_tensor", {
            "serialized_named_tensors": payloads, "load_format": "flattened_bucket",
            "weight_version": version, **_flush()})
        _check(result, "/update_weights_from_tensor", bucket)

    def close(self) -> None:
        pass


@register_transport("distributed")
class DistributedTransport:
    def __init__(self, client: EngineClient, options: TransportOptions | None = None):
        options = options or TransportOptions()
        self.client, self.engine_tp, self.master_address = client, options.engine_tp, options.master_address
        self.group = None
        self.group_name = None

    def setup(self, owners: list[int]) -> None:
        """Each owner rank gets its own group with the engine: owners push in turns without routing through rank 0."""
        rank = dist.get_rank()
        for owner in owners:  # the engine joins one group at a time, in the same order everywhere
            if rank == owner:
                self.group_name = f"megarl-owner-{owner}"
                port = free_port()
                box = {}
                request = threading.Thread(target=self._call_into, args=(box, "/init_weights_update_group", {
                    "master_address": self.master_address, "master_port": port, "rank_offset": 1,
                    "world_size": 1 + self.engine_tp, "group_name": self.group_name,
                    "backend": platform.distributed_backend()}))
                request.start()
                from sglang.srt.utils.common import init_custom_process_group

                # Under torchrun, TORCHELASTIC_USE_AGENT_STORE makes a tcp:// rendezvous with rank 0 a *client* of the
                # agent's store instead of hosting a new one, so nobody hosts this group's store and the call hangs.
                agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
                try:
                    self.group = init_custom_process_group(
                        backend=platform.distributed_backend(), init_method=f"tcp://{self.master_address}:{port}",
                        world_size=1 + self.engine_tp, rank=0, group_name=self.group_name)
                finally:
                    if agent_store is not None:
                        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store
                request.join()
                _check(box.get("result"), "/init_weights_update_group", None, box.get("error"))
            dist.barrier()

    def _call_into(self, box, path, payload):
        try:
            box["result"] = self.client.call(path, payload)
        except Exception as e:  # noqa: BLE001 - reported by the caller thread
            box["error"] = e

    shared_memory = False

    def send(self, source: WeightSource, version: str) -> tuple[int, int]:
        return send_buckets(self, source, version)

    def push(self, bucket: FlatBucket, version: str) -> None:
        box = {}
        request = threading.Thread(target=self._call_into, args=(box, "/update_weights_from_distributed", {
            "names": bucket.names, "dtypes": [str(m.dtype).replace("torch.", "") for m in bucket.metadata],
            "shapes": [list(m.shape) for m in bucket.metadata], "group_name": self.group_name,
            "load_format": "flattened_bucket", "weight_version": version, **_flush()}))
        request.start()
        try:
            dist.broadcast(bucket.flat, src=0, group=self.group)
        except RuntimeError as e:  # the engine's end of the group is gone (gloo; NCCL may instead wait for its timeout)
            request.join()
            raise EngineUnavailable(f"the broadcast of a weight bucket to {self.client.url} failed: "
                                    f"{str(e).splitlines()[0]}") from None
        request.join()
        _check(box.get("result"), "/update_weights_from_distributed", bucket, box.get("error"))

    def close(self) -> None:
        if self.group is not None:
            try:
                self.client.call("/destroy_weights_update_group", {"group_name": self.group_name})
            finally:
                dist.destroy_process_group(self.group)
                self.group = None


@register_transport("disk")
class DiskTransport:
    """Whole-model fallback: not bucketed; ModelBridge.save_hf writes one shard per owner rank."""

    shared_memory = False

    def __init__(self, client: EngineClient, options: TransportOptions | None = None):
        folder = (options or TransportOptions()).folder
        if not folder:
            raise ValueError("DiskTransport needs TransportOptions.folder (the HF folder the engine reloads)")
        self.client, self.folder = client, folder

    def setup(self, owners: list[int]) -> None:
        pass

    def send(self, source: WeightSource, version: str) -> tuple[int, int]:
        source.bridge.save_hf(source.chunks, self.folder)

        def load() -> None:
            result = self.client.call("/update_weights_from_disk", {"model_path": os.path.abspath(self.folder),
                                                                   "weight_version": version, **_flush()})
            _check(result, "/update_weights_from_disk", None)

        on_rank0(load)  # the engine's failure reaches every rank
        return 0, 0  # nothing bucketed: the engine read the folder

    def close(self) -> None:
        pass


def _check(result, path: str, bucket: FlatBucket | None, error: Exception | None = None) -> None:
    if error is not None:
        raise error
    if isinstance(result, dict) and result.get("success") is False:
        where = f" (bucket starting at {bucket.names[0]}, {len(bucket.names)} tensors)" if bucket else ""
        raise EngineError(f"SGLang {path} failed{where}: {result.get('message')}")
