"""Token log-probabilities and entropy straight from the final hidden states and the TP-sharded output weight: the
[tokens, vocab/tp] logits are never materialised, nor is their gradient.

The idea of Liger-Kernel's fused linear cross-entropy, made vocab-parallel over the TP group and extended to entropy
and temperature. The logits are computed one [chunk tokens, block vocabulary rows] tile at a time
(hidden_chunk @ weight_block.T, within this rank's vocabulary slice), in two reused tile buffers (64 MiB each by
default: 4,096 x 4,096). The forward pass reduces each tile to the per-token sums of megarl.losses.vocab_parallel
(same code: _prepare, _chunk_sums, _merge across the blocks of a chunk, _combine across TP ranks) and keeps only hidden,
weight, targets and two numbers per token (log Z, entropy). The backward pass recomputes each tile's logits, turns
them into d(loss)/d(logits) with vocab_parallel's _chunk_grad, and multiplies that into grad_hidden (this rank's
vocabulary share; summed over the TP group like Megatron's ColumnParallelLinear: copy_to_tensor_model_parallel_region,
or gather_from_sequence_parallel_region under sequence parallelism) and the weight's gradient. Token chunks are the
outer loop, so each pass reads the weight, and updates its gradient, once per chunk rather than once per few tokens.

The weight's gradient goes where Megatron's ColumnParallelLinear puts it with gradient_accumulation_fusion: into the
parameter's existing `main_grad` buffer (Megatron DDP) tile by tile, so no [vocab/tp, hidden] gradient is allocated
either (see _FusedLinearLogProbEntropy.backward). Without a `main_grad` it is returned like any autograd gradient.

Cost: the LM-head matmul runs once in the forward and three times in the backward (recompute, grad_hidden,
grad_weight), against 1 + 2 for the unfused path: the price of never holding [tokens, vocab/tp] tensors.

In a model: GPTModel's `output_processor` hook (megatron-core) replaces its output layer on the last pipeline stage by
`head_input`, which hands the loss function a HeadInput (hidden states + output weight) instead of logits;
`logprob_entropy` takes either. megarl.losses.step passes the hook when algorithm.fused_logprobs is on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .vocab_parallel import (_chunk_grad, _chunk_sums, _combine, _flat_targets, _merge, _output_grads, _prepare,
                             _target_slots, _tp_rank, vocab_parallel_logprob_entropy)

CHUNK_BYTES = 64 << 20  # one [tokens, vocabulary] float32 tile: 4,096 tokens x 4,096 vocabulary rows
VOCAB_BLOCK = 4096  # vocabulary rows per tile (the default token chunk fills CHUNK_BYTES with them)


def _buffers(rows, cols, weight, hidden):
    """The [rows, cols] logits tile (the activations' dtype) and float32 scratch tile that every tile of a pass reuses:
    fresh tile-sized tensors lie above glibc's mmap threshold and would page-fault anew every time."""
    return (torch.empty(rows, cols, dtype=hidden.dtype, device=hidden.device),
            torch.empty(rows, cols, dtype=torch.float32, device=hidden.device))


def _tiles(n, per_rank, chunk, block):
    """(token slice, vocabulary-row slice) of every tile, token chunks outermost: within a chunk the tiles walk the
    vocabulary, so each pass reads the weight (and updates its gradient) once per chunk of `chunk` tokens."""
    for start in range(0, n, chunk):
        for first in range(0, per_rank, block):
            yield slice(start, min(n, start + chunk)), slice(first, min(per_rank, first + block))


class _FusedLinearLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, vocab_size, group, chunk, block, weight_shared):
        per_rank = weight.shape[0]
        vocab_start = _tp_rank(group) * per_rank
        n = hidden.shape[0]
        local_max = torch.empty(n, dtype=torch.float32, device=hidden.device)
        sums = torch.zeros(2 + targets.shape[1], n, dtype=torch.float32, device=hidden.device)
        logits, scratch = _buffers(min(chunk, n), min(block, per_rank), weight, hidden)
        for rows, cols in _tiles(n, per_rank, chunk, block):
            c, v = rows.stop - rows.start, cols.stop - cols.start
            x = torch.mm(hidden[rows], weight[cols].t(), out=logits[:c, :v])
            x = _prepare(x, temperature, vocab_start + cols.start, vocab_size, owned=True)
            local_t, on_tile = _target_slots(targets[rows], vocab_start + cols.start, v)
            tile_max, tile_sums = _chunk_sums(x, local_t, on_tile, overwrite=True, scratch=scratch[:c, :v])
            if cols.start == 0:
                local_max[rows], sums[:, rows] = tile_max, tile_sums
            else:  # the vocabulary so far and this block, at their common max
                local_max[rows], sums[:, rows] = _merge(local_max[rows], sums[:, rows], tile_max, tile_sums)
        log_prob, entropy, log_z = _combine(local_max, sums, group)
        ctx.save_for_backward(hidden, weight, targets, log_z, entropy)
        # main_grad is read at forward time, as Megatron's linear layers do (a weight may be shared by several calls)
        ctx.main_grad = getattr(weight, "main_grad", None)
        ctx.param = weight
        ctx.config = (temperature, vocab_start, vocab_size, chunk, block, weight_shared)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        hidden, weight, targets, log_z, entropy = ctx.saved_tensors
        temperature, vocab_start, vocab_size, chunk, block, weight_shared = ctx.config
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        n, per_rank = hidden.shape[0], weight.shape[0]
        g_lp, g_h = _output_grads(grad_log_prob, grad_entropy, targets, entropy)
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        wgrad = None
        if need_weight:  # accumulated in float32 (in place into main_grad when the parameter has one)
            wgrad = ctx.main_grad if ctx.main_grad is not None else torch.zeros(
                weight.shape, dtype=torch.promote_types(weight.dtype, torch.float32), device=weight.device)
        logits, scratch = _buffers(min(chunk, n), min(block, per_rank), weight, hidden)
        for rows, cols in _tiles(n, per_rank, chunk, block):
            c, v = rows.stop - rows.start, cols.stop - cols.start
            h, w = hidden[rows], weight[cols]
            y = torch.mm(h, w.t(), out=logits[:c, :v])  # the tile's logits, recomputed
            y = _prepare(y, temperature, vocab_start + cols.start, vocab_size, owned=True)
            local_t, on_tile = _target_slots(targets[rows], vocab_start + cols.start, v)
            g = _chunk_grad(y, log_z[rows], entropy[rows], g_lp[rows], g_h[rows], local_t, on_tile, temperature,
                            scratch=scratch[:c, :v]).to(hidden.dtype)
            if need_hidden:
                grad_hidden[rows].addmm_(g, w)
            if need_weight:
                if wgrad.dtype == g.dtype:
                    wgrad[cols].addmm_(g.t(), h)
                else:  # bf16 activations, fp32 accumulation (Megatron's wgrad_gemm_accum_fp32 is a CUDA kernel)
                    wgrad[cols].addmm_(g.t().float(), h.float())
        grad_weight = None
        if need_weight and ctx.main_grad is None:
            grad_weight = wgrad.to(weight.dtype)
        elif need_weight and hasattr(ctx.param, "grad_added_to_main_grad") and not weight_shared:
            # Megatron's gradient_accumulation_fusion protocol (ColumnParallelLinear's backward): the gradient is in
            # main_grad already; an untouched placeholder (no memory is written) still fires DDP's grad hook, which
            # skips it because of the flag. A shared weight (tied embedding on this stage) returns None instead: the
            # embedding's own gradient fires the hook and must be added, which the flag would prevent.
            grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            ctx.param.grad_added_to_main_grad = True
        return grad_hidden, grad_weight, None, None, None, None, None, None, None


def fused_logprob_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                          temperature: float = 1.0, group=None, sequence_parallel: bool = False,
                          weight_shared: bool = False, chunk_tokens: int | None = None,
                          vocab_block: int = VOCAB_BLOCK, chunk_bytes: int = CHUNK_BYTES):
    """(log p(target), entropy) per position from hidden @ weight.T without materialising it: log p shaped like
    `targets` (one per position, or [..., K]: K per position, from the same pass), entropy like hidden without its
    last dimension.

    hidden: [..., h], the final hidden states (after the final norm) that the output layer would read; with
    sequence_parallel, [s/tp, ...] this rank's slice of the sequence (dim 0), all-gathered here as Megatron's
    ColumnParallelLinear does. targets: global token ids shaped like the (gathered) hidden without its last dim, or
    with a trailing K.
    weight: [vocab/tp, h] this TP rank's slice of the (padded) output weight. vocab_size: the true vocabulary size;
    padded rows are excluded. temperature: logits / T as the rollout engine sampled them. group: the TP group (None:
    the whole vocabulary is local). weight_shared: the weight also gets a gradient through autograd from another use
    on this stage (the tied input embedding); only matters when it has a Megatron `main_grad`. vocab_block: vocabulary
    rows per tile. chunk_tokens: tokens per tile; by default as many as fill `chunk_bytes` per float32 tile.
    Differentiable w.r.t. hidden and weight; equal to vocab_parallel_logprob_entropy(hidden @ weight.T, ...).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if group is not None and dist.get_world_size(group) > 1:
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region)

        hidden = (gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=group)
                  if sequence_parallel else copy_to_tensor_model_parallel_region(hidden, group=group))
    flat_targets, lp_shape = _flat_targets(targets, hidden.shape[:-1], source="hidden states")
    block = max(1, min(int(vocab_block), weight.shape[0]))
    chunk = int(chunk_tokens) if chunk_tokens else max(1, chunk_bytes // (4 * block))
    log_prob, entropy = _FusedLinearLogProbEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, flat_targets, float(temperature), int(vocab_size), group,
        chunk, block, bool(weight_shared))
    return log_prob.reshape(lp_shape), entropy.reshape(hidden.shape[:-1])


@dataclass
class HeadInput:
    """What GPTModel's last stage hands the loss function instead of logits when the fused path is on."""
    hidden: torch.Tensor  # [s, b, h] after the final norm ([s/tp, b, h] under sequence parallelism)
    weight: torch.Tensor  # [vocab/tp, h]: the output layer's weight, or the shared embedding's when tied
    sequence_parallel: bool
    weight_shared: bool  # tied, with the embedding on this same chunk (it differentiates the weight too)


def head_input(*, hidden_states, output_layer, output_weight, config, **_):
    """GPTModel `output_processor` (megatron-core's hook in GPTModel._postprocess, called in place of the output layer
    on the last stage): the final hidden states and the output weight, for logprob_entropy."""
    if getattr(config, "use_mup", False):
        raise ValueError("algorithm.fused_logprobs=true does not apply MuP's output-logit scaling of this model. "
                         "Fix: set algorithm.fused_logprobs: false")
    tied = output_weight is not None
    return HeadInput(hidden=hidden_states, weight=output_weight if tied else output_layer.weight,
                     sequence_parallel=bool(output_layer.sequence_parallel),
                     weight_shared=tied and output_layer.weight is None)


def logprob_entropy(output, targets: torch.Tensor, *, vocab_size: int, temperature: float = 1.0, group=None):
    """(log p(target), entropy) [b, s] from a GPTModel's last-stage output: this rank's logits [b, s, vocab/tp]
    (vocab_parallel_logprob_entropy) or a HeadInput (fused_logprob_entropy). targets [b, s], or [b, s, K] for K
    targets per position (log p [b, s, K], one pass over the vocabulary for all). group: the TP group."""
    if isinstance(output, HeadInput):  # hidden states are [s, b, h]: work in that order, hand back [b, s]
        log_prob, entropy = fused_logprob_entropy(
            output.hidden, output.weight, targets.transpose(0, 1), vocab_size=vocab_size, temperature=temperature,
            group=group, sequence_parallel=output.sequence_parallel, weight_shared=output.weight_shared)
        return log_prob.transpose(0, 1), entropy.t()
    return vocab_parallel_logprob_entropy(output, targets, vocab_size=vocab_size, temperature=temperature,
                                          group=group)
