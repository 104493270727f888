"""CPU stand-in for SGLang's `sgl_kernel` (CUDA kernels), put on the SGLang server's PYTHONPATH only on CPU.

SGLang 0.5.23 imports sgl_kernel unconditionally (mem_cache/memory_pool.py imports copy_all_layer_kv_cache_cpu), but
its CPU engine with the torch_native attention backend never calls these kernels for the models megarl serves on CPU.
Any kernel that is called raises NotImplementedError naming it, so a missing kernel is loud, never silently wrong.

One CPU op is provided for real: `torch.ops.sgl_kernel.murmur_hash32_cpu`, which SGLang's seeded sampler
(sglang/kernels/ops/sampling/murmur_hash.py:115, used for per-request `sampling_seed`) calls on CPU. It is the same
MurmurHash3 mix of (seed low, seed high, position, column) as SGLang's Triton kernel, in int64 torch arithmetic.
"""
import torch

__version__ = "0.4.10"

_M32 = 0xFFFFFFFF


def _rotl(x, r):
    return ((x << r) | (x >> (32 - r))) & _M32


def _mix(h, k):
    k = _rotl((k * 0xCC9E2D51) & _M32, 15)
    k = (k * 0x1B873593) & _M32
    h = _rotl(h ^ k, 13)
    return (h * 5 + 0xE6546B64) & _M32


def _fmix(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def murmur_hash32_cpu(seed: torch.Tensor, positions: torch.Tensor, col_indices: torch.Tensor) -> torch.Tensor:
    """[n, m] hashes (values in [0, 2^32), int64) of each row's (seed, position) with each column index."""
    seed = seed.view(torch.int64) if seed.dtype == torch.uint64 else seed.to(torch.int64)
    low, high = (seed & _M32).unsqueeze(1), ((seed >> 32) & _M32).unsqueeze(1)
    pos = (positions.to(torch.int64) & _M32).unsqueeze(1)
    col = (col_indices.to(torch.int64) & _M32).unsqueeze(0)
    h = _mix(_mix(_mix(torch.zeros_like(low), low), high), pos)
    return _fmix(_mix(h, col) ^ 16)


_lib = torch.library.Library("sgl_kernel", "FRAGMENT")
_lib.define("murmur_hash32_cpu(Tensor seed, Tensor positions, Tensor col_indices) -> Tensor")
_lib.impl("murmur_hash32_cpu", murmur_hash32_cpu, "CPU")


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is a CUDA kernel and was called on CPU")

    _missing.__name__ = name
    return _missing
