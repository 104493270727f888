"""Token log-probabilities and entropy over vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice of the (padded) vocabulary: [tokens, vocab/tp]. The log-partition function
needs a max and a sum over the whole vocabulary, which are two all-reduces of one number per token; the target's
logit lives on exactly one rank (one more all-reduce). The backward pass is written out (d logp/dx = onehot - p,
dH/dx = p (E[x] - x)) and recomputes p chunk by chunk from the saved logits, so no [tokens, vocab/tp] probability
tensor is ever stored. Columns at or past `vocab_size` (Megatron's vocabulary padding) are excluded.

Call it on the last pipeline stage, inside the loss function, with the raw logits of the model's output layer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_NEG = -1e30  # stands for -inf: exp() gives 0 and 0 * _NEG stays finite (0 * -inf would be nan)


def _scaled_chunk(logits, start, end, temperature, vocab_start, vocab_size):
    x = logits[start:end].float() / temperature
    columns = torch.arange(vocab_start, vocab_start + x.shape[-1], device=x.device)
    return x.masked_fill(columns >= vocab_size, _NEG)


def _all_reduce(t, op, group):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_size, group, chunk_size):
        tp_rank = dist.get_rank(group) if group is not None and dist.is_initialized() else 0
        per_rank = logits.shape[-1]
        vocab_start = tp_rank * per_rank
        n = logits.shape[0]
        log_z = torch.empty(n, dtype=torch.float32, device=logits.device)
        target_logit = torch.zeros(n, dtype=torch.float32, device=logits.device)
        # Max and the sum of exp over the full vocabulary, one chunk of tokens at a time.
        for start in range(0, n, chunk_size):
            end = min(n, start + chunk_size)
            x = _scaled_chunk(logits, start, end, temperature, vocab_start, vocab_size)
            log_z[start:end] = x.max(dim=-1).values
        _all_reduce(log_z, dist.ReduceOp.MAX, group)
        sum_exp = torch.empty_like(log_z)
        expected_x = torch.empty_like(log_z)
        local_t = targets - vocab_start
        on_rank = (local_t >= 0) & (local_t < per_rank)
        for start in range(0, n, chunk_size):
            end = min(n, start + chunk_size)
            x = _scaled_chunk(logits, start, end, temperature, vocab_start, vocab_size)
            e = torch.exp(x - log_z[start:end, None])
            sum_exp[start:end] = e.sum(-1)
            expected_x[start:end] = (e * x).sum(-1)
            idx = local_t[start:end].clamp(0, per_rank - 1)
            picked = x.gather(-1, idx[:, None]).squeeze(-1)
            target_logit[start:end] = torch.where(on_rank[start:end], picked, torch.zeros_like(picked))
        stacked = torch.stack([sum_exp, expected_x, target_logit])
        _all_reduce(stacked, dist.ReduceOp.SUM, group)
        sum_exp, expected_x, target_logit = stacked
        expected_x = expected_x / sum_exp  # E_p[x]
        log_z = log_z + torch.log(sum_exp)
        log_prob = target_logit - log_z
        entropy = log_z - expected_x
        ctx.save_for_backward(logits, targets, log_z, expected_x)
        ctx.config = (temperature, vocab_start, vocab_size, chunk_size)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, targets, log_z, expected_x = ctx.saved_tensors
        temperature, vocab_start, vocab_size, chunk_size = ctx.config
        per_rank = logits.shape[-1]
        grad = torch.empty_like(logits)
        local_t = targets - vocab_start
        on_rank = (local_t >= 0) & (local_t < per_rank)
        g_lp = grad_log_prob.float() if grad_log_prob is not None else torch.zeros_like(log_z)
        g_h = grad_entropy.float() if grad_entropy is not None else torch.zeros_like(log_z)
        for start in range(0, logits.shape[0], chunk_size):
            end = min(logits.shape[0], start + chunk_size)
            x = _scaled_chunk(logits, start, end, temperature, vocab_start, vocab_size)
            p = torch.exp(x - log_z[start:end, None])
            g = -p * g_lp[start:end, None] + p * (expected_x[start:end, None] - x) * g_h[start:end, None]
            rows = torch.nonzero(on_rank[start:end]).squeeze(-1)
            g[rows, local_t[start:end][rows]] += g_lp[start:end][rows]
            grad[start:end] = (g / temperature).to(grad.dtype)
        return grad, None, None, None, None, None


def vocab_parallel_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                                   temperature: float = 1.0, group=None, chunk_size: int = 4096):
    """(log p(target), entropy) per token, both [...] like `targets`, differentiable w.r.t. logits.

    logits: [..., vocab/tp] this TP rank's vocabulary slice (rank r holds columns [r*V/tp, (r+1)*V/tp)).
    targets: [...] global token ids. temperature: the sampling temperature the rollout engine used (logits / T).
    vocab_size: the true vocabulary size; padded columns past it are excluded. group: the TP process group
    (megatron.core.parallel_state.get_tensor_model_parallel_group()); None means the whole vocabulary is local.
    chunk_size: tokens processed at once, which bounds the temporary [chunk, vocab/tp] float32 buffers.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    shape = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    log_prob, entropy = _VocabParallelLogProbEntropy.apply(flat_logits, targets.reshape(-1), float(temperature),
                                                           int(vocab_size), group, int(chunk_size))
    return log_prob.reshape(shape), entropy.reshape(shape)
