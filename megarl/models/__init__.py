"""Models: HF folders -> Megatron GPTModel (megarl.models.hf.SUPPORTED_ARCHITECTURES), weight load/export, tiny test
models."""
from .bridge import ModelBridge, is_expert_param
from .checkpoint import load_model_checkpoint, save_model_checkpoint
from .forward import PackedLayout, causal_inputs, forward_logits, packed_layouts
from .hf import SUPPORTED_ARCHITECTURES, HFModelFolder, ModelFolderError, open_model_folder
from .tiny import FAMILIES, write_tiny_model, write_tokenizer

__all__ = ["FAMILIES", "SUPPORTED_ARCHITECTURES", "HFModelFolder", "ModelBridge", "ModelFolderError", "PackedLayout",
           "causal_inputs", "forward_logits", "is_expert_param", "load_model_checkpoint", "open_model_folder",
           "packed_layouts",
           "save_model_checkpoint", "write_tiny_model", "write_tokenizer"]
