"""The reshard step (3D-hybrid-engine style): Megatron TP/PP/EP shards -> HF-named tensors -> bounded buckets ->
rollout engine (tensor / distributed / disk transports), verified by checksums and probe log-probs."""
from .adapter import AdapterTransport
from .buckets import DEFAULT_BUCKET_BYTES, BucketPacker, FlatBucket
from .delta import DeltaEncoder
from .sync import SyncConfig, WeightSync
from .transports import (TRANSPORTS, BucketPusher, DiskTransport, DistributedTransport, TensorTransport,
                         TransportOptions, WeightSource, WeightTransport, register_transport, resolve_transport,
                         send_buckets)
from .verify import WeightMismatchError, tensor_checksum, verify_checksums, verify_probes

__all__ = ["AdapterTransport", "DEFAULT_BUCKET_BYTES", "DeltaEncoder", "TRANSPORTS", "BucketPacker", "BucketPusher",
           "DiskTransport", "DistributedTransport", "FlatBucket", "SyncConfig", "TensorTransport", "TransportOptions",
           "WeightMismatchError", "WeightSource", "WeightSync", "WeightTransport", "engine_syncs", "register_transport",
           "resolve_transport", "send_buckets", "tensor_checksum", "verify_checksums", "verify_probes"]


def engine_syncs(clients: list, bridge, chunks: list, reshard, engine, run_dir: str, rank: int,
                 local: bool, adapter=None) -> list[WeightSync]:
    """One WeightSync per policy engine client: reshard (the reshard config section) picks the transport, bucket size
    and verification; engine (rollout.engine) gives the engine's TP size and dtype. local: the engines run on rank 0's
    node (else they join the distributed transport's group at rank 0's host name). adapter: model.lora when the run
    syncs its LoRA adapters only (reshard.lora_sync=adapter, megarl.trainer.config.adapter_sync): reshard.transport
    is then not used (megarl.reshard.adapter)."""
    import os
    import socket

    import torch

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
    return syncs
