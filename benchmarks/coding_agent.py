"""The coding-agent example end to end on CPU: `bash launchers/coding_agent.sh` (code tasks in MBPP's format, SFT on
draft -> run -> fix -> submit trajectories with the sandboxed `python` tool, then GRPO on multi-turn episodes judged
by the `code` reward's hidden tests), and what every stage reports.

    .venv/bin/python benchmarks/coding_agent.py [--seed 0] [overrides...]

benchmarks/results/coding_agent.json: {"machine", "seed", "sft_final_nll", "pass_at_1_before", "pass_at_1_after",
"tool_call_rate_before", "tool_call_rate_after" (held-out episodes with at least one tool call, %),
"train_tool_call_rate" (per RL step), "train_reward" (per RL step), "wall_s", "config"}. The tiny model is not
expected to solve the tasks; the numbers show that each stage ran and what it measured.
"""
from __future__ import annotations

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

OUT = os.path.join(HERE, "results", "coding_agent.json")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    seed = 0
    if argv[:1] == ["--seed"]:
        seed, argv = int(argv[1]), argv[2:]
    run_dir = os.path.join(ROOT, "runs", "bench-coding-agent")
    shutil.rmtree(run_dir, ignore_errors=True)
    log = run_dir + ".log"
    os.makedirs(os.path.dirname(run_dir), exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(["bash", "launchers/coding_agent.sh", f"run_dir={run_dir}", f"seed={seed}",
                             "logging.progress=false", *argv], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc:
        with open(log) as f:
            print(f.read()[-3000:], file=sys.stderr)
        return rc
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl")) if line.strip()]
    evals = [r for r in rows if "eval/pass_at_1" in r]
    steps = [r for r in rows if "tool/call_rate" in r]
    sft = [json.loads(line) for line in open(os.path.join(run_dir, "sft", "sft_metrics.jsonl")) if line.strip()]
    result = {"machine": machine(), "seed": seed,
              "sft_final_nll": next((r["nll"] for r in reversed(sft) if "nll" in r), None),
              "pass_at_1_before": evals[0]["eval/pass_at_1"], "pass_at_1_after": evals[-1]["eval/pass_at_1"],
              "tool_call_rate_before": 100 * evals[0].get("eval/tool_call_rate", 0.0),
              "tool_call_rate_after": 100 * evals[-1].get("eval/tool_call_rate", 0.0),
              "tool_error_rate_after": 100 * evals[-1].get("eval/tool_error_rate", 0.0),
              "train_tool_call_rate": [round(100 * r["tool/call_rate"], 1) for r in steps],
              "train_reward": [round(r["reward/mean"], 3) for r in steps], "wall_s": round(wall, 1),
              "config": {"file": "configs/coding_agent.yaml", "overrides": [f"seed={seed}", *argv]}}
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(OUT + ".tmp", OUT)
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
