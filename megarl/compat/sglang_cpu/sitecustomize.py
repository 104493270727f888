"""Import-time patches for SGLang's CPU engine, loaded only by megarl's CPU SGLang servers (this folder is on their
PYTHONPATH). Each patch is applied when SGLang imports the module it patches.

1. Per-request seeded sampling (only when MEGARL_SGLANG_SEEDED_SAMPLING=1). 2. Routed-experts capture on CPU.
3. Multi-latent attention (DeepSeek-V3) prefill on the torch_native backend. 4. Qwen2-MoE's gated shared expert without
Triton. 5. LoRA serving (--enable-lora, adapter-only weight sync) without pinned memory. (2 to 5: see their
functions.)

Why: an RL run that is killed and resumed must draw the same rollouts as an uninterrupted one, so megarl gives every
request a `sampling_seed`. SGLang 0.5.23 honours per-request seeds only under --enable-deterministic-inference
(sglang/srt/sampling/sampling_batch_info.py:128, `enable_deterministic`), and that flag is refused with the
torch_native attention backend, the only one on CPU (sglang/srt/arg_groups/overrides.py:1119); it would also swap
aten::mm for Triton batch-invariant kernels, which do not exist on CPU. On GPU megarl uses the real flag.

What: after SGLang builds a batch's SamplingBatchInfo, when the requests carry `sampling_seed` and SGLang left the
seed tensor unset, set it (one int64 per request, 42 for a request without a seed, as SGLang does). SGLang's own
seeded sampler (`multinomial_with_seed`, a hash of seed and position) then draws each token; filtering and merging
of batches already carry the tensor along.
"""
import importlib.abc
import importlib.machinery
import os
import sys
import types


def _patch_seeded_sampling(module) -> None:
    import torch

    cls = module.SamplingBatchInfo
    original = cls.from_schedule_batch.__func__

    def from_schedule_batch(klass, batch, vocab_size):
        info = original(klass, batch, vocab_size)
        seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
        if info.sampling_seed is None and any(s is not None for s in seeds):
            info.sampling_seed = torch.tensor([42 if s is None else s for s in seeds], dtype=torch.int64,
                                              device=batch.device)
        return info

    cls.from_schedule_batch = classmethod(from_schedule_batch)


def _patch_routed_experts_host_cache(module) -> None:
    """2. Routed-experts capture (--enable-return-routed-experts, rollout routing replay) on CPU.

    Why: SGLang 0.5.23 allocates the capturer's host buffer with pin_memory=True (sglang/srt/state_capturer/base.py:67,
    BaseHostCache.__init__), which registers it with cudaHostRegister (sglang/srt/mem_cache/pool_host/common.py:147)
    and fails on a CPU-only torch ("Torch not compiled with CUDA enabled"). On CPU the "device" and host buffers are
    the same memory, so a plain tensor is what pinning would have bought. What: the capturer module's allocator table
    gets a plain allocation for "cpu"; SGLang's shared table (HiCache host pools) is left alone.
    """
    import torch

    def plain(dims, dtype, device, pin_memory, allocator, **_):
        return torch.empty(dims, dtype=dtype, device=device)

    table = dict(module.ALLOC_MEMORY_FUNCS)
    table["cpu"] = plain
    module.ALLOC_MEMORY_FUNCS = table


def _patch_mla_on_torch_native(module) -> None:
    """3. DeepSeek-V3 (multi-latent attention) on the torch_native attention backend: prefill through the absorbed MLA
    path.

    Why: SGLang 0.5.23 has no MLA dispatch of its own for torch_native, so it takes triton's
    (sglang/srt/models/deepseek_common/attention_backend_handler.py, AttentionBackendRegistry.get_handler), which sends
    every prefill without a cached prefix down the MHA path (forward_mha.py: k and v expanded through kv_b_proj, then
    attn_mha(..., save_kv_cache=False)). torch_native's forward_extend ignores the k and v it is given and attends over
    the layer's KV cache (layers/attention/torch_native_backend.py, get_key_buffer / get_value_buffer), which for MLA
    holds the compressed latent: the normalised kv_a as the value, kv_b_proj never applied. The prompt's log-probs
    and every token after it were those of another function (up to 2 nats from transformers on a tiny DeepSeek-V3;
    shapes that do not line up by chance crash at start-up). What: torch_native gets the MLA dispatch SGLang's other
    CPU path uses (_dispatch_mla_subtype: the absorbed path, which writes and reads the latent cache consistently).
    With it the engine equals transformers to ~1e-6, also after weight updates (post_load_weights rebuilds w_kc/w_vc
    from each kv_b_proj it receives).
    """
    module.AttentionBackendRegistry.register("torch_native", module._dispatch_mla_subtype)


def _patch_qwen2_moe_shared_expert_gate(module) -> None:
    """4. Qwen2-MoE's gated shared expert on CPU without AMX.

    Why: SGLang 0.5.23's Qwen2MoeSparseMoeBlock.forward (sglang/srt/models/qwen2_moe.py:821) adds the shared expert's
    output through `fused_gate_sigmoid_mul_add`, a Triton kernel (sglang/kernels/ops/elementwise/elementwise.py:159),
    whenever the gate is not on Intel's AMX backend; on a CPU without AMX Triton has no driver and the server dies in
    its first forward ("0 active drivers"). What: the module's name is bound to the same computation in torch,
    output += sigmoid(hidden_states . gate_weight) * shared_output per token, in float32 as the kernel computes it.
    """
    import torch

    def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states) -> None:
        gate = torch.sigmoid(hidden_states.float() @ gate_weight.float())[:, None]
        final_hidden_states.copy_(final_hidden_states.float() + gate * shared_output.float())

    module.fused_gate_sigmoid_mul_add = fused_gate_sigmoid_mul_add


class _TorchWithoutPinning(types.ModuleType):
    """torch as one SGLang module sees it: every attribute is torch's, except that the tensor factories ignore
    pin_memory (see _patch_lora_pinned_memory)."""

    _FACTORIES = ("tensor", "zeros", "empty", "ones", "full", "arange")

    def __init__(self, torch):
        super().__init__("torch")
        self._torch = torch

    def __getattr__(self, name):
        value = getattr(self._torch, name)
        if name not in self._FACTORIES:
            return value

        def unpinned(*args, pin_memory=False, **kwargs):
            return value(*args, **kwargs)

        return unpinned


def _patch_lora_pinned_memory(module) -> None:
    """5. LoRA serving on CPU (--enable-lora --lora-backend torch_native, megarl's adapter-only weight sync).

    Why: SGLang 0.5.23 stages the LoRA layers' output offsets and every batch's LoRA indices in pinned host memory
    whatever the device: sglang/srt/lora/layers.py:145 (also :324, :479, :723, :814: torch.tensor(...,
    pin_memory=True); :594: .pin_memory()), run when the LoRA layers are built at start-up, and
    sglang/srt/lora/backend/torch_backend.py:225-244 (prepare_lora_batch: .pin_memory() on :225, :228, :233, :234,
    pin_memory=True on :237, :241, :244), run for every batch. A CPU-only torch has no pinned-memory allocator
    ("pin_memory=True requires a CUDA or other accelerator backend" / "Cannot access accelerator device when none is
    available"): the server dies while building the model. On CPU the host memory is the device's memory, so the
    unpinned tensor is what pinning would have bought.
    What: the two modules' `torch` is torch with factories that ignore pin_memory (_TorchWithoutPinning: only these
    modules' calls change), and Tensor.pin_memory returns the tensor itself when torch has no accelerator. A method
    cannot be replaced for one module only; the replacement changes only calls that would raise otherwise (every
    pin_memory() call on a CPU-only torch), and SGLang's own pinning paths check is_pin_memory_available() first.
    """
    import torch

    module.torch = _TorchWithoutPinning(torch)
    if not torch.accelerator.is_available() and not getattr(torch.Tensor.pin_memory, "_megarl_unpinned", False):
        def pin_memory(self, device=None):
            return self

        pin_memory._megarl_unpinned = True
        torch.Tensor.pin_memory = pin_memory


_PATCHES = {"sglang.srt.state_capturer.base": _patch_routed_experts_host_cache,
            "sglang.srt.models.deepseek_common.attention_backend_handler": _patch_mla_on_torch_native,
            "sglang.srt.models.qwen2_moe": _patch_qwen2_moe_shared_expert_gate,
            "sglang.srt.lora.layers": _patch_lora_pinned_memory,
            "sglang.srt.lora.backend.torch_backend": _patch_lora_pinned_memory}
if os.environ.get("MEGARL_SGLANG_SEEDED_SAMPLING") == "1":
    _PATCHES["sglang.srt.sampling.sampling_batch_info"] = _patch_seeded_sampling


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchOnImport())
