"""One optimisation step of a token batch through Megatron's pipeline schedule (PP, VPP, DP grad reduction, grad
clipping in the optimizer), and forward-only log-probs for old/reference policies."""
from __future__ import annotations

import torch

from .. import platform
from ..parallel import last_pipeline_stage
from ..algorithms import AlgorithmConfig
from ..models.forward import causal_inputs, packed_layouts
from ..models.moe import replay_routing
from .fused_linear import head_input, logprob_entropy
from .rl import OBJECTIVES, TokenBatch, make_loss_func, reduce_metrics, values_from_head


def run_schedule(model, micro_batches: list[TokenBatch], loss_func_for, forward_only: bool = False,
                 fused_head: bool = False, pack: bool | None = False, *, pg):
    """get_forward_backward_func() over the micro-batches; loss_func_for(batch, packing) gives each one's loss_func.

    model: one (DDP-wrapped) GPTModel or the list of its virtual-pipeline chunks. fused_head: the last stage skips its
    output layer and hands the loss function a megarl.losses.fused_linear.HeadInput (final hidden states + output
    weight) instead of logits, through GPTModel's output_processor hook (algorithm.fused_logprobs).

    pack=False: the model reads the [b, s] rows as they are; with sequence parallelism they are right-padded to a
    multiple of the TP size first (inert positions, TokenBatch.pad_to_multiple), and loss_func_for sees the padded
    micro-batch with packing None. pack=True (algorithm.pack_sequences): only the model's forward changes. Each
    micro-batch's rows go into one row of their real tokens (megarl.models.forward.PackedLayout: per-sample attention
    and positions, the MoE routing to replay packed the same way), and loss_func_for gets the [b, s] micro-batch with
    its PackedLayout, whose unpack() puts the per-token outputs back on [b, s] before any objective runs.

    pg: megatron-core's ProcessGroupCollection (megarl.parallel.groups().mcore, or megarl.parallel.user_groups() in
    your own Megatron loop), passed to the schedule with a P2PCommunicator on its pipeline group."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

    model = as_chunks(model)
    thd = _thd()
    # TransformerEngine's attention takes no per-sample mask, only THD boundaries: rows that hold several samples
    # (segment_ids, SFT's sft.pack) always run packed there.
    if thd and any(b.segment_ids is not None for b in micro_batches):
        pack = True  # (not `pack or ...`: pack None must reach schedule_layouts as None)
    layouts = schedule_layouts(model, micro_batches, pack, pg=pg)  # pack None: packed unless context parallelism is on
    if layouts and layouts[0] is not None:
        seq_length = max(layout.length for layout in layouts)
        micro_batch_size = max(layout.out_rows for layout in layouts)
    else:
        multiple = _sequence_multiple(model, pg)
        micro_batches = [b.pad_to_multiple(multiple) for b in micro_batches]
        seq_length, micro_batch_size = micro_batches[0].input_ids.shape[1], micro_batches[0].input_ids.shape[0]

    head_kwargs = {"output_processor": head_input} if fused_head else {}

    def forward_step(data_iterator, chunk):
        batch, layout = next(data_iterator)
        routed = batch.routed_experts  # R3: the engine's experts (MoE) to replay, else None
        if layout is None:
            args, kwargs = causal_inputs(batch.input_ids, batch.segment_ids), {}
        else:
            args, kwargs = layout.model_inputs(layout.pack(batch.input_ids), thd)
            routed = layout.pack(routed, repeat_last=True) if routed is not None else None
        with replay_routing(_unwrap(chunk), routed):
            output = chunk(*args, **kwargs, **head_kwargs)
        return output, loss_func_for(batch, layout)

    items = list(zip(micro_batches, layouts))
    iterators = [iter(items) for _ in model] if len(model) > 1 else iter(items)
    groups = {"pg_collection": pg}
    if pg.pp.size() > 1:  # megatron-core's pipelined schedules take explicit groups with their p2p communicator
        groups["p2p_communicator"] = P2PCommunicator(pp_group=pg.pp, config=_unwrap(model[0]).config)
    schedule = get_forward_backward_func(pp_size=pg.pp.size(), vp_size=len(model) if len(model) > 1 else None)
    return schedule(forward_step_func=forward_step, data_iterator=iterators, model=model if len(model) > 1 else model[0],
                    num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=micro_batch_size,
                    forward_only=forward_only, **groups)


def schedule_layouts(model, micro_batches: list[TokenBatch], pack: bool | None, *, pg) -> list:
    """The PackedLayout run_schedule gives each micro-batch (None each when pack is off), packed lengths a multiple of
    the TP size under sequence parallelism. For code that must read per-token results of the forward in packed order
    (e.g. megarl.models.moe.RoutingStats).

    TransformerEngine (GPU): one THD row per micro-batch. The local attention (CPU) has no THD kernel: it builds a
    dense block-causal [length, length] mask, so one row of all the micro-batch's tokens would cost the square of
    their count in attention (measured 8x slower than padding on the quickstart's 256 short rows,
    benchmarks/packing.py). There the rows go into packed rows of at most the padded length instead: attention never
    costs more than padded, and the other layers compute only about the real tokens. With pipeline stages every
    micro-batch of the call gets one packed shape (the p2p activation shape is fixed); without, each keeps its own
    (megatron-core's no-pipelining schedule does not use seq_length / micro_batch_size). pg: as in run_schedule."""
    if pack is None:  # algorithm.pack_sequences unset: packed unless context parallelism is on
        pack = pg.cp.size() == 1
    if not pack:
        return [None] * len(micro_batches)
    if pg.cp.size() > 1:
        raise ValueError(f"algorithm.pack_sequences=true is not wired for context parallelism (parallel.cp="
                         f"{pg.cp.size()}): THD packing would need cu_seqlens padded per CP shard. Fix: set "
                         "algorithm.pack_sequences: false")
    return packed_layouts([b.loss_mask for b in micro_batches], [b.segment_ids for b in micro_batches],
                          _sequence_multiple(as_chunks(model), pg), equal_shapes=pg.pp.size() > 1,
                          row_length=None if _thd() else max(b.input_ids.shape[1] for b in micro_batches))


def _thd() -> bool:
    """True where models are built with the TransformerEngine spec (megarl.models.bridge.ModelBridge.layer_spec: on
    GPU), whose attention takes THD packed sequences."""
    return platform.on_gpu()


def _sequence_multiple(model: list, pg) -> int:
    """Sequence parallelism splits the sequence over the TP ranks: lengths must be a multiple of the TP size."""
    return pg.tp.size() if _unwrap(model[0]).config.sequence_parallel else 1


def _resolve_pack(pack: bool | None, cfg) -> bool | None:
    """An explicit pack, else the algorithm config's algorithm.pack_sequences (its default without a config)."""
    if pack is not None:
        return bool(pack)
    value = getattr(cfg, "pack_sequences", AlgorithmConfig.pack_sequences)
    return None if value is None else bool(value)


def forward_backward(model, global_batch: TokenBatch, num_microbatches: int, cfg, vocab_size: int,
                     objective: str = "rl", pack: bool | None = None, *, pg) -> list:
    """Accumulate gradients of this rank's share of a prepared global batch; returns the loss functions' metrics.
    Log-probs come from the fused output layer unless cfg.fused_logprobs is false (SFT, cfg None: fused). pack:
    packed forward (run_schedule); None: cfg.pack_sequences (cfg None: AlgorithmConfig's default). pg: megatron-core's
    ProcessGroupCollection (as in run_schedule)."""
    model = as_chunks(model)
    micro_batches = global_batch.split(num_microbatches)
    config = _unwrap(model[0]).config
    pack = _resolve_pack(pack, cfg)
    # log-prob objectives: from the fused output layer unless cfg.fused_logprobs is false; the critic's value head
    # is its output layer
    fused = (cfg.fused_logprobs if cfg is not None else True) and OBJECTIVES[objective].reads == "log_probs"
    return run_schedule(model, micro_batches, lambda b, p: make_loss_func(
        b, cfg, num_microbatches=num_microbatches, vocab_size=vocab_size, objective=objective, model_config=config,
        packing=p, pg=pg), fused_head=fused, pack=pack, pg=pg)


def train_step(model, optimizer, global_batch: TokenBatch, num_microbatches: int, cfg, vocab_size: int,
               objective: str = "rl", pack: bool | None = None, *, pg) -> dict:
    """zero grads -> forward/backward over the micro-batches -> optimizer step; globally reduced metrics. A non-finite
    loss or gradient on any rank skips the optimizer step on every rank (weights and optimizer state stay bit-exact
    as they were; metrics: skipped_updates 1.0, grad_norm nan); counting skips in a row is the caller's
    (megarl.trainer.numerics).

    model: the Megatron-DDP-wrapped model (one module or its virtual-pipeline chunks) whose config has
    finalize_model_grads_func set (megarl.trainer.setup.wrap_ddp does both): the schedule then reduces gradients
    over DP and all-reduces the sequence-parallel (norm) gradients over TP. global_batch: prepared by
    prepare_global_batch(). cfg: the AlgorithmConfig (None for objective="sft"). pack, pg: as in forward_backward."""
    model = as_chunks(model)
    _check_finalize(model)
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    per_microbatch = forward_backward(model, global_batch, num_microbatches, cfg, vocab_size, objective, pack, pg=pg)
    # megatron-core skips a step only under fp16 loss scaling; in bf16/fp32 Adam would take a NaN gradient into the
    # weights and the moments for good. So no rank steps unless every rank's loss and gradients are finite. (megarl
    # builds bf16/fp32 optimizers only: under fp16 this check would hide an overflow from megatron's loss scaler.)
    finite = finite_on_every_rank(model, per_microbatch)
    updated, grad_norm, _ = optimizer.step() if finite else (False, None, None)
    metrics = reduce_metrics(per_microbatch, pg)
    metrics.update(grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
                   update_successful=float(bool(updated)), skipped_updates=float(not finite),
                   lr=float(optimizer.param_groups[0]["lr"]))
    return metrics


def finite_on_every_rank(model: list, per_microbatch: list | None) -> bool:
    """True when this rank's losses (last pipeline stage) and gradient buffers hold no NaN / inf, and so does every
    other rank's: one all-reduce (MAX) of a flag over the world, so all ranks skip or step together (a NaN in a
    TP-sharded gradient reaches no other rank by itself). A collective.

    Each gradient buffer is summed rather than tested element-wise: a sum carries any NaN / inf, reads the buffer once
    and allocates nothing the size of the model. It also flags finite gradients so large that their sum overflows;
    their norm overflows before that, so skipping them is right too."""
    import torch.distributed as dist

    sums = [m["loss"].detach().float().sum() for m in per_microbatch or [] if "loss" in m]
    for chunk in model:
        buffers = getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", [])  # Megatron DDP's
        sums += [buffer.grad_data.sum(dtype=torch.float32) for buffer in buffers]
    device = sums[0].device if sums else torch.device("cuda" if platform.on_gpu() else "cpu")
    bad = torch.stack([~torch.isfinite(x) for x in sums]).any().float().reshape(1) if sums \
        else torch.zeros(1, device=device)
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    return not bool(bad.item())


@torch.no_grad()
def forward_only(model, global_batch: TokenBatch, num_microbatches: int, per_token, fused_head: bool = False,
                 pack: bool | None = False, *, pg):
    """per_token(model_output, micro_batch) -> [b, s] for every micro-batch through the forward-only schedule,
    concatenated and masked by loss_mask, with the batch's own sequence length s (padding run_schedule added is cut
    off again); on the last pipeline stage (None elsewhere). fused_head: as in run_schedule. pack: packed forward
    (run_schedule); per_token then gets the packed micro-batch (input_ids, targets, loss_mask as [1, total]) and its
    result is unpacked to [b, s]. pg: as in run_schedule."""

    def loss_func_for(batch, packing):
        def loss_func(output):
            if packing is None:
                values = per_token(output, batch)  # [b, s], or [b, s, n] for n values per token
            else:
                packed = TokenBatch(input_ids=packing.pack(batch.input_ids), targets=packing.pack(batch.targets),
                                    loss_mask=packing.pack(batch.loss_mask))
                values = packing.unpack(per_token(output, packed))
            mask = batch.loss_mask if values.dim() == 2 else batch.loss_mask.unsqueeze(-1)
            return torch.zeros(()), {"values": values * mask}
        return loss_func

    outputs = run_schedule(model, global_batch.split(num_microbatches), loss_func_for, forward_only=True,
                           fused_head=fused_head, pack=pack, pg=pg)
    if not last_pipeline_stage(pg):
        return None
    return torch.cat([o["values"][:, :global_batch.input_ids.shape[1]] for o in outputs])


def holds_results(pg) -> bool:
    """True on the ranks whose forward-only results count once: the last pipeline stage's TP rank 0 (the other TP
    ranks hold copies, the other stages nothing). pg: megatron-core's ProcessGroupCollection."""
    return last_pipeline_stage(pg) and pg.tp.rank() == 0


def compute_log_probs(model, global_batch: TokenBatch, num_microbatches: int, vocab_size: int,
                      temperature: float = 1.0, entropy: bool = False, fused: bool = True, pack: bool | None = None,
                      *, pg):
    """Log-probs [b, s] of the batch's targets under `model` (old or reference policy; one module or its chunks), on
    the last pipeline stage (None elsewhere; every TP rank there holds the same values); positions outside
    loss_mask are 0. Needs only input_ids, targets, loss_mask (and segment_ids when packed). entropy=True:
    (log-probs, entropies of the predicted distribution) from the same forward. fused: compute them from the final
    hidden states and the output weight without materialising the logits (algorithm.fused_logprobs). pack: packed
    forward (algorithm.pack_sequences; None: its default). pg: as in run_schedule."""

    def log_probs(output, batch):
        log_prob, ent = logprob_entropy(output, batch.targets, vocab_size=vocab_size, temperature=temperature,
                                        group=pg.tp)
        return torch.stack([log_prob, ent], dim=-1) if entropy else log_prob

    out = forward_only(model, global_batch, num_microbatches, log_probs, fused_head=fused,
                       pack=_resolve_pack(pack, None), pg=pg)
    return tuple(out.unbind(-1)) if entropy and out is not None else out


def compute_values(model, global_batch: TokenBatch, num_microbatches: int, pack: bool | None = None, *, pg):
    """The critic's values [b, s] on the last pipeline stage (None elsewhere); 0 outside loss_mask. pack, pg: as in
    compute_log_probs."""
    return forward_only(model, global_batch, num_microbatches, lambda output, batch: values_from_head(output),
                        pack=_resolve_pack(pack, None), pg=pg)


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
