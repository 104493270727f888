"""The README's main command, measured: `bash launchers/quickstart.sh seed=S` for seeds 0, 1 and 2, one after another.

    .venv/bin/python benchmarks/quickstart.py                 # seeds 0,1,2 (each ~6-10 min on 2 cores)
    .venv/bin/python benchmarks/quickstart.py --seeds 1       # one seed; replaces that seed's record
    .venv/bin/python benchmarks/quickstart.py --table         # runs nothing: the table and results/quickstart.png

Each run is the launcher exactly as a newcomer runs it (its own run folder runs/bench-quickstart/seed<S>, started
clean), alone on the machine. benchmarks/results/quickstart.json: {"runs": [{"seed", "pass_at_1_before",
"pass_at_1_after", "wall_s", "cpu"}]} (cpu: the processor's model name), plus each run's cores, date and config file;
the target is a held-out gain of at least +10 points for every seed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from machine import machine  # noqa: E402

OUT = os.path.join(HERE, "results", "quickstart.json")
PNG = os.path.join(HERE, "results", "quickstart.png")
WORK = os.path.join(ROOT, "runs", "bench-quickstart")
TARGET = 10.0  # points of held-out pass@1 gained by every seed


def run_seed(seed: int, work: str) -> dict:
    run_dir = os.path.join(work, f"seed{seed}")
    shutil.rmtree(run_dir, ignore_errors=True)
    log = run_dir + ".log"
    os.makedirs(work, exist_ok=True)
    load = round(os.getloadavg()[0], 2)  # 1-minute load average: wall_s depends on what else runs
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(["bash", "launchers/quickstart.sh", f"seed={seed}", f"run_dir={run_dir}"], cwd=ROOT,
                            stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc != 0:
        with open(log) as f:
            raise RuntimeError(f"quickstart seed {seed} failed (exit {rc}); log {log}:\n{f.read()[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    m = machine()
    return {"seed": seed, "pass_at_1_before": summary["pass_at_1_before"],
            "pass_at_1_after": summary["pass_at_1_after"], "wall_s": round(wall, 1), "cpu": m["cpu"],
            "cores": m["cores"], "load_average_at_start": load,
            "date": datetime.date.today().isoformat(), "config": "configs/quickstart.yaml"}


def plot(results: dict, path: str) -> str:
    """Held-out pass@1 before and after RL for each seed (bars), the gain written above each pair, and the target
    line (before + 10 points) per seed; the machine and date from the JSON in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = sorted(results["runs"], key=lambda r: r["seed"])
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = range(len(runs))
    before = [r["pass_at_1_before"] for r in runs]
    after = [r["pass_at_1_after"] for r in runs]
    ax.bar([x - 0.2 for x in xs], before, 0.4, label="before RL (after SFT)", color="#9aa7b8")
    ax.bar([x + 0.2 for x in xs], after, 0.4, label="after 100 GRPO steps", color="#2b6cb0")
    for x, b, a in zip(xs, before, after):
        ax.hlines(b + results.get("target_gain", TARGET), x + 0.0, x + 0.4, colors="#c53030", linestyles="dashed")
        ax.text(x + 0.2, a + 1, f"{a - b:+.1f}", ha="center", fontsize=9)
    ax.plot([], [], color="#c53030", linestyle="dashed", label="target: before + 10 points")
    ax.set_xticks(list(xs), [f"seed {r['seed']}" for r in runs])
    ax.set_ylabel("held-out pass@1 (%)")
    ax.set_ylim(0, 100)
    m = results.get("machine") or {"cpu": runs[0]["cpu"], "cores": runs[0]["cores"]}
    ax.set_title(f"quickstart (configs/quickstart.yaml): {m['cpu']}, {m['cores']} cores, {runs[0]['date']}",
                 fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default=OUT)
    p.add_argument("--work", default=WORK)
    p.add_argument("--table", action="store_true", help="run nothing: print the table and plot the JSON (--plot)")
    p.add_argument("--plot", default=PNG, help="the PNG --table writes (default benchmarks/results/quickstart.png)")
    args = p.parse_args(argv)
    for seed in [] if args.table else [int(s) for s in args.seeds.split(",")]:
        from real_model import save  # imports torch; not needed for --table
        run = run_seed(seed, args.work)
        save(args.out, lambda r: r.update(runs=[x for x in r.get("runs", []) if x["seed"] != seed] + [run],
                                          target_gain=TARGET, machine=machine()))
        gain = run["pass_at_1_after"] - run["pass_at_1_before"]
        print(f"[quickstart] seed {seed}: {run['pass_at_1_before']:.1f}% -> {run['pass_at_1_after']:.1f}% "
              f"({gain:+.1f}) in {run['wall_s']:.0f} s", flush=True)
    with open(args.out) as f:
        runs = sorted(json.load(f)["runs"], key=lambda r: r["seed"])
    print("| seed | before | after | gain | wall | cpu |\n|---|---|---|---|---|---|")
    for r in runs:
        gain = r["pass_at_1_after"] - r["pass_at_1_before"]
        print(f"| {r['seed']} | {r['pass_at_1_before']:.1f}% | {r['pass_at_1_after']:.1f}% | {gain:+.1f}"
              f"{'' if gain >= TARGET else ' (below the +10 target)'} | {r['wall_s']:.0f} s | {r['cpu']} |")
    if args.table:
        with open(args.out) as f:
            print(f"[quickstart] plot {plot(json.load(f), args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
