"""Faults injected into a real CPU RL run (issue 33): does the run survive, lose no sample, train no sample on weights
other than the ones recorded for it, and end where the fault-free run ends?

    .venv/bin/python benchmarks/chaos.py                 # the fault-free runs, then one run per fault (~25 min, 2 cores)
    .venv/bin/python benchmarks/chaos.py --faults engine_sigkill,engine_sigstop
    .venv/bin/python benchmarks/chaos.py --table         # runs nothing: the table from the JSON

The run: `megarl train` on 2 trainer ranks (torchrun), the quickstart's tiny Qwen2 and 2-digit addition from random
weights (no SFT: the run is about faults, not learning), GRPO, 6 steps of 8 prompts x 4 samples, one SGLang CPU engine,
2 reward workers, a checkpoint after every step, every sync verified, deterministic sampling (per-request seeds) so two
runs that train the same samples log the same metrics. The reward: 1 for the right sum, else half the share of digits
in the response (dense, so that the updates are not zero), with a hang or a NaN the benchmark can arm
(benchmarks/chaos_rewards.py).

Each fault is injected once, at a random moment of its step (the faults take steps 2 .. 5 in turn; the moment: after
step - 1 logged its metrics, a uniform delay within one fault-free step). The phase it hit is read from the run's log
where the run says (the engine request that found the engine dead or stopped), else "random point of the step".

  engine_sigkill       SIGKILL of the engine's process group
  engine_sigkill_push  the same, aimed at the weight push after step `step`: the benchmark polls the engine's
                       /model_info and kills it as soon as the first bucket of that push set its weight version
                       (reshard.bucket_mb=1 makes the push several buckets; the phase column says where it landed)
  engine_sigstop       SIGSTOP of the engine's process group, longer than rollout.engine.request_timeout_s (20 s here)
  trainer_rank_sigkill SIGKILL of one trainer rank (torchrun --max-restarts 1 starts both again; they resume)
  reward_worker_sigkill SIGKILL of one reward pool worker
  reward_hang          the next reward call hangs (reward.timeout_s = 5 s kills it)
  reward_nan           the next reward call returns NaN (the group's advantages, so the loss, are NaN)
  engine_sigkill_partial SIGKILL of the engine in an asynchronous run (rl.max_staleness=1, partial rollouts: the
                       producer generates the next step while this one trains, and weight updates pause it)
  checkpoint_enospc    the run_dir on a tmpfs sized so that a checkpoint of step `step` does not fit: the run must end
                       with one line, the previous checkpoint intact; the tmpfs is then made larger and the same
                       command started again must resume and finish (needs root to mount; otherwise not run)

Per fault: {"fault", "step", "phase", "survived", "samples_lost", "samples_off_policy", "recovery_s",
"metrics_equal", "differing"}: samples_lost = samples the run's steps should have trained and did not (from the dumped
training batches), samples_off_policy = trained samples with a token whose recorded weight version is not the step's
(the weights after step - 1; under rl.max_staleness=1 also step - 2), recovery_s = the faulted run's wall time minus the fault-free run's (both on this machine,
one after the other; a loaded machine makes it noisy), metrics_equal = every step's deterministic metrics equal the
fault-free run's (relative 1e-6), differing = the keys of the last step that do not. Target (issue 33): every fault
survived, 0 samples lost, 0 off policy, and for the faults that restart nothing in the trainer, the final metrics equal
the fault-free run's (engine_sigkill_partial is compared with a fault-free asynchronous run).

benchmarks/results/chaos.json: {"machine", "config", "fault_free": {"wall_s", "final"}, "faults": [...], "not_run"}.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from machine import machine  # noqa: E402

OUT = os.path.join(HERE, "results", "chaos.json")
WORK = os.path.join(ROOT, "runs", "bench-chaos")
STEPS, PROMPTS, SAMPLES = 6, 8, 4
FAULTS = ("engine_sigkill", "engine_sigkill_push", "engine_sigstop", "trainer_rank_sigkill", "reward_worker_sigkill", "reward_hang",
          "reward_nan", "engine_sigkill_partial", "checkpoint_enospc")
# the asynchronous run's settings (engine_sigkill_partial, against a fault-free run of its own)
PARTIAL = {"max_staleness": 1, "partial_rollouts": True}
# what each fault changes in the trainer: a restart of the ranks, or a sample's reward (a hang scores 0 by design, a
# NaN makes the step's update non-finite, so it is skipped): their final metrics are not expected to equal
EXPECTED_TO_DIFFER = {"reward_hang": "the hung response scores 0 (reward.timeout_s), by design",
                      "reward_nan": "the NaN step's update is skipped (rl.max_skipped_steps), by design",
                      "engine_sigkill_partial": "partial rollouts: a weight update cuts the responses in flight "
                                                "wherever they are, so what is trained depends on timing"}
NOT_RUN: list[str] = []
# what a fault is expected to change besides the trained values: timings, and the fault's own counters
VOLATILE = ("time/", "perf/", "reshard/sync_s", "reshard/verify_s", "engine/restores", "reshard/restored",
            "reward/errors", "reward/worker_failures", "skipped_updates")


def config(run_dir: str, arms: str, partial: bool = False) -> dict:
    rl = {"steps": STEPS, "eval_samples": 1, "dump_rollouts": True, **(PARTIAL if partial else {})}
    return {
        "run_dir": run_dir, "seed": 0,
        "model": {"tiny": {"family": "qwen2", "tokenizer": "char", "overrides": {
            "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 384, "max_position_embeddings": 128}}},
        "data": {"train": "synthetic", "max_prompt_tokens": 64,
                 "synthetic": {"task": "arithmetic", "digits": 2, "ops": ["+"], "num_train": 1000, "num_eval": 8}},
        "rollout": {"prompts_per_step": PROMPTS, "n_samples": SAMPLES, "max_new_tokens": 16,
                    "engine": {"max_total_tokens": 16384, "request_timeout_s": 20}},
        "algorithm": {"advantage_estimator": "grpo", "policy_loss": "ppo_clip"},
        "reward": {"name": "chaos_rewards:arithmetic_with_faults", "workers": 2, "timeout_s": 5,
                   "kwargs": {"arms": arms}},
        "optim": {"lr": 3e-4, "clip_grad": 1.0},
        "rl": rl,
        "reshard": {"verify_every": 1, "bucket_mb": 1},  # several buckets per push (engine_sigkill_push)
        "checkpoint": {"save_every": 1, "keep": 10, "export_hf": False},
        "logging": {"wandb": "disabled"},
    }


def _procs() -> dict[int, tuple[int, int, str]]:
    """pid -> (ppid, pgrp, cmdline) of every process."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
        except OSError:
            continue
        out[int(pid)] = (int(stat[1]), int(stat[2]), cmd)
    return out


def _descendants(root: int, procs: dict) -> list[int]:
    children = [p for p, (ppid, _, _) in procs.items() if ppid == root]
    return children + [d for c in children for d in _descendants(c, procs)]


def _metrics(run_dir: str) -> dict:
    by_step: dict = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            by_step.setdefault(row["step"], {}).update(row)
    return by_step


def inject(fault: str, run: subprocess.Popen, run_dir: str, arms: str) -> str:
    """Inject `fault` now; returns what was hit."""
    procs = _procs()
    tree = _descendants(run.pid, procs)
    if fault.startswith("engine_"):
        groups = {procs[p][1] for p in tree if "sglang.launch_server" in procs[p][2]}
        assert len(groups) == 1, groups
        group = groups.pop()
        os.killpg(group, signal.SIGSTOP if fault == "engine_sigstop" else signal.SIGKILL)
        return f"engine process group {group}"
    if fault == "trainer_rank_sigkill":
        ranks = [p for p in tree if procs[p][0] == run.pid and "megarl.cli" in procs[p][2]]  # torchrun's workers
        assert len(ranks) == 2, ranks
        victim = random.choice(ranks)
        os.kill(victim, signal.SIGKILL)
        return f"rank pid {victim}"
    if fault == "reward_worker_sigkill":
        servers = [p for p in tree if "forkserver" in procs[p][2] and "forkserver" not in procs[procs[p][0]][2]]
        workers = [p for s in servers for p in procs if procs[p][0] == s]
        assert workers, servers
        victim = random.choice(workers)
        os.kill(victim, signal.SIGKILL)
        return f"reward worker pid {victim}"
    name = {"reward_hang": "hang", "reward_nan": "nan"}[fault]
    open(os.path.join(arms, name), "w").close()
    return f"armed {name}"


PHASES = {"/generate": "rollout", "/model_info": "weight sync (version check)", "revive": "weight sync",
          "/server_info": "weight verification", "/weights_checker": "weight verification",
          "/begin_weight_update": "weight push", "/end_weight_update": "weight push",
          "/update_weights_from_tensor": "weight push", "/update_weights_from_distributed": "weight push",
          "/init_weights_update_group": "weight push", "/pause_generation": "weight push (pause)",
          "/continue_generation": "weight push (resume)", "/flush_cache": "weight push"}


def wait_for_push(run: subprocess.Popen, step: int) -> None:
    """Return as soon as the engine serves version step-`step`: its push has started (each bucket sets the version),
    the rest of its buckets, the end of its window and its verification still to come."""
    import requests

    procs = _procs()
    command = next(procs[p][2].split() for p in _descendants(run.pid, procs) if "sglang.launch_server" in procs[p][2])
    url = f"http://127.0.0.1:{command[command.index('--port') + 1]}/model_info"
    session = requests.Session()
    while run.poll() is None:
        try:
            if session.get(url, timeout=5).json().get("weight_version") == f"step-{step}":
                return
        except requests.RequestException:
            pass
        time.sleep(0.002)


def phase_from_log(log: str, fault: str) -> str:
    """Where the fault hit, as the run says: the engine request that found the engine dead or stopped."""
    found = re.search(r"(?:died|stopped answering) during (\S+) ", open(log, errors="replace").read())
    if found:
        return f"{PHASES.get(found[1], 'engine request')} ({found[1]})"
    return "random point of the step"


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def enospc_disk_bytes(reference_dir: str, step: int) -> int:
    """A tmpfs size under which the run_dir fits the checkpoints of steps 1 .. step - 1 but only half of step's: the
    fault-free run's run_dir without its checkpoints, plus step - 1 and a half checkpoints."""
    ckpts = os.path.join(reference_dir, "checkpoints")
    one = _du(os.path.join(ckpts, "step_000001"))
    return _du(reference_dir) - _du(ckpts) + (step - 1) * one + one // 2


def one_run(name: str, fault: str | None, step: int, step_s: float, port: int, partial: bool = False,
            disk_bytes: int | None = None) -> dict:
    """One `megarl train` run; `fault` injected at a random moment of `step` (checkpoint_enospc: the run_dir on a
    tmpfs of disk_bytes, made larger after the failure, and the run started again)."""
    arms, mount = os.path.join(WORK, name + "-arms"), None
    run_dir = os.path.join(WORK, name)
    if disk_bytes is not None:
        mount = os.path.join(WORK, name + "-disk")
        os.makedirs(mount, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={disk_bytes}", "tmpfs", mount], check=True)
        run_dir = os.path.join(mount, "run")
    try:
        return _one_run(name, fault, step, step_s, port, partial, run_dir, arms, mount)
    finally:
        if mount is not None:
            subprocess.run(["umount", mount], check=False)


def _one_run(name, fault, step, step_s, port, partial, run_dir, arms, mount) -> dict:
    for path in (run_dir, arms):
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(arms)
    import yaml

    path = os.path.join(WORK, name + ".yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config(run_dir, arms, partial), f)
    log = os.path.join(WORK, name + ".log")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1",
               PYTHONWARNINGS="ignore")

    def launch(restarts: int, mode: str = "w") -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                 "--master_port", str(port), "--max-restarts", str(restarts), "-m", "megarl.cli",
                                 "train", path], cwd=ROOT, env=env, stdout=open(log, mode),
                                stderr=subprocess.STDOUT, start_new_session=True)

    def wait(run: subprocess.Popen) -> int:
        try:
            return run.wait(timeout=1800)
        finally:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()

    start = time.monotonic()
    out = {"fault": fault, "step": step}
    run = launch(0 if mount else 1)  # a full disk is not retried by torchrun: the run ends, a person frees space
    if fault is not None and mount is None:
        metrics = os.path.join(run_dir, "metrics.jsonl")
        while not (os.path.exists(metrics) and f'"step": {step - 1},' in open(metrics).read()):
            if run.poll() is not None:
                raise RuntimeError(f"the run ended before step {step}:\n" + open(log).read()[-3000:])
            time.sleep(0.1)
        if fault == "engine_sigkill_push":
            wait_for_push(run, step)
        else:
            time.sleep(random.uniform(0.0, step_s))
        out["hit"] = inject(fault, run, run_dir, arms)
    code = wait(run)
    if mount is not None:  # the disk filled up: one line, the previous checkpoint intact; then more space, resume
        lines = [line for line in open(log, errors="replace").read().splitlines() if "free at least" in line]
        latest_file = os.path.join(run_dir, "checkpoints", "latest")
        latest = open(latest_file).read().strip() if os.path.exists(latest_file) else None
        intact = latest is not None and os.path.isdir(os.path.join(run_dir, "checkpoints", latest))
        out["hit"] = f"the checkpoint after {latest} did not fit"
        out["enospc"] = {"exit_code": code, "line": lines[0][:400] if lines else None, "latest": latest,
                         "latest_intact": intact}
        subprocess.run(["mount", "-o", "remount,size=4g", mount], check=True)
        resumed = wait(launch(1, "a"))
        code = resumed if code != 0 and lines and intact else -1
    out["wall_s"] = round(time.monotonic() - start, 1)
    out["survived"] = code == 0
    metrics = _metrics(run_dir) if os.path.exists(os.path.join(run_dir, "metrics.jsonl")) else {}
    rollouts = os.path.join(run_dir, "rollouts")
    dumps = sorted(os.listdir(rollouts)) if os.path.isdir(rollouts) else []
    oldest_allowed = PARTIAL["max_staleness"] if partial else 0  # a token of step t is sampled by the weights after
    lost = off_policy = 0  # step t - 1 - staleness .. t - 1 (rl.max_staleness)
    for s in range(1, STEPS + 1):
        trained = {(d, json.loads(line)["sample"]) for d in dumps
                   if d.startswith(f"step_{s:06d}.dp") and d.endswith(".train.jsonl")
                   for line in open(os.path.join(rollouts, d))}
        lost += max(0, PROMPTS * SAMPLES - len(trained))
        off_policy += sum(not all(s - 1 - oldest_allowed <= v <= s - 1 for v in json.loads(line)["token_versions"])
                          for d in dumps if d.startswith(f"step_{s:06d}.worker")
                          for line in open(os.path.join(rollouts, d)))
    out.update(samples_lost=lost, samples_off_policy=off_policy, metrics=metrics, log=log)
    if fault is not None:
        out["phase"] = f"checkpoint of step {step}" if mount else phase_from_log(log, fault)
    return out


def deterministic(m: dict) -> dict:
    return {k: v for k, v in m.items() if isinstance(v, (int, float)) and not k.startswith(VOLATILE)}


def compare(faulted: dict, reference: dict) -> tuple[bool, list[str]]:
    equal, differing = True, []
    for step, ref in reference.items():
        a, b = deterministic(ref), deterministic(faulted.get(step, {}))
        for key in a:
            same = key in b and abs(a[key] - b[key]) <= 1e-6 * max(1.0, abs(a[key]))
            equal &= same
            if not same and step == max(reference):
                differing.append(key)
    return equal, differing


def table(result: dict) -> str:
    from docs_numbers import GENERATORS  # the one table, also README.md's

    return GENERATORS["chaos"](result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--seed", type=int, default=0, help="picks the moment of each fault in its step")
    parser.add_argument("--table", action="store_true")
    args = parser.parse_args()
    if args.table:
        print(table(json.load(open(OUT))))
        return
    random.seed(args.seed)
    os.makedirs(WORK, exist_ok=True)
    references = {False: one_run("fault-free", None, 0, 0.0, 29800)}
    assert references[False]["survived"], open(references[False]["log"]).read()[-3000:]
    step_s = sum(m.get("time/step_s", 0.0) for m in references[False]["metrics"].values()) / STEPS
    faults, not_run = [], list(NOT_RUN)
    for i, fault in enumerate(args.faults.split(",")):
        assert fault in FAULTS, f"--faults: {fault!r} is not one of {FAULTS}"
        # the faults spread over steps 2 .. STEPS - 1, each at a random moment of its step
        partial, step, disk = fault == "engine_sigkill_partial", 2 + i % (STEPS - 2), None
        if partial and True not in references:
            references[True] = one_run("fault-free-partial", None, 0, 0.0, 29805, partial=True)
        if fault == "checkpoint_enospc":
            if os.geteuid() != 0:
                not_run.append("checkpoint_enospc: mounting its small tmpfs needs root")
                continue
            disk = enospc_disk_bytes(os.path.join(WORK, "fault-free"), step)
        r = one_run(fault, fault, step, step_s, 29810 + 10 * i, partial=partial, disk_bytes=disk)
        reference = references[partial]
        equal, differing = compare(r["metrics"], reference["metrics"]) if r["survived"] else (False, [])
        faults.append({"fault": fault, "step": r["step"], "phase": r["phase"], "hit": r["hit"],
                       "survived": r["survived"], "samples_lost": r["samples_lost"],
                       "samples_off_policy": r["samples_off_policy"],
                       "recovery_s": round(r["wall_s"] - reference["wall_s"], 1), "metrics_equal": equal,
                       "differing": differing, "expected_to_differ": EXPECTED_TO_DIFFER.get(fault),
                       "engine_restores": max((m.get("engine/restores", 0) for m in r["metrics"].values()), default=0),
                       "skipped_updates": sum(m.get("skipped_updates", 0) for m in r["metrics"].values()),
                       "reward_errors": sum(m.get("reward/errors", 0) for m in r["metrics"].values()),
                       "reward_worker_failures": sum(m.get("reward/worker_failures", 0)
                                                     for m in r["metrics"].values()),
                       **({"enospc": r["enospc"]} if "enospc" in r else {})})
        print(json.dumps(faults[-1]), flush=True)
    reference = references[False]
    last = reference["metrics"][max(reference["metrics"])]
    result = {"machine": machine(), "config": config("<run_dir>", "<arms>"),
              "fault_free": {"wall_s": reference["wall_s"], "samples_lost": reference["samples_lost"],
                             "samples_off_policy": reference["samples_off_policy"],
                             "final": deterministic(last)},
              "faults": faults, "not_run": not_run,
              "targets": {"survived": "all", "samples_lost": 0, "samples_off_policy": 0,
                          "metrics_equal": "every fault that restarts nothing in the trainer and changes no reward"}}
    with open(OUT, "w") as f:
        json.dump(result, f, indent=1)
    print(table(result))


if __name__ == "__main__":
    main()
