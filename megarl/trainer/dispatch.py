"""A step's rollout -> the DP ranks that train it, as tensors.

Rank 0 (the rollout side: engine requests, rewards, dynamic sampling over whole groups) holds the step's samples
packed as flat tensors (batching.PackedRollout) and plans the step (batching.BatchPlan: whole groups per DP rank,
balanced by tokens, one shape for all). It sends each DP replica's leader exactly that replica's rows, point to point
(a header of sizes, then one tensor per field); the leader broadcasts them over its replica group (the TP x CP x PP
ranks that train the same rows). A rank receives about 1/DP of the step, nothing is pickled, and no rank builds a
batch from another replica's samples.

Why rank 0 still runs the rollout: dynamic sampling and the token-balanced split need every group of the step in one
place, and that side is I/O (HTTP to the engines, reward processes), not tensor work. The per-token data is what was
expensive to move, and it now moves once, to where it is trained.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from ..parallel import Groups
from .batching import BatchPlan, PackedRollout

_DTYPES = [torch.int32, torch.int64, torch.uint8, torch.int16, torch.float32]
_PER_SAMPLE = ("seq_lens", "prompt_lens", "score", "group", "sample_index")
_PER_RESPONSE_TOKEN = ("rollout_log_probs", "loss_mask")
_FIXED = {"seq_lens": torch.int64, "prompt_lens": torch.int64, "score": torch.float32, "group": torch.int64,
          "sample_index": torch.int64, "rollout_log_probs": torch.float32, "loss_mask": torch.uint8}


@dataclass(frozen=True)
class Shape:
    """What a receiving rank needs to know before the tensors arrive: the shares's sizes and the step's plan."""
    samples: int
    tokens: int
    response_tokens: int
    routing: int  # entries of the MoE routing (-1: none)
    tokens_dtype: int
    routing_dtype: int
    rows: int
    seq_len: int
    num_microbatches: int

    def header(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.long)

    @classmethod
    def of(cls, share: PackedRollout, plan: BatchPlan) -> "Shape":
        routed = share.routed_experts
        return cls(share.num_samples, share.tokens.numel(), share.rollout_log_probs.numel(),
                   -1 if routed is None else routed.numel(), _DTYPES.index(share.tokens.dtype),
                   0 if routed is None else _DTYPES.index(routed.dtype), plan.rows, plan.seq_len,
                   plan.num_microbatches)

    def empty(self) -> PackedRollout:
        sizes = {name: self.samples for name in _PER_SAMPLE} | {name: self.response_tokens
                                                                 for name in _PER_RESPONSE_TOKEN}
        out = {name: torch.empty(n, dtype=_FIXED[name]) for name, n in sizes.items()}
        out["tokens"] = torch.empty(self.tokens, dtype=_DTYPES[self.tokens_dtype])
        if self.routing >= 0:
            out["routed_experts"] = torch.empty(self.routing, dtype=_DTYPES[self.routing_dtype])
        return PackedRollout(**out)


_HEADER = len(fields(Shape))


@dataclass
class Dispatched:
    share: PackedRollout  # this DP rank's samples
    rows: int
    seq_len: int
    num_microbatches: int
    bytes_received: int  # what this rank received (header included): ~1/DP of the step on every rank but the source


def dispatch(packed: PackedRollout | None, plan: BatchPlan | None, groups: Groups, src: int = 0) -> Dispatched:
    """Every rank: its DP rank's share of the step. `packed` and `plan` are needed on `src` only. A collective over
    the world (point to point from src to the leaders, then a broadcast in each replica group)."""
    rank = dist.get_rank()
    received = 0
    share = shape = None
    if rank == src:
        sends = []
        for dp_rank, leader in enumerate(groups.leaders):
            part = packed.select(plan.shares[dp_rank])
            part_shape = Shape.of(part, plan)
            if leader == rank:
                share, shape = part, part_shape
                continue
            sends.append(dist.isend(part_shape.header(), dst=leader))
            sends += [dist.isend(t.contiguous(), dst=leader) for t in part.tensors().values()]
        for work in sends:
            work.wait()
    elif rank == groups.leader:
        header = torch.empty(_HEADER, dtype=torch.long)
        dist.recv(header, src=src)
        shape = Shape(*header.tolist())
        share = shape.empty()
        for t in share.tensors().values():
            dist.recv(t, src=src)
        received += header.numel() * 8 + share.nbytes
    if groups.replica is not None:  # the leader shares the rows with the rest of its replica
        header = shape.header() if rank == groups.leader else torch.empty(_HEADER, dtype=torch.long)
        dist.broadcast(header, src=groups.leader, group=groups.replica)
        if rank != groups.leader:
            shape = Shape(*header.tolist())
            share = shape.empty()
            received += header.numel() * 8 + share.nbytes
        for t in share.tensors().values():
            dist.broadcast(t, src=groups.leader, group=groups.replica)
    return Dispatched(share, shape.rows, shape.seq_len, shape.num_microbatches, received)
