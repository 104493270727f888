"""Launch topology: where every trainer rank and SGLang engine runs, the rank groups, and what each node executes.

    topo = plan(cfg, nnodes=2, gpus_per_node=8, config_path="configs/qwen3_30b_a3b_16gpu_disagg.yaml")
    print(format_topology(topo, verbose=False))

Pure functions: nothing here starts torch.distributed, opens weights or talks to the network. The rank groups come
from megatron-core's own `RankGenerator`, built exactly as `initialize_model_parallel` builds them (a
decoder generator for the dense groups, an expert generator for ep/etp/expert-dp, order tp-cp-ep-dp-pp), so the
printed groups are the ones the job creates; tests/launch/test_topology.py checks them against initialize_model_parallel
itself, run with a fake world.

Rank -> host: torchrun gives node i the global ranks i*G .. i*G+G-1 (G = --nproc-per-node), local GPU = rank % G.
Placements (rollout.placement):
  colocated      every node trains; the engines share the trainer's GPUs, one per rollout.engine.tp_size GPUs.
  disaggregated  the last rollout.engine.nodes nodes run only SGLang servers (gpus_per_node / tp_size each); the
                 trainer gets the first nnodes - engine.nodes nodes; weights go over reshard.transport=distributed.
"""
from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Mapping, Optional

from ..config import ConfigError
from . import memory as mem
from ..parallel import ORDER, ModelShape, ParallelConfig, ParallelConfigError
from ..parallel.env import expand_hostlist

DEFAULT_GPUS_PER_NODE = 8
THIS_MACHINE = "this machine"  # launch_defaults' source when nothing but this machine's devices set the plan
RDZV_PORT = 29500  # torchrun's c10d rendezvous port on the first trainer node (MASTER_PORT overrides it)
ENGINE_PORT = 30000  # SGLang's default port; engine k on a node listens on ENGINE_PORT + k
DEFAULT_GPU_MEMORY_GB = 80.0  # the per-GPU verdict's budget when no GPU is visible (an 80 GB A100/H100)
NO_ENGINE_COMMANDS = ("sft", "dpo")  # train on fixed data: they start no SGLang engine (megarl.trainer.sft / dpo)


class TopologyError(ConfigError):
    """A launch layout that cannot run; the message names the field (or flag) and the fix. A ConfigError, so the
    CLI reports it with exit code 2 like any other configuration error."""


@dataclass(frozen=True)
class GroupKind:
    """One kind of process group: how megatron-core's initialize_model_parallel builds it."""
    name: str  # the name printed by the dry run
    title: str
    generator: str  # "decoder" (dense layers) or "expert" (MoE layers): which RankGenerator
    token: str  # the RankGenerator.get_ranks token initialize_model_parallel uses
    group_desc: str  # the group_desc initialize_model_parallel passes to torch.distributed.new_group


GROUP_KINDS = (
    GroupKind("tp", "tensor parallel", "decoder", "tp", "TENSOR_MODEL_PARALLEL_GROUP"),
    GroupKind("cp", "context parallel", "decoder", "cp", "CONTEXT_PARALLEL_GROUP"),
    GroupKind("dp", "data parallel", "decoder", "dp", "DATA_PARALLEL_GROUP"),
    GroupKind("dp-cp", "data parallel incl. cp (gradient all-reduce)", "decoder", "dp-cp",
              "DATA_PARALLEL_GROUP_WITH_CP"),
    GroupKind("pp", "pipeline parallel", "decoder", "pp", "PIPELINE_MODEL_PARALLEL_GROUP"),
    GroupKind("tp-pp", "model parallel (tp x pp)", "decoder", "tp-gtp_remat-pp", "MODEL_PARALLEL_GROUP"),
    GroupKind("ep", "expert parallel", "expert", "ep", "EXPERT_MODEL_PARALLEL_GROUP"),
    GroupKind("etp", "expert tensor parallel", "expert", "tp", "EXPERT_TENSOR_PARALLEL_GROUP"),
    GroupKind("expert-dp", "expert data parallel", "expert", "dp", "EXPERT_DATA_PARALLEL_GROUP"),
)


@dataclass(frozen=True)
class Engine:
    """One SGLang server: `tp` GPUs on one node."""
    index: int
    node: int
    host: str
    gpus: tuple[int, ...]  # local GPU ids on the node
    port: Optional[int]  # None: the trainer picks a free port when it starts the engine
    url: str
    command: str


@dataclass(frozen=True)
class PoolServer:
    """One SGLang server of an engine pool (pools.<name>, or the OPD teacher) that trainer rank 0 starts."""
    pool: str
    gpus: tuple[int, ...]  # local GPU ids on rank 0's node (empty on CPU)
    command: str


@dataclass(frozen=True)
class Node:
    index: int
    host: str
    role: str  # "trainer", "trainer + engines" (colocated) or "engines" (disaggregated)
    ranks: tuple[int, ...]  # the trainer's global ranks on this node (empty on engine nodes)
    engines: tuple[int, ...]  # indices into Topology.engines
    commands: tuple[str, ...]  # what to run on this node, in order (engines first, then the trainer)


@dataclass(frozen=True)
class Topology:
    command: str  # train | run | sft | dpo | eval
    config_path: str
    nnodes: int
    gpus_per_node: int
    placement: str
    hosts: tuple[str, ...]
    trainer_nodes: tuple[int, ...]
    engine_nodes: tuple[int, ...]  # nodes that run SGLang servers (all of them when colocated)
    world_size: int  # trainer ranks
    parallel: ParallelConfig
    sizes: dict  # tp pp vpp cp ep etp dp expert-dp
    groups: dict  # GroupKind.name -> list of global rank lists
    model_path: str
    model_shape: Optional[ModelShape]
    shape_source: str
    engine_tp: int
    engines: tuple[Engine, ...]
    engines_started_by: str  # "trainer" (rank 0 starts them; engine.urls stays empty), "nodes" (pre-launched) or
    # "none" (sft / dpo start no engine)
    engine_urls: tuple[str, ...]  # what rollout.engine.urls the trainer gets (empty: it starts its own)
    rdzv_endpoint: str
    nodes: tuple[Node, ...]
    launch_source: str = "--nnodes/--gpus-per-node"
    notes: tuple[str, ...] = field(default_factory=tuple)
    device: str = "GPU"  # what a trainer rank runs on: "GPU", or "CPU" (one process per rank, engines on the cores)
    # [pp rank][virtual stage] -> the global decoder layers that chunk holds (megatron-core's placement); None without
    # a model shape. pipeline_split: the TransformerConfig split fields the run sets ({}: even split).
    stage_layers: Optional[list] = None
    pipeline_split: dict = field(default_factory=dict)
    # The memory estimate per GPU (megarl.launch.memory): per pp rank, and one engine GPU (None for sft); memory is
    # None when the shape lacks what it needs (memory_missing names those fields).
    memory: Optional[list[mem.StageMemory]] = None
    engine_memory: Optional[mem.EngineMemory] = None
    memory_missing: tuple[str, ...] = ()
    distributed_optimizer: bool = False
    # the other models' engine pools (megarl.rollout.pools): servers rank 0 starts, and pools reached at their urls
    pool_servers: tuple[PoolServer, ...] = ()
    pool_urls: dict = field(default_factory=dict)
    verdict: Optional[mem.Verdict] = None  # per-GPU fit against gpu_memory_gb; None on CPU or without an estimate
    engine_fraction: Optional[float] = None  # the --mem-fraction-static the engine command passes SGLang
    engine_share: Optional[float] = None  # bytes the engine claims per GPU (memory.engine_share); None without verdict
    placeholder_hosts: bool = False  # hosts are node0, node1, ...: replace them with the real names

    def host_of(self, rank: int) -> tuple[int, int]:
        """(node index, local GPU) of a trainer rank."""
        return self.trainer_nodes[rank // self.gpus_per_node], rank % self.gpus_per_node


# ----------------------------------------------------------------------------------------------- rank groups
def rank_groups(parallel: ParallelConfig, world_size: int) -> dict[str, list[list[int]]]:
    """Every group kind's global rank lists, from megatron-core's RankGenerator, built as initialize_model_parallel
    (megatron-core 0.19.2) builds them: the same sizes, orders and get_ranks tokens."""
    from ..compat.megatron import rank_generator

    parallel.validate(world_size, on_gpu=True)
    tp, pp, cp, ep, etp = parallel.tp, parallel.pp, parallel.cp, parallel.ep, parallel.expert_tp
    # initialize_model_parallel inserts a size-1 'gtp_remat' axis after tp (decoder) and after ep (expert); a size-1
    # axis changes no group, but rank_generator uses its helper, so the orders are literally the same.
    decoder = rank_generator(tp=tp, ep=1, dp=world_size // (tp * pp * cp), pp=pp, cp=cp, order=ORDER, after="tp")
    expert = rank_generator(tp=etp, ep=ep, dp=world_size // (etp * ep * pp), pp=pp, cp=1, order=ORDER, after="ep")
    generators = {"decoder": decoder, "expert": expert}
    groups = {}
    for kind in GROUP_KINDS:
        gen = generators[kind.generator]
        token = "-".join(t for t in kind.token.split("-") if t in gen.order.split("-"))  # older: no gtp_remat axis
        groups[kind.name] = gen.get_ranks(token)
    if decoder.get_ranks("pp") != expert.get_ranks("pp"):  # initialize_model_parallel asserts the same
        raise TopologyError("the dense and expert pipeline groups differ; megatron-core refuses this layout. "
                            "Fix: change parallel.ep/etp so etp*ep divides tp*cp*dp")
    return groups


# ----------------------------------------------------------------------------------------------- model shape
def model_shape(cfg) -> tuple[Optional[ModelShape], str]:
    """(shape, where it came from): the model folder's config.json when it is here, else the preset's model.shape
    hint, else a tiny model's settings; None when nothing says (the layout is then checked against the world only).
    Reads config.json as JSON: no transformers, no weights."""
    from ..trainer.config import model_shape_hint

    m = cfg.model
    if m.path:
        config_json = os.path.join(m.path, "config.json")
        if os.path.isfile(config_json):
            try:
                with open(config_json) as f:
                    raw = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise TopologyError(f"{config_json} cannot be read ({e}). Fix: restore config.json") from None
            return _shape_from_hf(raw, config_json), config_json
        if m.shape is not None:
            return model_shape_hint(m.shape), f"model.shape (the preset's hint; {m.path} is not on this machine)"
        return None, f"unknown ({m.path}/config.json is not here and the preset has no model.shape)"
    if m.tiny is not None:
        from ..models import tiny  # the settings write_tiny_model would use (nothing is written)

        raw = {**tiny._BASE, **tiny._FAMILY.get(m.tiny.family, {}), **m.tiny.overrides}
        return _shape_from_hf(raw, "model.tiny"), f"model.tiny ({m.tiny.family})"
    if m.shape is not None:
        return model_shape_hint(m.shape), "model.shape"
    return None, "unknown"


def _shape_from_hf(raw: dict, source: str) -> ModelShape:
    """HF config.json fields -> ModelShape, as megarl.models.hf.HFModelFolder.shape() maps them (megarl.models.hf
    knows each family's field names)."""
    from ..models.hf import model_shape

    try:
        return model_shape(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise TopologyError(f"{source}: cannot read the model shape ({e!r} missing or not an integer). Fix: restore "
                            "config.json from the original model") from None


# ------------------------------------------------------------------------------------------------ the plan
def plan(cfg, nnodes: int, gpus_per_node: int, *, config_path: str = "CONFIG", overrides: tuple = (),
         command: str = "train", hosts: Optional[list[str]] = None, rdzv_port: int = RDZV_PORT,
         launch_source: str = "--nnodes/--gpus-per-node", device: str = "GPU",
         gpu_memory_gb: float = DEFAULT_GPU_MEMORY_GB) -> Topology:
    """Where everything runs for `cfg` (a validated TrainConfig) on `nnodes` x `gpus_per_node` GPUs. `hosts`: the
    node names (default node0, node1, ... placeholders); the rest only shapes the printed commands. device="CPU":
    `gpus_per_node` counts trainer processes, and the engines (rollout.engine.num_engines, started by rank 0) run on
    the CPU cores, with SGLang's CPU command line. gpu_memory_gb: each GPU's memory, for the fit verdict. sft and dpo
    (NO_ENGINE_COMMANDS) are planned without engines: every node trains."""
    on_gpu = device == "GPU"
    if nnodes < 1:
        raise TopologyError(f"--nnodes must be >= 1, got {nnodes}")
    if gpus_per_node < 1:
        raise TopologyError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
    placeholder_hosts = not hosts
    hosts = list(hosts) if hosts else [f"node{i}" for i in range(nnodes)]
    if len(hosts) != nnodes:
        raise TopologyError(f"{len(hosts)} host names for --nnodes {nnodes}. Fix: pass --nnodes {len(hosts)}")
    with_engines = command not in NO_ENGINE_COMMANDS
    placement = cfg.rollout.placement if with_engines else "none"
    engine_cfg = cfg.rollout.engine
    engine_tp = engine_cfg.tp_size
    if on_gpu and with_engines and gpus_per_node % engine_tp:
        raise TopologyError(
            f"rollout.engine.tp_size={engine_tp} does not divide --gpus-per-node {gpus_per_node}: an SGLang engine "
            f"runs on one node. Fix: set rollout.engine.tp_size to a divisor of {gpus_per_node}")
    notes = []
    if placement == "disaggregated":
        if engine_cfg.nodes >= nnodes:
            fix = f"lower rollout.engine.nodes to at most {nnodes - 1}, or " if nnodes > 1 else ""
            raise TopologyError(
                f"rollout.engine.nodes={engine_cfg.nodes} leaves no node for the trainer on --nnodes {nnodes}. Fix: "
                f"{fix}launch at least {engine_cfg.nodes + 1} nodes, or use rollout.placement=colocated")
        trainer_nodes = tuple(range(nnodes - engine_cfg.nodes))
        engine_nodes = tuple(range(nnodes - engine_cfg.nodes, nnodes))
    else:
        trainer_nodes = tuple(range(nnodes))
        engine_nodes = trainer_nodes if with_engines else ()
    world = len(trainer_nodes) * gpus_per_node
    p = cfg.parallel
    shape, shape_source = model_shape(cfg)
    try:
        p.validate(world, shape, on_gpu=True)  # planned for GPU nodes: cp > 1 is allowed
    except ParallelConfigError as e:
        unit = "GPUs" if on_gpu else "CPU processes"
        where = f"{len(trainer_nodes)} trainer node(s) x {gpus_per_node} {unit} = {world} ranks"
        raise TopologyError(f"{e} [{where}; model shape from {shape_source}]") from None
    groups = rank_groups(p, world)
    stage_layers = p.stage_layers(shape.num_layers) if shape is not None else None  # validated just above
    split = p.pipeline_split(shape.num_layers) if shape is not None else {}
    dp = world // (p.tp * p.pp * p.cp)
    sizes = {"tp": p.tp, "pp": p.pp, "vpp": p.vpp, "cp": p.cp, "ep": p.ep, "etp": p.expert_tp, "dp": dp,
             "expert-dp": world // (p.expert_tp * p.ep * p.pp)}

    model_path = cfg.model.path or os.path.join(cfg.run_dir, "base-model")
    # Colocated on one node: the trainer's rank 0 starts the engines itself (megarl.trainer.rl), which is the path
    # that releases engine memory between phases. Anything spanning nodes is pre-launched on each node.
    started_by = "trainer" if placement == "colocated" and nnodes == 1 else ("nodes" if with_engines else "none")
    # the other models' pools that rank 0 starts take GPUs of its node after the policy engines' (megarl.rollout.pools)
    from ..rollout.pools import model_pools
    from ..trainer.config import fleet_spec

    fleet = fleet_spec(cfg)  # the servers the run starts, as megarl.rollout.fleet starts them
    started_pools = [(name, pool) for name, pool in model_pools(fleet) if pool.model and with_engines]
    pool_gpus = sum(pool.num_engines * pool.tp_size for _, pool in started_pools) if on_gpu else 0
    if pool_gpus and started_by == "trainer":  # the policy engines leave those GPUs to the pools
        per_node = (gpus_per_node - pool_gpus) // engine_tp
        if per_node < 1:
            raise TopologyError(
                f"the engine pools {[n for n, _ in started_pools]} take {pool_gpus} of the {gpus_per_node} GPUs, "
                f"leaving none for a policy engine of rollout.engine.tp_size={engine_tp}. Fix: run those pools "
                "elsewhere and give their pools.<name>.urls, or smaller pools (num_engines, tp_size)")
    else:
        per_node = gpus_per_node // engine_tp if on_gpu else engine_cfg.num_engines
    engines = []
    for node in engine_nodes:
        for k in range(per_node):
            gpus = tuple(range(k * engine_tp, (k + 1) * engine_tp)) if on_gpu else ()
            if started_by == "trainer":  # as megarl.trainer.rl starts them: localhost, a free port
                port, url = None, "http://127.0.0.1:<free port>"
                line = engine_command(fleet, model_path, len(engines), host="127.0.0.1", port=None,
                                      base_gpu=gpus[0] if k and on_gpu else None, on_gpu=on_gpu)
            else:
                port = ENGINE_PORT + k
                url = f"http://{hosts[node]}:{port}"
                line = engine_command(fleet, model_path, len(engines), host="0.0.0.0", port=port,
                                      base_gpu=gpus[0] if on_gpu else None, on_gpu=on_gpu)
            engines.append(Engine(index=len(engines), node=node, host=hosts[node], gpus=gpus, port=port, url=url,
                                  command=line))
    urls = tuple(e.url for e in engines) if started_by == "nodes" else ()

    extra = []  # overrides the trainer needs on top of the user's
    if started_by == "trainer":
        if on_gpu and engine_cfg.num_engines != len(engines):
            extra.append(f"rollout.engine.num_engines={len(engines)}")
        if engine_cfg.urls:
            notes.append("rollout.engine.urls is set: the trainer uses those servers and starts none; the engines "
                         "above are what it would start with urls empty")
    elif started_by == "nodes":
        extra.append("rollout.engine.urls=" + json.dumps(list(urls), separators=(",", ":")))
        if engine_cfg.urls:
            notes.append(f"rollout.engine.urls={list(engine_cfg.urls)} in the config is replaced by the urls above")
        if placement == "colocated":
            notes.append("multi-node colocated: the engines are pre-launched on every node and passed as "
                         "rollout.engine.urls; megarl.trainer.rl releases/resumes engine memory only for engines it "
                         "started itself, so with urls the engines keep their memory during training (set "
                         "rollout.engine.mem_fraction_static low, or wire release for urls first)")
        else:
            notes.append("disaggregated: the engines join the weight-broadcast group at trainer rank 0's host name "
                         "(socket.gethostname()); set reshard.master_address if the engines reach it by another name")

    pool_servers = _pool_servers(fleet, started_pools, engine_tp * len(engines) if started_by == "trainer" else 0,
                                 gpus_per_node, on_gpu)
    if started_pools and on_gpu:
        notes.append(f"the engine pools {[n for n, _ in started_pools]} are started by trainer rank 0 on node "
                     f"{trainer_nodes[0]}, on GPUs the trainer also trains on, and keep their memory throughout (only "
                     "the policy's engines release theirs); slurm/train_disagg.sbatch starts them on its last engine "
                     "node instead; for large judges or teachers, start their servers on nodes of their own and set "
                     "pools.<name>.urls (teacher.urls)")
    rdzv_endpoint = f"{hosts[trainer_nodes[0]]}:{rdzv_port}"  # the c10d store runs on the first trainer node
    node_plans = []
    for node in range(nnodes):
        on_node = tuple(e.index for e in engines if e.node == node)
        commands = [engines[i].command for i in on_node] if started_by == "nodes" else []
        ranks: tuple[int, ...] = ()
        if node in trainer_nodes:
            i = trainer_nodes.index(node)
            ranks = tuple(range(i * gpus_per_node, (i + 1) * gpus_per_node))
            commands.append(shlex.join([
                "megarl-torchrun", "--nnodes", str(len(trainer_nodes)), "--nproc-per-node", str(gpus_per_node),
                "--node-rank", str(i), "--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint,
                "-m", "megarl.cli", command, config_path, *overrides, *extra]))
        role = "trainer + engines" if ranks and on_node else ("trainer" if ranks else "engines")
        node_plans.append(Node(index=node, host=hosts[node], role=role, ranks=ranks, engines=on_node,
                               commands=tuple(commands)))
    if len(trainer_nodes) > 1:
        notes.append("torchrun's c10d rendezvous ignores --node-rank and numbers nodes by sorted host address; the "
                     "rank -> node map above holds when the hosts sort in the order listed (zero-padded Slurm names "
                     "do). For a pinned order use --rdzv-backend static")
    if shape is not None and cfg.model.path and not os.path.isfile(os.path.join(cfg.model.path, "config.json")):
        notes.append(f"{cfg.model.path} is not on this machine: the layout was checked against model.shape; the run "
                     "itself reads config.json and checks again")
    memory = engine_mem = verdict = share = None
    missing: tuple[str, ...] = ()
    fraction = engine_fraction(engines[0].command) if engines else None
    if shape is not None:
        missing = tuple(mem.missing_fields(shape))
        if not missing:
            dtype = "bfloat16" if on_gpu else "float32"
            memory = mem.trainer_memory(shape, stage_layers, sizes, cfg.optim.distributed_optimizer, dtype,
                                        cfg.model.lora)
            if engines:
                r = cfg.rollout
                step_tokens = r.prompts_per_step * r.n_samples * (cfg.data.max_prompt_tokens + r.max_new_tokens)
                engine_mem = mem.engine_memory(shape, engine_tp, engine_cfg.dtype or dtype, engine_cfg.max_total_tokens,
                                               step_tokens, len(engines))
            if on_gpu:  # a CPU run's processes share the host's memory: no per-GPU verdict
                share = mem.engine_share(engine_mem, fraction, engine_cfg.max_total_tokens,
                                         gpu_memory_gb * mem.GB) if engine_mem else None
                verdict = mem.fit_verdict(memory, engine_mem, placement, gpu_memory_gb * mem.GB, fraction,
                                          engine_cfg.max_total_tokens,
                                          cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens)
    return Topology(command=command, config_path=config_path, nnodes=nnodes, gpus_per_node=gpus_per_node,
                    placement=placement, hosts=tuple(hosts), trainer_nodes=trainer_nodes, engine_nodes=engine_nodes,
                    world_size=world, parallel=p, sizes=sizes, groups=groups, model_path=model_path,
                    model_shape=shape, shape_source=shape_source, engine_tp=engine_tp, engines=tuple(engines),
                    engines_started_by=started_by, engine_urls=urls, rdzv_endpoint=rdzv_endpoint,
                    nodes=tuple(node_plans), launch_source=launch_source, notes=tuple(notes),
                    stage_layers=stage_layers, pipeline_split=split, device=device, memory=memory,
                    engine_memory=engine_mem, memory_missing=missing,
                    distributed_optimizer=cfg.optim.distributed_optimizer, pool_servers=tuple(pool_servers),
                    pool_urls={name: list(pool.urls) for name, pool in model_pools(fleet)
                               if pool.urls and with_engines},
                    verdict=verdict, engine_fraction=fraction, engine_share=share,
                    placeholder_hosts=placeholder_hosts)


def engine_fraction(command: str) -> Optional[float]:
    """The --mem-fraction-static an engine command line passes SGLang (the last one wins, as in argparse; it comes
    from rollout.engine.mem_fraction_static or rollout.engine.extra_args); None when it passes none."""
    args = shlex.split(command)
    value = None
    for i, arg in enumerate(args):
        if arg == "--mem-fraction-static" and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith("--mem-fraction-static="):
            value = arg.split("=", 1)[1]
    return float(value) if value is not None else None


def _pool_servers(fleet, started_pools: list, policy_gpus: int, gpus_per_node: int, on_gpu: bool) -> list:
    """The servers of the pools rank 0 starts, as megarl.rollout.pools starts them (their GPUs after the policy
    engines' `policy_gpus` on rank 0's node); a TopologyError when they do not fit on the node."""
    from ..rollout.pools import first_gpus, pool_server_config
    from ..rollout.server import server_command

    first = first_gpus(fleet, policy_gpus)
    servers = []
    for name, pool in started_pools:
        for i in range(pool.num_engines):
            gpus = tuple(range(first[name] + i * pool.tp_size, first[name] + (i + 1) * pool.tp_size)) if on_gpu else ()
            if gpus and gpus[-1] >= gpus_per_node:
                raise TopologyError(
                    f"pools.{name}: server {i} would need GPU {gpus[-1]} on trainer rank 0's node, which has "
                    f"{gpus_per_node} (GPUs 0-{first[name] - 1} go to the policy engines and the pools before it). "
                    f"Fix: start it elsewhere and set pools.{name}.urls, or lower pools.{name}.num_engines / tp_size")
            cmd, _ = server_command(pool_server_config(fleet, name, pool, i, policy_gpus), "FREE_PORT", on_gpu=on_gpu)
            servers.append(PoolServer(pool=name, gpus=gpus, command=shlex.join(["python"] + cmd[1:])))
    return servers


def engine_command(fleet, model_path: str, index: int, host: str, port: Optional[int],
                   base_gpu: Optional[int], on_gpu: bool = True) -> str:
    """megarl.rollout.server.server_command for the planned device (the one builder; a dry run plans for GPU nodes
    from anywhere), printed with `python` for the interpreter. Pre-launched engines add --base-gpu-id so each engine on a
    node gets its own GPUs; port None prints FREE_PORT (the trainer picks one)."""
    from ..rollout.server import engine_server_config, server_command

    cmd, _ = server_command(engine_server_config(fleet, model_path, index, host=host, port=port, base_gpu_id=base_gpu),
                            "FREE_PORT" if port is None else port, on_gpu=on_gpu)
    return shlex.join(["python"] + cmd[1:])


# ---------------------------------------------------------------------------------------- launch environment
def launch_defaults(environ: Optional[Mapping[str, str]] = None,
                    local_gpus: Optional[int] = None) -> tuple[int, int, str]:
    """(nnodes, gpus_per_node, source) from the launcher's variables, as DistributedEnv reads them: torchrun's
    first (GROUP_WORLD_SIZE nodes x LOCAL_WORLD_SIZE), then Slurm's (SLURM_JOB_NUM_NODES x SLURM_GPUS_ON_NODE or
    tasks per node), else this machine (local_gpus GPUs, or one CPU process when it has none), else 1 x 8."""
    env = os.environ if environ is None else environ
    if "WORLD_SIZE" in env and "LOCAL_WORLD_SIZE" in env:
        gpus = _env_int(env, "LOCAL_WORLD_SIZE")
        nodes = _env_int(env, "GROUP_WORLD_SIZE") if env.get("GROUP_WORLD_SIZE") else \
            _env_int(env, "WORLD_SIZE") // gpus
        return nodes, gpus, "torchrun environment (GROUP_WORLD_SIZE, LOCAL_WORLD_SIZE)"
    nodes_key = next((k for k in ("SLURM_JOB_NUM_NODES", "SLURM_NNODES") if env.get(k)), None)
    if nodes_key:
        nodes = _env_int(env, nodes_key)
        for key in ("SLURM_GPUS_ON_NODE", "SLURM_NTASKS_PER_NODE"):
            if env.get(key):
                return nodes, _env_int(env, key), f"Slurm environment ({nodes_key}, {key})"
        if env.get("SLURM_NTASKS"):
            return nodes, _env_int(env, "SLURM_NTASKS") // nodes, f"Slurm environment ({nodes_key}, SLURM_NTASKS)"
        return nodes, DEFAULT_GPUS_PER_NODE, f"Slurm environment ({nodes_key}); {DEFAULT_GPUS_PER_NODE} GPUs/node"
    if local_gpus == 0:
        return 1, 1, f"{THIS_MACHINE}: no GPU, 1 CPU process (--gpus-per-node N: N processes)"
    if local_gpus:
        return 1, local_gpus, f"{THIS_MACHINE}: {local_gpus} GPU(s)"
    return 1, DEFAULT_GPUS_PER_NODE, f"default (1 node x {DEFAULT_GPUS_PER_NODE} GPUs)"


def launch_hosts(nnodes: int, environ: Optional[Mapping[str, str]] = None) -> Optional[list[str]]:
    """The job's host names from SLURM_JOB_NODELIST when it lists exactly `nnodes` hosts, else None (placeholders)."""
    env = os.environ if environ is None else environ
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return None
    hosts = expand_hostlist(nodelist)
    return hosts if len(hosts) == nnodes else None


def _env_int(env: Mapping[str, str], key: str) -> int:
    match = re.match(r"\s*(\d+)", env.get(key, ""))  # SLURM_*_PER_NODE may read "8(x2)"
    if not match or int(match.group(1)) < 1:
        raise TopologyError(f"environment variable {key}={env.get(key)!r} is not a positive integer. Fix: unset it, "
                            "or pass --nnodes/--gpus-per-node")
    return int(match.group(1))


# ---------------------------------------------------------------------------------------------- formatting
def format_topology(topo: Topology, verbose: bool = False) -> str:
    """The dry run's report. Compact unless `verbose`: the first 2 groups of each kind and a count."""
    G = topo.gpus_per_node
    s = topo.sizes
    unit = "GPUs" if topo.device == "GPU" else "CPU process(es)"
    placement = topo.placement if topo.placement != "none" else f"none ({topo.command} starts no SGLang engine)"
    lines = [f"megarl dry run: {topo.command} {topo.config_path} on {topo.nnodes} node(s) x {G} {unit} "
             f"[{topo.launch_source}]; placement {placement}"]
    shape = topo.model_shape
    if shape is not None:
        moe = f", {shape.num_experts} experts (moe ffn {shape.moe_ffn_hidden_size})" if shape.num_experts else ""
        lines.append(f"model     {topo.model_path}: {shape.num_layers} layers, {shape.num_attention_heads} heads / "
                     f"{shape.num_key_value_heads} KV heads, ffn {shape.ffn_hidden_size}{moe}  "
                     f"[shape from {topo.shape_source}]")
    else:
        lines.append(f"model     {topo.model_path}: shape {topo.shape_source}; layout checked against the world only")
    lines.append(f"parallel  tp={s['tp']} pp={s['pp']} vpp={s['vpp'] or '-'} cp={s['cp']} ep={s['ep']} "
                 f"etp={s['etp']} | dp={s['dp']} expert-dp={s['expert-dp']} | trainer world {topo.world_size} "
                 f"on node(s) {_span(topo.trainer_nodes)}, order {ORDER}")
    if topo.stage_layers is not None and s["pp"] > 1:
        lines += _format_stages(topo, verbose)
    if topo.memory is not None:
        lines += mem.format_memory(topo.memory, topo.engine_memory, s, "bfloat16" if topo.device == "GPU" else
                                   "float32", topo.distributed_optimizer, topo.placement, verbose,
                                   unit="GPU" if topo.device == "GPU" else "process", fraction=topo.engine_fraction,
                                   share=topo.engine_share)
    if topo.verdict is not None:
        lines += mem.format_verdict(topo.verdict)
    elif topo.memory_missing:
        lines.append(f"memory    not estimated: the model shape has no {', '.join(topo.memory_missing)} (add them to "
                     "model.shape from the model's config.json)")
    lines.append("")
    lines.append("rank groups (megatron-core's RankGenerator, as initialize_model_parallel builds them)"
                 + ("" if verbose else "; first 2 of each kind, --verbose lists all"))
    for kind in GROUP_KINDS:
        groups = topo.groups[kind.name]
        spans = max(len({topo.host_of(r)[0] for r in g}) for g in groups)
        where = "each within one node" if spans == 1 else f"up to {spans} nodes per group"
        if len(groups[0]) == 1 and not verbose:  # size 1: this kind of parallelism is off
            lines.append(f"  {kind.name:<9} {kind.title}: {len(groups)} group(s) of 1 (off: no communication)")
            continue
        lines.append(f"  {kind.name:<9} {kind.title}: {len(groups)} group(s) of {len(groups[0])}, {where}")
        shown = groups if verbose else groups[:2]
        for g in shown:
            lines.append(f"    {_fmt_ranks(g, verbose):<44} {_fmt_hosts(topo, g)}")
        if len(shown) < len(groups):
            lines.append(f"    ... {len(groups) - len(shown)} more")
    lines.append("")
    lines.append("nodes")
    for node in _listed_nodes(topo, verbose, lines, "the same, with their own ranks"):
        what = []
        if node.ranks:
            what.append(f"trainer ranks {node.ranks[0]}-{node.ranks[-1]}")
        if node.engines:
            what.append(f"{len(node.engines)} SGLang engine(s) of tp {topo.engine_tp}")
        lines.append(f"  node {node.index} ({node.host}): {node.role}: {', '.join(what)}")
    if topo.placeholder_hosts:
        shown = ", ".join(topo.hosts[:3]) + (", ..." if topo.nnodes > 3 else "")
        lines.append(f"  {shown}: placeholders for the planned machines; put their host names in the commands below "
                     "(under Slurm, SLURM_JOB_NODELIST names them)")
    lines.append("")
    lines += _format_engines(topo, verbose) if topo.engines_started_by != "none" else [
        f"engines   none: `megarl {topo.command}` trains on fixed data and starts no SGLang engine"]
    lines.append("")
    wait = "" if topo.engines_started_by == "none" else (
        ": start the SGLang servers first, in the background or one srun step each; the trainer waits for them up to "
        "rollout.engine.startup_timeout_s")
    lines.append(f"commands per node (each a long-running process{wait})")
    for node in _listed_nodes(topo, verbose, lines, "the same, with their own host and --node-rank"):
        lines.append(f"  node {node.index} ({node.host}):")
        for c in node.commands:
            lines.append(f"    {c}")
    if topo.engines_started_by == "trainer":
        lines.append("  started by trainer rank 0 on node 0 (megarl.rollout.server), equivalent to:")
        for e in topo.engines:
            lines.append(f"    {e.command}")
    if topo.pool_servers:
        lines.append(f"  the pools' servers, started by trainer rank 0 on node {topo.trainer_nodes[0]} "
                     "(megarl.rollout.pools), equivalent to:")
        for p in topo.pool_servers:
            lines.append(f"    {p.command}")
    if topo.notes:
        lines.append("")
        lines.append("notes")
        lines += [f"  - {n}" for n in topo.notes]
    return "\n".join(lines)


def _format_engines(topo: Topology, verbose: bool) -> list[str]:
    """The policy engines (where, how started, their urls) and the other models' pools."""
    lines = []
    if topo.placement == "disaggregated":
        how = "on their own nodes; weights go over reshard.transport=distributed"
    elif topo.device == "CPU":
        how = "on this machine's CPU cores (SGLang's CPU engine), started by the trainer's rank 0"
    elif topo.engines_started_by == "trainer":
        how = "on the trainer's GPUs; engine memory is released while the trainer trains"
    else:
        how = "on the trainer's GPUs, pre-launched on each node (see the notes on memory)"
    lines.append(f"engines   {len(topo.engines)} x SGLang tp {topo.engine_tp}, {how}")
    shown_engines = topo.engines if verbose or len(topo.engines) <= 8 else topo.engines[:4]
    for e in shown_engines:
        gpus = f"GPUs {_range(e.gpus)}" if e.gpus else "CPU"
        lines.append(f"  engine {e.index}: node {e.node} ({e.host}) {gpus}  {e.url}")
    if len(shown_engines) < len(topo.engines):
        lines.append(f"  ... {len(topo.engines) - len(shown_engines)} more")
    if topo.engines_started_by == "trainer":
        lines.append("  started by the trainer's rank 0 (rollout.engine.urls stays empty); each runs the command below")
    else:
        lines.append(f"  rollout.engine.urls for the trainer: {json.dumps(list(topo.engine_urls))}")
    if topo.pool_servers or topo.pool_urls:
        lines.append("pools     other models' SGLang servers (judges, verifiers, the OPD teacher); never weight-synced")
        for name in dict.fromkeys([p.pool for p in topo.pool_servers]):
            servers = [p for p in topo.pool_servers if p.pool == name]
            gpus = ", ".join(f"GPUs {_range(p.gpus)}" for p in servers if p.gpus) or "CPU"
            lines.append(f"  {name}: {len(servers)} server(s) started by trainer rank 0 on node "
                         f"{topo.trainer_nodes[0]} ({gpus})")
        for name, urls in topo.pool_urls.items():
            lines.append(f"  {name}: reached at {json.dumps(urls)}")
    return lines


def _format_stages(topo: Topology, verbose: bool) -> list[str]:
    """The decoder layers of every pipeline rank (and virtual stage), and where the split comes from."""
    p, split = topo.parallel, topo.pipeline_split
    fields = ", ".join(f"parallel.{k}={json.dumps(v)}" for k, v in split.items())  # true/false as YAML writes them
    if not split:
        how = "even split"
    elif any(getattr(p, k) not in (None, False) for k in split):
        how = f"split set in the config: {fields}"
    else:
        how = f"megarl's automatic split, as if {fields}"
    total = sum(len(r) for chunks in topo.stage_layers for r in chunks)
    lines = [f"stages    {total} decoder layers on pp {p.pp}{f' x vpp {p.virtual_pp}' if p.virtual_pp else ''} "
             f"({how}; megatron-core's placement)"]
    rows = [(rank, chunks) for rank, chunks in enumerate(topo.stage_layers)]
    shown = rows if verbose or len(rows) <= 4 else rows[:2] + [None] + rows[-1:]
    for row in shown:
        if row is None:
            hidden = rows[2:-1]
            counts = sorted({sum(len(r) for r in chunks) for _, chunks in hidden})
            each = f"{counts[0]} layers each" if len(counts) == 1 else f"{counts[0]}-{counts[-1]} layers"
            lines.append(f"  ... pp ranks {hidden[0][0]}-{hidden[-1][0]}: {each}")
            continue
        rank, chunks = row
        parts = [f"{r.start}-{r.stop - 1}" if len(r) > 1 else (f"{r.start}" if len(r) else "none") for r in chunks]
        where = " | ".join(parts) if len(chunks) > 1 else parts[0]
        lines.append(f"  pp rank {rank}: layers {where} ({sum(len(r) for r in chunks)})")
    return lines


def _listed_nodes(topo, verbose: bool, lines: list, elided: str):
    """The nodes to print in full; runs of nodes left out (not verbose) become one "... node(s) a-b: <elided>" line."""
    skipped: list[int] = []
    for node in topo.nodes:
        if not verbose and not _shown(topo, node):
            skipped.append(node.index)
            continue
        if skipped:
            lines.append(f"  ... node(s) {_span(skipped)}: {elided}")
            skipped = []
        yield node


def _shown(topo: Topology, node: Node) -> bool:
    """Compact output: the first two and the last node of each role; the ones between differ only in host, ranks
    and --node-rank."""
    same_role = [n.index for n in topo.nodes if n.role == node.role]
    return node.index in same_role[:2] + same_role[-1:]


def _fmt_ranks(ranks: list[int], verbose: bool) -> str:
    if verbose or len(ranks) <= 8:
        return "[" + ", ".join(map(str, ranks)) + "]"
    step = ranks[1] - ranks[0]
    if all(b - a == step for a, b in zip(ranks, ranks[1:])):
        return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}] ({len(ranks)} ranks, stride {step})"
    return f"[{', '.join(map(str, ranks[:4]))}, ..., {ranks[-1]}] ({len(ranks)} ranks)"


def _fmt_hosts(topo: Topology, ranks: list[int]) -> str:
    """'node 0 GPUs 0-3' or 'nodes 0-15 GPU 0': nodes that hold the same local GPUs are merged."""
    by_node: dict[int, list[int]] = {}
    for r in ranks:
        node, gpu = topo.host_of(r)
        by_node.setdefault(node, []).append(gpu)
    by_gpus: dict[tuple, list[int]] = {}
    for node, gpus in by_node.items():
        by_gpus.setdefault(tuple(sorted(gpus)), []).append(node)
    parts = []
    for gpus, nodes in by_gpus.items():
        unit = "GPU" if topo.device == "GPU" else "process"
        plural = ("es" if unit == "process" else "s") if len(gpus) > 1 else ""
        parts.append(f"node{'s' if len(nodes) > 1 else ''} {_span(nodes)} {unit}{plural} {_range(gpus)}")
    return "; ".join(parts)


def _range(values) -> str:
    """[0,1,2,3] -> '0-3'; [0,2,4] -> '0,2,4'; runs of consecutive values are joined."""
    values = sorted(values)
    runs, start = [], values[0]
    for a, b in zip(values, values[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a != start else f"{a}")
            start = b
    return ",".join(runs)


def _span(nodes) -> str:
    return _range(list(nodes))
