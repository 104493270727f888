"""CPU stand-in for torchvision, put on the SGLang server's PYTHONPATH only on CPU.

SGLang 0.5.23 imports torchvision at module level (multimodal processors), but the torchvision on PyPI does not load
beside the CPU torch 2.13.0 wheel ('operator torchvision::nms does not exist'). megarl serves text-only models, so the
submodules SGLang imports are registered here; using anything from them raises NotImplementedError naming it.
"""
import enum
import sys
import types

__version__ = "0.0.0+megarl.cpu.stand.in"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def _unavailable(qualified_name):
    class Unavailable:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError(f"torchvision stand-in: {qualified_name} is not available on megarl's CPU stack")

        def __call__(self, *args, **kwargs):
            raise NotImplementedError(f"torchvision stand-in: {qualified_name} is not available on megarl's CPU stack")

    Unavailable.__name__ = qualified_name.rsplit(".", 1)[-1]
    return Unavailable


def _submodule(name):
    module = types.ModuleType(f"{__name__}.{name}")
    module.InterpolationMode = InterpolationMode

    def __getattr__(attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _unavailable(f"{module.__name__}.{attr}")

    module.__getattr__ = __getattr__
    sys.modules[module.__name__] = module
    parent, _, leaf = name.rpartition(".")
    setattr(sys.modules[f"{__name__}.{parent}"] if parent else sys.modules[__name__], leaf, module)
    return module


for _name in ("transforms", "transforms.functional", "transforms.v2", "transforms.v2.functional", "io", "ops",
              "models", "utils", "datasets"):
    _submodule(_name)
