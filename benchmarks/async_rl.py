"""Asynchronous vs synchronous RL on the quickstart task: the same SFT start, the same number of trained samples,
the SGLang engine and the trainer on separate CPU cores (the engine's processes on one core, the trainer's on the
other, set by this script while the run goes), synchronous steps (rl.max_staleness 0) vs k = 1 and k = 2 with
partial rollouts.

    .venv/bin/python benchmarks/async_rl.py                      # k = 0, 1, 2; seed 0; 30 RL steps
    .venv/bin/python benchmarks/async_rl.py --seeds 0,1 --steps 60

Writes benchmarks/results/async_rl.json {"settings", "runs": [{"max_staleness", "partial", "steps", "wall_s",
"rl_wall_s", "step_s_mean", "rollout_busy_frac", "train_busy_frac", "pass_at_1_before", "pass_at_1_after",
"seed"}]} and prints a table, and async_rl_timeline.png (who is busy when over three steps, k = 0 and 1); a run already in the file (same settings) is not run again. wall_s: the whole command
(start-up and the two evaluations included); rl_wall_s: the RL steps alone (sum of time/step_s), what overlap can
shorten. rollout_busy_frac: the share of the steps' wall time the engine spent generating; train_busy_frac: the share
the trainer was not waiting for a rollout.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from machine import machine  # noqa: E402  (benchmarks/machine.py: the machine, for the JSON)
from algorithms import BenchError, ensure_sft  # noqa: E402  (the shared SFT start, one per seed)

CONFIG = os.path.join(ROOT, "configs", "quickstart.yaml")
OUT = os.path.join(HERE, "results", "async_rl.json")


def _rollout_side(proc) -> bool:
    """An SGLang process or a reward worker (the forkserver's pool), or a child of one: the rollout's own work, which
    on GPUs runs beside the trainer's devices rather than on them."""
    return any("sglang" in line or "forkserver" in line
               for line in (" ".join(p.cmdline()) for p in [proc] + proc.parents()))


def _place(root_pid: int, engine_cpus: set[int], trainer_cpus: set[int], done: threading.Event) -> None:
    """Until `done`: every process of the run on its cores (the rollout side, SGLang and the reward workers, on
    engine_cpus; the trainer on trainer_cpus)."""
    import psutil

    while not done.is_set():
        try:
            procs = [psutil.Process(root_pid)] + psutil.Process(root_pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                p.cpu_affinity(sorted(engine_cpus if _rollout_side(p) else trainer_cpus))
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        done.wait(0.5)


def run_name(k: int, partial: bool, mismatch: str = "none") -> str:
    return (f"k{k}" if partial or not k else f"k{k}-fixed") + (f"-{mismatch}" if mismatch != "none" and k else "")


def run_one(k: int, partial: bool, seed: int, steps: int, work: str, ckpt: str,
            cpus: tuple[set[int], set[int]], mismatch: str = "none") -> dict:
    seed_dir = os.path.join(work, f"seed{seed}")
    run_dir = os.path.join(seed_dir, run_name(k, partial, mismatch))
    subprocess.run(["rm", "-rf", run_dir], check=True)
    overrides = [f"run_dir={run_dir}", f"seed={seed}", "model.tiny=null", f"model.path={seed_dir}/base-model",
                 f"model.load={ckpt}", "sft.steps=0", f"rl.steps={steps}", f"rl.max_staleness={k}",
                 f"rl.partial_rollouts={str(partial).lower()}", "checkpoint.export_hf=false", "logging.wandb=disabled",
                 "logging.progress=false", f"algorithm.mismatch.mode={mismatch}"]
    from megarl.parallel.env import free_port

    cmd = [sys.executable, "-m", "megarl.launch.torchrun", "--nproc_per_node", "1", "--master_port", str(free_port()),
           "-m", "megarl.cli", "train", CONFIG, *overrides]
    log = os.path.join(seed_dir, f"{run_name(k, partial, mismatch)}.log")
    print(f"[async_rl] seed {seed} k={k}{'' if partial or not k else ' fixed schedule'}: {steps} RL steps -> "
          f"{run_dir}", flush=True)
    done = threading.Event()
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        placer = threading.Thread(target=_place, args=(proc.pid, cpus[0], cpus[1], done), daemon=True)
        placer.start()
        rc = proc.wait()
        done.set()
    wall = time.perf_counter() - start
    if rc != 0:
        raise BenchError(f"k={k} seed {seed} failed (exit {rc}); log {log}:\n" + open(log).read()[-3000:])
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    step_rows = [r for r in rows if "time/step_s" in r]
    step_s = [r["time/step_s"] for r in step_rows]
    waiting = sum(r.get("time/rollout_s", 0.0) for r in step_rows)
    if k:
        busy = sum(r["async/rollout_busy_frac"] * r["time/step_s"] for r in step_rows)
    else:  # synchronous: the engine generates during the rollout phase only
        busy = waiting
    summary = json.load(open(os.path.join(run_dir, "rl_summary.json")))
    return {"max_staleness": k, "partial": bool(k) and partial, "mismatch": mismatch, "steps": steps, "seed": seed,
            "wall_s": round(wall, 1),
            "rl_wall_s": round(sum(step_s), 1), "step_s_mean": round(sum(step_s) / len(step_s), 3),
            "rollout_busy_frac": round(busy / sum(step_s), 3), "train_busy_frac": round(1 - waiting / sum(step_s), 3),
            "pass_at_1_before": summary["pass_at_1_before"], "pass_at_1_after": summary["pass_at_1_after"]}


PHASES = ("rollout", "dispatch", "ref", "old_log_prob", "values", "advantages", "train", "reshard")
COLORS = {"rollout": "#dddddd", "train": "#1f77b4", "reshard": "#d62728", "generate": "#2ca02c"}


def timeline(run_dirs: dict[int, str], path: str, first: int = 10, steps: int = 3) -> str:
    """A picture of who is busy when over `steps` RL steps (from step `first`) of each run: the engine (its
    rollouts' generation intervals) and the trainer (its step's phases, waiting for the rollout in grey)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(run_dirs), 1, figsize=(10, 1.6 * len(run_dirs) + 0.6), squeeze=False)
    for ax, (k, run_dir) in zip(axes[:, 0], sorted(run_dirs.items())):
        rows = {r["step"]: r for r in map(json.loads, open(os.path.join(run_dir, "metrics.jsonl")))
                if "time/step_s" in r}
        shown = [rows[t] for t in range(first, first + steps) if t in rows]
        if not shown:
            continue
        origin = shown[0]["time/step_start"]
        end = shown[-1]["time/step_start"] + shown[-1]["time/step_s"] - origin
        for t, r in rows.items():  # the engine: every rollout generated in the window (also for later steps)
            a, b = r["time/generate_start"] - origin, r["time/generate_end"] - origin
            if b > 0 and a < end:
                ax.barh(1, b - a, left=a, color=COLORS["generate"], edgecolor="white")
                shown_from, shown_to = max(a, 0.0), min(b, end)
                if shown_to - shown_from > 0.05 * end:  # a label only where the bar has room for it
                    ax.text((shown_from + shown_to) / 2, 1, f"gen {t}", ha="center", va="center", fontsize=7)
        for r in shown:  # the trainer: its phases in order, from the step's start
            x = r["time/step_start"] - origin
            for phase in PHASES:
                d = r.get(f"time/{phase}_s", 0.0)
                ax.barh(0, d, left=x, color=COLORS.get(phase, "#9467bd"), edgecolor="white")
                x += d
            ax.text(r["time/step_start"] - origin, -0.45, f"step {r['step']}", fontsize=7)
        ax.set_yticks([0, 1], ["trainer", "engine"])
        ax.set_xlim(0, end)
        ax.set_title(f"rl.max_staleness = {k}" + (" (synchronous)" if k == 0 else " (partial rollouts)"), fontsize=9)
    axes[-1, 0].set_xlabel("seconds (grey: the trainer waits for a rollout; blue: train; red: weight sync; "
                           "purple: log-probs; green: the engine generates)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def table(results: dict) -> str:
    runs = results["runs"]
    sync = {r["seed"]: r for r in runs if r["max_staleness"] == 0}
    lines = ["| k | partial | mismatch | seed | steps | RL wall s | vs k=0 | step s | engine busy | trainer busy | "
             "pass@1 before -> after |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(runs, key=lambda r: (r["seed"], r["max_staleness"], r["partial"], r["mismatch"])):
        base = sync.get(r["seed"])
        ratio = f"{r['rl_wall_s'] / base['rl_wall_s']:.2f}x" if base else "-"
        partial = "yes" if r["partial"] else "no" if r["max_staleness"] else "-"
        mismatch = r["mismatch"] if r["max_staleness"] else "-"
        lines.append(f"| {r['max_staleness']} | {partial} | {mismatch} | {r['seed']} | {r['steps']} | "
                     f"{r['rl_wall_s']:.0f} | {ratio} | {r['step_s_mean']:.2f} | {r['rollout_busy_frac']:.0%} | "
                     f"{r['train_busy_frac']:.0%} | {r['pass_at_1_before']:.1f} -> {r['pass_at_1_after']:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--staleness", default="0,1,2", help="comma-separated rl.max_staleness values (default 0,1,2), "
                   "with partial rollouts; K-fixed: k = K on the fixed schedule (no partial rollouts), e.g. 1-fixed")
    p.add_argument("--seeds", default="0")
    p.add_argument("--mismatch", default="tis", help="algorithm.mismatch.mode of the k >= 1 runs (default tis: "
                   "the decoupled PPO objective, the trainer's default for k >= 1; none: no correction)")
    p.add_argument("--steps", type=int, default=30, help="RL steps per run (default 30, as the committed JSON)")
    p.add_argument("--sft-steps", type=int, default=400, help="SFT steps per seed (default: the quickstart's 400)")
    p.add_argument("--engine-cpus", default="1", help="cores of the SGLang engine (default 1)")
    p.add_argument("--trainer-cpus", default="0", help="cores of the trainer (default 0)")
    p.add_argument("--work", default=os.path.join(ROOT, "runs", "bench_async"))
    p.add_argument("--out", default=OUT)
    p.add_argument("--table", action="store_true", help="only print the table of the results file")
    args = p.parse_args(argv)
    settings = {"steps": args.steps, "sft_steps": args.sft_steps, "engine_cpus": args.engine_cpus,
                "trainer_cpus": args.trainer_cpus, "config": "configs/quickstart.yaml"}
    results = json.load(open(args.out)) if os.path.isfile(args.out) else {"settings": settings, "runs": []}
    if not args.table:
        if results["runs"] and results["settings"] != settings:
            raise SystemExit(f"{args.out} holds runs with other settings {results['settings']}; use --out")
        results["settings"] = settings
        cpus = tuple({int(c) for c in spec.split(",")} for spec in (args.engine_cpus, args.trainer_cpus))
        for seed in [int(s) for s in args.seeds.split(",")]:
            ckpt = ensure_sft(args.work, seed, {"sft_steps": args.sft_steps, "set": []})
            for spec in args.staleness.split(","):
                k, partial = int(spec.removesuffix("-fixed")), not spec.endswith("-fixed")
                mismatch = args.mismatch if k else "none"  # the synchronous run has no stale tokens to correct
                if any(r["seed"] == seed and r["max_staleness"] == k and r["partial"] == (partial and k > 0)
                       and r["mismatch"] == mismatch for r in results["runs"]):
                    continue
                results["runs"].append(run_one(k, partial, seed, args.steps, args.work, ckpt, cpus, mismatch))
                results["machine"] = machine()
                os.makedirs(os.path.dirname(args.out), exist_ok=True)
                with open(args.out + ".tmp", "w") as f:
                    json.dump(results, f, indent=1)
                os.replace(args.out + ".tmp", args.out)
    print(table(results))
    seed = min(r["seed"] for r in results["runs"]) if results["runs"] else None
    dirs = {r["max_staleness"]: os.path.join(args.work, f"seed{seed}", f"k{r['max_staleness']}")
            for r in results["runs"] if r["seed"] == seed and r["max_staleness"] <= 1 and
            (r["partial"] or not r["max_staleness"]) and r["mismatch"] == "none"}
    if dirs and all(os.path.isfile(os.path.join(d, "metrics.jsonl")) for d in dirs.values()):
        print("timeline:", timeline(dirs, os.path.splitext(args.out)[0] + "_timeline.png",
                                    first=min(10, args.steps // 2)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
