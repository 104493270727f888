"""A step's rollout -> the DP ranks that train it, as tensors.

The rollout workers (rollout.workers: the DP leaders, or rank 0 alone) each hold the samples they generated and
scored, packed as flat tensors (batching.PackedRollout). They agree on the step's plan (batching.BatchPlan: whole
groups per DP rank, balanced by tokens, one shape for all) from the samples' lengths, a small tensor all-reduce. Each
worker sends each DP replica's leader the rows of that replica it holds, point to point (a header of sizes, then one
tensor per field); the leader merges them in sample order and broadcasts them over its replica group (the TP x CP x
PP ranks that train the same rows). A rank receives about 1/DP of the step, nothing is pickled, and no rank builds a
batch from another replica's samples.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

from ..parallel import Groups
from .batching import PER_TOKEN_OPTIONAL, TEACHER_TOP_K, BatchPlan, PackedRollout

_DTYPES = [torch.int32, torch.int64, torch.uint8, torch.int16, torch.float32]
_PER_SAMPLE = ("seq_lens", "prompt_lens", "score", "baseline", "group", "sample_index")
_PER_RESPONSE_TOKEN = ("rollout_log_probs", "loss_mask")
_FIXED = {"seq_lens": torch.int64, "prompt_lens": torch.int64, "score": torch.float32, "baseline": torch.float32,
          "group": torch.int64, "sample_index": torch.int64, "rollout_log_probs": torch.float32,
          "loss_mask": torch.uint8, "teacher_log_probs": torch.float32, "token_versions": torch.int32,
          "teacher_top_ids": torch.int32, "teacher_top_log_probs": torch.float32}


@dataclass(frozen=True)
class Shape:
    """What a receiving rank needs to know before the tensors arrive: the shares's sizes and the step's plan."""
    samples: int
    tokens: int
    response_tokens: int
    routing: int  # entries of the MoE routing (-1: none)
    tokens_dtype: int
    routing_dtype: int
    optional: int  # bit i set: PER_TOKEN_OPTIONAL[i] travels too (opd's teacher log-probs, async token versions)
    top_k: int  # the width of the teacher's top-k per response token (opd_top_k; 0: none)
    rows: int
    seq_len: int
    num_microbatches: int

    def header(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f.name) for f in fields(self)], dtype=torch.long)

    @classmethod
    def of(cls, share: PackedRollout, rows: int, seq_len: int, num_microbatches: int) -> "Shape":
        routed = share.routed_experts
        return cls(share.num_samples, share.tokens.numel(), share.rollout_log_probs.numel(),
                   -1 if routed is None else routed.numel(), _DTYPES.index(share.tokens.dtype),
                   0 if routed is None else _DTYPES.index(routed.dtype),
                   sum(1 << i for i, name in enumerate(PER_TOKEN_OPTIONAL) if getattr(share, name) is not None),
                   0 if share.teacher_top_ids is None else share.teacher_top_ids.shape[1],
                   rows, seq_len, num_microbatches)

    def empty(self) -> PackedRollout:
        per_token = _PER_RESPONSE_TOKEN + tuple(name for i, name in enumerate(PER_TOKEN_OPTIONAL)
                                                if self.optional >> i & 1)
        sizes = {name: self.samples for name in _PER_SAMPLE} | {name: self.response_tokens for name in per_token}
        out = {name: torch.empty((n, self.top_k) if name in TEACHER_TOP_K else n, dtype=_FIXED[name])
               for name, n in sizes.items()}
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
    bytes_received: int  # what this rank received (headers included): ~1/DP of the step on every rank


def dispatch(packed: PackedRollout | None, plan: BatchPlan | None, groups: Groups,
             sources: tuple[int, ...] = (0,)) -> Dispatched:
    """Every rank: its DP rank's share of the step. On each source rank, `packed` holds the samples that rank
    generated (with their step-wide sample_index) and `plan` is the step's plan (the same on every source). A
    collective over the world: each source sends each DP leader the leader's samples it holds (point to point), the
    leader merges them in sample order and broadcasts them over its replica group."""
    rank = dist.get_rank()
    received, parts, shape, sends = 0, [], None, []
    if rank in sources:
        held = {index: k for k, index in enumerate(packed.sample_index.tolist())}
        for dp_rank, leader in enumerate(groups.leaders):
            part = packed.select([held[i] for i in plan.shares[dp_rank] if i in held])
            part_shape = Shape.of(part, plan.rows, plan.seq_len, plan.num_microbatches)
            if leader == rank:
                parts.append(part)
                shape = part_shape
                continue
            sends.append(dist.isend(part_shape.header(), dst=leader))
            sends += [dist.isend(t.contiguous(), dst=leader) for t in part.tensors().values() if t.numel()]
    if rank == groups.leader:
        for src in sources:
            if src == rank:
                continue
            header = torch.empty(_HEADER, dtype=torch.long)
            dist.recv(header, src=src)
            shape = Shape(*header.tolist())
            part = shape.empty()
            for t in part.tensors().values():
                if t.numel():
                    dist.recv(t, src=src)
            parts.append(part)
            received += header.numel() * 8 + part.nbytes
        share = PackedRollout.cat(parts)
        shape = Shape.of(share, shape.rows, shape.seq_len, shape.num_microbatches)
    for work in sends:  # only now: a source that is also a leader first receives what the other sources send it
        work.wait()
    if groups.replica is not None:  # the leader shares the rows with the rest of its replica
        header = shape.header() if rank == groups.leader else torch.empty(_HEADER, dtype=torch.long)
        dist.broadcast(header, src=groups.leader, group=groups.replica)
        if rank != groups.leader:
            shape = Shape(*header.tolist())
            share = shape.empty()
            received += header.numel() * 8 + share.nbytes
        for t in share.tensors().values():
            if t.numel():
                dist.broadcast(t, src=groups.leader, group=groups.replica)
    return Dispatched(share, shape.rows, shape.seq_len, shape.num_microbatches, received)
