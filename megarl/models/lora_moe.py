"""PEFT's format for LoRA on an MoE model's routed experts (megarl.models.lora's experts.gate_up_proj / down_proj).

transformers (5.x) keeps an MoE layer's routed experts as two 3D tensors of one module: mlp.experts.gate_up_proj
[experts, 2 * moe_ffn, hidden] (each expert's gate rows, then its up rows) and mlp.experts.down_proj
[experts, hidden, moe_ffn]. PEFT adapts such tensors with `target_parameters` (its lora.ParamWrapper): per tensor one
lora_A [rank * experts, in], expert e's A in rows e*rank .. (e+1)*rank, and one lora_B [out, rank * experts] whose
columns reshape to [rank, experts], expert e's B in columns e, e + experts, ...; expert e's delta is scale * B_e @ A_e.

megarl's adapter on expert e's linear_fc1 (one A, one B over Megatron's [gate; up] rows, the HF row order) is exactly
expert e's gate_up_proj adapter, and linear_fc2's is its down_proj adapter: no row mapping is needed. Both tensors
targeted on one module nest PEFT's wrappers: the later in the module's parameter order (down_proj) is the outer one,
the earlier sits under `base_layer` (keys ...mlp.experts.base_layer.lora_A.weight). ParamWrapper has no dropout.
"""
from __future__ import annotations

import re

import torch

# megarl target name -> transformers' expert tensor, in the experts module's parameter order (PEFT's nesting order)
EXPERT_TARGETS = {"experts.gate_up_proj": "gate_up_proj", "experts.down_proj": "down_proj"}
_CANONICAL = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.linear_fc([12])\.weight(\d+)$")


def is_expert_target(name: str) -> bool:
    return name in EXPERT_TARGETS


def expert_of(canonical: str) -> tuple[int, str, int] | None:
    """A routed expert's canonical weight name -> (layer, HF tensor name, global expert index); None otherwise."""
    match = _CANONICAL.match(canonical)
    if match is None:
        return None
    return int(match.group(1)), "gate_up_proj" if match.group(2) == "1" else "down_proj", int(match.group(3))


def peft_prefix(layer: int, tensor: str, targets: list[str]) -> str:
    """The PEFT key prefix of one layer's adapter on one expert tensor, given every target of the adapter."""
    order = [t for name, t in EXPERT_TARGETS.items() if name in targets]
    nesting = len(order) - 1 - order.index(tensor)
    return f"base_model.model.model.layers.{layer}.mlp.experts" + ".base_layer" * nesting


def pack(experts: dict, num_experts: int, targets: list[str]) -> dict[str, torch.Tensor]:
    """{(layer, tensor, expert): (A, B)} of every expert of the adapted layers -> PEFT's {key: tensor}."""
    out = {}
    for layer, tensor in sorted({(layer, tensor) for layer, tensor, _ in experts}):
        parts = [experts.get((layer, tensor, e)) for e in range(num_experts)]
        missing = [e for e, part in enumerate(parts) if part is None]
        assert not missing, f"layer {layer} {tensor}: no adapter for experts {missing}"
        prefix = peft_prefix(layer, tensor, targets)
        out[f"{prefix}.lora_A.weight"] = torch.cat([a for a, _ in parts], dim=0)
        out[f"{prefix}.lora_B.weight"] = torch.stack([b for _, b in parts], dim=-1).flatten(1)
    return out


def unpack(tensors: dict, canonical: str, targets: list[str], num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one expert's adapter from PEFT's tensors (KeyError naming the missing key)."""
    layer, tensor, expert = expert_of(canonical)
    prefix = peft_prefix(layer, tensor, targets)
    a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
    rank = a.shape[0] // num_experts
    return a[expert * rank:(expert + 1) * rank], b.reshape(b.shape[0], rank, num_experts)[:, :, expert]
