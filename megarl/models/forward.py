"""Running the sharded model: inputs for a causal forward, and full-vocabulary logits through Megatron's schedule."""
from __future__ import annotations

import torch


def causal_inputs(input_ids: torch.Tensor, segment_ids: torch.Tensor | None = None):
    """(input_ids, position_ids, attention_mask) for GPTModel; the mask is True where attention is blocked.

    With segment_ids (packed samples numbered from 1 within a row, 0 for padding), attention is causal within each
    sample only and positions restart at every sample, so a packed row computes exactly what the samples would alone.
    """
    batch, seq = input_ids.shape
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=input_ids.device), diagonal=1)
    if segment_ids is None:
        position_ids = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq).contiguous()
        return input_ids, position_ids, causal
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    mask = causal | ~same
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    index = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    start_index = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return input_ids, (index - start_index).contiguous(), mask


@torch.no_grad()
def forward_logits(chunks: list, micro_batches: list[torch.Tensor], vocab_size: int | None = None):
    """Full-vocabulary logits [b, s, vocab] per micro-batch on the last pipeline stage (None on other stages).

    Runs Megatron's forward-only pipeline schedule (PP/VPP), gathers the vocab-parallel logits over the TP group and
    drops the padded vocabulary rows when vocab_size is given. Meant for checks and probes: training never gathers
    the vocabulary.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def forward_step(data_iterator, model):
        output = model(*causal_inputs(next(data_iterator)))

        def keep_logits(logits):
            full = gather_from_tensor_model_parallel_region(logits)
            if vocab_size is not None:
                full = full[..., :vocab_size]
            return torch.zeros((), device=logits.device), {"logits": full}

        return output, keep_logits

    # Sequence parallelism splits the sequence over TP ranks: right-pad to a multiple of TP (causal attention keeps
    # the real positions unaffected) and cut the padding off the logits again.
    tp = ps.get_tensor_model_parallel_world_size()
    lengths = [b.shape[1] for b in micro_batches]
    micro_batches = [torch.nn.functional.pad(b, (0, -b.shape[1] % tp)) for b in micro_batches]
    seq_length = micro_batches[0].shape[1]
    iterators = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    for chunk in chunks:
        chunk.eval()
    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators, model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=micro_batches[0].shape[0],
        forward_only=True)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return [r["logits"][:, :n] for r, n in zip(results, lengths)]
