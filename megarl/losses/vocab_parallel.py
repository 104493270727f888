"""Token log-probabilities and entropy over vocab-parallel logits, without gathering the vocabulary.

Each TP rank holds logits for its slice of the (padded) vocabulary: [tokens, vocab/tp]. The log-partition function
needs a max and a sum over the whole vocabulary: two all-reduces of a few numbers per token; the target's
logit lives on exactly one rank. The forward pass reads the logits once: each rank sums exp(x - m) and
exp(x - m) * (x - m) per token (m: its local max), then the sums are rescaled to the global max and all-reduced. The backward pass is
written out (d logp/dx = onehot - p, dH/dx = p (-H - log p)) and recomputes p chunk by chunk from the saved logits, so
no [tokens, vocab/tp] probability tensor is ever stored. Columns at or past `vocab_size` (Megatron's vocabulary padding) are excluded.

Call it on the last pipeline stage, inside the loss function, with the raw logits of the model's output layer.
The per-chunk pieces (_prepare, _chunk_sums, _combine, _chunk_grad) are shared with megarl.losses.fused_linear, which
computes the same from the final hidden states and the output weight without ever holding the logits.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_NEG = -1e30  # stands for -inf: exp() gives 0 and 0 * _NEG stays finite (0 * -inf would be nan)


def _prepare(x, temperature, vocab_start, vocab_size, *, owned, writable=False):
    """float32 x / temperature for a [tokens, vocab/tp] chunk of this rank's logits, padded columns (at or past
    vocab_size) set to _NEG. owned: x is the caller's temporary and may be overwritten; otherwise a fresh buffer is made
    when it must be modified (temperature, padding, or writable=True) and x itself may come back."""
    if x.dtype != torch.float32:
        x, owned = x.float(), True  # .float() copies exactly when the dtype changes
    padded_from = vocab_size - vocab_start
    padded = padded_from < x.shape[-1]
    if (writable or padded or temperature != 1.0) and not owned:
        x = x.clone()
    if temperature != 1.0:
        x.div_(temperature)
    if padded:
        x[:, max(padded_from, 0):] = _NEG
    return x


def _target_slots(targets, vocab_start, per_rank):
    """(column of each target in this rank's slice, clamped to a valid index; whether the target is on this rank),
    both shaped like targets ([tokens, K]: K targets per token)."""
    local_t = targets - vocab_start
    on_rank = (local_t >= 0) & (local_t < per_rank)
    return local_t.clamp(0, per_rank - 1), on_rank


def _chunk_sums(x, local_t, on_rank, overwrite=False, scratch=None):
    """Per token of a prepared chunk x [c, vocab/tp] (overwritten when `overwrite`) with K targets each (local_t,
    on_rank: [c, K]): its max m over this rank's columns, and [sum exp(x - m), sum exp(x - m) * (x - m), each target's
    x (0 when it is not on this rank)] as a [2 + K, c] tensor. scratch: an x-sized float32 buffer to reuse for
    exp(x - m) (None: a new tensor)."""
    picked = x.gather(-1, local_t)
    m = x.amax(dim=-1)
    # <= 0: sums relative to the max keep the entropy free of cancellation
    shifted = x.sub_(m[:, None]) if overwrite else x - m[:, None]
    e = torch.exp(shifted, out=scratch) if scratch is not None else shifted.exp()
    sum_e = e.sum(-1)
    return m, torch.cat([torch.stack([sum_e, e.mul_(shifted).sum(-1)]),  # sum e*(x-m) in e's buffer (faster than a dot)
                      torch.where(on_rank, picked, torch.zeros_like(picked)).t()])


def _rescale(sums, offset):
    """_chunk_sums' [2 + K, c] sums relative to a max m, moved in place to a max M >= m (offset = m - M <= 0):
    sum exp(x - M) = scale s, sum exp(x - M) (x - M) = scale (A + offset s), with scale = exp(offset)."""
    scale = torch.exp(offset)
    sums[1] = scale * (sums[1] + offset * sums[0])
    sums[0] *= scale
    return sums


def _merge(max_a, sums_a, max_b, sums_b):
    """The sums of two column blocks of the same tokens (each relative to its own max) as one: (max, [2 + K, c])."""
    top = torch.maximum(max_a, max_b)
    return top, _rescale(sums_a, max_a - top).add_(_rescale(sums_b, max_b - top))


def _combine(local_max, sums, group):
    """(log p(target) [c, K], entropy [c], log Z [c]) from every rank's _chunk_sums (two small all-reduces over group).

    Combine the ranks at the global max M (_rescale): S = sum_r scale_r s_r, sum_j p_j (x_j - M) =
    sum_r scale_r (A_r + (m_r - M) s_r) / S, with scale_r = exp(m_r - M)."""
    global_max = _all_reduce(local_max.clone(), dist.ReduceOp.MAX, group)
    _all_reduce(_rescale(sums, local_max - global_max), dist.ReduceOp.SUM, group)
    sum_exp, sum_p_shifted, target_logits = sums[0], sums[1], sums[2:]
    log_z = global_max + torch.log(sum_exp)
    return (target_logits - log_z).t(), torch.log(sum_exp) - sum_p_shifted / sum_exp, log_z  # H = log S - E_p[x - M]


def _chunk_grad(y, log_z, entropy, g_lp, g_h, local_t, on_rank, temperature, scratch=None):
    """d(sum_k g_lp[:, k] log p(target k) + g_h H)/d(raw logits) of a chunk (g_lp, local_t, on_rank: [c, K]), from its
    prepared writable copy y (overwritten and returned). scratch: a y-sized float32 buffer to reuse for p (None: a new
    tensor)."""
    y = y.sub_(log_z[:, None])  # log p
    p = torch.exp(y, out=scratch) if scratch is not None else y.exp()
    # dlogp_k/dx = onehot_k - p; dH/dx = p (E[x] - x) = p (-H - log p).
    # g = p (g_h (-H - log p) - sum_k g_lp_k) + sum_k g_lp_k onehot_k: three passes over the chunk, then the targets
    g = y.mul_(-g_h[:, None]).sub_((g_h * entropy + g_lp.sum(-1))[:, None]).mul_(p)
    g.scatter_add_(1, local_t, torch.where(on_rank, g_lp, torch.zeros_like(g_lp)))  # adds up repeated targets
    if temperature != 1.0:
        g.div_(temperature)
    return g


def _all_reduce(t, op, group):
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _tp_rank(group) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def _output_grads(grad_log_prob, grad_entropy, targets, entropy):
    return (grad_log_prob.float() if grad_log_prob is not None else torch.zeros_like(targets, dtype=torch.float32),
            grad_entropy.float() if grad_entropy is not None else torch.zeros_like(entropy))


def _flat_targets(targets, lead_shape, source="logits"):
    """targets shaped like the logits (or hidden states: `source`) without their last dimension (one per position)
    or with a trailing K (K per position) -> ([tokens, K], the shape log p comes back in)."""
    lead_shape = tuple(lead_shape)
    if tuple(targets.shape) == lead_shape:
        return targets.reshape(-1, 1), lead_shape
    if targets.dim() == len(lead_shape) + 1 and tuple(targets.shape[:-1]) == lead_shape:
        return targets.reshape(-1, targets.shape[-1]), tuple(targets.shape)
    raise ValueError(f"targets {list(targets.shape)} do not match the positions {list(lead_shape)} of the {source}: "
                     "one target per position, or K per position in a trailing dimension")


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, vocab_size, group, chunk_size):
        per_rank = logits.shape[-1]
        vocab_start = _tp_rank(group) * per_rank
        n = logits.shape[0]
        local_max = torch.empty(n, dtype=torch.float32, device=logits.device)
        sums = torch.zeros(2 + targets.shape[1], n, dtype=torch.float32, device=logits.device)
        local_t, on_rank = _target_slots(targets, vocab_start, per_rank)
        for start in range(0, n, chunk_size):  # one pass over the logits
            end = min(n, start + chunk_size)
            x = _prepare(logits[start:end], temperature, vocab_start, vocab_size, owned=False)
            local_max[start:end], sums[:, start:end] = _chunk_sums(x, local_t[start:end], on_rank[start:end])
        log_prob, entropy, log_z = _combine(local_max, sums, group)
        ctx.save_for_backward(logits, targets, log_z, entropy)
        ctx.config = (temperature, vocab_start, vocab_size, chunk_size)
        return log_prob, entropy

    @staticmethod
    def backward(ctx, grad_log_prob, grad_entropy):
        logits, targets, log_z, entropy = ctx.saved_tensors
        temperature, vocab_start, vocab_size, chunk_size = ctx.config
        grad = torch.empty_like(logits)
        local_t, on_rank = _target_slots(targets, vocab_start, logits.shape[-1])
        g_lp, g_h = _output_grads(grad_log_prob, grad_entropy, targets, entropy)
        for start in range(0, logits.shape[0], chunk_size):
            end = min(logits.shape[0], start + chunk_size)
            y = _prepare(logits[start:end], temperature, vocab_start, vocab_size, owned=False, writable=True)
            grad[start:end] = _chunk_grad(y, log_z[start:end], entropy[start:end], g_lp[start:end], g_h[start:end],
                                          local_t[start:end], on_rank[start:end], temperature)
        return grad, None, None, None, None, None


def vocab_parallel_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, *, vocab_size: int,
                                   temperature: float = 1.0, group=None, chunk_size: int | None = None,
                                   chunk_bytes: int = 32 << 20):
    """(log p(target), entropy) per position, differentiable w.r.t. logits: [...] each, or with K targets per position
    ([..., K] targets) log p [..., K] and entropy [...], from one pass over the logits.

    logits: [..., vocab/tp] this TP rank's vocabulary slice (rank r holds columns [r*V/tp, (r+1)*V/tp)).
    targets: [...] or [..., K] global token ids. temperature: the sampling temperature the rollout engine used
    (logits / T).
    vocab_size: the true vocabulary size; padded columns past it are excluded. group: the TP process group
    (pg.tp of megatron-core's ProcessGroupCollection); None means the whole vocabulary is local.
    chunk_size: tokens processed at once; by default as many as fit `chunk_bytes` per [chunk, vocab/tp] float32
    temporary (32 MiB: ~55 tokens of a 151,936-token vocabulary at TP=1), which bounds the extra memory.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    flat_targets, lp_shape = _flat_targets(targets, logits.shape[:-1])
    flat_logits = logits.reshape(-1, logits.shape[-1])
    if chunk_size is None:
        chunk_size = max(1, chunk_bytes // (4 * flat_logits.shape[-1]))
    log_prob, entropy = _VocabParallelLogProbEntropy.apply(flat_logits, flat_targets, float(temperature),
                                                           int(vocab_size), group, int(chunk_size))
    return log_prob.reshape(lp_shape), entropy.reshape(logits.shape[:-1])
