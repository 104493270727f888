"""Reading a Hugging Face model folder (config.json + *.safetensors + tokenizer), with errors that say what to fix."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from ..errors import UserError
from ..parallel.config import ModelShape

# model_type -> the transformers architecture class name megarl supports for it.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
}
# Families whose router scores experts with a sigmoid plus the e_score_correction_bias and picks the top-k within the
# best topk_group of n_group expert groups (DeepSeek-V3's router, which GLM-4.5 reuses).
SIGMOID_GROUP_ROUTED = ("deepseek_v3", "glm4_moe")
# RoPE scaling the bridge builds: DeepSeek-V3's YaRN goes to megatron-core's multi-latent attention (mbridge passes
# factor, original_max_position_embeddings, beta_fast/slow, mscale and mscale_all_dim as rope_type yarn)
_ROPE_SCALING = {("deepseek_v3", "yarn")}
# The config.json field that holds the number of routed experts: Qwen-MoE, Mixtral, DeepSeek name it differently.
_EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
_REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")


class ModelFolderError(UserError, ValueError):
    """A model folder megarl cannot use; the message names the file/field and the fix."""


@dataclass
class HFModelFolder:
    path: str
    config: "object"  # transformers.PretrainedConfig
    weight_files: dict[str, str]  # HF tensor name -> safetensors file path
    # Block-quantised FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2): the (rows, columns) of one weight_scale_inv block;
    # None for an unquantised folder. See `dequantize_fp8_blockwise`.
    fp8_block: tuple[int, int] | None = None

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def is_moe(self) -> bool:
        return bool(self.shape().num_experts)

    @property
    def rope_theta(self) -> float:
        # transformers 5 keeps rope settings in config.rope_parameters; older configs have rope_theta.
        params = getattr(self.config, "rope_parameters", None) or {}
        return float(params.get("rope_theta", getattr(self.config, "rope_theta", 10000.0)))

    @property
    def rotary_percent(self) -> float:
        """The fraction of each attention head RoPE rotates (GLM-4.5: 0.5, the first half); 1.0 for most families.
        transformers 5 keeps it in rope_parameters; older configs have partial_rotary_factor."""
        params = getattr(self.config, "rope_parameters", None) or {}
        return float(params.get("partial_rotary_factor", getattr(self.config, "partial_rotary_factor", 1.0) or 1.0))

    def shape(self) -> ModelShape:
        return model_shape(self.config.to_dict())

    def read(self, names: Iterable[str]) -> list[torch.Tensor]:
        """Load the named tensors (only those) from the safetensors files. In an FP8 folder, a weight stored as
        float8_e4m3fn is returned dequantised (float32) with its `<name>_scale_inv`, which is read along with it."""
        from safetensors import safe_open

        names = list(names)
        missing = [n for n in names if n not in self.weight_files]
        if missing:
            raise ModelFolderError(f"{self.path}: tensor(s) {missing[:4]} are not in any *.safetensors file. "
                                   "Fix: the folder's weights do not match its config.json; re-export the model.")
        scales = [n + _SCALE_SUFFIX for n in names if self.fp8_block and n + _SCALE_SUFFIX in self.weight_files]
        out = {}
        by_file: dict[str, list[str]] = {}
        for n in names + scales:
            by_file.setdefault(self.weight_files[n], []).append(n)
        for file, file_names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for n in file_names:
                    out[n] = f.get_tensor(n)
        for n in names:
            if out[n].dtype == torch.float8_e4m3fn:
                if n + _SCALE_SUFFIX not in out:
                    raise ModelFolderError(f"{self.path}: {n} is float8_e4m3fn but {n}{_SCALE_SUFFIX} is missing. "
                                           "Fix: restore the checkpoint's *.weight_scale_inv tensors.")
                try:
                    out[n] = dequantize_fp8_blockwise(out[n], out[n + _SCALE_SUFFIX], self.fp8_block)
                except ValueError as e:
                    raise ModelFolderError(f"{self.path}: {n}: {e}. Fix: set config.json quantization_config."
                                           "weight_block_size to the block size the checkpoint was quantised with.") \
                        from None
        return [out[n] for n in names]


_SCALE_SUFFIX = "_scale_inv"  # "<name>.weight_scale_inv": the per-block scales of the FP8 tensor "<name>.weight"


def dequantize_fp8_blockwise(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """A block-quantised FP8 weight [rows, cols] in float32: every (block[0] x block[1]) block times its scale,
    scale_inv[i, j] scaling rows i*block[0]... and columns j*block[1]... (the last blocks of each dimension may be
    partial). The formula of DeepSeek-V3's checkpoints, transformers' Fp8Dequantize and SGLang's block_quant_dequant,
    computed as they compute it: the FP8 value and its scale multiplied in float32. Raises ValueError when the scale
    grid does not fit the weight and block."""
    rows, cols = weight.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != grid:
        raise ValueError(f"a {list(weight.shape)} weight in {list(block)} blocks needs a {list(grid)} scale grid, "
                         f"got {list(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return weight.float() * scale


def _fp8_block(raw: dict, config_path: str) -> tuple[int, int] | None:
    """config.json quantization_config -> the FP8 block size; None without one. Anything but block-wise FP8 with
    dynamic activation scales is refused (megarl would have to read those methods' own tensors)."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    fields = quant if isinstance(quant, dict) else {}
    method, block = fields.get("quant_method"), fields.get("weight_block_size")
    fix = ("Fix: use an unquantised (bf16/fp32) checkpoint, or a block-wise FP8 one (quant_method: fp8, fmt: e4m3, "
           "weight_block_size: [128, 128], activation_scheme: dynamic, as DeepSeek-V3 / Kimi-K2 ship).")
    if method != "fp8" or (fields.get("fmt") or "e4m3") != "e4m3" or \
            (fields.get("activation_scheme") or "dynamic") != "dynamic":
        raise ModelFolderError(f"{config_path}: quantization_config {quant!r} is not supported: megarl loads only "
                               f"block-wise FP8 weights (dequantised into the trainer's dtype). {fix}")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ModelFolderError(f"{config_path}: quantization_config.weight_block_size={block!r}: megarl loads only "
                               f"block-wise FP8 weights, which need two positive block sizes. {fix}")
    return block[0], block[1]


def model_shape(fields: Mapping) -> ModelShape:
    """config.json fields -> ModelShape. An expert's FFN width is moe_intermediate_size, or intermediate_size for
    Mixtral (whose experts are as wide as a dense MLP and which has no moe_intermediate_size). Shared experts:
    Qwen2-MoE's shared_expert_intermediate_size, or n_shared_experts x moe_intermediate_size (DeepSeek-V3, GLM-4.5).
    Dense layers of a MoE model: first_k_dense_replace (DeepSeek-V3, GLM-4.5)."""
    def opt(key):
        return int(fields[key]) if fields.get(key) is not None else None

    heads = int(fields["num_attention_heads"])
    experts = next((int(fields[k]) for k in _EXPERT_COUNT_FIELDS if fields.get(k)), None)
    moe_ffn = int(fields.get("moe_intermediate_size") or fields["intermediate_size"]) if experts else None
    shared = opt("shared_expert_intermediate_size") or \
        (int(fields["n_shared_experts"]) * moe_ffn if experts and fields.get("n_shared_experts") else None)
    mla = fields.get("kv_lora_rank") is not None
    shape = ModelShape(num_layers=int(fields["num_hidden_layers"]), num_attention_heads=heads,
                       num_key_value_heads=int(fields.get("num_key_value_heads") or heads),
                       ffn_hidden_size=int(fields["intermediate_size"]), num_experts=experts,
                       moe_ffn_hidden_size=moe_ffn, hidden_size=opt("hidden_size"), vocab_size=opt("vocab_size"),
                       head_dim=opt("head_dim"), num_dense_layers=opt("first_k_dense_replace") if experts else None,
                       shared_expert_ffn_hidden_size=shared if experts else None,
                       q_lora_rank=opt("q_lora_rank") if mla else None, kv_lora_rank=opt("kv_lora_rank"),
                       qk_nope_head_dim=opt("qk_nope_head_dim") if mla else None,
                       qk_rope_head_dim=opt("qk_rope_head_dim") if mla else None,
                       v_head_dim=opt("v_head_dim") if mla else None,
                       tie_word_embeddings=bool(fields.get("tie_word_embeddings", False)))
    if experts and not fields.get("moe_intermediate_size"):
        shape.moe_ffn_field = "intermediate_size"
    if experts and fields.get("shared_expert_intermediate_size") is None and fields.get("n_shared_experts"):
        shape.shared_expert_field = "n_shared_experts x moe_intermediate_size"
    return shape


# Config fields transformers honours and megarl's Megatron model would silently ignore are refused by
# _unsupported_variant, the one home for these checks (TP/EP divisibility of the widths is ParallelConfig.validate's).
# Each check reads transformers' config (so its defaults and derived fields such as layer_types apply) and returns the
# problem with its fix, or None; a field that is present but has no effect (sliding_window with use_sliding_window false
# or at least max_position_embeddings, attention_bias false) passes.

# Activations transformers' ACT2FN maps to SiLU: mbridge builds every MLP (dense, routed and shared experts) as SwiGLU.
_SILU = ("silu", "swish")
# model_type -> the projections transformers gives a bias when attention_bias is true, for families whose bridge
# does not build them all (o_proj's bias would need megatron-core's add_bias_linear, which adds the MLP biases too, and
# mbridge maps no o_proj bias). GLM-4.5's attention_bias (q/k/v only) is built (bridge._FAMILY_CONFIG); Qwen2 has no
# such field (its q/k/v biases are always there).
_ATTENTION_BIASES = {"llama": "q/k/v/o_proj", "qwen3": "q/k/v/o_proj", "qwen3_moe": "q/k/v/o_proj",
                     "deepseek_v3": "q_a_proj/kv_a_proj_with_mqa/o_proj"}
# Families whose attention transformers restricts to a sliding window (the bridge sets no attention window).
_SLIDING_WINDOW_FAMILIES = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral")


def _activation(config) -> str | None:
    act = getattr(config, "hidden_act", "silu")
    if act not in _SILU:
        return (f"hidden_act={act!r} is not supported for {config.model_type} (the bridge builds every MLP as SwiGLU: "
                "SiLU-gated). Fix: use a model with hidden_act: silu.")
    return None


def _biases(config) -> str | None:
    model_type = config.model_type
    if model_type in _ATTENTION_BIASES and getattr(config, "attention_bias", False):
        return (f"attention_bias=true ({_ATTENTION_BIASES[model_type]} biases) is not supported for {model_type} (the "
                "bridge does not build these biases). Fix: use a model with attention_bias: false.")
    if model_type == "llama" and getattr(config, "mlp_bias", False):
        return ("mlp_bias=true (gate/up/down_proj biases) is not supported for llama (the bridge builds the MLP "
                "without biases). Fix: use a model with mlp_bias: false.")
    return None


def _sliding_window(config) -> str | None:
    """Sliding-window attention that restricts some layer's attention: a window below max_position_embeddings on a
    layer transformers gives one (layer_types, derived from use_sliding_window and max_window_layers for Qwen2/Qwen3/
    Qwen2-MoE; every layer for Qwen3-MoE and Mixtral, whose config sets sliding_window None when it is off)."""
    window = getattr(config, "sliding_window", None)
    if config.model_type not in _SLIDING_WINDOW_FAMILIES or window is None:
        return None
    types = getattr(config, "layer_types", None)
    layers = [i for i, t in enumerate(types) if t == "sliding_attention"] if types is not None else \
        list(range(config.num_hidden_layers))
    max_positions = config.max_position_embeddings
    if not layers or window >= max_positions:
        return None
    if hasattr(config, "use_sliding_window"):
        switch = f"use_sliding_window=true, layer(s) {layers} of {config.num_hidden_layers}"
        if hasattr(config, "max_window_layers"):
            switch += f" per max_window_layers={config.max_window_layers}"
        off = "use_sliding_window: false"
    else:
        switch, off = "every layer", "sliding_window: null"
    return (f"sliding_window={window} ({switch}): sliding-window attention is not supported for {config.model_type} "
            f"(megarl's Megatron model attends to the whole sequence). Fix: use a model without it ({off}), or with "
            f"sliding_window >= max_position_embeddings ({max_positions}).")


def _moe(config) -> str | None:
    model_type = config.model_type
    mlp_only, sparse_step = getattr(config, "mlp_only_layers", None), getattr(config, "decoder_sparse_step", 1)
    if mlp_only or sparse_step != 1:
        # Qwen-MoE's dense layers between MoE layers: mbridge's Qwen-MoE bridges map MoE layers only.
        return (f"mlp_only_layers={mlp_only} / decoder_sparse_step={sparse_step}: dense MLP layers in a {model_type} "
                "model are not supported. Fix: use a model whose every layer is MoE (mlp_only_layers: [], "
                "decoder_sparse_step: 1).")
    if model_type == "qwen2_moe" and not config.shared_expert_intermediate_size:
        # transformers then builds a zero-width shared expert (its gate still has a weight); mbridge always maps one.
        return (f"shared_expert_intermediate_size={config.shared_expert_intermediate_size} (no shared expert) is not "
                "supported for qwen2_moe (the bridge builds Qwen2-MoE with its gated shared expert). Fix: use a model "
                "with shared_expert_intermediate_size > 0.")
    if model_type in SIGMOID_GROUP_ROUTED and not config.n_shared_experts:
        return (f"n_shared_experts={config.n_shared_experts} (no shared experts) is not supported for {model_type} "
                "(the bridge builds the shared experts). Fix: use a model with n_shared_experts >= 1.")
    topk = getattr(config, "num_experts_per_tok", None)
    renormalised = model_type == "mixtral" or getattr(config, "norm_topk_prob", False)
    if topk == 1 and renormalised and model_type not in SIGMOID_GROUP_ROUTED:
        # transformers' top-1 probability renormalised over the top-1 is exactly 1; megatron-core refuses that router
        # (its softmax over one logit, moe_router_pre_softmax false, has no gradient). Without renormalisation
        # (norm_topk_prob false) the top-1 probability is megatron-core's pre-softmax one, which the bridge builds.
        field = "" if model_type == "mixtral" else " with norm_topk_prob=true"
        fix = "num_experts_per_tok >= 2" + ("" if model_type == "mixtral" else ", or norm_topk_prob: false")
        return (f"num_experts_per_tok=1{field} is not supported for {model_type} (the renormalised top-1 weight is "
                f"always 1, a router megatron-core does not build). Fix: use a model with {fix}.")
    if model_type not in SIGMOID_GROUP_ROUTED:
        return None
    if not config.norm_topk_prob:
        # megatron-core always renormalises sigmoid router scores over the top-k (topk_routing_with_score_function).
        return (f"norm_topk_prob=false is not supported for {model_type} (megatron-core renormalises sigmoid router "
                "scores over the top-k). Fix: use a model with norm_topk_prob: true.")
    if topk == 1:
        # transformers renormalises the top-1 sigmoid score to 1; megatron-core skips the renormalisation at top-k 1.
        return (f"num_experts_per_tok=1 is not supported for {model_type} (transformers renormalises the top-1 "
                "sigmoid score to 1, megatron-core weights the expert by the raw score at top-k 1). Fix: use a model "
                "with num_experts_per_tok >= 2.")
    if model_type == "deepseek_v3" and config.q_lora_rank is None:
        # megatron-core 0.19's MLA with q/kv norms (kv_a_layernorm) builds the unfactored query projection as a fused
        # norm + linear: an RMSNorm in front of q_proj that transformers does not have.
        return ("q_lora_rank=null (an unfactored q_proj, as DeepSeek-V2-Lite) is not supported for deepseek_v3 "
                "(megatron-core's multi-latent attention would normalise the query input, transformers does not). "
                "Fix: use a model with q_lora_rank set (DeepSeek-V3: 1536).")
    if model_type == "deepseek_v3" and not getattr(config, "rope_interleave", True):
        # megatron-core's MLA always takes the RoPE dimensions interleaved (apply_rotary_pos_emb with mla=True).
        return ("rope_interleave=false is not supported for deepseek_v3 (megatron-core's multi-latent attention "
                "applies RoPE to interleaved dimensions, as DeepSeek-V3 does). Fix: use a model with rope_interleave: "
                "true.")
    group_topk = config.topk_group
    if config.n_group > 1 and topk // group_topk != 2:
        # DeepSeek scores a group by the sum of its best 2 experts; megatron-core by its best topk // group_topk.
        return (f"num_experts_per_tok={topk} / topk_group={group_topk}: group-limited routing is only exact when "
                "num_experts_per_tok // topk_group == 2 (DeepSeek scores a group by its best 2 experts, megatron-core "
                "by its best num_experts_per_tok // topk_group). Fix: use a model with num_experts_per_tok == "
                "2 * topk_group, or n_group: 1.")
    return None


_VARIANT_CHECKS = (_activation, _biases, _sliding_window, _moe)


def _unsupported_variant(config) -> str | None:
    """What in a supported family's config (transformers' config, so its defaults apply) megarl cannot build exactly,
    with the fix; or None. The first of _VARIANT_CHECKS that objects."""
    for check in _VARIANT_CHECKS:
        problem = check(config)
        if problem:
            return problem
    return None


def open_model_folder(path: str) -> HFModelFolder:
    """Validate and open an HF model folder. No network: the path must be a local directory."""
    if not os.path.isdir(path):
        raise ModelFolderError(f"model folder {path!r} does not exist. Fix: point model.path at a local Hugging Face "
                               "folder (config.json + *.safetensors + tokenizer); megarl never downloads at run time.")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelFolderError(f"{path}: config.json is missing. Fix: save the model with "
                               "`save_pretrained(folder)` so the folder has config.json.")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ModelFolderError(f"{config_path} is not valid JSON ({e}). Fix: restore the file from the original "
                               "model.") from None
    if not isinstance(raw, dict):
        raise ModelFolderError(f"{config_path} must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(f"{t} ({a})" for t, a in SUPPORTED_ARCHITECTURES.items())
        raise ModelFolderError(f"{config_path}: model_type={model_type!r} (architectures={raw.get('architectures')}) "
                               f"is not supported. Supported: {supported}.")
    missing = [k for k in _REQUIRED_FIELDS if k not in raw]
    if missing:
        raise ModelFolderError(f"{config_path}: required field(s) {missing} missing for model_type {model_type!r}. "
                               "Fix: restore config.json from the original model.")
    for key in _REQUIRED_FIELDS:
        if not isinstance(raw[key], int) or raw[key] < 1:
            raise ModelFolderError(f"{config_path}: field {key} must be a positive integer, got {raw[key]!r}")
    rope_type = ((raw.get("rope_parameters") or raw.get("rope_scaling") or {}).get("rope_type")
                 or (raw.get("rope_scaling") or {}).get("type") or "default")
    if rope_type != "default" and (model_type, rope_type) not in _ROPE_SCALING:
        raise ModelFolderError(f"{config_path}: rope type {rope_type!r} is not supported yet for {model_type} (only "
                               "'default'; DeepSeek-V3's 'yarn'). Fix: use a model without RoPE scaling.")

    fp8_block = _fp8_block(raw, config_path)

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    problem = _unsupported_variant(config)
    if problem:
        raise ModelFolderError(f"{config_path}: {problem}")
    weight_files = _index_weights(path)
    orphans = [n for n in weight_files if n.endswith(_SCALE_SUFFIX) and n[: -len(_SCALE_SUFFIX)] not in weight_files]
    if orphans and fp8_block:
        raise ModelFolderError(f"{path}: scale tensor(s) {orphans[:4]} have no weight. Fix: the folder's weights are "
                               "incomplete; restore them from the original checkpoint.")
    if any(n.endswith(_SCALE_SUFFIX) for n in weight_files) and not fp8_block:
        raise ModelFolderError(f"{config_path}: the weights hold *{_SCALE_SUFFIX} (FP8) tensors but config.json has no "
                               "quantization_config. Fix: restore the checkpoint's quantization_config (quant_method: "
                               "fp8, weight_block_size: [128, 128]).")
    return HFModelFolder(path=path, config=config, weight_files=weight_files, fp8_block=fp8_block)


def _index_weights(path: str) -> dict[str, str]:
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ModelFolderError(f"{path}: no *.safetensors weights. Fix: save with "
                               "`save_pretrained(folder, safe_serialization=True)` (.bin weights are not read).")
    index = {}
    for name in files:
        full = os.path.join(path, name)
        with safe_open(full, framework="pt") as f:
            for key in f.keys():
                index[key] = full
    return index
