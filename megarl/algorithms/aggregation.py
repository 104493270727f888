"""Loss aggregation as per-token weights computed once for the whole global batch.

Every mode is sum_t loss_t * w_t with w_t fixed before the batch is split into micro-batches, data-parallel ranks and
context-parallel shards, so the gradient does not depend on that split:

  token-mean               w = 1 / (response tokens in the global batch)
  token-sum                w = 1                                               (the plain sum: the gradient grows
                                                                                with the batch; no normalisation)
  seq-mean-token-sum       w = 1 / (sequences in the global batch)
  seq-mean-token-mean      w = 1 / (len(sequence) * sequences in the global batch)
  seq-mean-token-sum-norm  w = 1 / (norm_length * sequences in the global batch)     (Dr. GRPO; norm_length is a
                                                                                      constant, e.g. max new tokens)
"""
from __future__ import annotations

import torch
import torch.distributed as dist

AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def global_counts(mask: torch.Tensor, group=None) -> tuple[float, float]:
    """(response tokens, sequences with at least one response token) over the global batch.

    mask is this data-parallel rank's part of the global batch, whole sequences ([b, s], before any context-parallel
    sharding); group is the data-parallel group.
    """
    counts = torch.stack([mask.sum(), (mask.sum(-1) > 0).sum()]).double()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    return float(counts[0]), float(counts[1])


def loss_weights(mask: torch.Tensor, mode: str, num_tokens: float, num_seqs: float,
                 norm_length: int | None = None) -> torch.Tensor:
    """Per-token weights [b, s] for `mode`, given the global counts from global_counts()."""
    mask = mask.to(torch.float32)
    if mode == "token-mean":
        return mask / max(num_tokens, 1.0)
    if mode == "token-sum":
        return mask
    if mode == "seq-mean-token-sum":
        return mask / max(num_seqs, 1.0)
    if mode == "seq-mean-token-mean":
        return mask / mask.sum(-1, keepdim=True).clamp(min=1) / max(num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if not norm_length:
            raise ValueError("algorithm.aggregation=seq-mean-token-sum-norm needs algorithm.norm_length "
                             "(a constant such as the rollout's max new tokens)")
        return mask / (float(norm_length) * max(num_seqs, 1.0))
    raise ValueError(f"algorithm.aggregation={mode!r} is unknown; choose one of {AGGREGATIONS}")
