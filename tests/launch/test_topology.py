"""megarl.launch: the dry run's rank groups equal what megatron-core builds, placements, commands, and errors.

The group check runs megatron.core.parallel_state.initialize_model_parallel in this process against a FAKE world:
torch.distributed's world size / rank / new_group are patched so that new_group records the rank lists it is asked
for (NCCL and gloo alike) and hands back a dummy; nothing distributed starts. CPU only, no subprocess but one.
"""
import json
import os
import re
import shlex
import subprocess
import sys
from collections import defaultdict

import pytest
import torch.distributed as dist

from megarl import cli
from megarl.config import ConfigError
from megarl.launch import (GROUP_KINDS, TopologyError, dry_run, expand_hostlist, format_topology, launch_defaults,
                           launch_hosts, plan)
from megarl.parallel import ORDER
from megarl.trainer.config import load_train_config

pytestmark = pytest.mark.unit

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_GPUS_ON_NODE",
                "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch):
    for key in _LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)


def megatron_groups(monkeypatch, parallel, world_size: int, rank: int = 0) -> dict[str, list[list[int]]]:
    """group_desc -> rank lists, as initialize_model_parallel creates them for `world_size` (seen from `rank`)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        pytest.skip("parallel_state is already initialised in this process")
    recorded = defaultdict(list)

    class FakeGroup:  # what parallel_state's getters ask of a group
        def __init__(self, ranks):
            self.ranks = list(ranks)

        def size(self):
            return len(self.ranks)

        def rank(self):
            return self.ranks.index(rank) if rank in self.ranks else -1

    def new_group(ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False,
                  group_desc=None):  # torch.distributed.new_group's signature (megatron's create_group passes all)
        recorded[group_desc].append(list(ranks))
        return FakeGroup(ranks)

    with monkeypatch.context() as m:
        m.setattr(dist, "is_initialized", lambda: True)
        m.setattr(dist, "get_world_size", lambda group=None: world_size)
        m.setattr(dist, "get_rank", lambda group=None: rank)
        m.setattr(dist, "new_group", new_group)
        try:
            ps.initialize_model_parallel(  # the call megarl.parallel.initialize makes
                tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
                virtual_pipeline_model_parallel_size=parallel.vpp if (parallel.vpp or 1) > 1 else None,
                context_parallel_size=parallel.cp, expert_model_parallel_size=parallel.ep,
                expert_tensor_parallel_size=parallel.etp, order=ORDER)
            sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                     ps.get_data_parallel_world_size(), ps.get_expert_model_parallel_world_size(),
                     ps.get_expert_data_parallel_world_size())
        finally:
            ps.destroy_model_parallel()
    recorded["_sizes"] = sizes
    return dict(recorded)


CASES = [  # (preset, nnodes, gpus per node, overrides): 8, 16, 64 and 128 GPUs
    ("configs/qwen3_30b_a3b.yaml", 1, 8, []),
    ("configs/qwen3_30b_a3b.yaml", 2, 8, []),  # colocated on 16: dp 4, expert-dp 2
    ("configs/qwen3_30b_a3b_16gpu_disagg.yaml", 2, 8, []),  # 16 GPUs, the trainer gets 8
    ("configs/deepseek_v3_64gpu.yaml", 8, 8, []),
    ("configs/deepseek_v3.yaml", 16, 8, []),
    ("configs/deepseek_v3_pp4.yaml", 16, 8, []),  # uneven pipeline stages 16+15+15+15
    ("configs/glm45_air.yaml", 4, 8, []),
    # every group kind non-trivial at once: tp, pp (+vpp), cp, ep, etp != tp
    ("configs/qwen3_30b_a3b.yaml", 4, 8, ["parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.cp=2",
                                          "parallel.ep=4", "parallel.etp=2"]),
]


@pytest.mark.parametrize("preset,nnodes,gpus,overrides", CASES)
def test_dry_run_groups_equal_megatron(monkeypatch, preset, nnodes, gpus, overrides):
    cfg = load_train_config(preset, overrides)
    topo = plan(cfg, nnodes, gpus, config_path=preset)
    built = megatron_groups(monkeypatch, cfg.parallel, topo.world_size)
    for kind in GROUP_KINDS:
        assert topo.groups[kind.name] == built[kind.group_desc], kind.name
    # gloo twins are the same ranks; every trainer rank is in exactly one group of each kind
    assert built["DATA_PARALLEL_GROUP_GLOO"] == built["DATA_PARALLEL_GROUP"]
    assert built["EXPERT_DATA_PARALLEL_GROUP_GLOO"] == built["EXPERT_DATA_PARALLEL_GROUP"]
    for kind in GROUP_KINDS:
        assert sorted(r for g in topo.groups[kind.name] for r in g) == list(range(topo.world_size)), kind.name
    s = topo.sizes
    assert built["_sizes"] == (s["tp"], s["pp"], s["dp"], s["ep"], s["expert-dp"])
    assert s["dp"] == topo.world_size // (s["tp"] * s["pp"] * s["cp"])


def test_8gpu_colocated_plan_and_output():
    cfg = load_train_config("configs/qwen3_30b_a3b.yaml")
    topo = plan(cfg, 1, 8, config_path="configs/qwen3_30b_a3b.yaml")
    assert (topo.sizes["tp"], topo.sizes["ep"], topo.sizes["etp"], topo.sizes["dp"], topo.sizes["expert-dp"]) == \
        (4, 8, 1, 2, 1)
    assert topo.groups["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7]] and topo.groups["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert topo.groups["ep"] == [list(range(8))] and topo.groups["etp"] == [[r] for r in range(8)]
    assert topo.shape_source.startswith("model.shape") and topo.model_shape.num_experts == 128
    assert topo.engines_started_by == "trainer" and topo.engine_urls == () and len(topo.engines) == 1
    assert topo.engines[0].gpus == tuple(range(8))
    (node,) = topo.nodes
    assert node.role == "trainer + engines" and node.ranks == tuple(range(8))
    assert node.commands == ("megarl-torchrun --nnodes 1 --nproc-per-node 8 --node-rank 0 --rdzv-backend c10d "
                             "--rdzv-endpoint node0:29500 -m megarl.cli train configs/qwen3_30b_a3b.yaml",)
    text = format_topology(topo)
    assert "tp=4 pp=1 vpp=- cp=1 ep=8 etp=1 | dp=2 expert-dp=1" in text
    assert "--tp-size 8" in text and "each within one node" in text


def test_disaggregated_engines_on_last_nodes_with_urls():
    cfg = load_train_config("configs/qwen3_30b_a3b_16gpu_disagg.yaml")
    topo = plan(cfg, 2, 8, config_path="configs/qwen3_30b_a3b_16gpu_disagg.yaml")
    assert topo.trainer_nodes == (0,) and topo.engine_nodes == (1,) and topo.world_size == 8
    assert [(e.node, e.gpus, e.port) for e in topo.engines] == [(1, (0, 1), 30000), (1, (2, 3), 30001),
                                                                 (1, (4, 5), 30002), (1, (6, 7), 30003)]
    assert topo.engine_urls == tuple(f"http://node1:{30000 + k}" for k in range(4))
    trainer, engines = topo.nodes
    assert trainer.role == "trainer" and engines.role == "engines" and engines.ranks == ()
    assert len(engines.commands) == 4 and "--tp-size 2 --base-gpu-id 2" in engines.commands[1]
    assert all(c.startswith("python -m sglang.launch_server --model-path models/Qwen3-30B-A3B --host 0.0.0.0")
               for c in engines.commands)
    (torchrun,) = trainer.commands
    assert torchrun.startswith("megarl-torchrun --nnodes 1 --nproc-per-node 8 --node-rank 0 --rdzv-backend c10d "
                               "--rdzv-endpoint node0:29500 -m megarl.cli train")
    # the urls override the trainer gets parses back to exactly these urls
    override = next(a for a in shlex.split(torchrun) if a.startswith("rollout.engine.urls="))
    again = load_train_config("configs/qwen3_30b_a3b_16gpu_disagg.yaml", [override])
    assert again.rollout.engine.urls == list(topo.engine_urls)


def test_disaggregated_three_nodes_with_slurm_hosts():
    env = {"SLURM_JOB_NUM_NODES": "3", "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_NODELIST": "gpu[007-009]"}
    assert launch_defaults(env)[:2] == (3, 8)
    hosts = launch_hosts(3, env)
    assert hosts == ["gpu007", "gpu008", "gpu009"]
    cfg = load_train_config("configs/qwen3_30b_a3b_16gpu_disagg.yaml", ["rollout.engine.nodes=2"])
    topo = plan(cfg, 3, 8, hosts=hosts)
    assert topo.trainer_nodes == (0,) and topo.engine_nodes == (1, 2) and len(topo.engines) == 8
    assert topo.engine_urls[0] == "http://gpu008:30000" and topo.engine_urls[-1] == "http://gpu009:30003"
    assert topo.rdzv_endpoint == "gpu007:29500"


def test_multinode_colocated_ranks_and_hosts():
    cfg = load_train_config("configs/deepseek_v3.yaml")
    topo = plan(cfg, 16, 8, config_path="configs/deepseek_v3.yaml")
    assert topo.world_size == 128 and topo.sizes["expert-dp"] == 1 and topo.sizes["dp"] == 16
    assert topo.host_of(0) == (0, 0) and topo.host_of(127) == (15, 7) and topo.host_of(9) == (1, 1)
    assert len(topo.engines) == 16 and topo.engines_started_by == "nodes"
    assert [n.commands[-1].split()[:7] for n in topo.nodes[:2]] == [
        ["megarl-torchrun", "--nnodes", "16", "--nproc-per-node", "8", "--node-rank", str(i)] for i in range(2)]
    compact, verbose = format_topology(topo), format_topology(topo, verbose=True)
    assert "... 14 more" in compact and "node(s) 2-14: the same" in compact
    assert len(verbose.splitlines()) > len(compact.splitlines()) + 100
    assert "up to 16 nodes per group" in compact  # dp crosses nodes; tp stays on one
    assert "[0, 8, ..., 120] (16 ranks, stride 8)" in compact


def test_launch_defaults_from_environment():
    assert launch_defaults({})[:2] == (1, 8)
    assert launch_defaults({"WORLD_SIZE": "32", "LOCAL_WORLD_SIZE": "8", "GROUP_WORLD_SIZE": "4"})[:2] == (4, 8)
    assert launch_defaults({"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "4"})[:2] == (4, 4)
    assert launch_defaults({"SLURM_NNODES": "2", "SLURM_NTASKS_PER_NODE": "4"})[:2] == (2, 4)
    assert expand_hostlist("gpu[003-005,9],cpu1") == ["gpu003", "gpu004", "gpu005", "gpu9", "cpu1"]
    with pytest.raises(TopologyError, match="LOCAL_WORLD_SIZE"):
        launch_defaults({"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "x"})


def test_cli_dry_run_prints_commands_without_distributed(monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("a dry run must not start torch.distributed")

    monkeypatch.setattr(dist, "init_process_group", refuse)
    code = cli.main(["train", "configs/qwen3_30b_a3b.yaml", "--dry-run", "--nnodes", "1", "--gpus-per-node", "8",
                     "--gpu-memory-gb", "141"])  # the preset's H200s
    out = capsys.readouterr().out
    assert code == 0 and not dist.is_initialized()
    assert "megarl-torchrun --nnodes 1 --nproc-per-node 8 --node-rank 0 --rdzv-backend c10d --rdzv-endpoint node0:29500 " \
           "-m megarl.cli train configs/qwen3_30b_a3b.yaml" in out
    assert "python -m sglang.launch_server --model-path models/Qwen3-30B-A3B" in out


def test_cli_dry_run_in_a_fresh_process():
    """The real command line, in its own interpreter: exit 0, the torchrun line, and no process group."""
    code = ("import sys, torch.distributed as dist; from megarl import cli; "
            "dist.init_process_group = None; rc = cli.main(sys.argv[1:]); "
            "assert not dist.is_initialized(); sys.exit(rc)")
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    proc = subprocess.run([sys.executable, "-c", code, "run", "configs/qwen3_30b_a3b_16gpu_disagg.yaml",
                           "--dry-run", "--nnodes", "2", "--gpus-per-node", "8"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "-m megarl.cli run configs/qwen3_30b_a3b_16gpu_disagg.yaml 'rollout.engine.urls=" in proc.stdout
    assert "http://node1:30003" in proc.stdout


@pytest.mark.parametrize("argv,message", [
    # world size not divisible by tp*pp*cp
    (["configs/qwen3_30b_a3b.yaml", "parallel.tp=3"], r"world size 8 is not divisible by tp\*pp\*cp.*parallel.tp"),
    # etp*ep*pp does not divide the world
    (["configs/qwen3_30b_a3b.yaml", "parallel.ep=16"], r"etp\*ep\*pp = 1\*16\*1.*parallel.ep"),
    # the model shape (from the preset's model.shape hint): 61 layers over pp 2 x vpp 2, 100 experts over ep 8
    (["configs/deepseek_v3.yaml", "parallel.pp=2", "parallel.vpp=2", "parallel.ep=64", "--nnodes", "16"],
     r"num_hidden_layers=61 cannot be split over parallel.pp=2 x parallel.vpp=2.*Fix: unset parallel.vpp"),
    (["configs/qwen3_30b_a3b.yaml", "parallel.ep=8", "parallel.tp=1", "model.shape.num_experts=100"],
     r"num_experts=100 is not divisible by parallel.ep=8"),
    # disaggregated needs a trainer node
    (["configs/qwen3_30b_a3b_16gpu_disagg.yaml", "--nnodes", "1"],
     r"rollout.engine.nodes=1 leaves no node for the trainer.*Fix"),
    # an engine must fit on one node
    (["configs/qwen3_30b_a3b.yaml", "--gpus-per-node", "6"], r"rollout.engine.tp_size=8 does not divide "
                                                              r"--gpus-per-node 6"),
    # disaggregated needs engine nodes and the distributed transport
    (["configs/qwen3_30b_a3b_16gpu_disagg.yaml", "rollout.engine.nodes=0"],
     r"needs rollout.engine.nodes >= 1.*Fix"),
    (["configs/qwen3_30b_a3b_16gpu_disagg.yaml", "reshard.transport=tensor"], r"needs reshard.transport=distributed"),
    (["configs/qwen3_30b_a3b.yaml", "rollout.engine.nodes=1"], r"rollout.engine.nodes=1 is only used with"),
])
def test_bad_inputs_exit_2_naming_the_field(capsys, argv, message):
    nodes = [] if "--nnodes" in argv else ["--nnodes", "2" if "disagg" in argv[0] else "1"]
    code = cli.main(["train", *argv, "--dry-run", *nodes])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(message, err), err


def test_model_shape_and_moe_option_validation(tmp_path):
    with pytest.raises(ConfigError, match=r"model.shape has unknown key\(s\) \['layers'\]"):
        load_train_config(None, ["model.path=x", "model.shape={layers: 2}"])
    with pytest.raises(ConfigError, match=r"model.shape needs \['ffn_hidden_size'\]"):
        load_train_config(None, ["model.path=x", "model.shape={num_layers: 2, num_attention_heads: 4}"])
    with pytest.raises(ConfigError, match="model.moe_aux_loss_coeff must be >= 0"):
        load_train_config(None, ["model.path=x", "model.moe_aux_loss_coeff=-1"])
    with pytest.raises(ConfigError, match="model.freeze_router_bias is set but model.shape has no num_experts"):
        load_train_config(None, ["model.path=x", "model.freeze_router_bias=true",
                                 "model.shape={num_layers: 2, num_attention_heads: 4, ffn_hidden_size: 8}"])
    with pytest.raises(ConfigError, match=r"rollout.placement='split' is unknown"):
        load_train_config(None, ["model.path=x", "rollout.placement=split"])
    # a model folder's config.json wins over the hint
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "qwen3_moe", "num_hidden_layers": 6, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 64, "num_experts": 8, "moe_intermediate_size": 16}))
    cfg = load_train_config("configs/qwen3_30b_a3b.yaml", [f"model.path={folder}", "parallel.tp=2"])
    topo = plan(cfg, 1, 8)
    assert topo.model_shape.num_layers == 6 and topo.shape_source.endswith("config.json")
    with pytest.raises(TopologyError, match="num_key_value_heads=2 is not divisible by parallel.tp=4"):
        plan(load_train_config("configs/qwen3_30b_a3b.yaml", [f"model.path={folder}"]), 1, 8)


def test_quickstart_tiny_model_plans():
    """A tiny-model preset plans from its tiny settings (nothing is written)."""
    text = dry_run("run", "configs/quickstart.yaml", [], nnodes=1, gpus_per_node=1, environ={})
    assert "4 layers, 4 heads / 2 KV heads" in text and "shape from model.tiny (qwen2)" in text


def test_dry_run_of_a_cpu_config_on_a_cpu_machine_plans_the_cpu_run(monkeypatch):
    """No --nnodes/--gpus-per-node and no launcher variables on a machine without GPU: the plan is the CPU run the
    command would do (one process, SGLang's CPU engine started by rank 0), not an 8-GPU node; with the flags, the
    GPU plan as before."""
    import megarl.launch as launch

    monkeypatch.setattr(launch, "_local_gpus", lambda: 0)
    text = launch.dry_run("run", "configs/quickstart.yaml", [], environ={})
    assert "1 node(s) x 1 CPU process(es)" in text and "--device cpu" in text and "GPUs " not in text
    planned = launch.dry_run("run", "configs/quickstart.yaml", [], nnodes=1, gpus_per_node=8, environ={})
    assert "1 node(s) x 8 GPUs" in planned and "--device cpu" not in planned


# ------------------------------------------------------------------------------------------- memory estimate
def test_memory_estimate_equals_a_hand_computation():
    """megarl.launch.memory on a small MLA + MoE shape with a dense first layer, tp 2, pp 3 (uneven), ep 2, etp 1,
    against the parameter count written out tensor by tensor (DeepSeek-V3's HF names) and the byte rules."""
    from megarl.launch import memory
    from megarl.parallel import ModelShape, ParallelConfig

    s = ModelShape(num_layers=7, num_attention_heads=4, num_key_value_heads=4, ffn_hidden_size=48, num_experts=8,
                   moe_ffn_hidden_size=16, hidden_size=32, vocab_size=100, num_dense_layers=1,
                   shared_expert_ffn_hidden_size=16, q_lora_rank=12, kv_lora_rank=8, qk_nope_head_dim=6,
                   qk_rope_head_dim=2, v_head_dim=4)
    h, heads, V = 32, 4, 100
    # split over tp: q_b_proj, kv_b_proj, o_proj; whole on every tp rank: q_a_proj + q_a_layernorm,
    # kv_a_proj_with_mqa + kv_a_layernorm, input_layernorm + post_attention_layernorm
    attn_split = 12 * heads * (6 + 2) + 8 * heads * (6 + 4) + heads * 4 * h
    attn_whole = (h * 12 + 12) + (h * (8 + 2) + 8) + 2 * h
    dense_mlp = 3 * h * 48  # gate, up, down
    shared, router, experts = 3 * h * 16, 8 * h, 8 * 3 * h * 16
    tp, ep, world = 2, 2, 12
    p = ParallelConfig(tp=tp, pp=3, ep=ep, etp=1)
    stages = p.stage_layers(7)
    assert [list(r) for (r,) in stages] == [[0, 1], [2, 3, 4], [5, 6]]  # megarl's automatic uneven split
    moe_layer = (attn_split + shared) / tp + attn_whole + router
    dense = [V * h / tp + (attn_split + dense_mlp) / tp + attn_whole + moe_layer,  # embedding, layer 0 (dense), 1
             3 * moe_layer,
             2 * moe_layer + h + V * h / tp]  # + final norm and output layer
    expert = [1 * experts / ep, 3 * experts / ep, 2 * experts / ep]
    sizes = {"tp": tp, "pp": 3, "cp": 1, "ep": ep, "etp": 1, "dp": world // (tp * 3), "expert-dp": world // (ep * 3)}
    assert sizes["dp"] == 2 and sizes["expert-dp"] == 2
    for distributed, shards in ((True, (2, 2)), (False, (1, 1))):
        got = memory.trainer_memory(s, stages, sizes, distributed, "bfloat16")
        for st, d, e in zip(got, dense, expert):
            assert (st.dense_params, st.expert_params) == pytest.approx((d, e))
            assert st.weights == pytest.approx(2 * (d + e)) and st.gradients == pytest.approx(4 * (d + e))
            # fp32 master copy + two fp32 moments, sharded over dp (dense) and expert-dp (experts)
            assert st.optimizer == pytest.approx(12 * (d / shards[0] + e / shards[1]))
    (fp32,) = memory.trainer_memory(s, [[range(7)]], {**sizes, "pp": 1}, False, "float32")
    assert fp32.optimizer == pytest.approx(8 * (fp32.dense_params + fp32.expert_params))  # no master copy

    total = 2 * V * h + h + 7 * (attn_split + attn_whole) + dense_mlp + 6 * (shared + router + experts)
    assert memory.total_params(s) == total
    # the engine: weights over its tp; MLA's KV cache is one latent (kv_lora_rank + rope dims) per layer and token
    eng = memory.engine_memory(s, tp=2, dtype="bfloat16", max_total_tokens=None, step_tokens=1000, engines=3)
    assert eng.weights == pytest.approx(total * 2 / 2) and eng.kv_per_token == 7 * (8 + 2) * 2
    assert eng.tokens == 334 and eng.kv_cache == 334 * 140
    assert memory.engine_memory(s, 2, "bfloat16", 4096, 1000, 3).tokens == 4096
    # GQA: K and V, KV heads split over tp (one each when tp exceeds them)
    gqa = ModelShape(num_layers=3, num_attention_heads=8, num_key_value_heads=2, ffn_hidden_size=64, hidden_size=64,
                     vocab_size=100, head_dim=16)
    assert memory.kv_bytes_per_token(gqa, 1, "bfloat16") == 2 * 3 * 2 * 16 * 2
    assert memory.kv_bytes_per_token(gqa, 4, "bfloat16") == 2 * 3 * 1 * 16 * 2


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "qwen3_moe", "mixtral", "qwen3", "llama"])
def test_parameter_count_equals_transformers(family):
    """The estimate's parameter count of each tiny family (its config.json fields) against the transformers model
    built from them; what the estimate leaves out by design (biases, QK-norm weights) is left out of both."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megarl.launch import memory
    from megarl.models import tiny
    from megarl.models.hf import model_shape

    fields = {**tiny._BASE, **tiny._FAMILY[family]}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **fields))
    left_out = re.compile(r"\.bias$|\.(q_norm|k_norm)\.weight$")
    counted = {n: p.numel() for n, p in model.named_parameters() if not left_out.search(n)}
    assert sum(counted.values()) == memory.total_params(model_shape(fields))


def test_dry_run_prints_memory_per_stage_and_engine():
    from megarl.launch import memory

    text = dry_run("train", "configs/glm45_air.yaml", [], nnodes=4, gpus_per_node=8, environ={}, gpu_memory_gb=141)
    assert "pp rank 0: layers 0-22 (23)" in text and "pp rank 1: layers 23-45 (23)" in text
    cfg = load_train_config("configs/glm45_air.yaml")
    topo = plan(cfg, 4, 8, config_path="configs/glm45_air.yaml", gpu_memory_gb=141)
    first, last = topo.memory
    assert first.layers == last.layers == 23 and first.expert_params < last.expert_params  # layer 0 is dense
    assert f"trainer pp rank 1 (23 layers): {last.dense_params / 1e9:.2f}B dense + {last.expert_params / 1e9:.2f}B " \
           f"expert params: weights {last.weights / 1e9:.1f} GB" in text
    eng = topo.engine_memory
    assert eng.tp == 8 and eng.tokens == -(-64 * 8 * (1024 + 8192) // 4)  # one step over 4 engines, full length
    assert f"engine (SGLang tp 8, bfloat16): weights {eng.weights / 1e9:.1f} GB" in text
    # colocated: the trainer's state beside the engine's static share (mem_fraction_static 0.4 of 141 GB)
    assert topo.engine_share == pytest.approx(0.4 * 141e9)
    assert f"up to {(last.total + topo.engine_share) / 1e9:.1f} GB per GPU" in text
    assert "verdict   per GPU of 141.0 GB (--gpu-memory-gb): fits" in text
    # the preset's header quotes the estimate
    header = open("configs/glm45_air.yaml").read()
    assert f"{first.total / 1e9:.1f} GB on stage 0 and {last.total / 1e9:.1f} GB on stage 1" in header
    assert f"up to {(last.total + topo.engine_share) / 1e9:.1f} GB in all" in header
    # DeepSeek-V3: MLA's KV cache (kv_lora_rank 512 + rope 64 per layer, bf16) and 671B parameters
    ds = plan(load_train_config("configs/deepseek_v3.yaml"), 16, 8)
    assert ds.engine_memory.kv_per_token == 61 * (512 + 64) * 2
    assert round(memory.total_params(ds.model_shape) / 1e9) == 671
    pp4 = plan(load_train_config("configs/deepseek_v3_pp4.yaml"), 16, 8)
    assert [st.layers for st in pp4.memory] == [16, 15, 15, 15]
    assert max(st.total for st in pp4.memory) < ds.memory[0].total  # pp 4 holds fewer dense parameters per GPU
    # a shape without hidden_size / vocab_size: the dry run says what to add instead of guessing
    bare = dry_run("train", "configs/qwen3_30b_a3b.yaml", ["model.shape={num_layers: 48, num_attention_heads: 32, "
                   "num_key_value_heads: 4, ffn_hidden_size: 6144, num_experts: 128, moe_ffn_hidden_size: 768}"],
                   nnodes=1, gpus_per_node=8, environ={})
    assert "memory    not estimated: the model shape has no hidden_size, vocab_size (add them to model.shape" in bare


def test_dry_run_places_the_engine_pools_as_rank_0_starts_them():
    """Pools with a model take rank 0's GPUs after the policy engines' (which leave them room when the trainer starts
    both), with the command megarl.rollout.pools runs; pools with urls are listed; a pool that does not fit is one
    line naming the field."""
    from megarl.rollout.pools import pool_server_config
    from megarl.testing import tiny_model_dir
    from megarl.trainer.config import fleet_spec

    m = tiny_model_dir("qwen2")
    judge = [f"model.path={m}", "reward.name=judge", f"pools.judge.model={m}", "pools.judge.tp_size=2",
             "pools.meta.urls=[http://h:1]", "reward.judge.meta_verifier.pool=meta"]
    cfg = load_train_config(None, judge)
    topo = plan(cfg, 1, 8)
    assert [e.gpus for e in topo.engines] == [(k,) for k in range(6)]  # GPUs 6-7 left to the judge
    assert [(p.pool, p.gpus) for p in topo.pool_servers] == [("judge", (6, 7))] and topo.pool_urls == {
        "meta": ["http://h:1"]}
    # the printed command is the runtime's, given the policy engine count the plan passes to the trainer
    runtime = load_train_config(None, judge + ["rollout.engine.num_engines=6"])
    assert pool_server_config(fleet_spec(runtime), "judge", runtime.pools["judge"]).base_gpu_id == 6
    assert "--base-gpu-id 6" in topo.pool_servers[0].command and "rollout.engine.num_engines=6" in \
        " ".join(topo.nodes[0].commands)
    text = format_topology(topo)
    assert "judge: 1 server(s) started by trainer rank 0 on node 0 (GPUs 6-7)" in text
    assert 'meta: reached at ["http://h:1"]' in text
    with pytest.raises(TopologyError, match=r"leaving none for a policy engine"):
        plan(load_train_config(None, judge + ["pools.judge.num_engines=4"]), 1, 8)
    disagg = ["rollout.placement=disaggregated", "rollout.engine.nodes=1", "reshard.transport=distributed"]
    topo = plan(load_train_config(None, judge + disagg), 2, 8)  # the trainer's node has no policy engine
    assert [p.gpus for p in topo.pool_servers] == [(0, 1)]
    with pytest.raises(TopologyError, match=r"pools\.judge: server 4 would need GPU 9 .* Fix: .*pools\.judge\.urls"):
        plan(load_train_config(None, judge + disagg + ["pools.judge.num_engines=5"]), 2, 8)
