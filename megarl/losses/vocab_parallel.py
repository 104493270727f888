"""Token log-probabilities and entropy over vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice of the (padded) vocabulary: [tokens, vocab/tp]. The log-partition function
needs a max and a sum over the whole vocabulary: two all-reduces of a few numbers per token; the target's
logit lives on exactly one rank. The forward pass reads the logits once: each rank sums exp(x - m) and
exp(x - m) * (x - m) per token (m: its local max), then the sums are rescaled to the global max and all-reduced. The backward pass is
written out (d logp/dx = onehot - p, dH/dx = p (-H - log p)) and recomputes p chunk by chunk from the saved logits, so
no [tokens, vocab/tp] probability tensor is ever stored. Columns at or past `vocab_size` (Megatron's vocabulary padding) are excluded.

Call it on the last pipeline stage, inside the loss function, with the raw logits of the model's output layer.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_NEG = -1e30  # stands for -inf: exp() gives 0 and 0 * _NEG stays finite (0 * -inf would be nan)


def _scaled_chunk(logits, start, end, temperature, vocab_start, vocab_size, writable=False):
    """float32 logits[start:end] / temperature with padded columns set to _NEG; a fresh buffer when it must be
    modified (padding, or writable=True), otherwise possibly a view of the logits."""
    x = logits[start:end].float()
    padded_from = vocab_size - vocab_start
    fresh = logits.dtype != torch.float32  # .float() copies exactly when the dtype changes
    if temperature != 1.0:
        x, fresh = x / temperature, True
    if (writable or padded_from < x.shape[-1]) and not fresh:
        x = x.clone()
    if padded_from < x.shape[-1]:
        x[:, max(padded_from, 0):] = _NEG
    return x


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
        local_max = torch.empty(n, dtype=torch.float32, device=logits.device)
        # Per token, over this rank's columns, relative to the local max: sum exp, sum exp*x, and the target's x.
        sums = torch.zeros(3, n, dtype=torch.float32, device=logits.device)
        local_t = targets - vocab_start
        on_rank = (local_t >= 0) & (local_t < per_rank)
        for start in range(0, n, chunk_size):  # one pass over the logits
            end = min(n, start + chunk_size)
            x = _scaled_chunk(logits, start, end, temperature, vocab_start, vocab_size)
            m = x.max(dim=-1).values
            shifted = x - m[:, None]  # <= 0: sums relative to the max keep the entropy free of cancellation
            e = shifted.exp()
            local_max[start:end] = m
            sums[0, start:end] = e.sum(-1)
            sums[1, start:end] = torch.einsum("ij,ij->i", e, shifted)  # sum e*(x-m), no [chunk, V] temporary
            picked = x.gather(-1, local_t[start:end].clamp(0, per_rank - 1)[:, None]).squeeze(-1)
            sums[2, start:end] = torch.where(on_rank[start:end], picked, torch.zeros_like(picked))
        # Combine the ranks at the global max M: S = sum_r scale_r s_r, sum_j p_j (x_j - M) =
        # sum_r scale_r (A_r + (m_r - M) s_r) / S, with scale_r = exp(m_r - M).
        global_max = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, group)
        offset = local_max - global_max
        scale = torch.exp(offset)
        sums[1] = scale * (sums[1] + offset * sums[0])
        sums[0] *= scale
        _all_reduce(sums, dist.ReduceOp.SUM, group)
        sum_exp, sum_p_shifted, target_logit = sums
        log_z = global_max + torch.log(sum_exp)
        log_prob = target_logit - log_z
        entropy = torch.log(sum_exp) - sum_p_shifted / sum_exp  # H = log S - E_p[x - M]
        ctx.save_for_backward(logits, targets, log_z, entropy)
        ctx.config = (temperature, vocab_start, vocab_size, chunk_size)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, targets, log_z, entropy = ctx.saved_tensors
        temperature, vocab_start, vocab_size, chunk_size = ctx.config
        per_rank = logits.shape[-1]
        grad = torch.empty_like(logits)
        local_t = targets - vocab_start
        on_rank = (local_t >= 0) & (local_t < per_rank)
        g_lp = grad_log_prob.float() if grad_log_prob is not None else torch.zeros_like(log_z)
        g_h = grad_entropy.float() if grad_entropy is not None else torch.zeros_like(log_z)
        for start in range(0, logits.shape[0], chunk_size):
            end = min(logits.shape[0], start + chunk_size)
            y = _scaled_chunk(logits, start, end, temperature, vocab_start, vocab_size, writable=True)
            y = y.sub_(log_z[start:end, None])  # log p
            p = y.exp()
            # dlogp/dx = onehot - p; dH/dx = p (E[x] - x) = p (-H - log p). g = p (g_h (-H - log p) - g_lp)
            g = y.neg_().sub_(entropy[start:end, None]).mul_(g_h[start:end, None])
            g = g.sub_(g_lp[start:end, None]).mul_(p)
            rows = torch.nonzero(on_rank[start:end]).squeeze(-1)
            g[rows, local_t[start:end][rows]] += g_lp[start:end][rows]
            if temperature != 1.0:
                g.div_(temperature)
            grad[start:end] = g
        return grad, None, None, None, None, None


def vocab_parallel_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                                   temperature: float = 1.0, group=None, chunk_size: int | None = None,
                                   chunk_bytes: int = 32 << 20):
    """(log p(target), entropy) per token, both [...] like `targets`, differentiable w.r.t. logits.

    logits: [..., vocab/tp] this TP rank's vocabulary slice (rank r holds columns [r*V/tp, (r+1)*V/tp)).
    targets: [...] global token ids. temperature: the sampling temperature the rollout engine used (logits / T).
    vocab_size: the true vocabulary size; padded columns past it are excluded. group: the TP process group
    (megatron.core.parallel_state.get_tensor_model_parallel_group()); None means the whole vocabulary is local.
    chunk_size: tokens processed at once; by default as many as fit `chunk_bytes` per [chunk, vocab/tp] float32
    temporary (32 MiB: ~55 tokens of a 151,936-token vocabulary at TP=1), which bounds the extra memory.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    shape = targets.shape
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if chunk_size is None:
        chunk_size = max(1, chunk_bytes // (4 * flat_logits.shape[-1]))
    log_prob, entropy = _VocabParallelLogProbEntropy.apply(flat_logits, targets.reshape(-1), float(temperature),
                                                           int(vocab_size), group, int(chunk_size))
    return log_prob.reshape(shape), entropy.reshape(shape)
