"""mbridge: every place megarl relies on mbridge internals, written for mbridge 0.15.1 (with megatron-core 0.19.2).

megarl uses mbridge for its per-tensor rules (HF <-> Megatron names, layouts, TP split/merge, vocabulary padding) and
its HF config -> TransformerConfig mapping, but not its model construction or its distributed load/export (see
megarl/models/bridge.py). mbridge 0.15.1 keeps those rules in private members of its Bridge classes; this module is
the only place megarl touches them, and where megarl writes attributes mbridge reads:

- `bridge_class`: the registered bridge class for a model type (the private registry `_MODEL_REGISTRY`), adapted
  where mbridge and megatron-core disagree (its private `_build_base_config`, its `TransformerConfigClass`).
- `prepare_hf_config`: attributes of the HF config mbridge reads under transformers 4 names.
- `isolate_name_tables`, `direct_mapping`, `attention_mapping`, `mlp_mapping`: its private name tables.
- `hf_names`, `to_mcore_format`, `split_across_tp`, `merge_across_tp`, `to_hf_format`: its private per-tensor rules.
- `set_extra_args`, `set_vocab_padding`: attributes its methods read.

`check_assumptions()` checks each private member and signature (tests/compat/test_compat.py).
"""
from __future__ import annotations

import inspect

VERSION = "0.15.1"  # the mbridge release every entry here was written for (launchers/install.sh)

# The private Bridge methods megarl calls, with the parameters it passes (mbridge/core/bridge.py).
_WEIGHT_RULES = {
    "_weight_name_mapping_mcore_to_hf": ["mcore_weights_name"],
    "_weight_to_mcore_format": ["mcore_weights_name", "hf_weights"],
    "_weight_split_across_tp": ["mcore_weights_name", "mcore_weights", "param", "tp_split_size"],
    "_weight_merge_across_tp": ["mcore_weights_name", "mcore_weights", "param"],
    "_weight_to_hf_format": ["mcore_weights_name", "mcore_weights"],
}


def model_registry() -> dict:
    """model_type -> bridge class: mbridge 0.15.1's private registry (mbridge/core/bridge.py `_MODEL_REGISTRY`, filled
    by @register_model), what AutoBridge.from_config looks the class up in."""
    from mbridge.core.auto_bridge import _MODEL_REGISTRY

    return _MODEL_REGISTRY


def mla_config(bridge, **fields):
    """MLATransformerConfig from mbridge 0.15.1's fields (a method of the bridge, which calls
    self.TransformerConfigClass(**fields)). mbridge passes max_position_embeddings, which megatron-core 0.19 names
    original_max_position_embeddings (YaRN's original context length). It reads RoPE scaling from
    rope_scaling["type"], which transformers 5 calls rope_parameters["rope_type"]: without this a YaRN model (every
    DeepSeek-V3 checkpoint) would be built with plain RoPE, silently."""
    from megatron.core.transformer import MLATransformerConfig

    rope = dict(getattr(bridge.hf_config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") == "yarn":
        fields.update(rope_type="yarn", rotary_scaling_factor=rope["factor"], beta_fast=rope.get("beta_fast", 32),
                      beta_slow=rope.get("beta_slow", 1), mscale=rope.get("mscale", 1.0),
                      mscale_all_dim=rope.get("mscale_all_dim", 0.0),
                      max_position_embeddings=rope["original_max_position_embeddings"])
    fields["original_max_position_embeddings"] = fields.pop("max_position_embeddings")
    return MLATransformerConfig(**fields)


def bridge_class(model_type: str, extras: dict):
    """mbridge's bridge class for model_type, adapted where mbridge 0.15.1 and megatron-core 0.19.2 disagree, building
    its TransformerConfig with megarl's fields (`extras`, which win over mbridge's) from the start: mbridge's
    constructor builds one from its own fields alone (LLMBridge._build_base_config, private, called from __init__),
    which megatron-core may refuse before set_extra_args can correct it (Qwen3-MoE at top-k 1: mbridge's
    moe_router_pre_softmax=False, which megatron-core refuses there). DeepSeek-V3 builds its config through
    `mla_config`."""
    cls = model_registry()[model_type]

    def _build_base_config(self, *args, **kwargs):
        return cls._build_base_config(self, *args, **{**kwargs, **extras})

    namespace = {"_build_base_config": _build_base_config}
    if model_type == "deepseek_v3":
        namespace["TransformerConfigClass"] = mla_config
    return type(cls.__name__, (cls,), namespace)


def prepare_hf_config(hf_config, rope_theta: float) -> None:
    """Set what mbridge 0.15.1 reads from an HF config under transformers 4 names: it reads `rope_theta` as an
    attribute (transformers 5 keeps it in rope_parameters), and `head_dim` with getattr(config, "head_dim",
    hidden // heads), which does not catch transformers 5's Mixtral config holding head_dim=None."""
    if not hasattr(hf_config, "rope_theta"):
        hf_config.rope_theta = rope_theta
    if getattr(hf_config, "head_dim", 0) is None:
        hf_config.head_dim = hf_config.hidden_size // hf_config.num_attention_heads


def isolate_name_tables(mb, tied: bool) -> None:
    """Give the bridge instance its own `_DIRECT_MAPPING` (mbridge 0.15.1's private class-level name table), with the
    output layer mapped for this model's tied/untied embeddings. mbridge's Qwen2/Qwen3 bridges rewrite the class-level
    table for tied embeddings in their constructor (a tied model built first would make a later untied one export
    lm_head as embed_tokens): that rewrite is undone on the classes."""
    cls = type(mb)
    direct = dict(cls._DIRECT_MAPPING)
    direct["output_layer.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
    mb._DIRECT_MAPPING = direct
    for klass in cls.__mro__:
        if "_DIRECT_MAPPING" in vars(klass) and "output_layer.weight" in klass._DIRECT_MAPPING:
            klass._DIRECT_MAPPING["output_layer.weight"] = "lm_head.weight"


def direct_mapping(mb) -> dict:
    """Megatron name -> HF name for the non-layer tensors (private `_DIRECT_MAPPING`; per instance after
    isolate_name_tables)."""
    return mb._DIRECT_MAPPING


def attention_mapping(mb) -> dict:
    """The bridge's attention name table (private `_ATTENTION_MAPPING`, keyed by Megatron name fragments)."""
    return mb._ATTENTION_MAPPING


def mlp_mapping(mb) -> dict:
    """The bridge's MLP name table (private `_MLP_MAPPING`)."""
    return mb._MLP_MAPPING


def hf_names(mb, canonical: str) -> list[str]:
    """The HF tensor names that make one Megatron tensor (private Bridge._weight_name_mapping_mcore_to_hf)."""
    return mb._weight_name_mapping_mcore_to_hf(canonical)


def to_mcore_format(mb, canonical: str, hf_tensors: list):
    """The full (unsharded) Megatron tensor from its HF tensors (private Bridge._weight_to_mcore_format: QKV fused
    per query group, gate/up fused, vocabulary padded)."""
    return mb._weight_to_mcore_format(canonical, hf_tensors)


def split_across_tp(mb, canonical: str, full, param, size: int) -> list:
    """The TP shards of a full Megatron tensor (private Bridge._weight_split_across_tp)."""
    return mb._weight_split_across_tp(canonical, full, param, size)


def merge_across_tp(mb, canonical: str, parts: list, param):
    """The full Megatron tensor from its TP shards (private Bridge._weight_merge_across_tp)."""
    return mb._weight_merge_across_tp(canonical, parts, param)


def to_hf_format(mb, canonical: str, full) -> tuple[list[str], list]:
    """(HF names, HF tensors) of a full Megatron tensor (private Bridge._weight_to_hf_format; unpads the vocabulary)."""
    return mb._weight_to_hf_format(canonical, full)


def set_extra_args(mb, extras: dict) -> None:
    """Record `extras` as set_extra_args would, without rebuilding the config (bridge_class built it with them):
    mbridge 0.15.1's set_extra_args rebuilds self.config from them."""
    mb.extra_args = dict(extras)


def set_vocab_padding(mb, multiple: int, vocab_size: int, padded_vocab_size: int) -> None:
    """The three attributes mbridge 0.15.1's _weight_to_mcore_format / _weight_to_hf_format pad and unpad the
    embedding and output layer with (its get_model would set them; megarl builds the model itself)."""
    mb.make_vocab_size_divisible_by = multiple
    mb.vocab_size, mb.padded_vocab_size = vocab_size, padded_vocab_size


def check_assumptions() -> list[str]:
    """What this module relies on in the installed mbridge; returns the broken assumptions (empty: all hold)."""
    from importlib import metadata

    problems = []
    installed = metadata.version("mbridge")
    if installed != VERSION:
        problems.append(f"mbridge {installed} is installed, this module was written for {VERSION}")
    try:
        registry = model_registry()
    except ImportError as e:
        return problems + [f"mbridge.core.auto_bridge._MODEL_REGISTRY: {e}"]
    from mbridge.core.bridge import Bridge
    from mbridge.core.llm_bridge import LLMBridge

    for family in ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe"):
        if family not in registry:
            problems.append(f"_MODEL_REGISTRY has no {family!r}")
    for name, params in _WEIGHT_RULES.items():
        method = getattr(Bridge, name, None)
        if method is None:
            problems.append(f"Bridge.{name} is gone")
        elif list(inspect.signature(method).parameters)[1:len(params) + 1] != params:
            problems.append(f"Bridge.{name}{inspect.signature(method)} no longer takes {params}")
    for table in ("_DIRECT_MAPPING", "_ATTENTION_MAPPING", "_MLP_MAPPING"):
        if not isinstance(getattr(Bridge, table, None), dict):
            problems.append(f"Bridge.{table} is no longer a dict")
    if "output_layer.weight" not in getattr(Bridge, "_DIRECT_MAPPING", {}):
        problems.append("Bridge._DIRECT_MAPPING no longer maps output_layer.weight")
    if "_build_base_config" not in vars(LLMBridge) or "TransformerConfigClass" not in vars(LLMBridge):
        problems.append("LLMBridge._build_base_config / TransformerConfigClass is gone")
    for attr in ("extra_args", "make_vocab_size_divisible_by", "vocab_size", "padded_vocab_size"):
        if f"self.{attr}" not in inspect.getsource(Bridge.__init__):
            problems.append(f"Bridge.__init__ no longer sets self.{attr}")
    return problems
