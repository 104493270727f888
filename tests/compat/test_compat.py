"""megarl.compat: what megarl assumes about megatron-core, mbridge and SGLang holds for the installed versions.

Each library's module lists its assumptions in check_assumptions(); an upgrade that breaks one fails the named test
here (test_megatron_core_assumptions, test_mbridge_assumptions, test_sglang_assumptions) with what broke. The other
tests show that a broken assumption is reported, and that megarl's code outside megarl/compat neither imports a
private member of these libraries nor reads megatron's global groups (parallel_state).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from megarl.compat import mbridge as mbridge_compat
from megarl.compat import megatron as megatron_compat
from megarl.compat import sglang as sglang_compat
from megarl.compat import torch as torch_compat
from megarl.testing import run_ranks, tiny_model_dir

ROOT = Path(__file__).resolve().parents[2]
MEGARL = ROOT / "megarl"
LIBRARIES = ("megatron", "mbridge", "sglang", "sgl_kernel")


@pytest.mark.unit
def test_megatron_core_assumptions():
    assert megatron_compat.check_assumptions() == []


@pytest.mark.unit
def test_mbridge_assumptions():
    assert mbridge_compat.check_assumptions() == []


@pytest.mark.unit
def test_sglang_assumptions():
    assert sglang_compat.check_assumptions() == []


@pytest.mark.unit
def test_torch_assumptions():
    assert torch_compat.check_assumptions() == []


@pytest.mark.unit
def test_a_worker_torchrun_restarted_gets_its_own_keys_on_the_agents_store(monkeypatch):
    """The static rendezvous's store outlives the first attempt's workers, with their keys: a restarted attempt reads
    and writes under its own prefix (without it, tests/trainer/test_trainer_e2e.py::
    test_a_killed_rank_is_restarted_by_torchrun_and_resumes_exactly failed: "Gloo connectFullMesh failed ... Connection
    refused", a restarted rank connecting to the dead one's address)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    # plays torchrun's agent store
    agent = TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    agent.set("gloo/rank_0_address", "the first attempt's dead worker")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert torch_compat.restarted_workers_store("127.0.0.1", agent.port, 2, timedelta(seconds=30)) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    store = torch_compat.restarted_workers_store("127.0.0.1", agent.port, 2, timedelta(seconds=30))
    assert not store.check(["gloo/rank_0_address"])  # the first attempt's keys are not seen
    store.set("gloo/rank_0_address", "the restarted worker")
    assert agent.get("gloo/rank_0_address") == b"the first attempt's dead worker"  # and not overwritten either


@pytest.mark.unit
def test_versions_are_the_pinned_ones():
    from megarl import platform

    assert megatron_compat.VERSION == platform.PINNED["megatron-core"]
    install = (ROOT / "launchers" / "install.sh").read_text()
    assert f"megatron-core=={megatron_compat.VERSION}" in install and f"mbridge=={mbridge_compat.VERSION}" in install
    assert f"sglang=={sglang_compat.VERSION}" in (ROOT / "requirements" / "gpu.txt").read_text()
    assert f"torch=={torch_compat.VERSION}" in install


@pytest.mark.unit
def test_a_broken_assumption_is_reported(monkeypatch):
    from mbridge.core.bridge import Bridge
    from megatron.core.tensor_parallel import mappings

    monkeypatch.delattr(mappings, "_gather_along_first_dim")
    assert "megatron.core.tensor_parallel.mappings._gather_along_first_dim" in megatron_compat.check_assumptions()
    monkeypatch.delattr(Bridge, "_weight_split_across_tp")
    assert "Bridge._weight_split_across_tp is gone" in mbridge_compat.check_assumptions()
    monkeypatch.setitem(sglang_compat.PATCHED_MODULES, "sglang.srt.models.qwen2_moe", ("def no_such_kernel(",))
    assert sglang_compat.check_assumptions() == [
        "sglang.srt.models.qwen2_moe no longer has 'def no_such_kernel('"]
    monkeypatch.setattr(megatron_compat, "VERSION", "0.0.1")
    assert any("this module was written for 0.0.1" in p for p in megatron_compat.check_assumptions())


@pytest.mark.unit
def test_sitecustomize_patches_the_modules_compat_checks():
    """The CPU server's import-time patches (read as text: importing sitecustomize would install its import hook)
    target exactly the SGLang modules megarl.compat.sglang checks."""
    tree = ast.parse((Path(sglang_compat.CPU_STANDINS) / "sitecustomize.py").read_text())
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
            targets |= {k.value for k in node.keys}
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and \
                isinstance(node.value, ast.Name) and node.value.id == "_PATCHES":
            targets.add(node.slice.value)
    assert targets == set(sglang_compat.PATCHED_MODULES)
    for package in ("sgl_kernel", "torchvision"):
        assert (Path(sglang_compat.CPU_STANDINS) / package / "__init__.py").is_file()


@pytest.mark.unit
def test_the_cpu_server_gets_the_standins_and_patches():
    from megarl.rollout.server import ServerConfig, server_command

    _, env = server_command(ServerConfig(model_path="/nowhere", seeded_sampling=True), 1234, on_gpu=False)
    assert env["PYTHONPATH"].split(":")[0] == sglang_compat.CPU_STANDINS
    assert env[sglang_compat.SEEDED_SAMPLING_ENV] == "1"
    _, env = server_command(ServerConfig(model_path="/nowhere"), 1234, on_gpu=True)
    assert sglang_compat.SEEDED_SAMPLING_ENV not in env


def _outside_compat():
    for path in sorted(MEGARL.rglob("*.py")):
        relative = path.relative_to(MEGARL)
        if relative.parts[0] != "compat":
            yield relative, path.read_text()


@pytest.mark.unit
def test_no_private_member_of_the_libraries_outside_compat():
    found = []
    for relative, text in _outside_compat():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in LIBRARIES:
                found += [f"{relative}:{node.lineno} {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") or any(p.startswith("_") for p in node.module.split("."))]
            elif isinstance(node, ast.Import):
                found += [f"{relative}:{node.lineno} {a.name}" for a in node.names
                          if a.name.split(".")[0] in LIBRARIES and any(p.startswith("_") for p in a.name.split("."))]
        found += [f"{relative}: {m}" for m in re.findall(r"\.mb\._\w+|_MODEL_REGISTRY|_inject_gtp_remat_axis", text)]
    assert found == []


@pytest.mark.unit
def test_megatrons_global_groups_are_read_only_in_compat_and_the_adapter():
    assert [str(r) for r, text in _outside_compat() if "parallel_state" in text] == ["parallel/user_loop.py"]


@pytest.mark.unit
def test_model_bridge_requires_groups():
    from megarl.models import ModelBridge

    with pytest.raises(TypeError, match="user_groups"):
        ModelBridge(tiny_model_dir("qwen2"), pg=None)
    with pytest.raises(TypeError):
        ModelBridge(tiny_model_dir("qwen2"))


def _adapter_and_optimizer_guard():
    import types

    from megarl import parallel

    before = None
    try:
        parallel.user_groups()
    except RuntimeError as error:
        before = str(error)
    groups = parallel.initialize(parallel.ParallelConfig())
    same = all(getattr(parallel.user_groups(), n) is getattr(groups.mcore, n) for n in ("tp", "pp", "dp", "dp_cp"))
    foreign = types.SimpleNamespace(tp=None, pp=None, dp_cp=None, expt_dp=None)
    try:
        megatron_compat.get_megatron_optimizer(None, [], foreign)
        refused = None
    except RuntimeError as error:
        refused = str(error)
    return before, same, refused


@pytest.mark.multirank
def test_user_groups_adapter_and_the_optimizer_guard():
    """megarl.parallel.user_groups() is megatron's global groups as a ProcessGroupCollection (the same groups megarl's
    own code is given); megatron-core 0.19.2's optimizer, which only runs on those, refuses a model built on others."""
    (before, same, refused), = run_ranks(1, _adapter_and_optimizer_guard)
    assert before is not None and "initialize" in before
    assert same
    assert refused is not None and "global groups" in refused
