"""Where megarl meets the hardware: version pins, CPU shims for megatron-core, and the config flags each device needs.

`setup()` is called by everything that builds Megatron objects (megarl.parallel.initialize does it). It checks the
megatron-core version and, only when CUDA is absent, installs the CPU shims (cpu_shims.py). On a GPU it changes nothing.
"""
from __future__ import annotations

import os

import torch

from .version import PINNED, VersionMismatchError, check_versions

_done = False


def on_gpu() -> bool:
    return torch.cuda.is_available()


def setup() -> None:
    """Idempotent: check pinned versions; on CPU apply the megatron-core shims."""
    global _done
    if _done:
        return
    check_versions()
    if not on_gpu():
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        from . import cpu_shims

        cpu_shims.apply()
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
