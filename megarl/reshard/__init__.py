"""The reshard step (3D-hybrid-engine style): Megatron TP/PP/EP shards -> HF-named tensors -> bounded buckets ->
rollout engine (tensor / distributed / disk transports), verified by checksums and probe log-probs."""
from .adapter import AdapterTransport
from .buckets import DEFAULT_BUCKET_BYTES, BucketPacker, FlatBucket
from .engines import EngineSyncs, engine_syncs
from .delta import DeltaEncoder
from .sync import SyncConfig, WeightSync
from .transports import (TRANSPORTS, BucketPusher, DiskTransport, DistributedTransport, TensorTransport,
                         TransportOptions, WeightSource, WeightTransport, register_transport, resolve_transport,
                         send_buckets)
from .verify import WeightMismatchError, tensor_checksum, verify_checksums, verify_probes

__all__ = ["AdapterTransport", "DEFAULT_BUCKET_BYTES", "DeltaEncoder", "TRANSPORTS", "BucketPacker", "BucketPusher",
           "DiskTransport", "DistributedTransport", "EngineSyncs", "FlatBucket", "SyncConfig", "TensorTransport",
           "TransportOptions", "WeightMismatchError", "WeightSource", "WeightSync", "WeightTransport", "engine_syncs", "register_transport",
           "resolve_transport", "send_buckets", "tensor_checksum", "verify_checksums", "verify_probes"]
