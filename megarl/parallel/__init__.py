"""Process groups: torch.distributed from torchrun/Slurm variables, then megatron.core.parallel_state.

    env = DistributedEnv.from_environ()
    initialize(ParallelConfig(tp=2, pp=2), model_shape)   # init_process_group + parallel_state (tp-cp-ep-dp-pp)
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

ORDER = "tp-cp-ep-dp-pp"


def initialize(parallel: ParallelConfig, model: ModelShape | None = None, env: DistributedEnv | None = None,
               seed: int = 1234, timeout_minutes: int = 30):
    """Start torch.distributed (if not already started) and megatron's parallel_state; return parallel_state.

    The layout is validated before any group is created, so a bad layout fails on every rank with the same message.
    """
    platform.setup()
    if not dist.is_initialized():
        env = env or DistributedEnv.from_environ()
        parallel.validate(env.world_size, model, on_gpu=platform.on_gpu())
        env.export()
        if platform.on_gpu():
            torch.cuda.set_device(env.local_rank)
        dist.init_process_group(platform.distributed_backend(), rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(minutes=timeout_minutes))
    else:
        parallel.validate(dist.get_world_size(), model, on_gpu=platform.on_gpu())

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

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
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return parallel_state


def teardown() -> None:
    """Destroy megatron's groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["ORDER", "DistributedEnv", "LaunchEnvError", "ModelShape", "ParallelConfig", "ParallelConfigError",
           "first_slurm_host", "free_port", "initialize", "teardown"]
