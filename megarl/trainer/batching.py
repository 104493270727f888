"""From rollout samples to the token batches each data-parallel rank trains on.

- Whole prompt groups go to one DP rank (group-relative advantages and the loss's global counts need no more), and
  groups are spread so that every rank gets about the same number of tokens (longest first, to the lightest rank).
- Every rank's share is padded to the same number of rows and the same sequence length (a multiple of TP for sequence
  parallelism), so pipeline stages and DP ranks agree on shapes; padding rows carry no loss.
- The number of micro-batches follows a token budget: ceil(rows * seq_len / max_tokens_per_microbatch).
- Token ids are the engine's ids, copied as they are: nothing is re-tokenised between rollout and training.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..losses.rl import TokenBatch, place_response_values, shift_sequences


@dataclass
class Sample:
    group: int  # index of the prompt within the step (samples of one prompt share it)
    prompt_index: int  # dataset index of the prompt
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    finish_reason: str
    reward: float = 0.0
    score: float = 0.0  # the reward after shaping (overlong penalty): what advantages see
    trained: bool = True  # False: kept for metrics, no loss (overlong masking)
    loss_mask: list[int] | None = None  # per response token (multi-turn: 0 on observations); None: all trained
    routed_experts: list[int] | None = None  # the engine's MoE routing, flat [positions, layers, top-k] (R3)
    extra: dict = field(default_factory=dict)


def shard_groups(samples: list[Sample], dp_size: int) -> list[list[int]]:
    """Sample indices per DP rank: whole groups, balanced by token count (deterministic)."""
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group, []).append(i)
    tokens = {g: sum(len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in idx)
              for g, idx in groups.items()}
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for g in sorted(groups, key=lambda g: (-tokens[g], g)):
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        shares[rank].extend(groups[g])
        load[rank] += tokens[g]
    return [sorted(s) for s in shares]


def padded_length(samples: list[Sample], multiple: int) -> int:
    longest = max(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    return int(math.ceil(longest / multiple) * multiple)


def micro_batches_for(rows: int, seq_len: int, max_tokens: int) -> int:
    return max(1, min(rows, math.ceil(rows * seq_len / max_tokens)))


def routing_tensor(samples: list[Sample], rows: int, seq_len: int, shape: tuple[int, int]) -> torch.Tensor:
    """[rows, seq_len, layers, top-k] int64: each sample's engine routing at its positions (prompt + response[:-1]);
    elsewhere (the last token, whose output is never trained, and padding) experts 0..k-1, any valid choice."""
    layers, k = shape
    out = torch.arange(k).expand(rows, seq_len, layers, k).clone()
    for i, s in enumerate(samples):
        routed = torch.tensor(s.routed_experts, dtype=torch.int64)
        positions = len(s.prompt_ids) + len(s.response_ids) - 1
        if routed.numel() != positions * layers * k:
            raise ValueError(f"sample {i}: the engine's routing has {routed.numel()} entries, expected {positions} "
                             f"positions x {layers} layers x top-{k}")
        out[i, :positions] = routed.view(positions, layers, k)
    return out


def token_batch(samples: list[Sample], rows: int, seq_len: int, pad_id: int,
                routing_shape: tuple[int, int] | None = None) -> TokenBatch:
    """A TokenBatch of exactly `rows` rows (padding rows at the end carry no loss), with the rollout log-probs (and,
    given routing_shape = (layers, top-k) and samples carrying it, the engine's MoE routing)."""
    prompts = [s.prompt_ids for s in samples]
    responses = [s.response_ids for s in samples]
    pad_rows = rows - len(samples)
    if pad_rows < 0:
        raise ValueError(f"{len(samples)} samples do not fit {rows} rows")
    prompts += [[pad_id]] * pad_rows
    responses += [[]] * pad_rows
    input_ids, targets, mask = shift_sequences(prompts, responses, pad_id, seq_len)
    for i, s in enumerate(samples):
        if not s.trained:
            mask[i] = 0
        elif s.loss_mask is not None:  # observation tokens of a multi-turn sample are inputs, never targets
            start = len(s.prompt_ids) - 1
            mask[i, start:start + len(s.response_ids)] *= torch.tensor(s.loss_mask, dtype=mask.dtype)
    rollout = place_response_values([s.rollout_log_probs for s in samples] + [[]] * pad_rows,
                                    [len(p) for p in prompts], seq_len)
    routed = routing_tensor(samples, rows, seq_len, routing_shape) \
        if routing_shape and samples and samples[0].routed_experts is not None else None
    return TokenBatch(input_ids=input_ids, targets=targets, loss_mask=mask, rollout_log_probs=rollout * mask,
                      routed_experts=routed)


@dataclass
class RankBatch:
    """One DP rank's rows of a step (or mini-batch), and where they sit in the global sample list."""
    batch: TokenBatch
    sample_index: list[int]  # global sample index of each real row (padding rows follow)
    num_microbatches: int


def rank_batch(samples: list[Sample], dp_rank: int, dp_size: int, pad_id: int, seq_multiple: int,
               max_tokens_per_microbatch: int, row_multiple: int = 1,
               routing_shape: tuple[int, int] | None = None) -> RankBatch:
    """This DP rank's rows; the row count is a multiple of num_microbatches * row_multiple (mini-batches)."""
    shares = shard_groups(samples, dp_size)
    seq_len = padded_length(samples, seq_multiple)
    rows = max(len(s) for s in shares)
    num_mb = micro_batches_for(rows // row_multiple or 1, seq_len, max_tokens_per_microbatch) * row_multiple
    rows = int(math.ceil(rows / num_mb) * num_mb)  # equal micro-batches in every mini-batch
    mine = shares[dp_rank]
    return RankBatch(token_batch([samples[i] for i in mine], rows, seq_len, pad_id, routing_shape), mine, num_mb)

