"""Megatron shards -> HF-named tensors -> bounded buckets, on the ranks that own them.

ModelBridge.export_hf_weights already does the 3D part: TP (and expert-TP) shards are all-gathered inside their group
with the QKV / gate-up / vocabulary-padding layout handled by mbridge's rules, pipeline stages convert their own layers
under global layer indices, and expert-parallel ranks their own experts under global expert indices; every HF tensor
appears on exactly one owner rank. Here those tensors are grouped into buckets of at most `bucket_bytes` (a tensor
larger than that travels alone), so a rank holds at most one bucket plus the tensor being converted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass
class Bucket:
    names: list[str]
    tensors: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)


def iter_buckets(named_tensors, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 dtype: torch.dtype | None = None) -> Iterator[Bucket]:
    """Group a stream of (name, tensor) into buckets of at most bucket_bytes (optionally cast to dtype)."""
    if bucket_bytes <= 0:
        raise ValueError(f"reshard.bucket_bytes must be > 0, got {bucket_bytes}")
    names, tensors, size = [], [], 0
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        nbytes = tensor.numel() * tensor.element_size()
        if names and size + nbytes > bucket_bytes:
            yield Bucket(names, tensors)
            names, tensors, size = [], [], 0
        names.append(name)
        tensors.append(tensor.contiguous())
        size += nbytes
    if names:
        yield Bucket(names, tensors)


def flatten(bucket: Bucket) -> tuple[torch.Tensor, list[dict]]:
    """One contiguous byte buffer plus the metadata SGLang's FlattenedTensorBucket format carries (name, shape,
    dtype, byte range). Built with SGLang's own class so the engine reads exactly what it expects."""
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    flat = FlattenedTensorBucket(named_tensors=list(zip(bucket.names, bucket.tensors)))
    return flat.get_flattened_tensor(), flat.get_metadata()
