"""Does a change keep the quickstart's numbers? Compares two finished quickstart run folders (e.g. `bash
launchers/quickstart.sh` in a clone at the commit before a refactor and in one after, on the same machine): their
summaries and every logged metric except times, step by step. Prints a table; appends the comparison to
benchmarks/results/same_numbers.json with the machine.

    python benchmarks/same_numbers.py BEFORE_RUN_DIR AFTER_RUN_DIR --before-commit REV --after-commit REV
"""
from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import machine  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "same_numbers.json")


def _timeless(row: dict) -> dict:
    return {k: v for k, v in row.items() if not (k.startswith("time/") or k.endswith("_s") or "wall" in k)}


def compare(before: str, after: str) -> dict:
    rows = []
    for run in (before, after):
        with open(os.path.join(run, "metrics.jsonl")) as f:
            rows.append([_timeless(json.loads(line)) for line in f])
    summaries = []
    for run in (before, after):
        with open(os.path.join(run, "summary.json")) as f:
            summaries.append(json.load(f))
    differing = [i for i, (a, b) in enumerate(zip(*rows)) if a != b] + \
        list(range(min(map(len, rows)), max(map(len, rows))))
    keys = ("pass_at_1_before", "pass_at_1_after", "seed", "rl_steps", "sft_steps")
    return {"summary_before": summaries[0], "summary_after": summaries[1],
            "same_summary": all(summaries[0][k] == summaries[1][k] for k in keys),
            "metric_rows": len(rows[0]), "differing_rows": differing, "same_metrics": not differing}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--before-commit", required=True)
    p.add_argument("--after-commit", required=True)
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    result = {"before_commit": args.before_commit, "after_commit": args.after_commit, **compare(args.before,
                                                                                               args.after)}
    print(f"{'':8} {'before':>8} {'after':>8}")
    for key in ("pass_at_1_before", "pass_at_1_after", "wall_s"):
        print(f"{key:18} {result['summary_before'][key]:>8} {result['summary_after'][key]:>8}")
    print(f"metrics: {result['metric_rows']} rows, {len(result['differing_rows'])} differ (times excluded)")
    data = json.load(open(args.out)) if os.path.isfile(args.out) else {"comparisons": []}
    data["machine"] = machine()
    data["comparisons"].append(result)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
    return 0 if result["same_summary"] and result["same_metrics"] else 1


if __name__ == "__main__":
    sys.exit(main())
