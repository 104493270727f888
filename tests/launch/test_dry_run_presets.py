"""The dry run of every preset, as its header comment names it, on a fresh clone; the per-GPU verdict
(--gpu-memory-gb, the engine's static memory fraction); no engine for sft/dpo; this machine's host name.

A fresh clone is simulated by running in an empty folder holding only `configs/` (no models/, no runs/, no data/), on
a machine without GPU (megarl.launch._local_gpus patched to 0). Everything runs in-process through megarl.cli.main.
"""
import importlib
import os
import re
import shlex
import socket
from pathlib import Path

import pytest

import megarl.launch as launch
from megarl import cli
from megarl.launch import memory, plan, preflight
from megarl.trainer.config import load_train_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PRESETS = sorted(p.name for p in (REPO / "configs").glob("*.yaml"))
# "#   [prep && ]megarl <command> configs/X.yaml ... --dry-run ...[   # exits 2: ...]"
HEADER = re.compile(r"^#\s+(?:(?P<prep>.+?)\s+&&\s+)?megarl\s+(?P<argv>(?:run|train|sft|dpo|eval)\s+"
                    r"configs/(?P<name>\S+\.yaml)\s.*)$")
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "SLURM_PROCID", "SLURM_NTASKS", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "SLURM_GPUS_ON_NODE",
                "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def header_command(preset: str) -> tuple[list[str], list[str], str]:
    """(prep argv, megarl argv, the line's trailing note) of the preset header's --dry-run line."""
    header = []
    for line in (REPO / "configs" / preset).read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    for line in header:
        m = HEADER.match(line)
        if m and m.group("name") == preset and "--dry-run" in m.group("argv"):
            argv, _, note = m.group("argv").partition(" #")
            return shlex.split(m.group("prep") or ""), shlex.split(argv), note.strip()
    raise AssertionError(f"configs/{preset}: no '#   megarl <command> configs/{preset} ... --dry-run' header line")


@pytest.fixture
def fresh_clone(tmp_path, monkeypatch):
    """An empty folder with the repository's configs/ only, on a machine without GPU and outside any launcher."""
    (tmp_path / "configs").symlink_to(REPO / "configs")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launch, "_local_gpus", lambda: 0)
    monkeypatch.setattr(launch, "_local_gpu_memory_gb", lambda: launch.DEFAULT_GPU_MEMORY_GB)
    for key in _LAUNCH_VARS:
        monkeypatch.delenv(key, raising=False)
    return tmp_path


def run_cli(argv, capsys) -> tuple[int, str, list[str]]:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, [line for line in err.splitlines() if line.startswith("megarl: error")]


def test_every_header_names_the_right_command():
    """run for presets whose RL starts from this run's SFT checkpoint (model.load: sft), dpo for DPO presets."""
    for preset in PRESETS:
        _, argv, _ = header_command(preset)
        cfg = load_train_config(str(REPO / "configs" / preset))
        if cfg.model.load == "sft":
            assert argv[0] == "run", preset
        if "dpo:" in (REPO / "configs" / preset).read_text():
            assert argv[0] == "dpo", preset


@pytest.mark.parametrize("preset", PRESETS)
def test_header_dry_run_on_a_fresh_clone(fresh_clone, capsys, preset):
    prep, argv, note = header_command(preset)
    if prep:  # e.g. python -m megarl.examples.coding_agent FOLDER: writes the preset's data
        assert prep[:2] == ["python", "-m"] and prep[2].startswith("megarl."), prep
        # fewer tasks than the default 400 (the dry run reads the first 16 records; writing 400 takes minutes here)
        few = ["--tasks", "16", "--held-out", "4"] if prep[2] == "megarl.examples.coding_agent" else []
        assert importlib.import_module(prep[2]).main(prep[3:] + few) in (0, None)
    code, out, errors = run_cli(argv, capsys)
    cfg = load_train_config(f"configs/{preset}", [a for a in argv if "=" in a and not a.startswith("-")])
    if "exits 2" in note:  # documented as not fitting: the whole report, then one line
        assert code == 2 and len(errors) == 1, errors
        assert "does not fit" in errors[0] and "Fix: " in errors[0]
        assert "verdict" in out and "commands per node" in out
    elif code != 0:  # only a model folder that is not on a fresh clone, with no shape hint to plan from
        assert code == 2 and len(errors) == 1, errors
        assert cfg.model.path and not os.path.exists(cfg.model.path) and cfg.model.shape is None, errors
        assert "model.path" in errors[0] and "Fix: " in errors[0]
        maker = preflight.FOLDER_MAKERS.get(os.path.basename(cfg.model.path))
        if maker:  # the fix is the command that writes the folder
            assert maker.format(path=cfg.model.path) in errors[0]
    else:
        assert errors == [] and "checked" in out
        assert "does not fit" not in out


@pytest.mark.parametrize("preset", [p for p in PRESETS if "--nnodes" in header_command(p)[1]])
def test_without_the_flags_the_error_names_them(fresh_clone, capsys, preset):
    """A GPU preset dry-run on this (CPU) machine without --nnodes/--gpus-per-node: one line whose Fix is the
    flags the layout needs, the ones its header gives."""
    _, argv, _ = header_command(preset)
    flags = argv[argv.index("--nnodes"):argv.index("--nnodes") + 4]
    code, _, errors = run_cli(argv[:2] + ["--dry-run"], capsys)
    assert code == 2 and len(errors) == 1, errors
    assert errors[0].endswith(f"Fix: {' '.join(flags)}") or f"Fix: {' '.join(flags)} (" in errors[0], errors[0]
    assert "parallel layout" in errors[0]


def _threshold_gb(cfg, nnodes: int, gpus: int) -> float:
    """The GPU memory at which the colocated trainer fits exactly beside the engine's static fraction."""
    topo = plan(cfg, nnodes, gpus)
    worst = max(st.total for st in topo.memory)
    return worst / (1 - topo.engine_fraction) / memory.GB


def test_gpu_memory_flips_the_verdict(fresh_clone, capsys):
    """Just above the threshold: fits, exit 0; just below: the full report, then one line, exit 2."""
    argv = ["train", "configs/qwen3_30b_a3b.yaml", "--dry-run", "--nnodes", "1", "--gpus-per-node", "8"]
    edge = _threshold_gb(load_train_config("configs/qwen3_30b_a3b.yaml"), 1, 8)
    code, out, errors = run_cli(argv + ["--gpu-memory-gb", f"{edge * 1.01:.2f}"], capsys)
    assert code == 0 and errors == [] and "verdict   per GPU of" in out and ": fits" in out
    code, out, errors = run_cli(argv + ["--gpu-memory-gb", f"{edge * 0.99:.2f}"], capsys)
    assert code == 2 and len(errors) == 1
    assert "does not fit" in errors[0] and "optimizer" in errors[0] and "Fix: " in errors[0]
    assert "mem_fraction_static" in errors[0]
    assert "does not fit" in out and "commands per node" in out  # the report comes first


def test_too_large_a_layout_does_not_fit_and_names_the_terms():
    """DeepSeek-V3 on 64 GPUs: the trainer alone exceeds the GPU; the terms are named largest first."""
    cfg = load_train_config(str(REPO / "configs/deepseek_v3_64gpu.yaml"), ["rollout.placement=disaggregated",
                                                                            "rollout.engine.nodes=1",
                                                                            "reshard.transport=distributed"])
    topo = plan(cfg, 9, 8, gpu_memory_gb=141)
    assert not topo.verdict.fits
    trainer = topo.verdict.loads[0]
    assert trainer.problems and [name for name, _ in trainer.terms] == ["optimizer", "gradients", "weights"]
    assert trainer.total == pytest.approx(max(st.total for st in topo.memory))
    bigger = plan(cfg, 9, 8, gpu_memory_gb=trainer.total / memory.GB + 1)
    assert not bigger.verdict.loads[0].problems  # the engine's GPU is checked on its own


def test_the_engine_honours_its_static_fraction():
    """The engine claims mem_fraction_static of each GPU (as --mem-fraction-static in its printed command, where
    rollout.engine.extra_args wins), max_total_tokens caps it, and the colocated trainer gets the rest."""
    preset = str(REPO / "configs/qwen3_30b_a3b.yaml")
    for fraction in (0.35, 0.6):
        topo = plan(load_train_config(preset, [f"rollout.engine.mem_fraction_static={fraction}"]), 1, 8,
                    gpu_memory_gb=141)
        assert f"--mem-fraction-static {fraction}" in topo.engines[0].command
        assert topo.engine_fraction == fraction and topo.engine_share == pytest.approx(fraction * 141 * memory.GB)
        (load,) = topo.verdict.loads
        trainer = max(st.total for st in topo.memory)
        assert load.total == pytest.approx(trainer + topo.engine_share)
        assert bool(load.problems) == (trainer > (1 - fraction) * 141 * memory.GB)
    extra = plan(load_train_config(preset, ['rollout.engine.extra_args=["--mem-fraction-static", "0.5"]']), 1, 8)
    assert extra.engine_fraction == 0.5  # the last flag on SGLang's command line wins
    capped = plan(load_train_config(preset, ["rollout.engine.max_total_tokens=1000"]), 1, 8, gpu_memory_gb=141)
    eng = capped.engine_memory
    assert capped.engine_share == pytest.approx(eng.weights + 1000 * eng.kv_per_token)
    starved = plan(load_train_config(preset, ["rollout.engine.mem_fraction_static=0.05"]), 1, 8, gpu_memory_gb=141)
    assert any("engine weights" in p or "KV cache" in p for p in starved.verdict.loads[0].problems)


@pytest.mark.parametrize("command,preset", [("dpo", "dpo_tiny.yaml"), ("sft", "quickstart.yaml")])
def test_dpo_and_sft_list_no_engine(fresh_clone, command, preset):
    topo, text = launch.plan_dry_run(command, f"configs/{preset}", [], environ={})
    assert topo.engines == () and topo.engine_memory is None and topo.pool_servers == ()
    assert "sglang.launch_server" not in text and "SGLang engine(s)" not in text
    assert "engines   none" in text and f"placement none ({command} starts no SGLang engine)" in text
    gpu, _ = launch.plan_dry_run(command, f"configs/{preset}", [], nnodes=2, gpus_per_node=8, environ={})
    assert gpu.engines == () and gpu.trainer_nodes == (0, 1) and gpu.verdict.loads[0].name == "trainer GPU"


def test_this_machine_is_named_by_its_host_name(fresh_clone):
    """Planning this machine: its own host name in the commands; planning others: placeholders, said to be."""
    host = socket.gethostname()
    text = launch.dry_run("run", "configs/quickstart.yaml", [], environ={})
    assert f"--rdzv-endpoint {host}:29500" in text and f"node 0 ({host})" in text and "node0" not in text
    other = launch.dry_run("run", "configs/quickstart.yaml", [], nnodes=2, gpus_per_node=8, environ={})
    assert "--rdzv-endpoint node0:29500" in other and "node0, node1: placeholders for the planned machines" in other
    slurm = {"SLURM_JOB_NUM_NODES": "2", "SLURM_GPUS_ON_NODE": "8", "SLURM_JOB_NODELIST": "gpu[1-2]"}
    named = launch.dry_run("run", "configs/quickstart.yaml", [], environ=slurm)
    assert "--rdzv-endpoint gpu1:29500" in named and "placeholders" not in named
