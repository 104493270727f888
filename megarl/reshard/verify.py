"""Prove the engine holds the trainer's weights.

1. Per-tensor checksums: SGLang's /weights_checker hashes every parameter in its own layout (q/k/v fused into qkv_proj,
   gate/up into gate_up_proj). The owners of the HF tensors build the same fused tensors in the engine's dtype and hash
   them the same way (the first 8 bytes of SHA-256 over the raw bytes: SGLang's tensor_hash CPU path). A mismatch
   names the engine tensor and the HF tensors it came from. Fused MoE expert tensors (w13/w2) span expert-parallel
   ranks and are left to the probe check.
2. Probe log-probs (always): the engine's log p(token | prefix) for fixed probe sequences against the trainer's.
"""
from __future__ import annotations

import hashlib
import re

import torch
import torch.distributed as dist

from ..models.forward import forward_logits
from ..rollout.client import EngineClient

_FUSED = {  # engine name suffix -> HF name suffixes concatenated along dim 0
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_VOCAB_PADDING = 64  # SGLang's VocabParallelEmbedding pads the vocabulary rows to a multiple of this (DEFAULT_...)


class WeightMismatchError(RuntimeError):
    pass


def tensor_checksum(tensor: torch.Tensor) -> str:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(data)).digest()[:8].hex()


def engine_layout(named_tensors, dtype: torch.dtype):
    """(engine name, engine-layout tensor, HF sources) for the HF tensors given; fused groups are completed as their
    parts arrive (parts of one fused tensor come from one Megatron tensor, so from one owner)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        if ".experts." in name:
            continue  # fused per-layer expert tensors: checked by probes
        fused = next(((eng, parts) for eng, parts in _FUSED.items() if name.endswith(tuple(parts))), None)
        if fused is None:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                rows = -(-tensor.shape[0] // _VOCAB_PADDING) * _VOCAB_PADDING
                tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
            yield name, tensor.to(dtype), [name]
            continue
        engine_suffix, parts = fused
        prefix = name[: -len(next(p for p in parts if name.endswith(p)))]
        group = pending.setdefault(prefix + engine_suffix, {})
        group[name] = tensor
        sources = [prefix + p for p in parts]
        if all(s in group for s in sources):
            del pending[prefix + engine_suffix]
            yield prefix + engine_suffix, torch.cat([group[s] for s in sources]).to(dtype), sources


def verify_checksums(bridge, chunks, client: EngineClient | None, dtype: torch.dtype) -> int:
    """Compare every (non-expert) engine tensor with the trainer's; returns how many were compared (all ranks).

    A collective: each owner hashes its tensors, rank 0 asks the engine and compares."""
    mine = {name: (tensor_checksum(t), sources) for name, t, sources in
            engine_layout(bridge.export_hf_weights(chunks), dtype)}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    expected = {k: v for part in everyone for k, v in part.items()}
    problem = [None]
    if dist.get_rank() == 0:
        engine = client.weight_checksums()
        missing = sorted(set(expected) - set(engine))
        bad = sorted((n for n in expected if n in engine and engine[n] != expected[n][0]), key=_layer_order)
        if missing:
            problem[0] = f"the engine reports no tensor named {missing[0]} (of {len(missing)} missing)"
        elif bad:
            problem[0] = (f"engine tensor {bad[0]} differs from the trainer's (built from HF tensors "
                          f"{expected[bad[0]][1]}); {len(bad)} of {len(expected)} checked tensors differ: "
                          f"{bad[:5]}")
    dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise WeightMismatchError(f"weight sync verification failed: {problem[0]}")
    return len(expected)


def probe_sequences(vocab_size: int, count: int = 2, length: int = 24, seed: int = 1234) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=g).tolist()


def verify_probes(bridge, chunks, client: EngineClient | None, probes: list[list[int]], atol: float) -> float:
    """Max |engine log-prob - trainer log-prob| over the probe tokens (raises above atol). A collective."""
    ids = torch.tensor(probes)
    logits = forward_logits(chunks, [ids], vocab_size=bridge.vocab_size)
    trainer = None
    if logits is not None:
        logp = torch.log_softmax(logits[0].float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        trainer = logp
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, trainer)
    trainer = next(t for t in gathered if t is not None)
    result = [None]
    if dist.get_rank() == 0:
        engine = torch.tensor(client.prompt_log_probs(probes))
        result[0] = float((engine - trainer).abs().max())
    dist.broadcast_object_list(result, src=0)
    if result[0] > atol:
        raise WeightMismatchError(f"weight sync verification failed: the engine's log-probs of the probe sequences "
                                  f"differ from the trainer's by up to {result[0]:.3g} (> {atol}); the engine does "
                                  "not hold the trainer's weights")
    return result[0]


def _layer_order(name: str):
    match = re.search(r"layers\.(\d+)\.", name)
    return (int(match.group(1)) if match else -1, name)
