"""torchrun across "nodes": two torchrun agents on localhost (--nnodes 2, 2 processes each, static rendezvous on
127.0.0.1) run RL steps of a tiny config at TP=2 x DP=2, and agree with the same run on one node. Both runs use one
running engine (rollout.engine.urls), so each DP leader, on either node, is a rollout worker."""
import json
import os
import subprocess
import sys

import pytest

from megarl.parallel.env import free_port
from megarl.testing import tiny_model_dir
from megarl.testing.fixtures import early_run_engine
from tiny_rl import TINY, write_config

pytestmark = pytest.mark.e2e

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo
STEPS = 1


def _config(tmp, name: str, model: str) -> str:
    return write_config(tmp, name, seed=11, model={"tiny": None, "path": model}, parallel={"tp": 2},
                        rl={"steps": STEPS})


def _agent(config: str, nnodes: int, node_rank: int, nproc: int, port: int, log: str, url: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank",
                             str(node_rank), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1",
                             "--master-port", str(port), "-m", "megarl.cli", "train", config,
                             f"rollout.engine.urls=[{url}]"],
                            cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def _finish(procs: list, logs: list, timeout: float = 900) -> None:
    for proc, log in zip(procs, logs):
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                os.killpg(p.pid, 9)
            raise AssertionError(f"torchrun agent did not finish in {timeout}s; log tail:\n{open(log).read()[-3000:]}")
        assert rc == 0, f"torchrun agent failed ({rc}); log tail:\n{open(log).read()[-4000:]}"


def _metrics(run_dir) -> dict:
    by_step: dict = {}
    for line in open(os.path.join(run_dir, "metrics.jsonl")):
        row = json.loads(line)
        by_step.setdefault(row["step"], {}).update(row)
    skip = ("time/", "perf/", "reshard/sync_s", "reshard/verify_s")
    return {s: {k: v for k, v in m.items() if not k.startswith(skip)} for s, m in by_step.items()}


def _model(_=None) -> str:
    return tiny_model_dir(TINY["family"], tokenizer=TINY["tokenizer"], **TINY["overrides"])


# one engine for both runs, the one a run would start itself (launched ahead): each run first pushes its initial
# weights into it
engine = early_run_engine(lambda folder, _: _config(folder, "engine", _model()), _model)


def test_two_torchrun_nodes_agree_with_one(tmp_path, engine):
    """The static rendezvous waits for all 4 ranks, so the run completes only with both agents (node 1 hosts global
    ranks 2-3, the second TP pair = the second DP replica)."""
    configs = {name: _config(tmp_path, name, _model()) for name in ("two_nodes", "one_node")}
    port = free_port()
    logs = [str(tmp_path / f"node{i}.log") for i in (0, 1)]
    two = [_agent(configs["two_nodes"], 2, i, 2, port, logs[i], engine.url) for i in (0, 1)]
    _finish(two, logs)
    one_log = str(tmp_path / "one.log")
    _finish([_agent(configs["one_node"], 1, 0, 4, free_port(), one_log, engine.url)], [one_log])
    two_nodes, one_node = _metrics(tmp_path / "two_nodes"), _metrics(tmp_path / "one_node")
    assert sorted(two_nodes) == list(range(STEPS + 1))
    for step in range(1, STEPS + 1):
        assert two_nodes[step]["grad_norm"] > 0 and two_nodes[step]["rollout/samples"] == 16
    for step in two_nodes:
        for key, value in one_node[step].items():
            assert abs(two_nodes[step][key] - value) <= 1e-6 * max(1.0, abs(value)), (step, key)
