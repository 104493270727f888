"""The reshard step (3D-hybrid-engine style): Megatron TP/PP/EP shards -> HF-named tensors -> bounded buckets ->
rollout engine (tensor / distributed / disk transports), verified by checksums and probe log-probs."""
from .buckets import DEFAULT_BUCKET_BYTES, BucketPacker, FlatBucket
from .sync import SyncConfig, WeightSync
from .transports import (DiskTransport, DistributedTransport, TensorTransport, TransportOptions, WeightSource,
                         send_buckets)
from .verify import WeightMismatchError, tensor_checksum, verify_checksums, verify_probes

TRANSPORTS = {"tensor": TensorTransport, "distributed": DistributedTransport, "disk": DiskTransport}

__all__ = ["DEFAULT_BUCKET_BYTES", "TRANSPORTS", "BucketPacker", "DiskTransport", "DistributedTransport", "SyncConfig",
           "FlatBucket", "TensorTransport", "TransportOptions", "WeightMismatchError", "WeightSource", "WeightSync", "tensor_checksum",
           "send_buckets", "verify_checksums", "verify_probes"]
