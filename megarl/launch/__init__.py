"""Launching at scale: the topology a config gets on N nodes x G GPUs (rank groups, trainer and SGLang placement, the
command each node runs), printed by `megarl train|run|sft|dpo|eval CONFIG --dry-run` without starting anything, with
a per-GPU verdict (fits / does not fit --gpu-memory-gb).

    megarl train configs/qwen3_30b_a3b.yaml --dry-run --nnodes 1 --gpus-per-node 8
"""
from __future__ import annotations

import math
import os
import socket

from .memory import GB, verdict_error
from .topology import (DEFAULT_GPU_MEMORY_GB, DEFAULT_GPUS_PER_NODE, ENGINE_PORT, GROUP_KINDS, NO_ENGINE_COMMANDS,
                       RDZV_PORT, THIS_MACHINE, Engine, GroupKind, Node, Topology, TopologyError, expand_hostlist,
                       format_topology, launch_defaults, launch_hosts, model_shape, plan, rank_groups)


def dry_run(command: str, config: str, overrides: list[str], nnodes: int | None = None,
            gpus_per_node: int | None = None, verbose: bool = False, environ=None, check_engines: bool = False,
            force_resume: bool = False, gpu_memory_gb: float | None = None) -> str:
    """The dry run's report (plan_dry_run's text)."""
    return plan_dry_run(command, config, overrides, nnodes, gpus_per_node, verbose, environ, check_engines,
                        force_resume, gpu_memory_gb)[1]


def plan_dry_run(command: str, config: str, overrides: list[str], nnodes: int | None = None,
                 gpus_per_node: int | None = None, verbose: bool = False, environ=None, check_engines: bool = False,
                 force_resume: bool = False, gpu_memory_gb: float | None = None) -> tuple[Topology, str]:
    """Load and validate the config, run the pre-flight checks (megarl.launch.preflight), plan it and return the
    topology and its report; topology.verdict says whether it fits gpu_memory_gb per GPU (default: this machine's
    GPU, else DEFAULT_GPU_MEMORY_GB). Raises a UserError (ConfigError, TopologyError, ...) with the field and the fix.
    Never initialises torch.distributed and never reads weights."""
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
    here = not explicit and source.startswith(THIS_MACHINE)
    if not explicit:  # a layout larger than what was planned: name the flags that plan enough GPUs
        check_world(cfg, command, env_nodes, env_gpus, source, local_gpus)
    if explicit:
        source = "--nnodes/--gpus-per-node" if nnodes is not None and gpus_per_node is not None else \
            f"--nnodes/--gpus-per-node, the rest from {source}"
    nnodes = env_nodes if nnodes is None else nnodes
    gpus_per_node = env_gpus if gpus_per_node is None else gpus_per_node
    device = "CPU" if local_gpus == 0 and not explicit else "GPU"
    port = env.get("MASTER_PORT")
    # this machine's own name: the printed commands run here as they are (node0 would not resolve)
    hosts = [socket.gethostname()] if here else launch_hosts(nnodes, env)
    topo = plan(cfg, nnodes, gpus_per_node, config_path=config, overrides=tuple(overrides), command=command,
                hosts=hosts, rdzv_port=int(port) if port and port.isdigit() else RDZV_PORT,
                launch_source=source, device=device,
                gpu_memory_gb=_local_gpu_memory_gb() if gpu_memory_gb is None else gpu_memory_gb)
    if not check_engines and cfg.rollout.engine.urls and command not in NO_ENGINE_COMMANDS:
        checked.append("rollout.engine.urls: not contacted (add --check-engines)")
    return topo, format_topology(topo, verbose) + "\nchecked   " + "\n          ".join(checked)


def fit_error(topo: Topology) -> TopologyError | None:
    """The one-line error of a layout that does not fit its GPUs (None when it fits or was not checked)."""
    if topo.verdict is None or topo.verdict.fits:
        return None
    return TopologyError(f"{topo.config_path}: {verdict_error(topo.verdict)}")


def check_world(cfg, command: str, nnodes: int, gpus_per_node: int, source: str, local_gpus: int | None) -> None:
    """Raise a TopologyError naming --nnodes/--gpus-per-node when the layout cannot run on the planned machine(s)
    (`source`): the flags are the fewest nodes of this machine's GPUs (or DEFAULT_GPUS_PER_NODE) that it runs on."""
    p = cfg.parallel
    if min(p.tp, p.pp, p.cp, p.ep, p.expert_tp) < 1:  # a bad size: the plan's validation names the field
        return
    needed = math.lcm(p.tp * p.pp * p.cp, p.expert_tp * p.ep * p.pp)  # trainer ranks: dp and expert-dp of 1
    engine_nodes = cfg.rollout.engine.nodes if cfg.rollout.placement == "disaggregated" and \
        command not in NO_ENGINE_COMMANDS else 0
    have = max(nnodes - engine_nodes, 0) * gpus_per_node
    if have and have % needed == 0:
        return
    per_node = local_gpus if local_gpus else DEFAULT_GPUS_PER_NODE
    per_node = math.lcm(per_node, cfg.rollout.engine.tp_size) if command not in NO_ENGINE_COMMANDS else per_node
    trainer_nodes = needed // math.gcd(needed, per_node)
    layout = " ".join(f"{k}={v}" for k, v in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp), ("ep", p.ep),
                                                ("etp", p.expert_tp)) if v > 1) or "tp=1"
    split = f" ({trainer_nodes} trainer + {engine_nodes} engine node(s), rollout.engine.nodes)" if engine_nodes else ""
    raise TopologyError(
        f"parallel layout {layout} needs a multiple of {needed} trainer GPUs, and the plan has {have} ({source}; no "
        f"--nnodes/--gpus-per-node given). Fix: --nnodes {trainer_nodes + engine_nodes} --gpus-per-node "
        f"{per_node}{split}")


def _local_gpu_memory_gb() -> float:
    """The first visible GPU's memory in GB (1e9 bytes), else DEFAULT_GPU_MEMORY_GB."""
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return DEFAULT_GPU_MEMORY_GB
    return torch.cuda.get_device_properties(0).total_memory / GB


def _local_gpus() -> int:
    """GPUs this process can see (no CUDA context is created)."""
    import torch

    return torch.cuda.device_count()


__all__ = ["DEFAULT_GPU_MEMORY_GB", "ENGINE_PORT", "GROUP_KINDS", "RDZV_PORT", "Engine", "GroupKind", "Node",
           "Topology", "TopologyError", "check_world", "dry_run", "expand_hostlist", "fit_error", "format_topology",
           "launch_defaults", "launch_hosts", "model_shape", "plan", "plan_dry_run", "rank_groups"]
