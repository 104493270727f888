"""The dry run's memory estimate per GPU: the trainer's weights, gradients and optimizer state on each pipeline stage,
and the SGLang engine's weights and KV cache, from the model's shape (megarl.parallel.ModelShape: config.json, or a
preset's model.shape) and the layout. Pure functions; nothing is allocated.

What is counted, per decoder layer (h = hidden_size):
- attention, split over tp: GQA q/k/v/o (heads x head_dim and KV heads x head_dim wide); multi-latent attention
  (DeepSeek-V3) q up projection, kv up projection and o; replicated on every tp rank: MLA's q / kv down projections
  and their norms (megatron-core's TransformerEngine spec duplicates them), the two layer norms;
- a dense MLP (gate, up, down: 3 x h x ffn) split over tp; a MoE layer's shared experts the same way, its router
  (experts x h) replicated, its routed experts (3 x h x moe_ffn each) split over ep x etp;
- the embedding (vocab x h) on the first stage and the output layer on the last, split over tp (one tensor when tied
  on one stage); the final norm on the last stage. Left out: biases (q/k/v), QK-norm weights and Qwen2-MoE's
  shared-expert gate (a few thousand numbers per layer at most), and the vocabulary padding.
Bytes per parameter (megarl's Megatron setup, megarl.trainer.setup): weights 2 (bf16) on GPU, 4 (fp32) on CPU;
gradients 4 (fp32 main_grad: grad_reduce_in_fp32); Adam 12 with bf16 weights (fp32 master copy + two moments), 8 in
fp32, divided over dp x cp (dense parameters) and expert-dp (routed experts) with optim.distributed_optimizer.
Activations, communication buffers and the CUDA context come on top and are not estimated.

The verdict (fit_verdict) checks the fullest GPU against --gpu-memory-gb. SGLang claims mem_fraction_static of the
GPU for its weights and KV cache when it starts (less when rollout.engine.max_total_tokens caps the cache) and keeps
it while it generates; with colocated engines the trainer's state stays on the same GPU (megarl offloads none of it),
so the trainer must fit in the rest. Without a fraction the engine's share is the estimate below (weights + KV cache).

The engine: every weight split over the engine's tp (SGLang shards attention, MLPs and experts over its tp group) in
its dtype; the KV cache per token is 2 x layers x ceil(KV heads / tp) x head_dim values (GQA) or layers x
(kv_lora_rank + qk_rope_head_dim) values on every rank (MLA keeps one compressed latent per token, not split), for
rollout.engine.max_total_tokens tokens, or, when that is unset (SGLang sizes the cache from mem_fraction_static), for
one step's sequences at full length: prompts_per_step x n_samples x (max_prompt_tokens + max_new_tokens) over the
engines.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..parallel import ModelShape

GB = 1e9


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one decoder layer, by how the layout divides them."""
    split: int  # over tp
    replicated: int  # whole on every tp rank
    experts: int  # routed experts, over ep x etp


def layer_params(s: ModelShape, moe: bool) -> LayerParams:
    h, heads = s.hidden_size, s.num_attention_heads
    if s.kv_lora_rank is not None:  # multi-latent attention
        qk = s.qk_nope_head_dim + s.qk_rope_head_dim
        q_down = h * s.q_lora_rank + s.q_lora_rank if s.q_lora_rank else 0  # + q_a_layernorm
        q_up = (s.q_lora_rank or h) * heads * qk
        kv_down = h * (s.kv_lora_rank + s.qk_rope_head_dim) + s.kv_lora_rank  # + kv_a_layernorm
        kv_up = s.kv_lora_rank * heads * (s.qk_nope_head_dim + s.v_head_dim)
        split, replicated = q_up + kv_up + heads * s.v_head_dim * h, q_down + kv_down
    else:
        d = s.head_dim or h // heads
        split, replicated = 2 * h * heads * d + 2 * h * s.num_key_value_heads * d, 0
    replicated += 2 * h  # input and pre-MLP norms
    if not moe:
        return LayerParams(split + 3 * h * s.ffn_hidden_size, replicated, 0)
    return LayerParams(split + 3 * h * (s.shared_expert_ffn_hidden_size or 0), replicated + s.num_experts * h,
                       s.num_experts * 3 * h * s.moe_ffn_hidden_size)


def is_moe_layer(s: ModelShape, layer: int) -> bool:
    return bool(s.num_experts) and layer >= (s.num_dense_layers or 0)


def stage_params(s: ModelShape, layers, first: bool, last: bool, tp: int, ep: int, etp: int,
                 pp: int) -> tuple[float, float]:
    """(dense, expert) parameters one GPU of a pipeline stage holding `layers` (global indices) keeps."""
    dense = experts = 0.0
    for layer in layers:
        p = layer_params(s, is_moe_layer(s, layer))
        dense += p.split / tp + p.replicated
        experts += p.experts / (ep * etp)
    embedding = s.vocab_size * s.hidden_size / tp
    if first:
        dense += embedding
    if last:
        dense += s.hidden_size + (0 if s.tie_word_embeddings and pp == 1 else embedding)  # final norm, output layer
    return dense, experts


def adapter_params(s: ModelShape, layer: int, lora, tp: int, ep: int, etp: int) -> tuple[float, float]:
    """(dense, expert) LoRA parameters of one decoder layer on one GPU, in megarl.models.lora's layout: a
    column-parallel layer (q/k/v fused, gate/up fused, an expert's fc1) holds A [r, in] whole and B [out / tp, r]; a
    row-parallel one (o, down, an expert's fc2) A [r, in / tp] and B [out, r] whole; experts over etp, ep of them
    per GPU. Which layers: models.lora.valid_targets (dense MLP names on dense layers, experts.* on MoE layers)."""
    targets, r, h = set(lora.target_modules), lora.rank, s.hidden_size
    d = s.head_dim or h // s.num_attention_heads
    attention = s.num_attention_heads * d
    dense = experts = 0.0
    if targets & {"q_proj", "k_proj", "v_proj"}:
        dense += r * h + (attention + 2 * s.num_key_value_heads * d) * r / tp
    if "o_proj" in targets:
        dense += r * attention / tp + h * r
    if not is_moe_layer(s, layer):
        if targets & {"gate_proj", "up_proj"}:
            dense += r * h + 2 * s.ffn_hidden_size * r / tp
        if "down_proj" in targets:
            dense += r * s.ffn_hidden_size / tp + h * r
        return dense, experts
    ffn, local = s.moe_ffn_hidden_size, s.num_experts / ep
    if "experts.gate_up_proj" in targets:
        experts += local * (r * h + 2 * ffn * r / etp)
    if "experts.down_proj" in targets:
        experts += local * (r * ffn / etp + h * r)
    return dense, experts


def total_params(s: ModelShape) -> int:
    """Every parameter of the model (one copy): stage_params on one GPU holding every layer."""
    dense, experts = stage_params(s, range(s.num_layers), True, True, 1, 1, 1, 1)
    return round(dense + experts)


@dataclass(frozen=True)
class StageMemory:
    pp_rank: int
    layers: int
    dense_params: float  # per GPU
    expert_params: float
    weights: float  # bytes per GPU
    gradients: float
    optimizer: float
    adapter_params: float = 0.0  # model.lora: the trainable adapters (the rest is frozen: no gradients, no Adam)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer


@dataclass(frozen=True)
class EngineMemory:
    tp: int
    dtype: str
    weights: float  # bytes per GPU
    kv_per_token: float  # bytes per GPU
    tokens: int  # KV cache tokens per engine
    tokens_from: str

    @property
    def kv_cache(self) -> float:
        return self.kv_per_token * self.tokens

    @property
    def total(self) -> float:
        return self.weights + self.kv_cache


_DTYPE_BYTES = {"bfloat16": 2, "float32": 4}


def trainer_memory(s: ModelShape, stage_layers: list, sizes: dict, distributed_optimizer: bool,
                   dtype: str, lora=None) -> list[StageMemory]:
    """Per pipeline rank (stage_layers: [pp rank][virtual stage] -> ranges of global layers, as the dry run plans
    them; sizes: tp pp cp ep etp dp expert-dp). lora (models.lora.LoraConfig): frozen weights plus adapters, and
    gradients and Adam state for the adapters only (sharded as the weights they adapt)."""
    weight_bytes = _DTYPE_BYTES[dtype]
    adam = 4 * 2 + (4 if weight_bytes < 4 else 0)  # two fp32 moments (+ the fp32 master copy of bf16 weights)
    dense_shards = sizes["dp"] * sizes["cp"] if distributed_optimizer else 1
    expert_shards = sizes["expert-dp"] if distributed_optimizer else 1
    out = []
    pp = sizes["pp"]
    for rank, chunks in enumerate(stage_layers):
        layers = [layer for r in chunks for layer in r]
        dense, experts = stage_params(s, layers, rank == 0, rank == pp - 1, sizes["tp"], sizes["ep"], sizes["etp"],
                                      pp)
        if lora is not None:  # frozen weights; gradients and Adam for the adapters (expert ones over expert-dp)
            pieces = [adapter_params(s, layer, lora, sizes["tp"], sizes["ep"], sizes["etp"]) for layer in layers]
            a_dense, a_experts = sum(p[0] for p in pieces), sum(p[1] for p in pieces)
            adapters = a_dense + a_experts
            out.append(StageMemory(rank, len(layers), dense, experts, weights=(dense + experts + adapters) *
                                   weight_bytes, gradients=adapters * 4,
                                   optimizer=adam * (a_dense / dense_shards + a_experts / expert_shards),
                                   adapter_params=adapters))
            continue
        out.append(StageMemory(rank, len(layers), dense, experts, weights=(dense + experts) * weight_bytes,
                               gradients=(dense + experts) * 4,
                               optimizer=adam * (dense / dense_shards + experts / expert_shards)))
    return out


def kv_bytes_per_token(s: ModelShape, tp: int, dtype: str) -> float:
    """KV cache bytes one engine GPU keeps per token."""
    if s.kv_lora_rank is not None:
        values = s.num_layers * (s.kv_lora_rank + s.qk_rope_head_dim)
    else:
        values = 2 * s.num_layers * math.ceil(s.num_key_value_heads / tp) * (s.head_dim or
                                                                           s.hidden_size // s.num_attention_heads)
    return values * _DTYPE_BYTES[dtype]


def engine_memory(s: ModelShape, tp: int, dtype: str, max_total_tokens: Optional[int], step_tokens: int,
                  engines: int) -> EngineMemory:
    """One engine GPU. step_tokens: one RL step's sequences at full length (prompts x samples x (prompt + new
    tokens)), spread over `engines` when max_total_tokens is unset."""
    if max_total_tokens:
        tokens, source = max_total_tokens, "rollout.engine.max_total_tokens"
    else:
        tokens = math.ceil(step_tokens / max(engines, 1))
        source = (f"one step's sequences at full length over {engines} engine(s); rollout.engine.max_total_tokens "
                  "unset")
    return EngineMemory(tp, dtype, weights=total_params(s) * _DTYPE_BYTES[dtype] / tp,
                        kv_per_token=kv_bytes_per_token(s, tp, dtype), tokens=tokens, tokens_from=source)


@dataclass(frozen=True)
class GpuLoad:
    """What one GPU holds at the busiest moment, and whether it fits."""
    name: str  # "trainer GPU", "engine GPU", "trainer + engine GPU"
    terms: tuple[tuple[str, float], ...]  # (what, bytes), largest first
    problems: tuple[str, ...]  # why it does not fit; empty when it fits

    @property
    def total(self) -> float:
        return sum(b for _, b in self.terms)


@dataclass(frozen=True)
class Verdict:
    gpu_bytes: float
    loads: tuple[GpuLoad, ...]
    fixes: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return not any(load.problems for load in self.loads)


def engine_share(engine: EngineMemory, fraction: Optional[float], max_total_tokens: Optional[int],
                 gpu_bytes: float) -> float:
    """The bytes the engine claims on each of its GPUs: its static fraction of the GPU (SGLang sizes the KV cache to
    fill it, or to max_total_tokens when that needs less); without a fraction, the estimate (weights + KV cache)."""
    if not fraction:
        return engine.total
    share = fraction * gpu_bytes
    if max_total_tokens:
        share = min(share, engine.weights + engine.kv_per_token * max_total_tokens)
    return share


def fit_verdict(stages: list[StageMemory], engine: Optional[EngineMemory], placement: str, gpu_bytes: float,
                fraction: Optional[float], max_total_tokens: Optional[int], sequence_tokens: int) -> Verdict:
    """Whether the fullest trainer GPU and the engine's GPUs fit `gpu_bytes`. fraction: the engine's
    --mem-fraction-static (None: unset); sequence_tokens: one sequence at full length (prompt + new tokens), the
    least KV cache an engine can work with."""
    worst = max(stages, key=lambda st: st.total)
    where = f" (pp rank {worst.pp_rank})" if len(stages) > 1 else ""
    trainer = (("optimizer", worst.optimizer), ("gradients", worst.gradients), ("weights", worst.weights))
    if engine is None:  # sft / dpo: the trainer alone
        return Verdict(gpu_bytes, (_load(f"trainer GPU{where}", trainer, gpu_bytes, ()),), _trainer_fixes(None))
    share = engine_share(engine, fraction, max_total_tokens, gpu_bytes)
    cache = share - engine.weights
    engine_terms = (("engine weights", engine.weights), ("KV cache", max(cache, 0.0)))
    engine_problems = _engine_problems(engine, fraction, share, cache, sequence_tokens)
    fixes = _engine_fixes(fraction) if engine_problems else ()
    if placement == "colocated":  # the engine's share and the trainer's state on the same GPU
        room = gpu_bytes - share
        trainer_problems = () if worst.total <= room else (
            f"the trainer's {_gb(worst.total)} exceed the {_gb(room)} the engine leaves "
            f"({'1 - mem_fraction_static ' + str(fraction) if fraction else 'beside its estimate'})",)
        load = GpuLoad(f"trainer + engine GPU{where}", _largest_first(trainer + engine_terms),
                       engine_problems + trainer_problems)
        if engine_problems and trainer_problems:  # no fraction helps both: the engine needs GPUs of its own
            fixes = ("use rollout.placement=disaggregated (engines on nodes of their own)", _spread())
        elif trainer_problems:
            fixes = _trainer_fixes(fraction)
        return Verdict(gpu_bytes, (load,), fixes)
    loads = (_load(f"trainer GPU{where}", trainer, gpu_bytes, ()),
             _load("engine GPU", engine_terms, gpu_bytes, engine_problems))
    return Verdict(gpu_bytes, loads, fixes + (_trainer_fixes(None) if loads[0].problems else ()))


def _largest_first(terms) -> tuple:
    return tuple(sorted(terms, key=lambda t: -t[1]))


def _load(name: str, terms, gpu_bytes: float, problems: tuple) -> GpuLoad:
    terms = _largest_first(terms)
    total = sum(b for _, b in terms)
    over = (f"{_gb(total)} > {_gb(gpu_bytes)}",) if total > gpu_bytes else ()
    return GpuLoad(name, terms, over + problems)


def _engine_problems(engine: EngineMemory, fraction: Optional[float], share: float, cache: float,
                     sequence_tokens: int) -> tuple[str, ...]:
    """What keeps the engine from starting inside its share: weights larger than the share, or no room for one
    sequence's KV cache."""
    if engine.weights > share:
        what = f"its static share (mem_fraction_static {fraction})" if fraction else "its share"
        return (f"engine weights {_gb(engine.weights)} exceed {what} {_gb(share)}",)
    if cache < engine.kv_per_token * sequence_tokens:
        return (f"the KV cache left beside the engine weights ({_gb(cache)}) holds fewer than one sequence's "
                f"{sequence_tokens:,} tokens",)
    return ()


def _engine_fixes(fraction: Optional[float]) -> tuple[str, ...]:
    raise_it = "raise rollout.engine.mem_fraction_static" if fraction else "set rollout.engine.mem_fraction_static"
    return (f"{raise_it} or rollout.engine.tp_size (an engine stays on one node)",)


def _spread() -> str:
    return "spread the trainer over more GPUs (--nnodes with a larger parallel.ep / dp, or parallel.pp)"


def _trainer_fixes(fraction: Optional[float]) -> tuple[str, ...]:
    if fraction is None:
        return (_spread(),)
    return (f"lower rollout.engine.mem_fraction_static, use rollout.placement=disaggregated, or {_spread()}",)


def format_verdict(v: Verdict) -> list[str]:
    """The dry run's verdict lines: per GPU kind, fits or not, its terms largest first."""
    lines = [f"verdict   per GPU of {_gb(v.gpu_bytes)} (--gpu-memory-gb): {'fits' if v.fits else 'does not fit'}"]
    for load in v.loads:
        terms = ", ".join(f"{name} {_gb(b)}" for name, b in load.terms)
        state = "fits" if not load.problems else "does not fit: " + "; ".join(load.problems)
        lines.append(f"  {load.name}: {_gb(load.total)} ({terms}): {state}")
    return lines


def verdict_error(v: Verdict) -> str:
    """The one line a layout that does not fit ends with."""
    worst = next(load for load in v.loads if load.problems)
    terms = ", ".join(f"{name} {_gb(b)}" for name, b in worst.terms[:3])
    return (f"the layout does not fit {_gb(v.gpu_bytes)} per GPU (--gpu-memory-gb): {worst.name} needs "
            f"{_gb(worst.total)} ({terms}): {'; '.join(worst.problems)}. Fix: {'; or '.join(v.fixes)}, or GPUs with "
            "more memory (--gpu-memory-gb)")


def missing_fields(s: ModelShape) -> list[str]:
    """The shape fields the estimate needs and `s` lacks."""
    need = ["hidden_size", "vocab_size"]
    if s.kv_lora_rank is not None:
        need += ["qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"]
    return [k for k in need if getattr(s, k) is None]


def format_memory(stages: list[StageMemory], engine: Optional[EngineMemory], sizes: dict, dtype: str,
                  distributed_optimizer: bool, placement: str, verbose: bool = False, unit: str = "GPU",
                  fraction: Optional[float] = None, share: Optional[float] = None) -> list[str]:
    """The dry run's memory lines; unit: what one trainer rank runs on ("GPU", or "process" on CPU); fraction and
    share: the engine's mem_fraction_static and the bytes it claims per GPU (engine_share), when planned on GPUs."""
    shards = (f"sharded over dp x cp {sizes['dp'] * sizes['cp']} (dense) / expert-dp {sizes['expert-dp']} (experts)"
              if distributed_optimizer else "not sharded (optim.distributed_optimizer: false)")
    adam = "fp32 master + 2 moments" if dtype == "bfloat16" else "2 fp32 moments"
    lines = [f"memory    per {unit}, estimated from the model's shape (GB = 1e9 bytes; activations not included): "
             f"{dtype} weights, fp32 gradients, Adam {adam} {shards}"]
    shown = stages if verbose or len(stages) <= 4 else stages[:2] + [None] + stages[-1:]
    for st in shown:
        if st is None:
            hidden = stages[2:-1]
            worst = max(hidden, key=lambda x: x.total)
            lines.append(f"  ... pp ranks {hidden[0].pp_rank}-{hidden[-1].pp_rank}: up to {_gb(worst.total)} "
                         f"(pp rank {worst.pp_rank})")
            continue
        where = f"pp rank {st.pp_rank} " if len(stages) > 1 else ""
        params = (f"{_b(st.dense_params)} dense + {_b(st.expert_params)} expert params" if st.expert_params else
                  f"{_b(st.dense_params)} params")
        if st.adapter_params:
            params += f" frozen + {_b(st.adapter_params)} LoRA adapter params (trainable)"
        lines.append(f"  trainer {where}({st.layers} layers): {params}: weights {_gb(st.weights)} + gradients "
                     f"{_gb(st.gradients)} + optimizer {_gb(st.optimizer)} = {_gb(st.total)}")
    if engine is not None:
        lines.append(f"  engine (SGLang tp {engine.tp}, {engine.dtype}): weights {_gb(engine.weights)} + KV cache "
                     f"{engine.kv_per_token / 1e3:.1f} kB/token x {engine.tokens:,} tokens ({engine.tokens_from}) = "
                     f"{_gb(engine.kv_cache)}; total {_gb(engine.total)}")
        if fraction and share is not None:  # what SGLang actually claims: its static fraction, filled by KV cache
            tokens = max(share - engine.weights, 0) / engine.kv_per_token
            lines.append(f"  engine share: mem_fraction_static {fraction} (--mem-fraction-static) claims "
                         f"{_gb(share)} per {unit}: weights + a KV cache of {_gb(max(share - engine.weights, 0))} "
                         f"({int(tokens):,} tokens)")
        worst = max(stages, key=lambda x: x.total)
        if placement == "colocated":
            claimed = engine.total if share is None else max(share, engine.weights)  # the weights at least
            lines.append(f"  colocated: while the engine generates, the trainer's state stays in memory (megarl "
                         f"offloads none of it): up to {_gb(worst.total + claimed)} per {unit}")
    return lines


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.1f} GB" if nbytes >= 0.1 * GB else f"{nbytes / 1e6:.1f} MB"


def _b(params: float) -> str:
    return f"{params / 1e9:.2f}B" if params >= 1e8 else f"{params / 1e6:.2f}M" if params >= 1e5 else \
        f"{params / 1e3:.1f}K"
