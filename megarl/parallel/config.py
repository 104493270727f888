"""ParallelConfig: the TP/PP/VPP/CP/EP/ETP layout, validated against the world size and the model's shapes."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional


class ParallelConfigError(ValueError):
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


@dataclass
class ParallelConfig:
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    vpp: Optional[int] = None  # virtual pipeline stages per pipeline rank (interleaved schedule)
    cp: int = 1  # context parallel
    ep: int = 1  # expert parallel
    etp: Optional[int] = None  # expert tensor parallel (default: tp, as in Megatron)

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

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
        stages = self.pp * (self.vpp or 1)
        if m.num_layers % stages:
            raise ParallelConfigError(
                f"num_hidden_layers={m.num_layers} is not divisible by pp*vpp = {self.pp}*{self.vpp or 1}. "
                "Fix: choose pp (and vpp) so every pipeline stage gets the same number of layers.")
        _divides("num_attention_heads", m.num_attention_heads, "tp", self.tp)
        _divides("num_key_value_heads", m.num_key_value_heads, "tp", self.tp)
        if m.num_experts:
            _divides("num_experts", m.num_experts, "ep", self.ep)
            if m.moe_ffn_hidden_size:
                _divides("moe_intermediate_size", m.moe_ffn_hidden_size, "etp", self.expert_tp)
        else:
            if self.ep > 1:
                raise ParallelConfigError(f"parallel.ep={self.ep} but the model has no experts (dense). "
                                          "Fix: set ep: 1.")
            _divides("intermediate_size", m.ffn_hidden_size, "tp", self.tp)


def _positive(field: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ParallelConfigError(f"parallel.{field} must be a positive integer, got {value!r}")


def _divides(model_field: str, value: int, parallel_field: str, size: int) -> None:
    if value % size:
        raise ParallelConfigError(
            f"model {model_field}={value} is not divisible by parallel.{parallel_field}={size}. "
            f"Fix: pick a {parallel_field} that divides {value}.")
