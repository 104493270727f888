"""Process groups: torch.distributed from torchrun/Slurm variables, then megatron.core.parallel_state.

    env = DistributedEnv.from_environ()
    initialize(ParallelConfig(tp=2, pp=2), model_shape)   # init_process_group + parallel_state (tp-cp-ep-dp-pp)
    g = groups()                                          # the groups to pass explicitly (megarl.parallel.groups)
    ...
    teardown()
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .. import platform
from .config import ModelShape, ParallelConfig, ParallelConfigError
from .env import DistributedEnv, LaunchEnvError, first_slurm_host, free_port
from .groups import Groups, build_groups

ORDER = "tp-cp-ep-dp-pp"
_active: ParallelConfig | None = None  # the layout initialize() was last called with (read by pipeline_split)
_groups: Groups | None = None  # built with the layout's groups


def init_distributed(env: DistributedEnv | None = None, timeout_minutes: int = 30,
                     parallel: ParallelConfig | None = None, model: ModelShape | None = None) -> None:
    """Start torch.distributed from torchrun's or Slurm's variables (once; a no-op when it runs). `parallel` (and
    `model`) are validated against the world size first, so a bad layout fails on every rank before any group."""
    platform.setup()
    if dist.is_initialized():
        return
    env = env or DistributedEnv.from_environ()
    if parallel is not None:
        parallel.validate(env.world_size, model, on_gpu=platform.on_gpu())
    env.export()
    if platform.on_gpu():
        torch.cuda.set_device(env.local_rank)
    dist.init_process_group(platform.distributed_backend(), rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(minutes=timeout_minutes))


def initialize(parallel: ParallelConfig, model: ModelShape | None = None, env: DistributedEnv | None = None,
               seed: int = 1234, timeout_minutes: int = 30):
    """Start torch.distributed (if not already started) and megatron's parallel_state; return parallel_state.

    The layout is validated before any group is created, so a bad layout fails on every rank with the same message.
    Groups are built once: called again with the same layout (`megarl run`: SFT, then RL), the groups are kept and
    only the seeds are set again.
    """
    global _active, _groups
    init_distributed(env, timeout_minutes, parallel, model)
    parallel.validate(dist.get_world_size(), model, on_gpu=platform.on_gpu())

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    same = _active is not None and _active.as_dict() == parallel.as_dict()
    if not (same and parallel_state.model_parallel_is_initialized()):
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tp,
            pipeline_model_parallel_size=parallel.pp,
            virtual_pipeline_model_parallel_size=parallel.vpp if (parallel.vpp or 1) > 1 else None,
            context_parallel_size=parallel.cp,
            expert_model_parallel_size=parallel.ep,
            expert_tensor_parallel_size=parallel.etp,
            distributed_timeout_minutes=timeout_minutes,
            order=ORDER,
        )
        _groups = None
    if _groups is None:
        _groups = build_groups()
    _active = parallel
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return parallel_state


def pipeline_split(num_layers: int) -> dict:
    """The TransformerConfig fields that split `num_layers` over the pipeline stages of the layout initialize() set up
    ({} for an even split): what a model built for this layout must carry (ModelBridge adds them to its config).
    Groups made without initialize() get {} (megatron-core's even split, which asserts on an uneven layer count)."""
    from megatron.core import parallel_state

    if _active is None:
        return {}
    sizes = (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_virtual_pipeline_model_parallel_world_size())
    if sizes != (_active.pp, _active.virtual_pp):
        raise RuntimeError(f"megatron's parallel_state has (pp, vpp) = {sizes}, not the "
                           f"{(_active.pp, _active.virtual_pp)} megarl.parallel.initialize() set up: initialise the "
                           "groups through megarl.parallel.initialize only")
    return _active.pipeline_split(num_layers)


def groups() -> Groups:
    """The groups of the layout megarl.parallel.initialize() set up (megatron-core's collection and megarl's own)."""
    if _groups is None:
        raise RuntimeError("megarl.parallel.groups() before megarl.parallel.initialize()")
    return _groups


def mcore_groups(pg=None):
    """megatron-core's ProcessGroupCollection to run on: `pg` when given (megarl's own code passes
    megarl.parallel.groups().mcore), else megatron's parallel_state groups (a user's own Megatron loop that calls
    megarl's loss functions without passing groups, as megatron-core's own schedules default)."""
    if pg is not None:
        return pg
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection.use_mpu_process_groups()


def last_pipeline_stage(pg) -> bool:
    """True on the last pipeline stage of the ProcessGroupCollection `pg` (of all its virtual stages)."""
    return pg.pp.rank() == pg.pp.size() - 1


def teardown() -> None:
    """Destroy megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    global _active, _groups
    _active = _groups = None

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["ORDER", "DistributedEnv", "Groups", "groups", "last_pipeline_stage", "mcore_groups", "LaunchEnvError", "ModelShape", "ParallelConfig", "ParallelConfigError",
           "first_slurm_host", "free_port", "init_distributed", "initialize", "pipeline_split", "teardown"]
