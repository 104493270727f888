"""slurm/train.sbatch under a real Slurm cluster on this host (slurm_cluster.LocalSlurmCluster: slurmctld and
two slurmd "nodes" n1, n2 on 127.0.0.1, one CPU each): a 2-node job trains a tiny RL config with the real SGLang CPU
engine and completes; SIGUSR1 to the batch script makes the trainer checkpoint and stop, the script requeues the
job and the second start resumes and completes; a trainer rank killed mid-run fails the step and the script requeues
the job, which resumes from the latest checkpoint; bad input (a layout that does not fit the allocation, no Slurm
allocation, an unreachable master) fails fast with a clear message.

When Slurm cannot be installed or started here, the same tests run the script with bash, faked SLURM_* variables and
stub srun/scontrol (one node with two processes instead of two nodes), and test_real_slurm_cluster xfails with the
reason. MEGARL_TEST_SLURM=bash forces that mode.
"""
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from megarl.testing import tiny_model_dir
from tiny_rl import write_config
from slurm_cluster import TERMINAL, BashSlurm, Deadline, LocalSlurmCluster, Progress, SlurmUnavailable

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo
# A job that runs a training (engine start, steps, checkpoints) is waited for while it makes progress: it has STALL_S
# seconds to change its state or write a byte under its test's folder (batch log, node and engine logs, metrics,
# checkpoints), and CEILING_S in all. A loaded machine makes it slower, not stuck: a fixed clock (the disaggregated job
# had 180 s; it passes alone in ~95 s) failed under three heavy jobs.
STALL_S, CEILING_S = 300, 1800
SCRIPT = os.path.join(ROOT, "slurm", "train.sbatch")
DISAGG = os.path.join(ROOT, "slurm", "train_disagg.sbatch")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    scratch = tmp_path_factory.mktemp("slurm-cluster")
    reason = None
    if os.environ.get("MEGARL_TEST_SLURM") == "bash":
        reason = "MEGARL_TEST_SLURM=bash"
    else:
        try:
            c = LocalSlurmCluster(str(scratch), nodes=("n1", "n2"), cpus_per_node=1).__enter__()
        except SlurmUnavailable as e:
            reason = str(e)
    if reason is not None:
        c = BashSlurm(str(scratch / "bash-slurm")).__enter__()
    c.unavailable_reason = reason
    try:
        yield c
    finally:
        c.__exit__(None, None, None)


@pytest.fixture(autouse=True)
def _cancel_leftover_jobs(request):
    """A test that fails while its job still runs cancels it, so the next test gets the nodes."""
    yield
    if "cluster" not in request.fixturenames:
        return
    cluster = request.getfixturevalue("cluster")
    for job in _SUBMITTED:
        if cluster.job_state(job) not in TERMINAL | {"UNKNOWN"}:
            cluster.scancel(job)
            try:
                cluster.wait_for(job, TERMINAL, timeout=60)
            except AssertionError:
                pass
    _SUBMITTED.clear()


_SUBMITTED: list = []


def _layout(cluster) -> tuple[list, str]:
    """sbatch node options and processes per node: 2 nodes x 1 process (real Slurm), 1 node x 2 (bash stand-in)."""
    return (["-N2"], "1") if cluster.kind == "slurm" else (["-N1"], "2")


def _config(tmp_path, name: str, steps: int) -> tuple[str, str]:
    return write_config(tmp_path, name, seed=5, rl={"steps": steps}, checkpoint={"save_every": 0}), \
        str(tmp_path / name)


def _submit(cluster, tmp_path, name: str, args: list, env: dict | None = None) -> str:
    nodes, per_node = _layout(cluster)
    job_env = {"PYTHONPATH": os.pathsep.join(p for p in (os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH"))
                                             if p),
               "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "GPUS_PER_NODE": per_node, "MASTER_WAIT_S": "60"}
    job_env.update(env or {})
    job = cluster.sbatch(SCRIPT, args, env=job_env, cwd=ROOT,
                         options=[*nodes, f"--job-name={name}", f"--output={tmp_path}/%x-%j.out", f"--chdir={ROOT}"])
    _SUBMITTED.append(job)
    return job


def _batch_log(tmp_path, name: str, job: str) -> str:
    path = tmp_path / f"{name}-{job}.out"
    return path.read_text(errors="replace") if path.exists() else "(no batch log)"


def _node_logs(run_dir: str, name: str, job: str) -> dict:
    logs = {}
    for node in range(2):
        path = os.path.join(run_dir, "logs", f"{name}-{job}-node{node}.log")
        if os.path.exists(path):
            logs[node] = open(path, errors="replace").read()
    return logs


def _wait(cluster, tmp_path, run_dir, name, job, states, timeout=None) -> dict:
    """timeout: a fixed limit (the fail-fast tests, where the bound is what they check); None: follow progress."""
    try:
        if timeout is not None:
            return cluster.wait_for(job, states, timeout)
        return cluster.wait_for(job, states, STALL_S, progress=Progress(tmp_path), ceiling=CEILING_S)
    except AssertionError as e:
        logs = "\n".join(f"--- node {n}:\n{text[-3000:]}" for n, text in _node_logs(run_dir, name, job).items())
        raise AssertionError(f"{e}\n--- batch log:\n{_batch_log(tmp_path, name, job)[-3000:]}\n{logs}") from None


def _metric_rows(run_dir: str) -> list:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def _no_leftovers(run_dir: str) -> None:
    """No trainer rank, torchrun agent or SGLang server of this run is left (they carry run_dir in their args)."""
    deadline = time.monotonic() + 15
    while True:
        out = subprocess.run(["pgrep", "-af", run_dir], capture_output=True, text=True).stdout.strip()
        if not out or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not out, f"processes left running:\n{out}"


@pytest.mark.slurm
def test_real_slurm_cluster(cluster):
    """Reports (xfail) when the tests below ran the script under the bash stand-in instead of real Slurm."""
    if cluster.unavailable_reason:
        pytest.xfail(f"real Slurm unavailable, train.sbatch exercised with bash + stub srun/scontrol instead: "
                     f"{cluster.unavailable_reason}")
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=cluster.env, capture_output=True, text=True)
    assert out.stdout.split() == ["n1", "idle", "n2", "idle"], out


@pytest.mark.slurm
def test_preemption_checkpoints_requeues_and_resumes(cluster, tmp_path):
    """A job that is signalled before its time limit checkpoints, requeues itself, resumes and completes (one job
    covers the plain completion too: both attempts' node logs, the final checkpoint, the batch script's report)."""
    name, steps = "megarl-b", 8
    config, run_dir = _config(tmp_path, "preempt", steps=steps)
    job = _submit(cluster, tmp_path, name, [config])
    deadline = Deadline(STALL_S, Progress(tmp_path), CEILING_S)
    while max((r["step"] for r in _metric_rows(run_dir)), default=-1) < 2:
        state = cluster.job_state(job)
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), (state, _batch_log(tmp_path, name, job)[-3000:])
        expired = deadline.expired(state)
        assert not expired, f"no step 2 ({expired}):\n" + _batch_log(tmp_path, name, job)[-3000:]
        time.sleep(0.3)
    cluster.scancel(job, "USR1", batch=True)  # what Slurm does --signal=B:USR1@120 before the time limit

    # The first attempt stops after a checkpoint and requeues itself: Restarts goes to 1.
    deadline = Deadline(STALL_S, Progress(tmp_path), CEILING_S)
    while int(cluster.job_info(job).get("Restarts", 0)) < 1:
        state = cluster.job_state(job)
        assert state not in ("COMPLETED", "FAILED", "CANCELLED"), \
            (cluster.job_info(job), _batch_log(tmp_path, name, job)[-3000:])
        expired = deadline.expired(state)
        assert not expired, f"not requeued ({expired}):\n" + _batch_log(tmp_path, name, job)[-3000:]
        time.sleep(0.2)
    batch = _batch_log(tmp_path, name, job)
    assert "received SIGUSR1" in batch and "requeueing job" in batch, batch
    marker = json.loads(batch.split("the trainer checkpointed and stopped (")[1].split(")")[0])
    stopped = marker["step"]
    assert 2 <= stopped < steps, marker
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        first_attempt = f.read()
    assert max(json.loads(line)["step"] for line in first_attempt.splitlines()) == stopped
    assert os.path.isdir(os.path.join(run_dir, "checkpoints", f"step_{stopped:06d}"))

    info = _wait(cluster, tmp_path, run_dir, name, job, {"COMPLETED"})
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "1", info
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        final = f.read()
    # The second attempt resumed: the first attempt's lines are untouched (a fresh start would rewrite them), and
    # each later step was logged once (the last one also carries the final evaluation line).
    assert final.startswith(first_attempt)
    later = [json.loads(line)["step"] for line in final[len(first_attempt):].splitlines()]
    assert later[:steps - stopped] == list(range(stopped + 1, steps + 1)), later
    assert set(later[steps - stopped:]) <= {steps}, later
    node0 = _node_logs(run_dir, name, job)[0]
    second = node0.split("=== node 0 ")[-1]
    assert "restart 1" in second.splitlines()[0], second[:300]
    assert f"resumed from {os.path.join(run_dir, 'checkpoints', f'step_{stopped:06d}')}" in second, second[-3000:]
    assert not os.path.exists(os.path.join(run_dir, "STOP"))
    assert "latest" in os.listdir(os.path.join(run_dir, "checkpoints"))
    logs = _node_logs(run_dir, name, job)
    assert sorted(logs) == list(range(2 if cluster.kind == "slurm" else 1)), logs.keys()
    for node, text in logs.items():
        assert f"=== node {node} " in text
    batch = _batch_log(tmp_path, name, job)
    assert "training finished" in batch and f"run_dir {run_dir}" in batch, batch
    _no_leftovers(run_dir)


@pytest.mark.slurm
def test_a_killed_trainer_rank_requeues_the_job_which_resumes(cluster, tmp_path):
    """A trainer rank that dies (SIGKILL, as a lost node or an OOM kill does) fails the srun step; the script requeues
    the job, which resumes from the latest checkpoint and completes, without a human."""
    name, steps = "megarl-k", 5
    config = write_config(tmp_path, "killed", seed=5, rl={"steps": steps}, checkpoint={"save_every": 1})
    run_dir = str(tmp_path / "killed")
    job = _submit(cluster, tmp_path, name, [config])
    latest = os.path.join(run_dir, "checkpoints", "latest")
    deadline = Deadline(STALL_S, Progress(tmp_path), CEILING_S)
    while not (os.path.exists(latest) and open(latest).read().strip() >= "step_000002"):
        state = cluster.job_state(job)
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), (state, _batch_log(tmp_path, name, job)[-3000:])
        expired = deadline.expired(state)
        assert not expired, f"no checkpoint 2 ({expired}):\n" + _batch_log(tmp_path, name, job)[-3000:]
        time.sleep(0.3)
    listed = subprocess.run(["pgrep", "-af", f"megarl.cli train {config}"], capture_output=True, text=True).stdout
    ranks = [int(line.split()[0]) for line in listed.splitlines() if "megarl.launch.torchrun" not in line]
    assert ranks, listed
    os.kill(ranks[-1], 9)

    info = _wait(cluster, tmp_path, run_dir, name, job, {"COMPLETED"})
    assert info["ExitCode"] == "0:0" and info["Restarts"] == "1", info
    batch = _batch_log(tmp_path, name, job)
    assert "training failed (srun exit code" in batch and "requeueing job" in batch and "training finished" in batch, \
        batch[-3000:]
    second = _node_logs(run_dir, name, job)[0].split("=== node 0 ")[-1]
    assert "restart 1" in second.splitlines()[0] and "resumed from " in second, second[-3000:]
    steps_logged = [r["step"] for r in _metric_rows(run_dir)]
    assert max(steps_logged) == steps and set(range(1, steps + 1)) <= set(steps_logged), steps_logged
    _no_leftovers(run_dir)


@pytest.mark.slurm
def test_disaggregated_job_completes(cluster, tmp_path):
    """slurm/train_disagg.sbatch with rollout.placement=disaggregated, rollout.engine.nodes=1: n2 runs the SGLang
    server, n1 trains against it and pushes weights over reshard.transport=distributed, asynchronously (rl.max_staleness
    1; real Slurm only: the bash stand-in has one node). The reward is a judge model's (reward.name: judge) whose pool
    the config starts (pools.judge.model): its server runs on the engine node too, and the trainer reaches it there."""
    if cluster.kind != "slurm":
        pytest.skip(f"needs two Slurm nodes; real Slurm unavailable: {cluster.unavailable_reason}")
    name = "megarl-d"
    judge = tiny_model_dir("qwen2")  # another model (its own tokenizer); short template: its context is 256 tokens
    config = write_config(tmp_path, "disagg", seed=5, rl={"steps": 2}, checkpoint={"save_every": 0},
                          reward={"name": "judge", "workers": 1,
                                  "judge": {"template": "P: {prompt} R: {response} A: {answer}", "max_new_tokens": 8}},
                          pools={"judge": {"model": judge}})
    run_dir = str(tmp_path / "disagg")
    job_env = {"PYTHONPATH": os.pathsep.join(p for p in (os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH"))
                                             if p),
               "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "GPUS_PER_NODE": "1"}
    job = cluster.sbatch(DISAGG, [config, "rollout.placement=disaggregated", "rollout.engine.nodes=1",
                                  "reshard.transport=distributed", "rl.max_staleness=1"], env=job_env, cwd=ROOT,
                         options=["-N2", f"--job-name={name}", f"--output={tmp_path}/%x-%j.out", f"--chdir={ROOT}"])
    _SUBMITTED.append(job)
    info = _wait(cluster, tmp_path, run_dir, name, job, {"COMPLETED"})
    assert info["ExitCode"] == "0:0", info
    rows = _metric_rows(run_dir)
    assert sorted({r["step"] for r in rows}) == [0, 1, 2]
    # asynchronous (k = 1, partial rollouts): step 2 was generated while step 1 trained, by weights at most 1 step old
    lags = {r["step"]: r["async/max_lag"] for r in rows if "async/max_lag" in r}
    assert lags[1] == 0 and 0 <= lags[2] <= 1, lags
    batch = _batch_log(tmp_path, name, job)
    assert "engines healthy: http://127.0.0.1:" in batch and "training finished" in batch, batch
    assert "trainer nodes n1," in batch and "starting 1 SGLang server(s) on n2" in batch, batch
    assert "and 1 pool server(s) (judge:0:pools.judge:" in batch and "pools.judge.model=null" in batch, batch
    engine_log = open(os.path.join(run_dir, "logs", f"{name}-{job}-engine0.log")).read()
    assert "sglang.launch_server" in engine_log and "--host 0.0.0.0" in engine_log, engine_log[-2000:]
    assert "pool judge server 0: $" in engine_log and f"--model-path {judge}" in engine_log, engine_log[-2000:]
    assert all("reward/judge_parse_errors" in r for r in rows if r["step"] >= 1 and "reward/mean" in r)
    assert not os.path.isdir(os.path.join(run_dir, "engine"))  # the trainer started no engine of its own
    _no_leftovers(run_dir)


@pytest.mark.slurm
def test_layout_that_does_not_fit_the_allocation_fails_fast(cluster, tmp_path):
    name = "megarl-c1"
    config, run_dir = _config(tmp_path, "badlayout", steps=2)
    start = time.monotonic()
    job = _submit(cluster, tmp_path, name, [config, "parallel.tp=4"])
    info = _wait(cluster, tmp_path, run_dir, name, job, {"FAILED"}, timeout=90)
    assert time.monotonic() - start < 90
    assert info["ExitCode"] == "1:0", info
    batch = _batch_log(tmp_path, name, job)
    assert "world size 2 is not divisible by tp*pp*cp = 4*1*1" in batch and "parallel.tp" in batch, batch
    assert "GPUS_PER_NODE" in batch, batch
    assert not _node_logs(run_dir, name, job)  # no node started torchrun


@pytest.mark.slurm
def test_unreachable_master_fails_in_bounded_time(cluster, tmp_path):
    """The rendezvous port on the first node is taken (by a plain listening socket here, on loopback: the test sends
    nothing off this machine): node 0 refuses to start, node 1 gives up within MASTER_WAIT_S (the socket accepts TCP
    but is no torchrun store), the job fails with the cause in the logs."""
    name = "megarl-c2"
    config, run_dir = _config(tmp_path, "nomaster", steps=2)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        job = _submit(cluster, tmp_path, name, [config], env={"MEGARL_MASTER_ADDR": "127.0.0.1",
                                                              "MEGARL_MASTER_PORT": str(port), "MASTER_WAIT_S": "20"})
        info = _wait(cluster, tmp_path, run_dir, name, job, {"FAILED"}, timeout=90)
    assert time.monotonic() - start < 90
    assert info["ExitCode"] != "0:0", info
    logs = _node_logs(run_dir, name, job)
    assert f"MASTER_PORT={port} is in use on" in logs[0], logs[0][-2000:]
    assert f"MASTER_PORT={port}" in _batch_log(tmp_path, name, job)  # the tail of the failing node's log
    _no_leftovers(run_dir)


@pytest.mark.unit
def test_unreachable_master_seen_from_another_node(tmp_path):
    """The waiting side alone (node 1 of 2, bash with faked variables): bounded by MASTER_WAIT_S, clear message. The
    master is a loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = subprocess.run(["bash", "-c", 'source <(sed -n "/^read -r -d .. CHECK_MASTER_PY/,/^EOF$/p" "$0"); '
                             f'MASTER_WAIT_S=3 "$1" -c "$CHECK_MASTER_PY" connect 127.0.0.1 {port}', SCRIPT,
                             sys.executable], capture_output=True, text=True, timeout=60)
    assert script.returncode == 1, script
    assert f"cannot reach the master MASTER_ADDR=127.0.0.1 port {port}" in script.stderr, script.stderr


@pytest.mark.unit
def test_outside_slurm_fails_with_a_clear_message(tmp_path):
    config, _ = _config(tmp_path, "nojob", steps=2)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    start = time.monotonic()
    proc = subprocess.run(["bash", SCRIPT, config], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert time.monotonic() - start < 10
    assert proc.returncode == 1, proc
    assert "SLURM_JOB_NODELIST is not set: this script must run inside a Slurm allocation" in proc.stderr, proc.stderr
    assert "sbatch -N NODES" in proc.stderr
