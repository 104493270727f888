"""megatron-core: every place megarl relies on megatron-core internals, written for megatron-core 0.19.2.

What lives here (callers import it from megarl.compat.megatron; nothing else in megarl touches these):

- The CPU shims: monkeypatches that let megatron-core 0.19.2 run on a CPU-only torch build with gloo (`SHIMS`,
  `apply`, `revert`, `applied`). megatron-core is written for CUDA: it asks torch.cuda for the current device, RNG state
  and streams, and creates a few scratch tensors with a hard-coded device="cuda". On a CPU torch build each of those
  raises. Every shim below names the megatron-core file and line it works around (0.19.2) and is covered by a test in
  tests/platform/test_platform_shims.py that fails when the shim is reverted. They are applied by `megarl.platform.setup()`
  only when CUDA is absent. Each shim records what it replaced, so a test can revert one shim (in a forked rank) and
  watch megatron-core fail.
- megatron's global process-group state (`megatron.core.parallel_state`): creating and destroying it
  (`initialize_model_parallel`, `destroy_model_parallel`), reading its groups as a ProcessGroupCollection
  (`process_groups_from_parallel_state`, behind the one user adapter megarl.parallel.user_groups), and the optimizer,
  which in 0.19.2 only works on those global groups here (`get_megatron_optimizer`). Everywhere else megarl passes
  the ProcessGroupCollection explicitly.
- megatron-core's rank layout (`rank_generator`: RankGenerator and the private `_inject_gtp_remat_axis`) for the
  launch planner, and MLA's local core attention on CPU (`mla_core_attention`).

`check_assumptions()` checks that every private member and signature used here is still there (tests/compat/test_compat.py).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import queue
from dataclasses import dataclass
from typing import Callable

import inspect

import torch

VERSION = "0.19.2"  # the megatron-core release every entry here was written for (megarl.platform.PINNED)
_MISSING = object()


class _Patches:
    """Records (owner, attribute, previous value) so a shim can be reverted exactly."""

    def __init__(self) -> None:
        self.undo: list[tuple[object, str, object]] = []

    def set(self, owner: object, attr: str, value: object) -> None:
        self.undo.append((owner, attr, vars(owner).get(attr, _MISSING)))
        setattr(owner, attr, value)

    def revert(self) -> None:
        for owner, attr, old in reversed(self.undo):
            if old is _MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, old)
        self.undo.clear()


@dataclass
class Shim:
    name: str
    works_around: str  # megatron-core 0.19.2 file:line and what fails there
    install: Callable[[_Patches], None]


# ------------------------------------------------------------------------------------------------ torch.cuda queries
def _current_device(p: _Patches) -> None:
    p.set(torch.cuda, "current_device", lambda: "cpu")


def _rng(p: _Patches) -> None:
    import megatron.core.tensor_parallel.random as mrandom

    p.set(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
    p.set(torch.cuda, "set_rng_state", lambda new_state, device="cuda": torch.set_rng_state(new_state))
    p.set(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    p.set(mrandom, "_get_cuda_rng_state", lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
    p.set(mrandom, "_set_cuda_rng_state", lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))


def _synchronize(p: _Patches) -> None:
    p.set(torch.cuda, "synchronize", lambda device=None: None)


class _CpuStream(torch.cpu.Stream):
    def __init__(self, device=None, priority=0, **kwargs):
        super().__init__()

    def record_event(self, event=None):
        return torch.cpu.Event()

    def wait_stream(self, stream):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


_DEFAULT_STREAM = _CpuStream()


def _streams(p: _Patches) -> None:
    p.set(torch.cuda, "Stream", _CpuStream)
    p.set(torch.cuda, "Event", torch.cpu.Event)
    p.set(torch.cuda, "current_stream", lambda device=None: _DEFAULT_STREAM)
    p.set(torch.cuda, "default_stream", lambda device=None: _DEFAULT_STREAM)
    p.set(torch.cuda, "stream", torch.cpu.stream)


# ---------------------------------------------------------------------------------------- hard-coded device="cuda"
_FACTORIES = frozenset({"zeros", "ones", "empty", "full", "tensor", "arange", "zeros_like", "ones_like",
                        "empty_like", "full_like", "randn", "rand", "randint", "as_tensor"})


class _TorchOnCpu:
    """Stands in for the `torch` global of one megatron-core module: tensor factories asked for device="cuda" build on
    the CPU; every other attribute is the real torch."""

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name not in _FACTORIES:
            return attr

        @functools.wraps(attr)
        def factory(*args, **kwargs):
            device = kwargs.get("device")
            if (isinstance(device, str) and device.startswith("cuda")) or (
                    isinstance(device, torch.device) and device.type == "cuda"):
                kwargs["device"] = "cpu"
            return attr(*args, **kwargs)

        return factory


HARDCODED_CUDA_MODULES = (
    "megatron.core.pipeline_parallel.schedules",  # :749/:1121/:2292 total_num_tokens
    "megatron.core.optimizer.optimizer",  # :690/:698/:702/:1249 found_inf, _scale
    "megatron.core.optimizer.clip_grads",  # :96/:108/:231 total_norm_cuda
    "megatron.core.distributed.param_and_grad_buffer",  # :1145
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.utils",  # :1332 local_multi_tensor_l2_norm (grad norm without apex/TE)
)


def _hardcoded_cuda(p: _Patches) -> None:
    for module in HARDCODED_CUDA_MODULES:
        p.set(importlib.import_module(module), "torch", _TorchOnCpu())


# ----------------------------------------------------------------------------------------------------- type() names
_TENSOR_TYPE = torch.Tensor.type
_type_depth = [0]


def _type_with_cuda_names(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        return _TENSOR_TYPE(self).replace("torch.", "torch.cuda.", 1)
    return _TENSOR_TYPE(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def _cuda_type_names():
    _type_depth[0] += 1
    torch.Tensor.type = _type_with_cuda_names
    try:
        yield
    finally:
        _type_depth[0] -= 1
        if _type_depth[0] == 0:
            torch.Tensor.type = _TENSOR_TYPE


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapped


def _cuda_type_names_in_optimizers(p: _Patches) -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    dist_opt = distrib_optimizer.DistributedOptimizer
    for owner, name in ((dist_opt, "_build_model_and_main_param_groups"), (dist_opt, "__init__"),
                        (optimizer.Float16OptimizerWithFloat16Params, "__init__")):
        raw = vars(owner)[name]
        if isinstance(raw, classmethod):
            p.set(owner, name, classmethod(_with_cuda_type_names(raw.__func__)))
        else:
            p.set(owner, name, _with_cuda_type_names(raw))
    clip = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    p.set(clip_grads, "clip_grad_by_total_norm_fp32", clip)
    p.set(optimizer, "clip_grad_by_total_norm_fp32", clip)


# ----------------------------------------------------------------------------------------------------------- MoE
def _moe_split_sizes(p: _Patches) -> None:
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy() if as_numpy else tensor
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    p.set(moe_utils, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)
    p.set(token_dispatcher, "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


def _sequence_parallel_torch_norm(p: _Patches) -> None:
    from megatron.core.transformer import torch_norm

    def __new__(cls, config, hidden_size, eps=1e-5, persist_layer_norm=False, zero_centered_gamma=False,
                normalization="LayerNorm"):
        if config.layernorm_zero_centered_gamma:
            raise ValueError("layernorm_zero_centered_gamma needs TransformerEngine or apex (GPU)")
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            # finalize_model_grads all-reduces grads of params tagged sequence_parallel over TP (as apex does).
            setattr(param, "sequence_parallel", config.sequence_parallel)
        return norm

    p.set(torch_norm.WrappedTorchNorm, "__new__", __new__)


def _uneven_collectives(p: _Patches) -> None:
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    gather, reduce_scatter = mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        sizes = [int(x) for x in output_split_sizes]
        padded = input_.new_zeros([max(sizes)] + list(input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:n] for part, n in zip(parts, sizes)], dim=0)

    def _reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        full = input_.contiguous().clone()
        dist.all_reduce(full, group=group)
        return torch.split(full, [int(x) for x in input_split_sizes], dim=0)[group.rank()].contiguous()

    p.set(mappings, "_gather_along_first_dim", _gather_along_first_dim)
    p.set(mappings, "_reduce_scatter_along_first_dim", _reduce_scatter_along_first_dim)


def _tensor_cuda(p: _Patches) -> None:
    p.set(torch.Tensor, "cuda", lambda self, device=None, non_blocking=False, **kwargs: self)


# ---------------------------------------------------------------------------------------- multi-latent attention
def _mla_rope_key_grad(p: _Patches) -> None:
    from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                        scatter_to_sequence_parallel_region)
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    original = MLASelfAttention._qkv_down_projection

    def _qkv_down_projection(self, hidden_states):
        # Return the kv down projection gathered and sequence-sharded, the layout of a replicated down projection:
        # get_query_key_value_tensors then takes its branch for that layout, whose gather_from_sequence_parallel_region
        # of the RoPE key sums the key's gradient over the TP ranks on the way back. (gather: backward keeps this
        # rank's columns; scatter: backward all-gathers the sequence.) Without sequence parallelism (mbridge turns it
        # on whenever tp > 1; ModelBridge refuses MLA at tp > 1 without it on CPU) nothing changes.
        q_compressed, kv_combined = original(self, hidden_states)
        if kv_combined.size(-1) == self.config.kv_lora_rank + self.config.qk_pos_emb_head_dim \
                or not self.config.sequence_parallel:
            return q_compressed, kv_combined
        kv_combined = gather_from_tensor_model_parallel_region(kv_combined, group=self.tp_group)
        return q_compressed, scatter_to_sequence_parallel_region(kv_combined, group=self.tp_group)

    p.set(MLASelfAttention, "_qkv_down_projection", _qkv_down_projection)


# ----------------------------------------------------------------------------------------------- checkpointing
def _checkpoint_results_queue(p: _Patches) -> None:
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        p.set(filesystem_async, "_results_queue", queue.Queue())


SHIMS: dict[str, Shim] = {s.name: s for s in [
    Shim("current_device",
         "models/common/embeddings/rotary_pos_embedding.py:162, utils.py:715/1595, p2p_communication.py:215: "
         "torch.cuda.current_device() places scratch buffers -> AssertionError 'Torch not compiled with CUDA "
         "enabled'. Returns 'cpu'.", _current_device),
    Shim("rng",
         "tensor_parallel/random.py:104/135/303 (model_parallel_cuda_manual_seed, CudaRNGStatesTracker.fork) use "
         "torch.cuda RNG state. The 'device' RNG becomes the CPU RNG.", _rng),
    Shim("synchronize",
         "pipeline_parallel/p2p_communication.py:263: _communicate_shapes (variable_seq_lengths=True) calls "
         "torch.cuda.synchronize(). A no-op on CPU.", _synchronize),
    Shim("streams",
         "transformer/moe/token_dispatcher.py:469/922: MoEAlltoAllTokenDispatcher creates torch.cuda.Stream() and "
         "uses current_stream(). Mapped onto torch.cpu's no-op Stream/Event.", _streams),
    Shim("hardcoded_cuda",
         "pipeline_parallel/schedules.py:749/1121/2292 total_num_tokens=torch.zeros(..., device='cuda'), and the "
         "optimizer/clip-grad/grad-buffer modules listed in HARDCODED_CUDA_MODULES. Factories send 'cuda' to CPU.",
         _hardcoded_cuda),
    Shim("tensor_cuda",
         "models/common/language_module/language_module.py:307: with tied embeddings and PP>1 the last stage's "
         "output weight is moved with `.cuda()` before the embedding all-reduce (also distrib_optimizer.py:1374). "
         "Identity on CPU.", _tensor_cuda),
    Shim("cuda_type_names",
         "optimizer/distrib_optimizer.py:466/477, optimizer/optimizer.py:1028, clip_grads.py:174: params must "
         "report type() 'torch.cuda.FloatTensor' (TypeError 'Wrapped parameters must be one of ...'). Inside just "
         "those functions CPU tensors report the cuda type name.", _cuda_type_names_in_optimizers),
    Shim("moe_split_sizes",
         "transformer/moe/moe_utils.py:1184 maybe_move_tensor_to_cpu turns split sizes into numpy only when "
         "tensor.is_cuda; gloo's all_to_all_single then rejects tensor splits (TypeError, mappings.py:460).",
         _moe_split_sizes),
    Shim("sequence_parallel_torch_norm",
         "transformer/torch_norm.py:50 asserts `not config.sequence_parallel` for the local-spec norm, but MoE with "
         "TP>1 requires sequence parallelism (moe_layer.py). Allows it and tags the params sequence_parallel.",
         _sequence_parallel_torch_norm),
    Shim("uneven_collectives",
         "tensor_parallel/mappings.py:154/159: the alltoall dispatcher with expert-TP>1 gathers/reduce-scatters "
         "uneven splits; gloo needs equal sizes ('ProcessGroupGloo::allgather: invalid tensor size'). Pads.",
         _uneven_collectives),
    Shim("mla_rope_key_grad",
         "transformer/multi_latent_attention.py:739: with the local spec's ColumnParallelLinear kv down projection and "
         "tp > 1, gather_from_tensor_model_parallel_region's backward keeps this rank's columns of the gradient, and "
         "the RoPE key (k_pos_emb, shared by every rank's heads) loses the other ranks' share: logits are right, "
         "gradients are not. The gathered projection takes the replicated-projection branch (line 752), whose "
         "sequence-parallel gather sums the key's gradient (megarl runs tp > 1 with sequence parallelism).",
         _mla_rope_key_grad),
    Shim("checkpoint_results_queue",
         "dist_checkpointing/strategies/filesystem_async.py:53-65 get_write_results_queue() starts a spawn-context "
         "multiprocessing.Manager per rank for a synchronous save (a fresh interpreter that re-imports __main__). "
         "A synchronous save never hands the queue to another process: a queue.Queue is enough.",
         _checkpoint_results_queue),
]}

_applied: dict[str, _Patches] = {}


def apply(names=None) -> list[str]:
    """Install the named shims (default: all). Idempotent."""
    for name in names or SHIMS:
        if name not in _applied:
            patches = _Patches()
            SHIMS[name].install(patches)
            _applied[name] = patches
    return sorted(_applied)


def revert(name: str) -> None:
    """Undo one shim (tests use this in a forked rank to show the shim is needed)."""
    _applied.pop(name).revert()


def applied() -> list[str]:
    return sorted(_applied)


# ---------------------------------------------------------------------------------- megatron's global process groups
# megatron-core keeps one set of process groups in module globals (megatron.core.parallel_state). megarl passes its
# ProcessGroupCollection explicitly everywhere; the global groups still have to exist because parts of megatron-core
# 0.19.2 only read them: the optimizer (below), and the defaults of functions called without a group. These
# functions are the only places megarl reads or writes that state.
def initialize_model_parallel(*, tp: int, pp: int, vpp: int | None, cp: int, ep: int, etp: int | None,
                              timeout_minutes: int, order: str):
    """Create megatron's global groups for this layout (destroying any previous ones) and return them as
    megatron-core's ProcessGroupCollection. megatron-core 0.19.2: parallel_state.initialize_model_parallel (its
    keyword names, `order`)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if (vpp or 1) > 1 else None, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
        distributed_timeout_minutes=timeout_minutes, order=order)
    return process_groups_from_parallel_state()


def model_parallel_is_initialized() -> bool:
    from megatron.core import parallel_state

    return parallel_state.model_parallel_is_initialized()


def destroy_model_parallel() -> None:
    """Destroy megatron's global groups when they exist (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


def process_groups_from_parallel_state():
    """megatron-core's ProcessGroupCollection of the groups in megatron's global state (megatron-core 0.19.2:
    ProcessGroupCollection.use_mpu_process_groups). Raises when that state is not initialised."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    if not model_parallel_is_initialized():
        raise RuntimeError("megatron's model-parallel groups are not initialised: call megarl.parallel.initialize() "
                           "(or megatron.core's initialize_model_parallel) first")
    return ProcessGroupCollection.use_mpu_process_groups()


def pipeline_sizes() -> tuple[int, int | None]:
    """(pp, vpp) of megatron's global groups."""
    from megatron.core import parallel_state

    return (parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_virtual_pipeline_model_parallel_world_size())


def _is_global_collection(pg) -> bool:
    """Whether `pg` holds megatron's global groups (the ones the optimizer will use)."""
    if not model_parallel_is_initialized():
        return False
    mine = process_groups_from_parallel_state()
    return all(getattr(pg, name, None) is getattr(mine, name, None) for name in ("tp", "pp", "dp_cp", "expt_dp"))


def get_megatron_optimizer(config, model: list, pg):
    """megatron-core's get_megatron_optimizer(config, model) for the model built on `pg`.

    Works around megatron-core 0.19.2: get_megatron_optimizer(pg_collection=...) refuses the gloo groups its
    distributed optimizer keeps CPU-side state in (process_groups_config.py,
    ProcessGroupCollection.setup_process_groups_for_optimizer: an explicit collection must bring them, and none of
    megatron-core's builders make them), while without pg_collection it takes megatron's global groups. So the
    optimizer is built without pg_collection, and `pg` must be those global groups (megarl.parallel.initialize builds
    both from the same call): anything else raises rather than stepping on the wrong groups."""
    from megatron.core.optimizer import get_megatron_optimizer as build

    if not _is_global_collection(pg):
        raise RuntimeError("megatron-core 0.19.2's optimizer runs on megatron's global groups only, and the model's "
                           "ProcessGroupCollection is another one. Fix: build the model on "
                           "megarl.parallel.groups().mcore (or megarl.parallel.user_groups())")
    return build(config, model)


# ------------------------------------------------------------------------------------------------ rank layout
def rank_generator(*, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, after: str):
    """megatron-core's RankGenerator built as initialize_model_parallel (0.19.2, parallel_state.py:857/886) builds
    it: the order gets the size-1 'gtp_remat' axis inserted after `after` ("tp" for the decoder, "ep" for the expert
    generator) by the private parallel_state._inject_gtp_remat_axis (absent in older releases: order as given)."""
    from megatron.core import parallel_state

    inject = getattr(parallel_state, "_inject_gtp_remat_axis", None)
    return parallel_state.RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp,
                                        order=inject(order, after=after) if inject else order)


# --------------------------------------------------------------------------------------------------- MLA on CPU
@functools.cache
def mla_core_attention() -> type:
    """megatron-core's local (unfused) attention for MLA on CPU. MLA passes k_channels / v_channels (its query/key
    heads are qk_head_dim + qk_pos_emb_head_dim wide, its value heads v_head_dim), which megatron-core 0.19.2's
    DotProductAttention (transformer/dot_product_attention.py) does not accept; its forward already works for any
    query/key head size and takes MLA's softmax_scale, so only the output width (value heads x heads on this rank,
    its attribute hidden_size_per_partition) is set here."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


# ------------------------------------------------------------------------------------------------- assumptions
def _has(module: str, *names: str) -> list[str]:
    mod = importlib.import_module(module)
    return [f"{module}.{n}" for n in names if not hasattr(mod, n)]


def _params(fn) -> set[str]:
    return set(inspect.signature(fn).parameters)


def check_assumptions() -> list[str]:
    """What this module relies on in the installed megatron-core; returns the broken assumptions (empty: all hold)."""
    from importlib import metadata

    problems = []
    installed = metadata.version("megatron-core")
    if installed != VERSION:
        problems.append(f"megatron-core {installed} is installed, this module was written for {VERSION}")
    # Private members patched or called (the CPU shims, the rank layout).
    problems += _has("megatron.core.tensor_parallel.random", "_get_cuda_rng_state", "_set_cuda_rng_state")
    problems += _has("megatron.core.tensor_parallel.mappings", "_gather_along_first_dim",
                     "_reduce_scatter_along_first_dim")
    problems += _has("megatron.core.dist_checkpointing.strategies.filesystem_async", "_results_queue")
    problems += _has("megatron.core.parallel_state", "_inject_gtp_remat_axis", "RankGenerator",
                     "initialize_model_parallel", "destroy_model_parallel", "model_parallel_is_initialized")
    problems += _has("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu")
    problems += _has("megatron.core.transformer.moe.token_dispatcher", "maybe_move_tensor_to_cpu")
    problems += _has("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32")
    problems += _has("megatron.core.optimizer.clip_grads", "clip_grad_by_total_norm_fp32")
    for module in HARDCODED_CUDA_MODULES:  # the shim replaces each module's `torch` global
        if getattr(importlib.import_module(module), "torch", None) is None:
            problems.append(f"{module} no longer imports torch as a module global")
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    for owner, name in ((DistributedOptimizer, "_build_model_and_main_param_groups"),
                        (MLASelfAttention, "_qkv_down_projection"), (WrappedTorchNorm, "__new__")):
        if name not in vars(owner):
            problems.append(f"{owner.__module__}.{owner.__name__}.{name} is gone")
    if "hidden_states" not in _params(MLASelfAttention._qkv_down_projection):
        problems.append("MLASelfAttention._qkv_down_projection no longer takes hidden_states")
    # Signatures called with keywords.
    from megatron.core import parallel_state
    from megatron.core.optimizer import get_megatron_optimizer as build
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    wanted = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
              "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size",
              "distributed_timeout_minutes", "order"}
    missing = wanted - _params(parallel_state.initialize_model_parallel)
    if missing:
        problems.append(f"parallel_state.initialize_model_parallel lacks {sorted(missing)}")
    if not {"config", "model_chunks", "pg_collection"} <= _params(build):
        problems.append("get_megatron_optimizer(config, model_chunks, pg_collection=...) changed")
    if not hasattr(ProcessGroupCollection, "use_mpu_process_groups") or \
            not hasattr(ProcessGroupCollection, "setup_process_groups_for_optimizer"):
        problems.append("ProcessGroupCollection.use_mpu_process_groups / setup_process_groups_for_optimizer is gone")
    if {"k_channels", "v_channels"} <= _params(DotProductAttention.__init__):
        problems.append("DotProductAttention now accepts k_channels/v_channels: mla_core_attention may go")
    return problems
