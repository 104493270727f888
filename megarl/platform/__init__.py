"""Where megarl meets the hardware: version pins, installing the CPU shims for megatron-core, and the config flags
each device needs.

`setup()` is called by everything that builds Megatron objects (megarl.parallel.initialize does it). Only when CUDA is
absent, it checks the megatron-core version (the CPU shims patch lines of exactly that release) and installs the CPU
shims (megarl/compat/megatron.py). On a GPU it changes nothing: megatron-core's own CUDA paths need no shim, so no pin
is enforced.
"""
from __future__ import annotations

import logging
import os
import warnings

import torch

from .version import PINNED, VersionMismatchError, check_versions

_done = False
# Notices megatron-core and mbridge print at import on every rank, none of which a megarl user can act on: the
# optional CUDA packages are absent on CPU by design, and the rest are about APIs megarl does not use.
_IMPORT_NOTICES = ("Apex is not installed", "absl.logging is not installed", "full scope is deprecated",
                   "MimoModelConfig is experimental")
for _notice in _IMPORT_NOTICES + (("Transformer Engine and Apex are not installed",) if not torch.cuda.is_available()
                                  else ()):
    warnings.filterwarnings("ignore", message=f".*{_notice}", category=UserWarning)
# megatron-core 0.19.2 logs that GPTModel is deprecated in favour of HybridModel each time one is built; megarl builds
# GPTModel on purpose (mbridge maps onto it).
logging.getLogger("megatron.core.models.gpt.gpt_model").addFilter(lambda r: "IS DEPRECATED" not in r.getMessage())


def on_gpu() -> bool:
    return torch.cuda.is_available()


def setup() -> None:
    """Idempotent: on CPU, check the pinned megatron-core version and apply its shims."""
    global _done
    if _done:
        return
    if not on_gpu():
        check_versions()  # where the shims apply, and only there
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        from ..compat import megatron

        megatron.apply()
    _done = True


def transformer_config_overrides() -> dict:
    """TransformerConfig fields the current device needs.

    CPU: no fused kernels (they are CUDA/apex/TE code), CPU initialisation, fp32. `batch_p2p_comm=False` on any
    gloo run: with the interleaved (VPP) schedule, batched isend/irecv over gloo silently swaps messages (wrong losses,
    no error); plain isend/irecv is exact.
    """
    if on_gpu():
        return {}
    return dict(
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        moe_grouped_gemm=False,
        batch_p2p_comm=False,
        overlap_p2p_comm=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        bf16=False,
        fp16=False,
    )


def distributed_backend() -> str:
    return "nccl" if on_gpu() else "gloo"


__all__ = ["PINNED", "VersionMismatchError", "check_versions", "distributed_backend", "on_gpu", "setup",
           "transformer_config_overrides"]
