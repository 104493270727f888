"""Delta weight sync against full sync over a real RL run (issue 31).

    .venv/bin/python benchmarks/delta_sync.py              # SmolLM2-135M-Instruct, both modes, both transports
    .venv/bin/python benchmarks/delta_sync.py --transports tensor   # one transport (~8 min on 2 cores)
    .venv/bin/python benchmarks/delta_sync.py --table      # runs nothing: the table from the JSON

Per mode (reshard.mode full | delta), one `megarl train configs/smollm2_arith.yaml` run (GRPO on 2-digit addition, the
preset's learning rate 1e-6) with a bf16 engine (rollout.engine.dtype=bfloat16: an engine dtype where deltas can pay;
the CPU default is fp32, where nearly every value changes), per transport (tensor: colocated, the engine maps the
trainer's shared-memory buckets; distributed: a gloo broadcast to the engine, here over the loopback), every sync verified
(reshard.verify_every=1: SGLang's checksum of every engine tensor against the trainer's, and the probe log-probs). Both
runs use the same seed. Per sync, from the run's metrics: bytes pushed, the sync's time (without its verification),
the fraction of engine-dtype values that changed since the previous sync, and whether it was full: the syncs after
each step (the initial push, full in both modes, is not in the metrics). The ratios compare the mean delta sync of the
delta run against the mean sync of the full run.

Targets (issue 31): bytes <= 0.25x of full and sync time <= 0.5x over the run at the default learning rate, with the
verification passing on every sync.

benchmarks/results/delta_sync.json: {"machine", "targets", "runs": [{"model", "mode", "steps", "syncs": [{"step", "full_sync",
"pushed_bytes", "sync_s", "changed_frac", "verified_tensors"}], "wall_s"}], "summary": [{"model", ...ratios}]}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from machine import machine  # noqa: E402

OUT = os.path.join(HERE, "results", "delta_sync.json")
WORK = os.path.join(ROOT, "runs", "bench-delta")
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
CONFIG = os.path.join(ROOT, "configs", "smollm2_arith.yaml")
STEPS = 6
TARGETS = {"bytes_vs_full": 0.25, "time_vs_full": 0.5}  # issue 31, over the run at the default learning rate
# reshard.probe_atol: a bf16 engine's log-probs of random probe sequences differ from the fp32 trainer's by up to
# ~0.34 on SmolLM2 (measured; 30 layers of bf16 rounding), over the 0.05 default; the checksums stay exact
SETTINGS = ["rollout.engine.dtype=bfloat16", "reshard.verify_every=1", "reshard.probe_atol=1.0", "rl.eval_samples=1",
            "logging.wandb=disabled"]
TRANSPORTS = ("tensor", "distributed")


def run(mode: str, transport: str, steps: int, work: str) -> dict:
    import algorithms

    run_dir = os.path.join(work, f"{transport}-{mode}")
    shutil.rmtree(run_dir, ignore_errors=True)
    overrides = [f"run_dir={run_dir}", f"rl.steps={steps}", f"reshard.mode={mode}", f"reshard.transport={transport}",
                 *SETTINGS]
    wall = algorithms._megarl("train", overrides, run_dir + ".log", config=CONFIG)
    syncs = []
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            if "reshard/sync_s" not in row:
                continue
            syncs.append({"step": row["step"], "full_sync": row.get("reshard/full_sync", 1.0),
                          "pushed_bytes": row["reshard/pushed_bytes"], "sync_s": round(row["reshard/sync_s"], 4),
                          "changed_frac": row.get("reshard/changed_frac"),
                          "verified_tensors": row.get("reshard/verified_tensors"),
                          "probe_max_abs_diff": row.get("reshard/probe_max_abs_diff")})
    return {"model": "SmolLM2-135M-Instruct", "transport": transport, "mode": mode, "steps": steps, "syncs": syncs,
            "wall_s": round(wall, 1), "settings": SETTINGS}


def summary(runs: list[dict]) -> list[dict]:
    """Per model and transport: mean bytes and time of the delta run's delta syncs over the full run's syncs."""
    out = []
    for model, transport in sorted({(r["model"], r["transport"]) for r in runs}):
        by_mode = {r["mode"]: r for r in runs if (r["model"], r["transport"]) == (model, transport)}
        if set(by_mode) != {"full", "delta"}:
            continue
        full = by_mode["full"]["syncs"]
        delta = [s for s in by_mode["delta"]["syncs"] if not s["full_sync"]]
        if not full or not delta:
            continue

        def mean(rows, key):
            return sum(r[key] for r in rows) / len(rows)

        every = by_mode["full"]["syncs"] + by_mode["delta"]["syncs"]
        out.append({"model": model, "transport": transport, "delta_syncs": len(delta), "full_syncs": len(full),
                    "bytes_vs_full": round(mean(delta, "pushed_bytes") / mean(full, "pushed_bytes"), 4),
                    "time_vs_full": round(mean(delta, "sync_s") / mean(full, "sync_s"), 4),
                    "changed_frac_mean": round(mean(delta, "changed_frac"), 5),
                    "full_sync_s": round(mean(full, "sync_s"), 4), "delta_sync_s": round(mean(delta, "sync_s"), 4),
                    "all_verified": all((s["verified_tensors"] or 0) > 0 for s in every)})
    return out


def table(results: dict) -> str:
    from docs_numbers import GENERATORS  # the table docs/benchmarks.md shows, from one place

    return GENERATORS["delta-sync"](results)


def main(argv=None) -> int:
    from real_model import save

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=STEPS)
    p.add_argument("--transports", default=",".join(TRANSPORTS), help="comma-separated: tensor, distributed")
    p.add_argument("--work", default=WORK)
    p.add_argument("--out", default=OUT)
    p.add_argument("--table", action="store_true", help="print the table from the JSON; run nothing")
    args = p.parse_args(argv)
    if not args.table:
        if not os.path.isfile(os.path.join(SMOLLM2, "config.json")):
            sys.exit(f"delta_sync.py: error: {SMOLLM2} is missing. Fix: bash launchers/smollm2.sh rl.steps=0 "
                     "(converts it)")
        runs = [run(mode, transport, args.steps, args.work) for transport in args.transports.split(",")
                for mode in ("full", "delta")]

        def update(r):
            measured = {(y["model"], y["transport"]) for y in runs}
            r["runs"] = [x for x in r.get("runs", []) if (x["model"], x.get("transport", "tensor")) not in measured] \
                + runs
            r["summary"] = summary(r["runs"])
            r["targets"] = TARGETS
            r["machine"] = machine()

        save(args.out, update)
    with open(args.out) as f:
        print(table(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
