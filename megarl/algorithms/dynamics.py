"""RL-dynamics metrics over the model's parameters: update sparsity, the fraction of parameters whose bf16 value an
RL step changed (RL updates touch a small subnetwork, "Reinforcement Learning Finetunes Small Subnetworks in Large
Language Models", arXiv:2505.11711). The entropy split of high- vs low-entropy tokens is
megarl.algorithms.token_selection.entropy_split.

Each parameter element is counted once over the whole job: within a model-parallel group by megatron-core's own
rule for the gradient norm (param_is_not_shared: the tied embedding's copy on the last pipeline stage is skipped;
param_is_not_tensor_parallel_duplicate: a parameter not sharded over TP, e.g. a norm, counts on TP rank 0 only), and
data-parallel replicas, which hold identical values, on DP rank 0 only (expert parameters: expert-DP rank 0). The
rows Megatron pads the vocabulary with (their number depends on TP) are not counted. The counts are summed over
every rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def counts_here(param, dp_rank: int, expert_dp_rank: int) -> bool:
    """Whether this rank counts `param` (a Megatron parameter with its parallel attributes), see the docstring."""
    from megatron.core.tensor_parallel.layers import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.module import param_is_not_shared

    expert = not getattr(param, "allreduce", True)  # Megatron marks expert parameters allreduce=False
    return (expert_dp_rank if expert else dp_rank) == 0 and param_is_not_shared(param) and \
        param_is_not_tensor_parallel_duplicate(param)


def bf16_snapshot(params) -> list[torch.Tensor]:
    """bf16 copies of the parameters (2 bytes per parameter of extra memory while the step runs)."""
    return [p.detach().to(torch.bfloat16).clone() for p in params]


def changed_counts(params, before: list[torch.Tensor], counted: list[bool], rows: list | None = None):
    """float64 [changed, total] over the counted parameters: elements whose bf16 value differs from `before`;
    rows[i] (None: all) limits parameter i to its first rows (a vocabulary shard without its padding)."""
    out = torch.zeros(2, dtype=torch.float64)
    for i, (p, b, here) in enumerate(zip(params, before, counted)):
        if here:
            keep = slice(None) if rows is None or rows[i] is None else slice(0, rows[i])
            out[0] += float((p.detach()[keep].to(torch.bfloat16) != b[keep]).sum())
            out[1] += p.detach()[keep].numel()
    return out


def kl_sums(log_prob: torch.Tensor, initial_log_prob: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Forgetting: float64 [sum k3, sum k1, tokens] of KL(pi || pi_initial) estimated on tokens sampled from pi
    (megarl.algorithms.kl: k1 = log pi - log pi_0, k3 = exp(-k1) + k1 - 1), over the masked tokens; sum over ranks
    and divide by the tokens."""
    from .kl import kl_estimate

    return torch.stack([(kl_estimate(log_prob, initial_log_prob, "k3") * mask).sum(),
                        ((log_prob - initial_log_prob) * mask).sum(), mask.sum()]).double()


class UpdateSparsity:
    """snapshot() before the updates, changed() after (a collective over every rank): (elements whose bf16 value
    changed in between, elements of the model), each element counted once (see the module docstring); the update
    sparsity is 1 - changed / total."""

    def __init__(self, chunks, pg, vocab_size: int | None = None):
        """pg: megatron-core's ProcessGroupCollection of the model's layout."""
        named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
        self.params = [p for _, p in named]
        dp_rank, expert_dp_rank = pg.dp.rank(), pg.expt_dp.rank()
        self.counted = [counts_here(p, dp_rank, expert_dp_rank) for p in self.params]
        tp_rank = pg.tp.rank()
        # the vocabulary-parallel embedding / output layer: this TP rank's rows below vocab_size
        self.rows = [max(0, min(p.shape[0], vocab_size - tp_rank * p.shape[0]))
                     if vocab_size is not None and n.endswith(("word_embeddings.weight", "output_layer.weight"))
                     else None for n, p in named]
        self.before = None

    def snapshot(self) -> "UpdateSparsity":
        self.before = bf16_snapshot(self.params)
        return self

    def changed(self) -> tuple[float, float]:
        counts = changed_counts(self.params, self.before, self.counted, self.rows)
        self.before = None
        dist.all_reduce(counts)
        return float(counts[0]), float(counts[1])
