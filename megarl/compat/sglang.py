"""SGLang: every place megarl relies on SGLang internals, written for SGLang 0.5.23.

The SGLang server is a child process (megarl/rollout/server.py). On CPU it starts with the folder `sglang_cpu/` next to
this module first on its PYTHONPATH (`CPU_STANDINS`), which holds:

- `sitecustomize.py`: import-time patches of SGLang's CPU engine, each applied when SGLang imports the module it
  patches (`PATCHED_MODULES` below; the file names the SGLang 0.5.23 lines each one works around): per-request seeded
  sampling (only with `SEEDED_SAMPLING_ENV`=1), routed-experts capture on CPU, MLA prefill on the torch_native
  backend (SGLang's private `_dispatch_mla_subtype`), Qwen2-MoE's gated shared expert without Triton, LoRA serving
  without pinned host memory (adapter-only weight sync, megarl/reshard/adapter.py).
- `sgl_kernel/` and `torchvision/`: stand-in packages for the CUDA kernels package and torchvision, which SGLang
  0.5.23 imports unconditionally and which do not load on a CPU torch.

The trainer itself imports a few SGLang internals (public names in internal modules): the flattened-bucket metadata
and serializer for weight updates (megarl/reshard), its process-group helper, its CPU tensor hash, and its OpenAI tool
protocol (megarl/envs). `check_assumptions()` checks all of these by reading SGLang's sources (nothing is imported:
SGLang's modules need the stand-ins above to import on a CPU torch), tests/compat/test_compat.py calls it.
"""
from __future__ import annotations

import importlib.util
import os

VERSION = "0.5.23"  # the SGLang release every entry here was written for (requirements/gpu.txt)
CPU_STANDINS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_cpu")
SEEDED_SAMPLING_ENV = "MEGARL_SGLANG_SEEDED_SAMPLING"

# The SGLang modules sitecustomize.py patches, and what each patch reads in them (source text that must be there).
PATCHED_MODULES = {
    "sglang.srt.sampling.sampling_batch_info": ("def from_schedule_batch(cls, batch", "sampling_seed: Optional"),
    "sglang.srt.state_capturer.base": ("ALLOC_MEMORY_FUNCS", "pin_memory=True"),
    "sglang.srt.models.deepseek_common.attention_backend_handler": (
        "class AttentionBackendRegistry", "def register(cls, backend_name, handler_func)",
        "def _dispatch_mla_subtype(attn, forward_batch)"),
    "sglang.srt.models.qwen2_moe": ("fused_gate_sigmoid_mul_add(",),
    # LoRA serving on CPU: the modules that pin host memory (their `torch` is replaced) and the calls
    "sglang.srt.lora.layers": ("import torch\n", "pin_memory=True", ".cpu().pin_memory()"),
    "sglang.srt.lora.backend.torch_backend": ("import torch\n", "pin_memory=True", ".pin_memory()"),
}
# What the stand-ins stand in for, and the SGLang internals megarl's trainer imports: module -> source text.
USED_INTERNALS = {
    "sglang.kernels.ops.sampling.murmur_hash": ("torch.ops.sgl_kernel.murmur_hash32_cpu",),  # sgl_kernel stand-in
    "sglang.srt.weight_sync.tensor_bucket": ("class FlattenedTensorMetadata",),  # megarl/reshard/buckets.py
    "sglang.srt.utils.common": ("def init_custom_process_group(", "class MultiprocessingSerializer"),  # transports
    "sglang.srt.managers.mm_utils": ("def tensor_hash(",),  # megarl/reshard/verify.py
    "sglang.srt.entrypoints.openai.protocol": ("class Function(", "class Tool("),  # megarl/envs/tool_env.py
    "sglang.srt.function_call.function_call_parser": ("class FunctionCallParser",),
    # megarl/reshard/sync.py: how the engine refuses a second weight-update window (taking over a dead trainer's)
    "sglang.srt.managers.scheduler_components.weight_updater": ("a weight-update session is already open",),
    # megarl/reshard/adapter.py: the adapter-only sync's endpoints and the load request's fields
    "sglang.srt.entrypoints.http_server": ('"/load_lora_adapter_from_tensors"', '"/unload_lora_adapter"',
                                          '"/v1/models"', "parent=served_model_names[0]"),
    "sglang.srt.managers.io_struct": ("class LoadLoRAAdapterFromTensorsReqInput", "config_dict: Dict[str, Any]",
                                      "serialized_named_tensors: Annotated[List[bytes]"),
    # megarl/compat/sglang.py load_weight_delta: the custom weight loader extension point, and that every update path
    # loads through the model's load_weights
    "sglang.srt.model_executor.model_runner_components.weight_updater": (
        "elif load_format in self.custom_weight_loaders:", "custom_loader(self.get_model(), named_tensors)",
        "self.get_model().load_weights(named_tensors)", "self.get_model().load_weights(reconstructed_tensors)"),
    "sglang.srt.arg_groups.fields.model": ("custom_weight_loader: A[",),
}
# SGLang's answer to /begin_weight_update while a window is open (it keeps one per engine, whoever opened it)
WEIGHT_WINDOW_OPEN = "a weight-update session is already open"

# Delta weight sync (megarl/reshard/delta.py). SGLang loads every weight update (tensor, flattened bucket,
# distributed broadcast, disk) through the model's load_weights, which knows HF names only. Its extension point for
# other formats, `--custom-weight-loader`, is reached from /update_weights_from_tensor alone
# (model_runner_components/weight_updater.py: custom_loader(self.get_model(), named_tensors)); the broadcast path has
# none. So the trainer calls DELTA_LOADER once per sync with no tensors, and load_weight_delta wraps the model's
# load_weights (an instance attribute: the model object, not SGLang's code) so that every later load takes megarl's
# sparse updates (name#delta) against the whole tensors this engine was sent, over any transport.
DELTA_LOADER = "megarl.compat.sglang.load_weight_delta"


def load_weight_delta(model, named_tensors) -> None:
    """SGLang's custom weight loader (runs in each engine TP rank's scheduler): make the model's load_weights take
    delta updates (once per model object; a restarted engine is a new one), then load `named_tensors` through it."""
    if not getattr(model.load_weights, "megarl_delta", False):
        from ..reshard.delta import apply_delta

        load_weights, base = model.load_weights, {}  # base: the whole HF tensors this engine holds, in host memory

        def load_with_deltas(weights, *args, **kwargs):
            return load_weights(apply_delta(base, weights), *args, **kwargs)

        load_with_deltas.megarl_delta = True
        model.load_weights = load_with_deltas
    if named_tensors:
        model.load_weights(list(named_tensors))


def cpu_server_env(env: dict, seeded_sampling: bool) -> dict:
    """The CPU server's environment with the stand-ins and patches on its PYTHONPATH (first), and the seeded-sampling
    patch switched on when asked."""
    env["PYTHONPATH"] = os.pathsep.join(p for p in (CPU_STANDINS, env.get("PYTHONPATH")) if p)
    if seeded_sampling:
        env[SEEDED_SAMPLING_ENV] = "1"
    return env


def _source(module: str) -> str | None:
    """A module's source text, found without importing it (nor, for a submodule, its packages' __init__)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(spec.submodule_search_locations[0], *rest)
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            with open(candidate, errors="replace") as f:
                return f.read()
    return None


def check_assumptions() -> list[str]:
    """What megarl relies on in the installed SGLang; returns the broken assumptions (empty: all hold)."""
    from importlib import metadata

    try:
        installed = metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return ["sglang is not installed"]
    problems = [] if installed == VERSION else [f"sglang {installed} is installed, this module was written for "
                                                f"{VERSION}"]
    for module, texts in {**PATCHED_MODULES, **USED_INTERNALS}.items():
        source = _source(module)
        if source is None:
            problems.append(f"{module} is gone")
            continue
        problems += [f"{module} no longer has {text!r}" for text in texts if text not in source]
    return problems
