"""Launching at scale: the topology a config gets on N nodes x G GPUs (rank groups, trainer and SGLang placement, the
command each node runs), printed by `megarl train|run|sft CONFIG --dry-run` without starting anything.

    megarl train configs/qwen3_30b_a3b.yaml --dry-run --nnodes 1 --gpus-per-node 8
"""
from __future__ import annotations

import os

from .topology import (ENGINE_PORT, GROUP_KINDS, RDZV_PORT, Engine, GroupKind, Node, Topology, TopologyError,
                       expand_hostlist, format_topology, launch_defaults, launch_hosts, model_shape, plan,
                       rank_groups)


def dry_run(command: str, config: str, overrides: list[str], nnodes: int | None = None,
            gpus_per_node: int | None = None, verbose: bool = False, environ=None, check_engines: bool = False,
            force_resume: bool = False) -> str:
    """Load and validate the config, run the pre-flight checks (megarl.launch.preflight), plan it and return the
    report. Raises a UserError (ConfigError, TopologyError, ...) with the field and the fix. Never initialises
    torch.distributed and never reads weights."""
    from ..trainer.config import load_train_config
    from .preflight import preflight

    env = os.environ if environ is None else environ
    cfg = load_train_config(config, overrides)
    checked = preflight(cfg, command, engines=check_engines, planning=True, force_resume=force_resume)
    # Without --nnodes/--gpus-per-node or a launcher's variables, the plan is for this machine: its GPUs, or, on a
    # machine without one, the CPU run it would do (one process unless torchrun says more).
    explicit = nnodes is not None or gpus_per_node is not None
    local_gpus = None if explicit else _local_gpus()  # planning for other machines: their defaults, not this one
    env_nodes, env_gpus, source = launch_defaults(env, local_gpus)
    if explicit:
        source = "--nnodes/--gpus-per-node" if nnodes is not None and gpus_per_node is not None else \
            f"--nnodes/--gpus-per-node, the rest from {source}"
    nnodes = env_nodes if nnodes is None else nnodes
    gpus_per_node = env_gpus if gpus_per_node is None else gpus_per_node
    device = "CPU" if local_gpus == 0 and not explicit else "GPU"
    port = env.get("MASTER_PORT")
    topo = plan(cfg, nnodes, gpus_per_node, config_path=config, overrides=tuple(overrides), command=command,
                hosts=launch_hosts(nnodes, env), rdzv_port=int(port) if port and port.isdigit() else RDZV_PORT,
                launch_source=source, device=device)
    if not check_engines and cfg.rollout.engine.urls and command != "sft":
        checked.append("rollout.engine.urls: not contacted (add --check-engines)")
    return format_topology(topo, verbose) + "\nchecked   " + "\n          ".join(checked)


def _local_gpus() -> int:
    """GPUs this process can see (no CUDA context is created)."""
    import torch

    return torch.cuda.device_count()


__all__ = ["ENGINE_PORT", "GROUP_KINDS", "RDZV_PORT", "Engine", "GroupKind", "Node", "Topology", "TopologyError",
           "dry_run", "expand_hostlist", "format_topology", "launch_defaults", "launch_hosts", "model_shape", "plan",
           "rank_groups"]
