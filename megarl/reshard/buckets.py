"""Megatron shards -> HF-named tensors -> bounded buckets, on the ranks that own them.

ModelBridge.export_hf_weights does the 3D part: TP (and expert-TP) shards are gathered to the owner inside their group
with the QKV / gate-up / vocabulary-padding layout handled by mbridge's rules, pipeline stages convert their own layers
under global layer indices, and expert-parallel ranks their own experts under global expert indices; every HF tensor
appears on exactly one owner rank. Here those tensors are packed into one reusable flat byte buffer of `bucket_bytes`
(in shared memory for the colocated transport, so handing it to SGLang copies nothing), in SGLang's flattened-bucket
layout. A tensor larger than the buffer travels alone as a view of itself. So a rank holds one bucket buffer plus the
tensor being converted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

DEFAULT_BUCKET_BYTES = 512 << 20
ALIGN = 16


@dataclass
class FlatBucket:
    flat: torch.Tensor  # uint8, the bucket's bytes (a view of the reusable buffer, or of one large tensor)
    metadata: list  # sglang FlattenedTensorMetadata per tensor (name, shape, dtype, byte range)

    @property
    def names(self) -> list[str]:
        return [m.name for m in self.metadata]

    @property
    def nbytes(self) -> int:
        return self.flat.numel()

    def tensor(self, name: str) -> torch.Tensor:
        """A typed, writable view of one tensor inside the bucket."""
        m = next(m for m in self.metadata if m.name == name)
        return self.flat[m.start_idx:m.end_idx].view(m.dtype).view(m.shape)


class BucketPacker:
    def __init__(self, bucket_bytes: int = DEFAULT_BUCKET_BYTES, shared_memory: bool = False):
        if bucket_bytes <= 0:
            raise ValueError(f"reshard.bucket_bytes must be > 0, got {bucket_bytes}")
        self.bucket_bytes, self.shared_memory = bucket_bytes, shared_memory
        self._buffer: torch.Tensor | None = None

    def buffer(self) -> torch.Tensor:
        if self._buffer is None:  # allocated on first use, reused for every bucket of every sync
            self._buffer = torch.empty(self.bucket_bytes, dtype=torch.uint8)
            if self.shared_memory:
                self._buffer.share_memory_()
        return self._buffer

    def pack(self, named_tensors, dtype=None) -> Iterator[FlatBucket]:
        """Buckets of at most bucket_bytes from a stream of (name, tensor), each tensor cast to `dtype` (a dtype, or
        name -> dtype; None: as it is). A yielded bucket is valid until the consumer asks for the next one (the buffer
        is then reused)."""
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata

        metadata, used = [], 0
        for name, tensor in named_tensors:
            want = dtype(name) if callable(dtype) else dtype
            if want is not None and tensor.dtype != want:
                tensor = tensor.to(want)
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes > self.bucket_bytes:  # travels alone, without a copy into the buffer
                if metadata:
                    yield FlatBucket(self.buffer()[:used], metadata)
                    metadata, used = [], 0
                flat = tensor.contiguous().reshape(-1).view(torch.uint8)
                yield FlatBucket(flat, [FlattenedTensorMetadata(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                                                start_idx=0, end_idx=nbytes, numel=nbytes)])
                continue
            used = -(-used // ALIGN) * ALIGN  # every tensor starts aligned for its dtype
            if used + nbytes > self.bucket_bytes:
                yield FlatBucket(self.buffer()[:used], metadata)
                metadata, used = [], 0
            target = self.buffer()[used:used + nbytes].view(tensor.dtype).view(tensor.shape)
            target.copy_(tensor)
            metadata.append(FlattenedTensorMetadata(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                                    start_idx=used, end_idx=used + nbytes, numel=nbytes))
            used += nbytes
            del tensor
        if metadata:
            yield FlatBucket(self.buffer()[:used], metadata)
