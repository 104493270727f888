"""Process groups: torch.distributed from torchrun/Slurm variables, then megatron-core's groups for the layout.

    env = DistributedEnv.from_environ()
    initialize(ParallelConfig(tp=2, pp=2), model_shape)   # init_process_group + megatron's groups (tp-cp-ep-dp-pp)
    g = groups()                                          # the groups to pass explicitly (megarl.parallel.groups)
    ...
    teardown()

Inside megarl every function that communicates takes its groups as an argument (`pg`, megatron-core's
ProcessGroupCollection: groups().mcore). A user's own Megatron loop that set up megatron's groups itself gets that
collection once from user_groups() (megarl/parallel/user_loop.py) and passes it on.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .. import platform
from ..compat import megatron as megatron_compat
from ..compat.torch import restarted_workers_store
from .config import ModelShape, ParallelConfig, ParallelConfigError
from .env import DistributedEnv, LaunchEnvError, first_slurm_host, free_port
from .groups import Groups, build_groups
from .user_loop import user_groups

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
    timeout = timedelta(minutes=timeout_minutes)
    # a worker torchrun restarted: its own keys on the agent's store (megarl.compat.torch)
    store = restarted_workers_store(env.master_addr, env.master_port, env.world_size, timeout)
    dist.init_process_group(platform.distributed_backend(), rank=env.rank, world_size=env.world_size,
                            timeout=timeout, store=store)


def initialize(parallel: ParallelConfig, model: ModelShape | None = None, env: DistributedEnv | None = None,
               seed: int = 1234, timeout_minutes: int = 30) -> Groups:
    """Start torch.distributed (if not already started) and megatron-core's groups for the layout; return the groups
    (megarl.parallel.groups()).

    The layout is validated before any group is created, so a bad layout fails on every rank with the same message.
    Groups are built once: called again with the same layout (`megarl run`: SFT, then RL), the groups are kept and
    only the seeds are set again.
    """
    global _active, _groups
    init_distributed(env, timeout_minutes, parallel, model)
    parallel.validate(dist.get_world_size(), model, on_gpu=platform.on_gpu())

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    keep = _groups is not None and _active is not None and _active.as_dict() == parallel.as_dict() \
        and megatron_compat.model_parallel_is_initialized()
    if not keep:
        mcore = megatron_compat.initialize_model_parallel(
            tp=parallel.tp, pp=parallel.pp, vpp=parallel.vpp, cp=parallel.cp, ep=parallel.ep, etp=parallel.etp,
            timeout_minutes=timeout_minutes, order=ORDER)
        _groups = build_groups(mcore)
    _active = parallel
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return _groups


def pipeline_split(num_layers: int) -> dict:
    """The TransformerConfig fields that split `num_layers` over the pipeline stages of the layout initialize() set up
    ({} for an even split): what a model built for this layout must carry (ModelBridge adds them to its config).
    Groups made without initialize() get {} (megatron-core's even split, which asserts on an uneven layer count)."""
    if _active is None:
        return {}
    sizes = megatron_compat.pipeline_sizes()
    if sizes != (_active.pp, _active.virtual_pp):
        raise RuntimeError(f"megatron-core's global groups have (pp, vpp) = {sizes}, not the "
                           f"{(_active.pp, _active.virtual_pp)} megarl.parallel.initialize() set up: initialise the "
                           "groups through megarl.parallel.initialize only")
    return _active.pipeline_split(num_layers)


def groups() -> Groups:
    """The groups of the layout megarl.parallel.initialize() set up (megatron-core's collection and megarl's own)."""
    if _groups is None:
        raise RuntimeError("megarl.parallel.groups() before megarl.parallel.initialize()")
    return _groups


def last_pipeline_stage(pg) -> bool:
    """True on the last pipeline stage of the ProcessGroupCollection `pg` (of all its virtual stages)."""
    return pg.pp.rank() == pg.pp.size() - 1


def teardown() -> None:
    """Destroy megatron-core's groups and the default process group (safe to call twice)."""
    global _active, _groups
    _active = _groups = None

    megatron_compat.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["ORDER", "DistributedEnv", "Groups", "groups", "last_pipeline_stage", "LaunchEnvError", "ModelShape",
           "ParallelConfig", "ParallelConfigError", "first_slurm_host", "free_port", "init_distributed", "initialize",
           "pipeline_split", "teardown", "user_groups"]
