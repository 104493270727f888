"""One optimisation step of a token batch through Megatron's pipeline schedule (PP, VPP, DP grad reduction, grad
clipping in the optimizer), and forward-only log-probs for old/reference policies."""
from __future__ import annotations

import torch

from ..models.forward import causal_inputs
from ..models.moe import replay_routing
from .fused_linear import head_input, logprob_entropy
from .rl import TokenBatch, make_loss_func, make_value_loss_func, reduce_metrics, values_from_head


def run_schedule(model, micro_batches: list[TokenBatch], loss_func_for, forward_only: bool = False,
                 fused_head: bool = False):
    """get_forward_backward_func() over the micro-batches; loss_func_for(batch) gives each one's loss_func.

    model: one (DDP-wrapped) GPTModel or the list of its virtual-pipeline chunks. With sequence parallelism the
    micro-batches are right-padded to a multiple of the TP size first (inert positions, TokenBatch.pad_to_multiple),
    so any sequence length works; loss_func_for sees the padded micro-batch. fused_head: the last stage skips its
    output layer and hands the loss function a megarl.losses.fused_linear.HeadInput (final hidden states + output
    weight) instead of logits, through GPTModel's output_processor hook (algorithm.fused_logprobs)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model = as_chunks(model)
    if _unwrap(model[0]).config.sequence_parallel:
        tp = ps.get_tensor_model_parallel_world_size()
        micro_batches = [b.pad_to_multiple(tp) for b in micro_batches]

    head_kwargs = {"output_processor": head_input} if fused_head else {}

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        with replay_routing(_unwrap(chunk), batch.routed_experts):  # R3: the engine's experts (MoE), else no-op
            output = chunk(*causal_inputs(batch.input_ids, batch.segment_ids), **head_kwargs)
        return output, loss_func_for(batch)

    iterators = [iter(micro_batches) for _ in model] if len(model) > 1 else iter(micro_batches)
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators, model=model if len(model) > 1 else model[0],
        num_microbatches=len(micro_batches), seq_length=micro_batches[0].input_ids.shape[1],
        micro_batch_size=micro_batches[0].input_ids.shape[0], forward_only=forward_only)


def forward_backward(model, global_batch: TokenBatch, num_microbatches: int, cfg, vocab_size: int,
                     objective: str = "rl") -> list:
    """Accumulate gradients of this rank's share of a prepared global batch; returns the loss functions' metrics.
    Log-probs come from the fused output layer unless cfg.fused_logprobs is false (SFT, cfg None: fused)."""
    model = as_chunks(model)
    micro_batches = global_batch.split(num_microbatches)
    config = _unwrap(model[0]).config
    if objective == "value":  # the critic: its "logits" are the value head's output
        return run_schedule(model, micro_batches, lambda b: make_value_loss_func(b, cfg,
                                                                                 num_microbatches=num_microbatches))
    fused = cfg.fused_logprobs if cfg is not None else True
    return run_schedule(model, micro_batches, lambda b: make_loss_func(
        b, cfg, num_microbatches=num_microbatches, vocab_size=vocab_size, objective=objective, model_config=config),
        fused_head=fused)


def train_step(model, optimizer, global_batch: TokenBatch, num_microbatches: int, cfg, vocab_size: int,
               objective: str = "rl") -> dict:
    """zero grads -> forward/backward over the micro-batches -> optimizer step; globally reduced metrics.

    model: the Megatron-DDP-wrapped model (one module or its virtual-pipeline chunks) whose config has
    finalize_model_grads_func set (megarl.trainer.setup.wrap_ddp does both): the schedule then reduces gradients
    over DP and all-reduces the sequence-parallel (norm) gradients over TP. global_batch: prepared by
    prepare_global_batch(). cfg: the AlgorithmConfig (None for objective="sft")."""
    model = as_chunks(model)
    _check_finalize(model)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    per_microbatch = forward_backward(model, global_batch, num_microbatches, cfg, vocab_size, objective)
    updated, grad_norm, _ = optimizer.step()
    metrics = reduce_metrics(per_microbatch)
    metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                   update_successful=float(bool(updated)), lr=float(optimizer.param_groups[0]["lr"]))
    return metrics


@torch.no_grad()
def forward_only(model, global_batch: TokenBatch, num_microbatches: int, per_token, fused_head: bool = False):
    """per_token(model_output, micro_batch) -> [b, s] for every micro-batch through the forward-only schedule,
    concatenated and masked by loss_mask, with the batch's own sequence length s (padding run_schedule added is cut
    off again); on the last pipeline stage (None elsewhere). fused_head: as in run_schedule."""
    from megatron.core import parallel_state as ps

    def loss_func_for(batch):
        def loss_func(output):
            values = per_token(output, batch)  # [b, s], or [b, s, n] for n values per token
            mask = batch.loss_mask if values.dim() == 2 else batch.loss_mask.unsqueeze(-1)
            return torch.zeros(()), {"values": values * mask}
        return loss_func

    outputs = run_schedule(model, global_batch.split(num_microbatches), loss_func_for, forward_only=True,
                           fused_head=fused_head)
    if not ps.is_pipeline_last_stage(ignore_virtual=True):
        return None
    return torch.cat([o["values"] for o in outputs])[:, :global_batch.input_ids.shape[1]]


def holds_results() -> bool:
    """True on the ranks whose forward-only results count once: the last pipeline stage's TP rank 0 (the other TP
    ranks hold copies, the other stages nothing)."""
    from megatron.core import parallel_state as ps

    return ps.is_pipeline_last_stage(ignore_virtual=True) and ps.get_tensor_model_parallel_rank() == 0


def compute_log_probs(model, global_batch: TokenBatch, num_microbatches: int, vocab_size: int,
                      temperature: float = 1.0, entropy: bool = False, fused: bool = True):
    """Log-probs [b, s] of the batch's targets under `model` (old or reference policy; one module or its chunks), on
    the last pipeline stage (None elsewhere; every TP rank there holds the same values); positions outside
    loss_mask are 0. Needs only input_ids, targets, loss_mask (and segment_ids when packed). entropy=True:
    (log-probs, entropies of the predicted distribution) from the same forward. fused: compute them from the final
    hidden states and the output weight without materialising the logits (algorithm.fused_logprobs)."""
    from megatron.core import parallel_state as ps

    def log_probs(output, batch):
        log_prob, ent = logprob_entropy(output, batch.targets, vocab_size=vocab_size, temperature=temperature,
                                        group=ps.get_tensor_model_parallel_group())
        return torch.stack([log_prob, ent], dim=-1) if entropy else log_prob

    out = forward_only(model, global_batch, num_microbatches, log_probs, fused_head=fused)
    return tuple(out.unbind(-1)) if entropy and out is not None else out


def compute_values(model, global_batch: TokenBatch, num_microbatches: int):
    """The critic's values [b, s] on the last pipeline stage (None elsewhere); 0 outside loss_mask."""
    return forward_only(model, global_batch, num_microbatches, lambda output, batch: values_from_head(output))


def as_chunks(model) -> list:
    """[model] for one module, the list itself for virtual-pipeline chunks."""
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _check_finalize(model: list) -> None:
    """Without finalize_model_grads the schedule never reduces gradients over DP nor all-reduces the
    sequence-parallel norm gradients over TP: TP replicas would silently drift apart."""
    config = _unwrap(model[0]).config
    if config.finalize_model_grads_func is None or not hasattr(model[0], "zero_grad_buffer"):
        raise ValueError("train_step needs the model wrapped in Megatron DDP with config.finalize_model_grads_func "
                         "set (otherwise DP and sequence-parallel gradients are never reduced). Fix: "
                         "model = megarl.trainer.setup.wrap_ddp(chunks), or set both yourself (docs/losses.md)")


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model
