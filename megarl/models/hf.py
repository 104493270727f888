"""Reading a Hugging Face model folder (config.json + *.safetensors + tokenizer), with errors that say what to fix."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from ..errors import UserError
from ..parallel.config import ModelShape

# model_type -> the transformers architecture class name megarl supports for it.
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_REQUIRED_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")


class ModelFolderError(UserError, ValueError):
    """A model folder megarl cannot use; the message names the file/field and the fix."""


@dataclass
class HFModelFolder:
    path: str
    config: "object"  # transformers.PretrainedConfig
    weight_files: dict[str, str]  # HF tensor name -> safetensors file path

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def is_moe(self) -> bool:
        return bool(getattr(self.config, "num_experts", None))

    @property
    def rope_theta(self) -> float:
        # transformers 5 keeps rope settings in config.rope_parameters; older configs have rope_theta.
        params = getattr(self.config, "rope_parameters", None) or {}
        return float(params.get("rope_theta", getattr(self.config, "rope_theta", 10000.0)))

    def shape(self) -> ModelShape:
        c = self.config
        return ModelShape(num_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                          num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
                          ffn_hidden_size=c.intermediate_size, num_experts=getattr(c, "num_experts", None),
                          moe_ffn_hidden_size=getattr(c, "moe_intermediate_size", None))

    def read(self, names: Iterable[str]) -> list[torch.Tensor]:
        """Load the named tensors (only those) from the safetensors files."""
        from safetensors import safe_open

        names = list(names)
        missing = [n for n in names if n not in self.weight_files]
        if missing:
            raise ModelFolderError(f"{self.path}: tensor(s) {missing[:4]} are not in any *.safetensors file. "
                                   "Fix: the folder's weights do not match its config.json; re-export the model.")
        out = {}
        by_file: dict[str, list[str]] = {}
        for n in names:
            by_file.setdefault(self.weight_files[n], []).append(n)
        for file, file_names in by_file.items():
            with safe_open(file, framework="pt") as f:
                for n in file_names:
                    out[n] = f.get_tensor(n)
        return [out[n] for n in names]


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
    if rope_type != "default":
        raise ModelFolderError(f"{config_path}: rope type {rope_type!r} is not supported yet (only 'default'). "
                               "Fix: use a model without RoPE scaling.")

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    return HFModelFolder(path=path, config=config, weight_files=_index_weights(path))


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
