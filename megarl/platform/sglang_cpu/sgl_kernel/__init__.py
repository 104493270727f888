"""CPU stand-in for SGLang's `sgl_kernel` (CUDA kernels), put on the SGLang server's PYTHONPATH only on CPU.

SGLang 0.5.23 imports sgl_kernel unconditionally (mem_cache/memory_pool.py imports copy_all_layer_kv_cache_cpu), but
its CPU engine with the torch_native attention backend never calls these kernels for the models megarl serves on CPU.
Any kernel that is called raises NotImplementedError naming it, so a missing kernel is loud, never silently wrong.
"""
__version__ = "0.4.10"


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def _missing(*args, **kwargs):
        raise NotImplementedError(f"sgl_kernel stand-in: {name} is a CUDA kernel and was called on CPU")

    _missing.__name__ = name
    return _missing
