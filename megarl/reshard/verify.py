"""Prove the engine holds the trainer's weights.

1. Per-tensor checksums: SGLang's /weights_checker hashes every parameter of every engine TP rank in that rank's own
   layout (q/k/v fused into qkv_proj, gate/up into gate_up_proj, the experts of a layer fused into w13_weight and
   w2_weight, each TP-sharded, zero-padded where SGLang pads). The owners of the HF tensors build the same per-rank
   tensors in the engine's dtype and hash them with SGLang's hash (CPU engines: the first 8 bytes of SHA-256 over the
   raw bytes, computed here incrementally so padding and experts stream through; GPU engines: SGLang's own
   tensor_hash). A mismatch names the engine tensor, the engine TP rank and the HF tensors it came from.
2. Probe log-probs (always): the engine's log p(token | prefix) for fixed probe sequences against the trainer's.

The engine's layout. SGLang does not report parameter shapes over HTTP (/weights_checker sends only hashes,
/get_weights_by_name exists for a few model classes and truncates), and computing its padded config in the trainer
(ModelConfig + adjust_config_with_unaligned_cpu_tp) imports all of SGLang's model registry (~20 s per process). So the
engine's TP size, expert-parallel size and device come from the engine (/server_info and the checksum reply), and the
padding rules SGLang applies are restated in `engine_shapes` with the SGLang lines they come from; the checksum tests
check them against real engines (odd shapes, engine TP 1 and 2).

Experts. A fused expert tensor of one layer spans the trainer's expert-parallel ranks, and SHA-256 cannot be split
across processes, so one rank per layer (the owner of expert 0) hashes it: each other owner sends it, expert by
expert in order, the engine-layout slice of each expert (one expert's weights in flight at a time, so memory stays at
one expert; a GPU engine's hash needs the whole per-rank tensor, one layer at a time).
"""
from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..errors import UserError, on_rank0
from ..models.forward import forward_logits
from ..rollout.client import EngineClient

logger = logging.getLogger(__name__)

_FUSED = {  # engine name suffix -> HF name suffixes concatenated along dim 0
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    # DeepSeek-V3 / GLM-4.5 shared experts (SGLang's models/glm4_moe.py: shared_experts = an MLP with gate_up_proj)
    "mlp.shared_experts.gate_up_proj.weight": ("mlp.shared_experts.gate_proj.weight",
                                               "mlp.shared_experts.up_proj.weight"),
    # Qwen2-MoE's one shared expert (SGLang's models/qwen2_moe.py: shared_expert = a Qwen2MoeMLP with gate_up_proj)
    "mlp.shared_expert.gate_up_proj.weight": ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"),
    # DeepSeek-V3's multi-latent attention: the query and key/value down-projections read the same input, and SGLang
    # (models/deepseek_v2.py, DeepseekV2AttentionMLA with q_lora_rank) holds them as one replicated matrix
    "self_attn.fused_qkv_a_proj_with_mqa.weight": ("self_attn.q_a_proj.weight",
                                                   "self_attn.kv_a_proj_with_mqa.weight"),
}
# The routed experts' HF names, per family: the module holding them -> {HF projection name: its role}. Every family's
# engine fuses the gate and up projections of a layer's experts into w13_weight and the down projections into
# w2_weight; the roles are named as Qwen-MoE names the projections.
_EXPERT_PROJECTIONS = {
    "mlp": {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj"},  # Qwen-MoE, DeepSeek-V3, GLM-4.5
    "block_sparse_moe": {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},  # Mixtral
}
_EXPERT_ROLES = ("gate_proj", "up_proj", "down_proj")
# Tensors SGLang 0.5.23 holds in float32 whatever the engine's dtype: routers whose scores decide which experts run
# (an e_score_correction_bias spread over a few bf16 ULPs would collapse in bf16 and reorder the top-k)
_FP32_IN_ENGINE = {
    "glm4_moe": (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"),  # models/glm4_moe.py, Glm4MoeGate
    "deepseek_v3": (".mlp.gate.e_score_correction_bias",),  # models/deepseek_v2.py, MoEGate (topk_method noaux_tc)
}
_EXPERT = re.compile(r"^(.*\.(%s)\.experts\.)(\d+)\.(\w+)\.weight$" % "|".join(map(re.escape, _EXPERT_PROJECTIONS)))
_LAYER = re.compile(r"layers\.(\d+)\.")


def engine_dtypes(hf_config, dtype: torch.dtype) -> Callable[[str], torch.dtype]:
    """name -> the dtype the engine holds that tensor in (and the weight sync sends it in): `dtype`, except the
    family's float32 router tensors (_FP32_IN_ENGINE; DeepSeek-V3's router weight too when its config sets
    router_fp32, as MoEGate reads it)."""
    fp32 = _FP32_IN_ENGINE.get(getattr(hf_config, "model_type", None), ())
    if getattr(hf_config, "router_fp32", False):
        fp32 += (".mlp.gate.weight",)
    return lambda name: torch.float32 if name.endswith(fp32) else dtype


def expert_name(hf_name: str) -> tuple[str, int, str] | None:
    """(prefix up to the expert index, expert index, role: gate_proj / up_proj / down_proj) of a routed expert's HF
    tensor in any supported family, or None for any other tensor."""
    match = _EXPERT.match(hf_name)
    role = match and _EXPERT_PROJECTIONS[match.group(2)].get(match.group(4))
    return (match.group(1), int(match.group(3)), role) if role else None


def _expert_sources(prefix: str, count: int, roles: tuple[str, ...]) -> list[str]:
    """The HF names of the given roles' projections of experts 0..count-1 in the prefix's family (for messages)."""
    module = prefix[: -len(".experts.")].rsplit(".", 1)[-1]  # "model.layers.3.block_sparse_moe.experts." -> its module
    hf = {role: proj for proj, role in _EXPERT_PROJECTIONS[module].items()}
    return [f"{prefix}{{0..{count - 1}}}.{hf[role]}.weight" for role in roles]


class WeightMismatchError(UserError, RuntimeError):
    pass


# ------------------------------------------------------------------------------------------- the engine's layout
@dataclass(frozen=True)
class EngineShapes:
    """What one SGLang engine holds, per TP rank: padded head counts, intermediate sizes and vocabulary."""
    tp: int
    head_dim: int
    heads: int  # query heads after padding
    kv_heads: int  # key/value heads after padding (fewer than tp: replicated, rank r holds head r * kv_heads // tp)
    intermediate: int | None
    moe_intermediate: int | None
    shared_expert_intermediate: int | None
    vocab: int  # rows of embed_tokens / lm_head after padding
    q_b: int | None = None  # multi-latent attention: rows of q_b_proj (heads x (qk_nope + qk_rope head dims))
    kv_b: int | None = None  # and of kv_b_proj (heads x (qk_nope + v head dims)); o_proj reads heads x v_head_dim


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def engine_shapes(hf_config, tp: int, cpu: bool) -> EngineShapes:
    """SGLang 0.5.23's padding rules for an unquantised model at engine TP `tp`:
    - vocabulary rows: a multiple of 64, times tp when that does not divide (layers/vocab_parallel_embedding.py,
      VocabParallelEmbedding.__init__: DEFAULT_VOCAB_PADDING_SIZE, `padding_size *= self.tp_size`);
    - CPU engines only (configs/update_config.py, adjust_config_with_unaligned_cpu_tp): when tp does not divide the
      query or key/value heads, the kv heads are zero-padded to a multiple of tp and the query heads to kv x group;
      intermediate_size / moe_intermediate_size / shared_expert_intermediate_size not divisible by 32 x tp
      (DEFAULT_MOE_PADDING_SIZE x tp) are zero-padded to that multiple."""
    def get(name):
        return getattr(hf_config, name, None)

    heads = hf_config.num_attention_heads
    kv = get("num_key_value_heads") or heads
    head_dim = get("head_dim") or hf_config.hidden_size // heads
    sizes = {name: get(name) for name in ("intermediate_size", "moe_intermediate_size",
                                          "shared_expert_intermediate_size")}
    if cpu:
        if heads % tp or kv % tp:
            heads, kv = _round_up(kv, tp) * (heads // kv), _round_up(kv, tp)
        sizes = {name: (_round_up(v, 32 * tp) if v and v % (32 * tp) else v) for name, v in sizes.items()}
    padding = 64 if _round_up(hf_config.vocab_size, 64) % tp == 0 else 64 * tp
    mla = {}
    if get("kv_lora_rank"):  # DeepSeek-V3's multi-latent attention: q_b_proj / kv_b_proj rows and o_proj columns
        head_dim = hf_config.v_head_dim
        mla = dict(q_b=heads * (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim),
                   kv_b=heads * (hf_config.qk_nope_head_dim + hf_config.v_head_dim))
    return EngineShapes(tp=tp, head_dim=head_dim, heads=heads, kv_heads=kv, intermediate=sizes["intermediate_size"],
                        # Mixtral has no moe_intermediate_size: its experts are intermediate_size wide
                        moe_intermediate=sizes["moe_intermediate_size"] or sizes["intermediate_size"],
                        # Qwen2-MoE's field; DeepSeek-V3 / GLM-4.5: n_shared_experts x the (padded) expert width
                        shared_expert_intermediate=sizes["shared_expert_intermediate_size"] or
                        (sizes["moe_intermediate_size"] * get("n_shared_experts")
                         if sizes["moe_intermediate_size"] and get("n_shared_experts") else None),
                        vocab=_round_up(hf_config.vocab_size, padding), **mla)


def shard_rule(hf_name: str, shapes: EngineShapes) -> tuple[int, int] | None:
    """(dim, padded size along dim) of the engine's TP split of this HF tensor; None: every rank holds all of it."""
    s = shapes
    intermediate = s.moe_intermediate if ".experts." in hf_name else \
        s.shared_expert_intermediate if (".shared_expert." in hf_name or ".shared_experts." in hf_name) else \
        s.intermediate
    rules = {"embed_tokens.weight": (0, s.vocab), "lm_head.weight": (0, s.vocab),
             "q_proj.weight": (0, s.heads * s.head_dim), "q_proj.bias": (0, s.heads * s.head_dim),
             "k_proj.weight": (0, s.kv_heads * s.head_dim), "k_proj.bias": (0, s.kv_heads * s.head_dim),
             "v_proj.weight": (0, s.kv_heads * s.head_dim), "v_proj.bias": (0, s.kv_heads * s.head_dim),
             "o_proj.weight": (1, s.heads * s.head_dim), "gate_proj.weight": (0, intermediate),
             "up_proj.weight": (0, intermediate), "down_proj.weight": (1, intermediate),
             "q_b_proj.weight": (0, s.q_b), "kv_b_proj.weight": (0, s.kv_b)}
    suffix = next((k for k in rules if hf_name.endswith("." + k) or hf_name == k), None)
    return rules[suffix] if suffix else None


def rank_slice(tensor: torch.Tensor, hf_name: str, shapes: EngineShapes, rank: int) -> torch.Tensor:
    """Engine TP rank `rank`'s part of one HF tensor: the rank's block of the tensor zero-padded to the engine's size
    (a view when no padding falls into it)."""
    rule = shard_rule(hf_name, shapes)
    if rule is None:
        return tensor
    dim, padded = rule
    if hf_name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")) and \
            shapes.kv_heads < shapes.tp:  # fewer kv heads than ranks: each rank holds one, replicated
        head = rank * shapes.kv_heads // shapes.tp
        return tensor.narrow(dim, head * shapes.head_dim, shapes.head_dim)
    per = padded // shapes.tp
    start = rank * per
    have = max(0, min(per, tensor.shape[dim] - start))
    if have == per:
        return tensor.narrow(dim, start, per)
    shape = list(tensor.shape)
    shape[dim] = per
    out = tensor.new_zeros(shape)
    if have:
        out.narrow(dim, 0, have).copy_(tensor.narrow(dim, start, have))
    return out


def tensor_checksum(tensor: torch.Tensor) -> str:
    """SGLang's CPU tensor_hash (sglang/srt/managers/mm_utils.py) as /weights_checker formats it."""
    digest = _Digest(gpu=False)
    digest.update(tensor)
    return digest.hexdigest()


class _Digest:
    """SGLang's tensor hash over a sequence of tensors taken as one. CPU: SHA-256 of the raw bytes, first 8 bytes,
    fed piece by piece. GPU: SGLang's own gpu tensor_hash, which needs the whole tensor (the pieces are concatenated)."""

    def __init__(self, gpu: bool):
        self.gpu, self.parts = gpu, []
        self.sha = None if gpu else hashlib.sha256()

    def update(self, tensor: torch.Tensor) -> None:
        if self.gpu:
            self.parts.append(tensor.detach().reshape(-1))
        else:
            data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            self.sha.update(memoryview(data))

    def hexdigest(self) -> str:
        if not self.gpu:
            return self.sha.digest()[:8].hex()
        from sglang.srt.managers.mm_utils import tensor_hash

        return f"{tensor_hash(torch.cat(self.parts).cuda()):016x}"


def engine_layout(named_tensors, dtype, shapes: EngineShapes, ranks: range | None = None):
    """(engine rank, engine name, that rank's engine tensor, HF sources) for the non-expert HF tensors given; fused
    groups are completed as their parts arrive (parts of one fused tensor come from one Megatron tensor, so from one
    owner). Expert tensors are skipped (see `expert_pieces`). dtype: the engine's, or name -> dtype
    (`engine_dtypes`)."""
    ranks = range(shapes.tp) if ranks is None else ranks
    dtype_of = dtype if callable(dtype) else (lambda _: dtype)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        if expert_name(name):
            continue
        fused = next(((eng, parts) for eng, parts in _FUSED.items() if name.endswith(tuple(parts))), None)
        if fused is None:
            for r in ranks:
                yield r, name, rank_slice(tensor, name, shapes, r).to(dtype_of(name)), [name]
            continue
        engine_suffix, parts = fused
        prefix = name[: -len(next(p for p in parts if name.endswith(p)))]
        group = pending.setdefault(prefix + engine_suffix, {})
        group[name] = tensor
        sources = [prefix + p for p in parts]
        if all(s in group for s in sources):
            del pending[prefix + engine_suffix]
            for r in ranks:
                yield r, prefix + engine_suffix, torch.cat([rank_slice(group[s], s, shapes, r).to(
                    dtype_of(prefix + engine_suffix)) for s in sources]), sources


def expert_pieces(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, prefix: str, shapes: EngineShapes,
                  rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's rows of engine rank `rank`'s fused w13_weight (gate then up) and w2_weight (down)."""
    return (torch.cat([rank_slice(gate, prefix + "gate_proj.weight", shapes, rank).to(dtype),
                       rank_slice(up, prefix + "up_proj.weight", shapes, rank).to(dtype)]),
            rank_slice(down, prefix + "down_proj.weight", shapes, rank).to(dtype).contiguous())


# ------------------------------------------------------------------------------------------------- checksums
def engine_checksum_layout(client: EngineClient) -> tuple[dict[int, dict[str, str]], dict]:
    """The engine's per-TP-rank checksums and what its layout depends on (tp, ep, device) as it reports them."""
    per_rank = client.weight_checksums()
    info = client.call("/server_info", method="GET")
    tp = int(info.get("tp_size") or len(per_rank))
    if sorted(per_rank) != list(range(tp)):
        raise WeightMismatchError(f"weight sync verification failed: the engine reports checksums for TP ranks "
                                  f"{sorted(per_rank)}, expected 0..{tp - 1}")
    return per_rank, {"tp": tp, "ep": int(info.get("ep_size") or 1), "gpu": info.get("device", "cpu") != "cpu"}


def verify_checksums(bridge, chunks, client: EngineClient | None, dtype: torch.dtype) -> int:
    """Compare every engine tensor of every engine TP rank (experts included) with the trainer's; returns how many
    (rank, tensor) pairs were compared. A collective: each owner hashes its tensors, rank 0 asks the engine and
    compares."""
    # rank 0 asks the engine; its failure (or the mismatch below) reaches every rank (megarl.errors.on_rank0)
    engine, layout = on_rank0(lambda: engine_checksum_layout(client))
    shapes = engine_shapes(bridge.hf.config, layout["tp"], cpu=not layout["gpu"])
    mine, experts = {}, {}
    for r, name, tensor, sources in engine_layout(_collect_experts(bridge.export_hf_weights(chunks, copy=False),
                                                                   experts), engine_dtypes(bridge.hf.config, dtype),
                                                  shapes):
        digest = _Digest(layout["gpu"])
        digest.update(tensor)
        mine[(r, name)] = (digest.hexdigest(), sources)
    if layout["ep"] == 1:
        mine.update(_expert_checksums(experts, shapes, dtype, layout["gpu"]))
    elif dist.get_rank() == 0:
        logger.warning("expert checksums skipped: the engine runs expert parallel (ep_size=%d); the probe "
                       "log-probs still check the experts", layout["ep"])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    expected = {k: v for part in everyone for k, v in part.items()}

    def compare() -> None:
        missing = sorted((k for k in expected if k[1] not in engine[k[0]]), key=_order)
        bad = sorted((k for k in expected if k[1] in engine[k[0]] and engine[k[0]][k[1]] != expected[k][0]),
                     key=_order)
        if missing:
            raise WeightMismatchError(f"weight sync verification failed: the engine reports no tensor named "
                                      f"{missing[0][1]} on TP rank {missing[0][0]} ({len(missing)} (rank, tensor) "
                                      "pairs missing)")
        if bad:
            (rank, name), names = bad[0], sorted({n for _, n in bad}, key=lambda n: _order((0, n)))
            raise WeightMismatchError(
                f"weight sync verification failed: engine tensor {name} differs from the trainer's on engine TP "
                f"rank {rank} of {layout['tp']} (built from HF tensors {_summary(expected[bad[0]][1])}); "
                f"{len(names)} of {len({n for _, n in expected})} checked tensors differ: {names[:5]}")

    on_rank0(compare)
    return len(expected)


def _collect_experts(stream, experts: dict):
    """Pass the non-expert tensors on; keep this rank's expert tensors (live views where no gather was needed)."""
    for name, tensor in stream:
        key = expert_name(name)
        if key:
            experts[key] = tensor
        else:
            yield name, tensor


def _expert_checksums(experts: dict, shapes: EngineShapes, dtype: torch.dtype, gpu: bool) -> dict:
    """Checksums of every layer's fused w13_weight / w2_weight per engine rank, computed on the owner of the layer's
    expert 0 while the other owners send their experts' slices one expert at a time, in expert order. Every rank walks
    the same (layer, expert) order, so the blocking sends and receives pair up."""
    held = sorted({(prefix, e) for prefix, e, _ in experts})
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held)
    owner = {key: rank for rank, keys in enumerate(everyone) for key in keys}
    me, out = dist.get_rank(), {}
    for prefix in sorted({p for p, _ in owner}, key=lambda p: _order((0, p))):
        count = 1 + max(e for p, e in owner if p == prefix)
        hasher = owner[(prefix, 0)]
        digests = {(r, w): _Digest(gpu) for r in range(shapes.tp) for w in ("w13", "w2")} if me == hasher else None
        like = experts.get((prefix, 0, "gate_proj"))
        for e in range(count):
            src = owner[(prefix, e)]
            if me not in (src, hasher):
                continue
            for r in range(shapes.tp):
                if me == src:
                    pieces = expert_pieces(*(experts[(prefix, e, p)] for p in _EXPERT_ROLES),
                                           f"{prefix}{e}.", shapes, r, dtype)
                    if src != hasher:
                        for piece in pieces:
                            dist.send(piece.contiguous(), dst=hasher)
                        continue
                else:  # the hasher receives this expert's slices
                    w13_rows = 2 * shapes.moe_intermediate // shapes.tp
                    w2_cols = shapes.moe_intermediate // shapes.tp
                    hidden = like.shape[1]
                    pieces = (torch.empty(w13_rows, hidden, dtype=dtype, device=like.device),
                              torch.empty(hidden, w2_cols, dtype=dtype, device=like.device))
                    for piece in pieces:
                        dist.recv(piece, src=src)
                digests[(r, "w13")].update(pieces[0])
                digests[(r, "w2")].update(pieces[1])
        if me == hasher:
            sources = {w: _expert_sources(prefix, count, roles)
                       for w, roles in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",)))}
            for (r, w), digest in digests.items():
                out[(r, f"{prefix}{w}_weight")] = (digest.hexdigest(), sources[w])
    return out


def _summary(sources: list[str]) -> str:
    return ", ".join(sources)


def _order(key):
    rank, name = key
    match = _LAYER.search(name)
    return (int(match.group(1)) if match else -1, name, rank)


# ---------------------------------------------------------------------------------------------------- probes
def probe_sequences(vocab_size: int, count: int = 2, length: int = 24, seed: int = 1234) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length), generator=g).tolist()


def verify_probes(bridge, chunks, client: EngineClient | None, probes: list[list[int]], atol: float) -> float:
    """Max |engine log-prob - trainer log-prob| over the probe tokens (raises above atol). A collective."""
    ids = torch.tensor(probes)
    logits = forward_logits(chunks, [ids], vocab_size=bridge.vocab_size, pg=bridge.pg)
    trainer = None
    if logits is not None:
        logp = torch.log_softmax(logits[0].float(), -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        trainer = logp
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, trainer)
    trainer = next(t for t in gathered if t is not None)

    def compare() -> float:
        diff = float((torch.tensor(client.prompt_log_probs(probes)) - trainer).abs().max())
        if diff > atol:
            raise WeightMismatchError(f"weight sync verification failed: the engine's log-probs of the probe "
                                      f"sequences differ from the trainer's by up to {diff:.3g} (> {atol}); the "
                                      "engine does not hold the trainer's weights")
        return diff

    return on_rank0(compare)
