"""LoRA adapters on the Megatron linear layers of a built model, tensor-parallel exact, and PEFT export / import.

An adapter adds scale * B(A(dropout(x))) to a frozen linear layer's output (scale = alpha / rank, PEFT's scaling).
It follows Megatron-Bridge's ParallelLinearAdapter (megatron-core 0.19.2 has no LoRA layer of its own): A and B sit
next to the frozen tensor-parallel weight and are split the way that needs no extra gather of the layer's output.

- Column-parallel layer (linear_qkv, linear_fc1; weight [out/tp, in]): A [rank, in] whole on every TP rank, B
  [out/tp, rank] split by output rows like the weight. A's output h is replicated, so its backward is an all-reduce
  over TP (copy_to_tensor_model_parallel_region, as the layer does for its own input); with sequence parallelism the
  layer's input holds s/tp tokens, so h is all-gathered along the sequence (backward: reduce-scatter) and A's gradient,
  from this rank's tokens only, is summed over TP by finalize_model_grads (A is tagged `sequence_parallel`).
- Row-parallel layer (linear_proj, linear_fc2; weight [out, in/tp]): A [rank, in/tp] split by input columns like the
  weight, B [out, rank] whole. A's outputs are partial sums, reduced over TP (all-reduce, or reduce-scatter along the
  sequence under sequence parallelism, where B's per-token-slice gradient is then summed over TP: B is tagged).

Either way the output equals TP=1's: the adapter's weight delta scale * B @ A is exactly the TP shard of the full
delta (ColumnParallel: rows of B; RowParallel: columns of A), which is also how merged_weight() merges it.

HF names -> Megatron's fused layers: q_proj, k_proj, v_proj -> self_attention.linear_qkv; o_proj ->
self_attention.linear_proj; gate_proj, up_proj -> mlp.linear_fc1; down_proj -> mlp.linear_fc2. A fused layer carries
one adapter (one A, one B over all fused rows), so its HF names come as a group: name all of q/k/v (or gate/up) or
none of them. In PEFT's format a fused adapter is one adapter per projection that share A: lora_A of q_proj, k_proj
and v_proj is the same A, and lora_B of each is B's rows for that projection, in HF layout (mbridge's QKV / gate-up
row mapping, the one used for the weights). B_q @ A is then exactly the q rows of the fused delta, so PEFT computes
the same outputs. Importing needs the shared A (a PEFT adapter trained with separate q/k/v A's is refused).

MoE models: `experts.gate_up_proj` and `experts.down_proj` (PEFT's target_parameters names of transformers' fused
expert tensors) put one adapter on each routed expert's linear_fc1 / linear_fc2 (megatron-core's SequentialMLP),
A seeded by the global expert index. Expert layers use the expert-TP group, and under expert TP / EP the token
dispatcher does their communication (input gathered over expert TP, outputs summed): the adapter adds none of its own
in the forward, and its whole factor's partial gradient is all-reduced over expert TP. A and B carry the layer
weight's `allreduce` mark, so DDP reduces them over the expert-data-parallel group. PEFT's format for them: lora_moe.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import weakref
import zlib
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..config import ConfigError
from . import lora_moe

# HF module name -> Megatron layer (path inside a decoder layer) that holds its weight
HF_TO_MEGATRON = {"q_proj": "self_attention.linear_qkv", "k_proj": "self_attention.linear_qkv",
                  "v_proj": "self_attention.linear_qkv", "o_proj": "self_attention.linear_proj",
                  "gate_proj": "mlp.linear_fc1", "up_proj": "mlp.linear_fc1", "down_proj": "mlp.linear_fc2",
                  # an MoE model's routed experts: PEFT's target_parameters names of transformers' fused expert tensors
                  "experts.gate_up_proj": "mlp.experts.linear_fc1", "experts.down_proj": "mlp.experts.linear_fc2"}
EXPERT_PATHS = ("mlp.experts.linear_fc1", "mlp.experts.linear_fc2")  # one adapter per local expert (lora_moe)
ADAPTER = "lora_adapter"  # the adapter's submodule name on its linear layer (parameters: <layer>.lora_adapter.A / B)


class LoraConfigError(ConfigError):
    pass


@dataclass
class LoraConfig:
    rank: int = 8
    alpha: float = 16.0  # scale = alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # on the adapter's input only (PEFT's lora_dropout)
    target_modules: list = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    seed: int = 0  # A's gaussian init: a function of (seed, layer, module) only, so every TP/PP layout gets the same A
    load: Optional[str] = None  # start from this PEFT adapter folder (its r / lora_alpha / targets must match)

    def __post_init__(self):
        if not isinstance(self.rank, int) or self.rank < 1:
            raise LoraConfigError(f"model.lora.rank must be an integer >= 1, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraConfigError(f"model.lora.dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str) or not self.target_modules:
            raise LoraConfigError("model.lora.target_modules must be a non-empty list of HF module names, e.g. "
                                  f"[q_proj, k_proj, v_proj, o_proj]; got {self.target_modules!r}")
        self.target_modules = list(dict.fromkeys(self.target_modules))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def valid_targets(config) -> list[str]:
    """The HF module names LoRA can target in a model with this TransformerConfig. MoE models: attention and the routed
    experts (experts.gate_up_proj, experts.down_proj; not yet the shared experts or the dense layers of a mixed model);
    multi-latent attention has no fused linear_qkv."""
    names = []
    if not config.multi_latent_attention:
        names += ["q_proj", "k_proj", "v_proj", "o_proj"]
    if not config.num_moe_experts:
        names += ["gate_proj", "up_proj", "down_proj"] if config.gated_linear_unit else ["up_proj", "down_proj"]
    elif config.gated_linear_unit:  # transformers' fused gate_up_proj exists for gated experts only
        names += ["experts.gate_up_proj", "experts.down_proj"]
    return names


def megatron_targets(cfg: LoraConfig, config) -> list[str]:
    """cfg.target_modules -> Megatron layer paths; one line naming the valid names on a bad one or a split group."""
    valid = valid_targets(config)
    bad = [n for n in cfg.target_modules if n not in valid]
    if bad:
        raise LoraConfigError(f"model.lora.target_modules: {', '.join(map(str, bad))} not a LoRA target of this model; "
                              f"valid names: {', '.join(valid) or '(none)'}")
    paths = []
    for name in cfg.target_modules:
        path = HF_TO_MEGATRON[name]
        group = [n for n in valid if HF_TO_MEGATRON[n] == path]
        missing = [n for n in group if n not in cfg.target_modules]
        if missing:
            raise LoraConfigError(f"model.lora.target_modules: {', '.join(group)} share Megatron's fused {path} "
                                  f"(one adapter): name all of them or none (missing {', '.join(missing)})")
        if path not in paths:
            paths.append(path)
    return paths


class LoraAdapter(torch.nn.Module):
    """scale * B(A(dropout(x))) for one frozen Megatron linear layer (see the module docstring for the TP layout)."""

    def __init__(self, layer, cfg: LoraConfig, generator: torch.Generator):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        if isinstance(layer, ColumnParallelLinear):
            self.column = True
            if layer.gather_output:
                raise LoraConfigError("LoRA on a ColumnParallelLinear with gather_output=True is not supported")
        elif isinstance(layer, RowParallelLinear):
            self.column = False
            if not layer.input_is_parallel:
                raise LoraConfigError("LoRA on a RowParallelLinear with input_is_parallel=False is not supported")
        else:  # e.g. TransformerEngine's fused layer-norm linear: its input is not the normalised x the adapter needs
            raise LoraConfigError(f"LoRA adapters wrap megatron-core's local ColumnParallelLinear / RowParallelLinear; "
                                  f"{type(layer).__name__} is not supported yet")
        self.group = layer.tp_group  # an expert's: the expert-TP group
        # An expert layer under expert TP / EP: the token dispatcher all-gathers its input over expert TP and sums its
        # outputs (reduce-scatter), so the layer itself communicates nothing (see forward)
        self.expert_comm = bool(getattr(layer, "explicit_expert_comm", False))
        self.sequence_parallel = bool(layer.sequence_parallel) and not self.expert_comm
        self.scale, self.enabled = cfg.scale, True
        self.held = None  # (A, B) used instead of the parameters while set (held_adapters: the KL reference)
        # Dropout on the adapter's input, as PEFT. A column-parallel layer without sequence parallelism sees the same
        # x on every TP rank, and the masks agree only while the ranks' default RNG streams do (as for Megatron's
        # hidden dropout); elsewhere each rank drops its own tokens / input columns.
        self.dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout > 0 else torch.nn.Identity()
        tp, rank = self.group.size(), self.group.rank()
        dtype, device = layer.weight.dtype, layer.weight.device
        # PEFT's "gaussian" init (std 1/rank), drawn whole so each TP rank takes its slice of the same matrix
        a = (torch.randn(cfg.rank, layer.input_size, generator=generator) / cfg.rank).to(device, dtype)
        if self.column:
            self.A = torch.nn.Parameter(a)
            self.B = torch.nn.Parameter(torch.zeros(layer.output_size // tp, cfg.rank, dtype=dtype, device=device))
            whole = self.A
            set_tensor_model_parallel_attributes(self.B, True, 0, 1)
        else:
            self.A = torch.nn.Parameter(a.chunk(tp, dim=1)[rank].contiguous())
            self.B = torch.nn.Parameter(torch.zeros(layer.output_size, cfg.rank, dtype=dtype, device=device))
            whole = self.B
            set_tensor_model_parallel_attributes(self.A, True, 1, 1)
        if self.sequence_parallel:  # its gradient comes from this rank's tokens: finalize_model_grads sums it over TP
            whole.sequence_parallel = True
        # megatron-core's mark for expert-parallel weights (allreduce=False): DDP puts them in its expert buffers,
        # reduced over the expert-data-parallel group, and the optimizer in its expert param groups. As the layer's.
        self.A.allreduce = self.B.allreduce = getattr(layer.weight, "allreduce", True)

    def forward(self, x):
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            gather_from_sequence_parallel_region,
                                                            reduce_from_tensor_model_parallel_region,
                                                            reduce_scatter_to_sequence_parallel_region)

        a, b = self.held if self.held is not None else (self.A, self.B)
        if self.expert_comm:
            # Column: x is the same on every expert-TP rank, h = A x too; B's rows give this rank's output columns.
            # Row: h = A_r x_r is a partial sum and so is B h, which the dispatcher sums with the layer's output. In
            # both the whole factor sees a partial gradient on each rank: its backward all-reduces it over expert TP
            # (the input gradient stays partial: the dispatcher's gather backward sums it, as for the layer's own).
            if self.column:
                a = copy_to_tensor_model_parallel_region(a, group=self.group)
            else:
                b = copy_to_tensor_model_parallel_region(b, group=self.group)
            return torch.nn.functional.linear(torch.nn.functional.linear(self.dropout(x), a), b) * self.scale
        h = torch.nn.functional.linear(self.dropout(x), a)
        if self.column:
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.group) \
                if self.sequence_parallel else copy_to_tensor_model_parallel_region(h, group=self.group)
        else:
            h = reduce_scatter_to_sequence_parallel_region(h, group=self.group) \
                if self.sequence_parallel else reduce_from_tensor_model_parallel_region(h, group=self.group)
        return torch.nn.functional.linear(h, b) * self.scale

    def delta_weight(self) -> torch.Tensor:
        """This rank's shard of the full weight delta scale * B @ A (the layer weight's own shard)."""
        return (self.B @ self.A) * self.scale


def _add_adapter_output(layer, args, output):
    """Forward hook: the frozen layer's (output, bias) plus the adapter's output (unless adapters are disabled)."""
    adapter = getattr(layer, ADAPTER)
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(args[0]), bias


def _sharded_state_dict_with_adapter(layer, swiglu: bool):
    """The layer's sharded_state_dict treats every tensor in its state_dict that is not its own weight/bias as
    replicated, which would save one rank's B (or A) shard for all: the adapter's tensors are replaced by ones sharded
    along the adapter's own split dimension. swiglu: a gated linear_fc1, whose rows each TP rank holds as [its gate
    rows; its up rows]; B is saved with the factory Megatron's MLP uses for that weight, so other TP sizes load it."""
    original = layer.sharded_state_dict

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        state = {k: v for k, v in original(prefix, sharded_offsets, metadata).items()
                 if not k.startswith(f"{prefix}{ADAPTER}.")}
        adapter = getattr(layer, ADAPTER)
        axis = {"B": 0} if adapter.column else {"A": 1}
        mine = make_sharded_tensors_for_checkpoint(
            adapter.state_dict(prefix="", keep_vars=True), f"{prefix}{ADAPTER}.", axis, sharded_offsets,
            tp_group=adapter.group, dp_cp_group=metadata["dp_cp_group"])
        if swiglu:
            key = f"{prefix}{ADAPTER}.B"
            mine[key] = apply_swiglu_sharded_factory(mine[key], sharded_offsets,
                                                     metadata.get("singleton_local_shards", False),
                                                     tp_group=adapter.group, dp_group=metadata["dp_cp_group"])
        state.update(mine)
        return state

    return sharded_state_dict


def _unwrap(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def adapted_layers(chunks: list):
    """(chunk, local layer path like 'decoder.layers.0.self_attention.linear_qkv', layer) for every adapted layer."""
    for chunk in chunks:
        for name, module in _unwrap(chunk).named_modules():
            if hasattr(module, ADAPTER) and isinstance(getattr(module, ADAPTER), LoraAdapter):
                yield chunk, name, module


def apply_lora(chunks: list, cfg: LoraConfig) -> list[LoraAdapter]:
    """Freeze every parameter of the chunks and add a LoRA adapter to each targeted linear layer (in place).

    Only the adapters' A and B require gradients afterwards, so Megatron DDP and the optimizer built from these chunks
    hold buffers and state for them alone. Call before wrap_ddp / make_optimizer. B starts at zero: the adapted model
    computes the base model's outputs until the first update."""
    config = _unwrap(chunks[0]).config
    paths = megatron_targets(cfg, config)
    adapters = []
    for chunk in chunks:
        model = _unwrap(chunk)
        model.requires_grad_(False)
        for layer in model.decoder.layers:
            for path in paths:
                for key, linear in _target_linears(layer, path):
                    # seeded by the global layer number and module (and global expert index): the same A on every
                    # TP / PP / VPP / EP layout
                    seed = zlib.crc32(f"{cfg.seed}:{layer.layer_number}:{key}".encode())
                    adapter = LoraAdapter(linear, cfg, torch.Generator().manual_seed(seed))
                    linear.add_module(ADAPTER, adapter)
                    linear.register_forward_hook(_add_adapter_output)
                    linear.sharded_state_dict = _sharded_state_dict_with_adapter(
                        linear, swiglu=path.endswith("linear_fc1") and config.gated_linear_unit)
                    linear.weight.lora_adapter = adapter  # ModelBridge exports the merged weight (merged_weight)
                    adapters.append(adapter)
    return adapters


def _target_linears(layer, path: str) -> list:
    """(seed key, linear layer) for one target path of a decoder layer. A routed-expert path names the fc1 / fc2 of
    every local expert, keyed by its global expert index; a layer without routed experts (a dense layer of a mixed
    model) has none."""
    if path not in EXPERT_PATHS:
        return [(path, layer.get_submodule(path))]
    experts = getattr(layer.mlp, "experts", None)
    if experts is None:
        return []
    if not hasattr(experts, "local_experts"):  # TransformerEngine's grouped GEMM keeps all experts in one tensor
        raise LoraConfigError(f"LoRA on routed experts needs megatron-core's SequentialMLP (the local spec); "
                              f"{type(experts).__name__} is not supported yet")
    name = path.rsplit(".", 1)[1]
    return [(f"{path}:{index}", getattr(expert, name))
            for index, expert in zip(layer.mlp.local_expert_indices, experts.local_experts)]


def is_adapter_param(name: str) -> bool:
    return f".{ADAPTER}." in name


def merged_weight(param: torch.Tensor) -> torch.Tensor:
    """A layer weight with its adapter's delta added (a new tensor), or the weight itself when it has no adapter or
    adapters are disabled. Local shards merge locally: the delta's shard is the adapter's own product."""
    adapter = getattr(param, "lora_adapter", None)
    if adapter is None or not adapter.enabled:
        return param
    return param + adapter.delta_weight().to(param.dtype)


def checkpoint_has_adapters(ckpt_dir: str) -> bool:
    """Whether a megarl run checkpoint (dist_checkpointing) holds LoRA adapter tensors (read from its metadata)."""
    from megatron.core import dist_checkpointing

    return any(f".{ADAPTER}." in key for key in dist_checkpointing.load_tensors_metadata(ckpt_dir))


@contextlib.contextmanager
def adapters_disabled(chunks: list):
    """The base model inside the block (e.g. the reference model's log-probs from the policy's own weights)."""
    adapters = [getattr(layer, ADAPTER) for _, _, layer in adapted_layers(chunks)]
    previous = [a.enabled for a in adapters]
    for a in adapters:
        a.enabled = False
    try:
        yield
    finally:
        for a, was in zip(adapters, previous):
            a.enabled = was


def initial_function(chunks: list):
    """A context factory under which a LoRA policy computes its function as of now: the KL reference, made before
    training starts, with no second model. Fresh adapters (B = 0 everywhere, the usual start): the base model with the
    adapters off. Adapters that start trained (a LoRA checkpoint as model.load, a PEFT folder as model.lora.load): a
    copy of their values now (the adapters' size), held on the side and used in place of the parameters inside the
    block. A collective over the world: the ranks must agree, since an adapter that is off skips its TP collectives."""
    adapters = [getattr(layer, ADAPTER) for _, _, layer in adapted_layers(chunks)]
    trained = torch.tensor([float(any(bool(a.B.detach().any()) for a in adapters))])
    dist.all_reduce(trained, op=dist.ReduceOp.MAX)
    if not trained.item():
        return lambda: adapters_disabled(chunks)
    held = [(a.A.detach().clone(), a.B.detach().clone()) for a in adapters]

    @contextlib.contextmanager
    def held_adapters():
        for adapter, values in zip(adapters, held):
            adapter.held = values
        try:
            yield
        finally:
            for adapter in adapters:
                adapter.held = None

    return held_adapters


# ------------------------------------------------------------------------------------------------------- PEFT
def _peft_prefix(hf_weight_name: str) -> str:
    # PEFT keys: base_model.model.<HF module>.lora_A.weight (the adapter name "default" is left out on save)
    assert hf_weight_name.endswith(".weight"), hf_weight_name
    return "base_model.model." + hf_weight_name[: -len(".weight")]


# bridge -> {(canonical name, fused rows): (HF names, each projection's rows of the fused tensor)}
_row_maps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _row_map(bridge, canonical: str, rows: int) -> tuple[list[str], list[torch.Tensor]]:
    """Where each HF projection's rows sit in a fused layer's weight (QKV, gate/up), by mbridge's own conversion of a
    tensor whose row r holds r (its conversion reshapes with the hidden size, so the probe is [rows, hidden]; rows move
    whole). Computed once per layer and kept: the adapter sync runs it for every fused layer on every sync."""
    maps = _row_maps.setdefault(bridge, {})
    if (canonical, rows) not in maps:
        from ..compat import mbridge as mbridge_compat

        probe = torch.arange(rows, dtype=torch.float64)[:, None].expand(rows, bridge.config.hidden_size).contiguous()
        names, parts = mbridge_compat.to_hf_format(bridge.mb, canonical, probe)
        maps[(canonical, rows)] = (names, [part[:, 0].long() for part in parts])
    return maps[(canonical, rows)]


def _rows_to_hf(bridge, canonical: str, b: torch.Tensor) -> tuple[list[str], list[torch.Tensor]]:
    """Split a fused layer's B [fused out, rank] into the HF projections' B's with the weight's own row mapping."""
    names, rows = _row_map(bridge, canonical, b.shape[0])
    return names, [b.index_select(0, r) for r in rows]


def _rows_from_hf(bridge, canonical: str, bs: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of _rows_to_hf: the HF projections' B's -> the fused B [fused out, rank] in Megatron's layout."""
    fused_rows = sum(b.shape[0] for b in bs)
    _, rows = _row_map(bridge, canonical, fused_rows)
    fused = torch.empty(fused_rows, bs[0].shape[1], dtype=bs[0].dtype)
    for r, b in zip(rows, bs):
        fused[r] = b
    return fused


def _gather_tp(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _grad(param: torch.Tensor) -> torch.Tensor:
    grad = getattr(param, "main_grad", None)  # Megatron DDP accumulates here
    grad = param.grad if grad is None else grad
    return torch.zeros_like(param) if grad is None else grad


@torch.no_grad()
def full_adapters(chunks: list, bridge, grads: bool = False):
    """(canonical weight name, column?, full A, full B) of every adapter on the rank that owns the layer's weight in
    export_hf_weights (TP rank 0 of data-parallel replica 0; an expert's: expert-TP rank 0 of expert-data-parallel
    replica 0), in Megatron's fused row layout. grads=True: their gradients (main_grad under Megatron DDP). A
    collective over (expert) TP: every rank must iterate to the end."""
    from ..compat import mbridge as mbridge_compat

    for chunk, path, layer in adapted_layers(chunks):
        adapter = getattr(layer, ADAPTER)
        a, b = (_grad(adapter.A), _grad(adapter.B)) if grads else (adapter.A, adapter.B)
        canonical = bridge.canonical_name(chunk, f"{path}.weight")
        # (an expert's adapter is split over the expert-TP group, its weight's owner is an expert-TP rank 0)
        if adapter.column:  # B split by output rows like the weight (its q/k/v groups, or its gate and up halves)
            b = mbridge_compat.merge_across_tp(bridge.mb, canonical, _gather_tp(b, adapter.group), layer.weight)
        else:  # A split by input columns
            a = torch.cat(_gather_tp(a, adapter.group), dim=1)
        if bridge.owner_rank(canonical) == dist.get_rank():
            yield canonical, adapter.column, a.detach().clone(), b.detach().clone()


def peft_tensors(chunks: list, bridge) -> tuple[dict[str, torch.Tensor], dict]:
    """({PEFT key: tensor}, {(layer, expert tensor, global expert): (A, B)}) for the adapters this rank owns: routed
    experts' adapters come per expert, for lora_moe.pack once every expert is at hand (a collective over (expert) TP:
    every rank must call it)."""
    out, experts = {}, {}
    for canonical, column, a, b in full_adapters(chunks, bridge):
        expert = lora_moe.expert_of(canonical)
        if expert is not None:
            experts[expert] = (a, b)
            continue
        names, bs = _rows_to_hf(bridge, canonical, b) if column else ([bridge.hf_names(canonical)[0]], [b])
        for name, b_part in zip(names, bs):
            out[f"{_peft_prefix(name)}.lora_A.weight"] = a.clone()  # one A per projection in PEFT's file
            out[f"{_peft_prefix(name)}.lora_B.weight"] = b_part
    return out, experts


def _peft_target_lists(cfg: LoraConfig) -> tuple[list[str], list[str]]:
    """cfg.target_modules as PEFT's (target_modules, target_parameters): routed experts are tensors, not modules."""
    return ([n for n in sorted(cfg.target_modules) if not lora_moe.is_expert_target(n)],
            [n for n in sorted(cfg.target_modules) if lora_moe.is_expert_target(n)])


def export_peft(chunks: list, bridge, cfg: LoraConfig, folder: str) -> None:
    """Write the adapters as a PEFT folder (adapter_config.json + adapter_model.safetensors) that
    peft.PeftModel.from_pretrained(<the HF model>, folder) loads. A collective: every rank calls it; rank 0 writes
    (the adapters are small: the owners send theirs to rank 0) and publishes the folder whole."""
    import peft
    from safetensors.torch import save_file

    from .checkpoint import publish_dir

    modules, parameters = _peft_target_lists(cfg)
    if parameters and cfg.dropout:
        raise LoraConfigError(f"model.lora.dropout={cfg.dropout}: PEFT's LoRA on routed experts (target_parameters) "
                              "has no dropout, so this adapter has no PEFT form. Fix: set model.lora.dropout: 0.0")
    mine = peft_tensors(chunks, bridge)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        tensors = {k: v for dense, _ in everyone for k, v in dense.items()}
        tensors.update(lora_moe.pack({k: v for _, experts in everyone for k, v in experts.items()},
                                     bridge.config.num_moe_experts or 0, cfg.target_modules))
        tensors = {k: v.to(bridge.dtype).contiguous() for k, v in tensors.items()}
        parent = os.path.dirname(os.path.abspath(folder)) or "."
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".megarl-peft-", dir=parent)
        try:
            peft.LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                            target_modules=modules, target_parameters=parameters or None, bias="none",
                            task_type="CAUSAL_LM",
                            init_lora_weights="gaussian", base_model_name_or_path=bridge.hf.path).save_pretrained(tmp)
            save_file(tensors, os.path.join(tmp, "adapter_model.safetensors"), metadata={"format": "pt"})
            publish_dir(tmp, folder)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    dist.barrier()


def read_peft_config(folder: str) -> LoraConfig:
    """A LoraConfig from a PEFT LoRA folder's adapter_config.json (the fields megarl's adapters can represent)."""
    with open(os.path.join(folder, "adapter_config.json")) as f:
        c = json.load(f)
    unsupported = {k: c[k] for k, default in (("peft_type", "LORA"), ("bias", "none"), ("use_rslora", False),
                                              ("use_dora", False), ("fan_in_fan_out", False))
                   if c.get(k, default) != default}
    if c.get("rank_pattern") or c.get("alpha_pattern"):
        unsupported["rank_pattern/alpha_pattern"] = "set"
    if not isinstance(c.get("target_modules"), list):
        unsupported["target_modules"] = c.get("target_modules")
    # PEFT matches them as name suffixes: mlp.experts.gate_up_proj is experts.gate_up_proj
    parameters = [p.removeprefix("mlp.") for p in c.get("target_parameters") or []]
    if not all(lora_moe.is_expert_target(p) for p in parameters):
        unsupported["target_parameters"] = c["target_parameters"]
    if unsupported:
        raise LoraConfigError(f"{folder}: PEFT adapter settings megarl cannot load: {unsupported}")
    return LoraConfig(rank=c["r"], alpha=c["lora_alpha"], dropout=c.get("lora_dropout", 0.0),
                      target_modules=list(c["target_modules"]) + list(parameters))


@torch.no_grad()
def load_peft(folder: str, chunks: list, bridge, cfg: LoraConfig) -> None:
    """Copy a PEFT adapter folder into the adapters apply_lora(chunks, cfg) added. Every rank reads the (small) file
    and keeps its own shards. The folder's r, lora_alpha and target modules must be cfg's."""
    from safetensors.torch import load_file

    from ..compat import mbridge as mbridge_compat

    theirs = read_peft_config(folder)
    differ = [f"{k}: folder {getattr(theirs, k)!r} vs model.lora {getattr(cfg, k)!r}"
              for k in ("rank", "alpha") if getattr(theirs, k) != getattr(cfg, k)]
    if sorted(theirs.target_modules) != sorted(cfg.target_modules):
        differ.append(f"target_modules: folder {sorted(theirs.target_modules)} vs model.lora "
                      f"{sorted(cfg.target_modules)}")
    if differ:
        raise LoraConfigError(f"model.lora.load={folder}: adapter does not match model.lora ({'; '.join(differ)})")
    tensors = load_file(os.path.join(folder, "adapter_model.safetensors"))
    for chunk, path, layer in adapted_layers(chunks):
        adapter = getattr(layer, ADAPTER)
        tp, tp_rank = adapter.group.size(), adapter.group.rank()  # an expert's: expert TP
        canonical = bridge.canonical_name(chunk, f"{path}.weight")
        if lora_moe.expert_of(canonical) is not None:
            try:
                a, b = lora_moe.unpack(tensors, canonical, cfg.target_modules, bridge.config.num_moe_experts)
            except KeyError as e:
                raise LoraConfigError(f"{folder}: adapter tensors missing: {e.args[0]}") from None
            if adapter.column:
                adapter.A.copy_(a)
                adapter.B.copy_(mbridge_compat.split_across_tp(bridge.mb, canonical, b.to(adapter.B.dtype),
                                                               layer.weight, tp)[tp_rank])
            else:
                adapter.A.copy_(a.chunk(tp, dim=1)[tp_rank])
                adapter.B.copy_(b)
            continue
        prefixes = [_peft_prefix(n) for n in bridge.hf_names(canonical)]
        missing = [f"{p}.lora_{x}.weight" for p in prefixes for x in "AB" if f"{p}.lora_{x}.weight" not in tensors]
        if missing:
            raise LoraConfigError(f"{folder}: adapter tensors missing: {', '.join(missing[:4])}")
        a = tensors[f"{prefixes[0]}.lora_A.weight"]
        if any(not torch.equal(tensors[f"{p}.lora_A.weight"], a) for p in prefixes[1:]):
            raise LoraConfigError(f"{folder}: {', '.join(prefixes)} have different lora_A; megarl's fused "
                                  f"{path.rsplit('.', 1)[-1]} adapter shares one A across them")
        bs = [tensors[f"{p}.lora_B.weight"] for p in prefixes]
        if adapter.column:
            b = _rows_from_hf(bridge, canonical, bs) if len(bs) > 1 else bs[0]
            adapter.A.copy_(a)
            adapter.B.copy_(mbridge_compat.split_across_tp(bridge.mb, canonical, b.to(adapter.B.dtype),
                                                           layer.weight, tp)[tp_rank])
        else:
            adapter.A.copy_(a.chunk(tp, dim=1)[tp_rank])
            adapter.B.copy_(bs[0])
