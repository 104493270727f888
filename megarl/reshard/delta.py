"""Delta weight sync (reshard.mode: delta): send the engine only the values that changed since the last sync.

After an RL step every fp32 master weight has moved, but most of them round to the same value in the engine's dtype
(bf16, FP8) as before. Each owner rank keeps a shadow: the engine-dtype tensors it last sent, which are exactly what the
engine holds. Per HF tensor, the elements whose bits differ from the shadow are sent as (flat indices, values) where
that is smaller than the tensor, the whole tensor where it is not, and nothing where nothing changed.

The engine side is SGLang's custom weight loader megarl.compat.sglang.load_weight_delta (the server starts with
`--custom-weight-loader` naming it, megarl.rollout.server): it keeps the HF tensors it was sent, patches them with the
deltas and loads the patched tensors through the model's own load_weights, so the engine ends bit-identical to a full
sync (the verification's checksums compare exactly that).

A sync is full (every tensor whole, the shadow rebuilt) when the shadow is empty (a process's first sync: a start or a
resume), when the engine does not hold the version this process last pushed (it restarted, or another writer pushed),
after a failed verification, and every reshard.full_every syncs (megarl.reshard.sync.WeightSync decides, on every rank
alike).

Trainer memory: the shadow holds each owner's HF tensors in the engine's dtype (bf16: 2 bytes per parameter, against
16 for the fp32 weights and Adam moments it trains).
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

# the name suffix of a sparse update: one uint8 tensor (so it never splits across buckets): the count of changed
# elements (int64), their flat indices (int32; int64 for tensors of 2**31 elements or more), their values (the tensor's
# engine dtype), zeros up to a multiple of 16 bytes (the packer aligns tensors to 16 bytes and SGLang's receiver of a
# broadcast bucket packs them back to back: sizes in multiples of 16 keep the two layouts equal)
DELTA = "#delta"
_PAD = 16
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_elements(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat indices of the elements whose bits differ (a bitwise compare: -0.0 vs 0.0 and NaN payloads count as
    changes, so the engine ends bit-identical)."""
    bits = _BITS[new.element_size()]
    return torch.nonzero(new.reshape(-1).view(bits) != old.reshape(-1).view(bits)).reshape(-1)


def sparse_pays(changed: int, numel: int, element_size: int) -> bool:
    """(indices, values) is smaller than the whole tensor."""
    return 8 + _PAD + changed * (_index_dtype(numel).itemsize + element_size) < numel * element_size


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2 ** 31 else torch.int64


def sparse_payload(index: torch.Tensor, values: torch.Tensor, numel: int) -> torch.Tensor:
    """The bytes of a sparse update of a tensor of `numel` elements (see DELTA)."""
    parts = [torch.tensor([index.numel()], dtype=torch.int64).view(torch.uint8),
             index.to(_index_dtype(numel)).view(torch.uint8), values.reshape(-1).view(torch.uint8)]
    size = sum(p.numel() for p in parts)
    return torch.cat(parts + [torch.zeros(-size % _PAD, dtype=torch.uint8)])


def split_payload(payload: torch.Tensor, base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int64 flat indices, values) of a sparse update of `base` (its dtype and size give the index and value
    types)."""
    payload = payload.reshape(-1).clone()  # its own storage: aligned for the typed views below
    count = int(payload[:8].view(torch.int64))
    index_type = _index_dtype(base.numel())
    end = 8 + count * index_type.itemsize
    index = payload[8:end].view(index_type).long()
    return index, payload[end:end + count * base.element_size()].view(base.dtype)


class DeltaEncoder:
    """One owner rank's shadow of what the engine holds, and the encoding of its tensors against it."""

    def __init__(self):
        self.shadow: dict[str, torch.Tensor] = {}
        self.stats = {"changed": 0, "elements": 0, "sparse": 0, "dense": 0, "unchanged": 0}

    def reset(self) -> None:
        """Forget what was sent: the next encode sends every tensor whole."""
        self.shadow.clear()

    @property
    def shadow_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.shadow.values())

    def encode(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, engine-dtype tensor) -> what to send: (name, tensor) whole, (name#delta, indices and values as bytes),
        or nothing. The shadow is updated to the values sent."""
        for name, tensor in named_tensors:
            old = self.shadow.get(name)
            self.stats["elements"] += tensor.numel()
            if old is None or old.shape != tensor.shape or old.dtype != tensor.dtype:
                self.shadow[name] = tensor.detach().clone()
                self.stats["changed"] += tensor.numel()
                self.stats["dense"] += 1
                yield name, tensor
                continue
            index = changed_elements(tensor, old)
            self.stats["changed"] += index.numel()
            if index.numel() == 0:
                self.stats["unchanged"] += 1
                continue
            if sparse_pays(index.numel(), tensor.numel(), tensor.element_size()):
                values = tensor.reshape(-1)[index]
                old.view(-1)[index] = values
                self.stats["sparse"] += 1
                yield name + DELTA, sparse_payload(index, values, tensor.numel())
            else:
                old.copy_(tensor)
                self.stats["dense"] += 1
                yield name, tensor

    def take_stats(self) -> dict:
        """The counts since the last call: elements and changed elements, tensors sent sparse / whole / not at all."""
        stats, self.stats = self.stats, dict.fromkeys(self.stats, 0)
        return stats


def apply_delta(base: dict[str, torch.Tensor], named_tensors: Iterable[tuple[str, torch.Tensor]]
                ) -> list[tuple[str, torch.Tensor]]:
    """The engine side's arithmetic (megarl.compat.sglang.load_weight_delta): a whole tensor replaces its base (a copy
    in host memory: on a GPU engine the base costs host memory, not GPU memory), a name#delta patches it in place;
    returns the (name, whole tensor) pairs to load. Raises KeyError naming a tensor that has a delta but no base (the
    engine lost what it was sent: a full sync is needed)."""
    out = []
    for name, tensor in named_tensors:
        if name.endswith(DELTA):
            name = name[:-len(DELTA)]
            if name not in base:
                raise KeyError(f"a delta for {name}, which this engine was never sent whole (restarted?): the trainer "
                               "must send a full sync")
            index, values = split_payload(tensor.cpu(), base[name])
            base[name].view(-1)[index] = values
        else:
            base[name] = tensor.detach().to("cpu", copy=True)
        out.append((name, base[name]))
    return out
