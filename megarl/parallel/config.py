"""ParallelConfig: the TP/PP/VPP/CP/EP/ETP layout, validated against the world size and the model's shapes."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from ..errors import UserError


class ParallelConfigError(UserError, ValueError):
    """A parallel layout that cannot run; the message names the field and the fix."""


@dataclass
class ModelShape:
    """The model dimensions a parallel layout must divide (read from the HF config by megarl.models)."""
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    ffn_hidden_size: int
    num_experts: Optional[int] = None
    moe_ffn_hidden_size: Optional[int] = None
    # What the dry run's memory estimate (megarl.launch.memory) also needs; None where config.json lacks them.
    hidden_size: Optional[int] = None
    vocab_size: Optional[int] = None
    head_dim: Optional[int] = None  # None: hidden_size // num_attention_heads
    num_dense_layers: Optional[int] = None  # MoE models: the first layers with a dense MLP (first_k_dense_replace)
    shared_expert_ffn_hidden_size: Optional[int] = None  # all shared experts of a MoE layer together
    q_lora_rank: Optional[int] = None  # multi-latent attention (DeepSeek-V3): its config.json fields
    kv_lora_rank: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None
    tie_word_embeddings: bool = False
    # The config.json field(s) the expert widths above come from, for messages (class attributes, not dataclass fields:
    # not part of a preset's model.shape hint); megarl.models.hf.model_shape sets them per family.
    moe_ffn_field = "moe_intermediate_size"  # Mixtral: intermediate_size
    shared_expert_field = "shared_expert_intermediate_size"  # DeepSeek-V3 / GLM-4.5: n_shared_experts x moe_...


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    vpp: Optional[int] = None  # virtual pipeline stages per pipeline rank (interleaved schedule)
    cp: int = 1  # context parallel
    ep: int = 1  # expert parallel
    etp: Optional[int] = None  # expert tensor parallel (default: tp, as in Megatron)
    # Uneven pipeline stages: megatron-core's TransformerConfig fields of the same names, passed through unchanged.
    # All unset: layers are split evenly when pp*vpp divides them, otherwise megarl picks the first and last stage
    # sizes itself (auto_split: the smallest largest stage; see pipeline_split).
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None
    account_for_embedding_in_pipeline_split: bool = False  # the embedding counts as one layer of the first stage
    account_for_loss_in_pipeline_split: bool = False  # the output layer + loss count as one layer of the last stage

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def virtual_pp(self) -> Optional[int]:
        """vpp as megatron-core takes it: None unless the interleaved schedule is on (vpp > 1)."""
        return self.vpp if (self.vpp or 1) > 1 else None

    def pipeline_split(self, num_layers: int) -> dict:
        """The TransformerConfig fields that place `num_layers` decoder layers on the pipeline stages: the split fields
        set here; with none set and pp*vpp not dividing num_layers, an automatic first/last stage split (auto_split);
        otherwise {} (megatron-core's even split). Raises ParallelConfigError (with values that work) if none fits."""
        explicit = {k: getattr(self, k) for k in SPLIT_FIELDS if getattr(self, k) not in (None, False)}
        if explicit or self.pp == 1 or num_layers % (self.pp * (self.virtual_pp or 1)) == 0:
            return explicit
        split = auto_split(num_layers, self.pp, self.virtual_pp)
        if split is None:
            raise ParallelConfigError(
                f"num_hidden_layers={num_layers} cannot be split over parallel.pp={self.pp} x parallel.vpp={self.vpp}: "
                "megatron-core's first/last split with vpp needs every stage's layer count to be a multiple of vpp "
                "and (0.19.2) pp >= 3. "
                f"Fix: {_suggest(num_layers, self.pp, self.virtual_pp)}")
        return split

    def stage_layers(self, num_layers: int) -> list[list[range]]:
        """[pipeline rank][virtual stage] -> the global decoder layer indices that chunk builds (megatron-core's
        get_transformer_layer_offset / get_num_layers_to_build under this layout); validates the split."""
        split = self.pipeline_split(num_layers)
        try:
            return pipeline_stage_layers(num_layers, self.pp, self.virtual_pp, split)
        except ParallelConfigError as e:
            if not any(getattr(self, k) not in (None, False) for k in SPLIT_FIELDS):
                raise
            set_here = ", ".join(f"parallel.{k}={_yaml(v)}" for k, v in split.items())
            raise ParallelConfigError(
                f"{set_here} cannot place num_hidden_layers={num_layers} on pp={self.pp}"
                f"{f' x vpp={self.vpp}' if self.virtual_pp else ''} ({e}). "
                f"Fix: {_suggest(num_layers, self.pp, self.virtual_pp)}, or unset them to get megarl's automatic "
                "split") from None

    def dp(self, world_size: int) -> int:
        """Data-parallel size: what the world has left after tp*cp*pp."""
        self.validate(world_size)
        return world_size // (self.tp * self.cp * self.pp)

    def as_dict(self) -> dict:
        return asdict(self)

    def validate(self, world_size: int, model: ModelShape | None = None, on_gpu: bool = True) -> None:
        for field in ("tp", "pp", "cp", "ep"):
            _positive(field, getattr(self, field))
        if self.vpp is not None:
            _positive("vpp", self.vpp)
            if self.pp == 1 and self.vpp > 1:
                raise ParallelConfigError(f"parallel.vpp={self.vpp} needs parallel.pp > 1 (the interleaved schedule "
                                          "splits each pipeline rank's layers). Fix: set pp >= 2 or unset vpp.")
        if self.etp is not None:
            _positive("etp", self.etp)
        for field in SPLIT_FIELDS:
            value = getattr(self, field)
            if field.startswith("account_for"):
                if not isinstance(value, bool):
                    raise ParallelConfigError(f"parallel.{field} must be true or false, got {value!r}")
            elif value is not None:
                _positive(field, value)
            if value not in (None, False) and self.pp == 1:
                raise ParallelConfigError(f"parallel.{field}={_yaml(value)} places layers on pipeline stages but "
                                          "parallel.pp=1. Fix: unset it, or set pp >= 2.")
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel:
            raise ParallelConfigError(
                f"world size {world_size} is not divisible by tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = "
                f"{model_parallel}. Fix: launch a multiple of {model_parallel} ranks, or change parallel.tp/pp/cp.")
        expert_parallel = self.expert_tp * self.ep * self.pp
        if world_size % expert_parallel:
            raise ParallelConfigError(
                f"world size {world_size} is not divisible by etp*ep*pp = {self.expert_tp}*{self.ep}*{self.pp} = "
                f"{expert_parallel} (the expert layout). Fix: change parallel.ep or parallel.etp.")
        if self.cp > 1 and not on_gpu:
            raise ParallelConfigError("parallel.cp > 1 needs TransformerEngine attention, which is GPU-only "
                                      "(megatron-core's local attention asserts cp == 1). Fix: set cp: 1 on CPU.")
        if model is not None:
            self._validate_model(model)

    def _validate_model(self, m: ModelShape) -> None:
        self.stage_layers(m.num_layers)  # raises when the layers cannot be placed on the stages
        _divides("num_attention_heads", m.num_attention_heads, "tp", self.tp)
        _divides("num_key_value_heads", m.num_key_value_heads, "tp", self.tp)
        if m.num_experts:
            _divides("num_experts", m.num_experts, "ep", self.ep)
            if m.moe_ffn_hidden_size:
                _divides(m.moe_ffn_field, m.moe_ffn_hidden_size, "etp", self.expert_tp)
            if m.shared_expert_ffn_hidden_size:  # megatron-core splits the shared experts over tp, not etp
                _divides(m.shared_expert_field, m.shared_expert_ffn_hidden_size, "tp", self.tp)
        else:
            if self.ep > 1:
                raise ParallelConfigError(f"parallel.ep={self.ep} but the model has no experts (dense). "
                                          "Fix: set ep: 1.")
            _divides("intermediate_size", m.ffn_hidden_size, "tp", self.tp)


def _positive(field: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelConfigError(f"parallel.{field} must be a positive integer, got {value!r}. Fix: "
                                  f"parallel.{field}=1 (no split), or a size that divides the GPUs")


def _divides(model_field: str, value: int, parallel_field: str, size: int) -> None:
    if value % size:
        raise ParallelConfigError(
            f"model {model_field}={value} is not divisible by parallel.{parallel_field}={size}. "
            f"Fix: pick a {parallel_field} that divides {value}.")


SPLIT_FIELDS = ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
FIRST_LAST = "num_layers_in_first/last_pipeline_stage"


def auto_split(num_layers: int, pp: int, vpp: Optional[int] = None) -> Optional[dict]:
    """The first/last stage sizes megarl picks when pp*vpp does not divide num_layers, or None if megatron-core's
    first/last split cannot place them at all.

    megatron-core can only make the first and the last stage differ; the middle stages hold equal counts, and with vpp
    every stage's count is a multiple of vpp (and, in megatron-core 0.19.2, pp >= 3: at pp 2 its layer offsets for
    a vpp first/last split divide by zero). Among those splits: the smallest largest stage (the pipeline runs at its
    slowest stage), then the smallest difference between stages, then the lighter last stage (it also holds the output
    layer and the loss). E.g. 3 layers at pp 2 -> 2 + 1; 61 at pp 16 -> 3 + 14 x 4 + 2; 5 at pp 2 x vpp 2 -> None."""
    v = vpp or 1
    if pp < 2 or (vpp and pp == 2):  # megatron-core 0.19.2 cannot place a vpp first/last split at pp 2 (see below)
        return None
    best = None
    for first in range(v, num_layers, v):
        for last in range(v, num_layers - first + 1, v):
            rest, middle = num_layers - first - last, pp - 2
            if (rest > 0) != (middle > 0) or (middle and (rest % middle or (rest // middle) % v)):
                continue
            sizes = [first, last] + ([rest // middle] if middle else [])
            key = (max(sizes), max(sizes) - min(sizes), last)
            if best is None or key < best[0]:
                best = (key, first, last)
    if best is None:
        return None
    return {"num_layers_in_first_pipeline_stage": best[1], "num_layers_in_last_pipeline_stage": best[2]}


def pipeline_stage_layers(num_layers: int, pp: int, vpp: Optional[int], split: dict) -> list[list[range]]:
    """[pipeline rank][virtual stage] -> global decoder layer indices, computed by megatron-core itself: its
    TransformerConfig validates the split (its messages are quoted), get_transformer_layer_offset and
    get_num_layers_to_build place the layers, as GPTModel does when it builds each chunk."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    try:
        # hidden size and heads do not matter here; pipeline_dtype is required with pp > 1
        config = TransformerConfig(num_layers=num_layers, hidden_size=1, num_attention_heads=1,
                                   pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                                   pipeline_dtype=torch.float32, use_cpu_initialization=True, **split)
        stages = [[range(get_transformer_layer_offset(config, v, rank),
                         get_transformer_layer_offset(config, v, rank) + get_num_layers_to_build(config, v, rank))
                   for v in (range(vpp) if vpp else [None])] for rank in range(pp)]
    except (ValueError, AssertionError) as e:
        raise ParallelConfigError(f"megatron-core: {' '.join(str(e).split())}") from None
    except ZeroDivisionError:
        # get_transformer_layer_offset (0.19.2) divides by the number of middle stages for a first/last split with
        # vpp, which is 0 at pp 2; TransformerConfig accepts the layout, so say it here.
        raise ParallelConfigError(f"megatron-core cannot place {FIRST_LAST} with vpp at pp={pp} (no middle stage: its "
                                  "get_transformer_layer_offset divides by zero)") from None
    # The chunks in pipeline order (virtual stage major) must hold every layer once, in order.
    placed = [i for v in range(vpp or 1) for rank in range(pp) for i in stages[rank][v]]
    if placed != list(range(num_layers)):
        raise ParallelConfigError(f"megatron-core places layers {placed} for num_hidden_layers={num_layers} with "
                                  f"{split or 'an even split'} at pp={pp}, vpp={vpp}. Fix: choose another split")
    return stages


def _suggest(num_layers: int, pp: int, vpp: Optional[int]) -> str:
    """Settings that place num_layers on pp (x vpp) stages, for error messages."""
    def fits(v, split):
        try:
            pipeline_stage_layers(num_layers, pp, v, split)
            return True
        except ParallelConfigError:
            return False

    def describe(split):
        return " and ".join(f"parallel.{k}={_yaml(v)}" for k, v in split.items())

    options = []
    auto = auto_split(num_layers, pp, vpp)
    if auto:
        options.append(f"set {describe(auto)}")
    accounts = [{"account_for_embedding_in_pipeline_split": True}, {"account_for_loss_in_pipeline_split": True},
                {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}]
    options += [f"set {describe(a)}" for a in accounts if fits(vpp, a)][:1]
    if vpp:
        no_vpp = auto_split(num_layers, pp) if num_layers % pp else {}
        if no_vpp is not None:
            options.append(f"unset parallel.vpp{f' (megarl then sets {describe(no_vpp)})' if no_vpp else ''}")
        for v in range(2, (num_layers + 2) // pp + 1):  # a rank needs >= vpp layer slots (embedding, loss count)
            if v == vpp:
                continue
            split = {} if num_layers % (pp * v) == 0 else auto_split(num_layers, pp, v)
            if split is None:
                split = next((a for a in accounts if fits(v, a)), None)
            if split is not None:
                options.append(f"use parallel.vpp={v}{f' with {describe(split)}' if split else ''}")
                break
    return " or ".join(options) if options else f"choose parallel.pp (and vpp) that fit {num_layers} layers"


def _yaml(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
