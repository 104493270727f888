"""How long the first install takes and how big it is: `bash launchers/install.sh` into a new virtual environment with
an empty pip cache (what a newcomer's first `bash launchers/quickstart.sh` does), timed per stage from the script's
own progress lines.

    .venv/bin/python benchmarks/install.py            # one install into a temporary folder (removed afterwards)
    .venv/bin/python benchmarks/install.py --table    # only print the table from the JSON

benchmarks/results/install.json: {"machine", "runs": [{"device", "wall_s", "venv_gb", "stages": [[progress line,
seconds since start]], "package_sources", "date", "python"}]}. Where the wheels came from (pip's configured indexes and
find-links: a local wheel mirror makes the install faster than one that downloads) is recorded with the time.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from machine import machine  # noqa: E402

OUT = os.path.join(HERE, "results", "install.json")
PROGRESS = re.compile(r"^megarl: \[(\d+)/(\d+)\] (.*) \((\d+) s so far\)$")


def folder_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            full = os.path.join(folder, name)
            if not os.path.islink(full):
                total += os.path.getsize(full)
    return total


def package_sources() -> list[str]:
    """pip's configured index / find-links settings (from `pip config list` and the environment)."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if any(k in line for k in ("index-url", "find-links"))]


def install_once(device: str) -> dict:
    """One first install into a temporary venv with its own empty pip cache; the record."""
    work = tempfile.mkdtemp(prefix="megarl-install-bench-")
    try:
        venv, cache = os.path.join(work, "venv"), os.path.join(work, "pip-cache")
        env = dict(os.environ, MEGARL_VENV=venv, MEGARL_DEVICE=device, PIP_CACHE_DIR=cache)
        start = time.perf_counter()
        proc = subprocess.run(["bash", "launchers/install.sh"], cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - start
        if proc.returncode != 0:
            raise SystemExit(f"install.sh failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        stages = [[m.group(3), int(m.group(4))] for m in map(PROGRESS.match, proc.stdout.splitlines()) if m]
        return {"device": device, "wall_s": round(wall, 1), "venv_gb": round(folder_bytes(venv) / 1e9, 2),
                "stages": stages, "package_sources": package_sources(),
                "date": datetime.date.today().isoformat(), "python": sys.version.split()[0]}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def table(results: dict) -> str:
    rows = ["| device | first install | virtual environment | machine | date |", "|---|---|---|---|---|"]
    m = results["machine"]
    for r in results["runs"]:
        rows.append(f"| {r['device']} | {r['wall_s']:.0f} s | {r['venv_gb']:.1f} GB | {m['cpu']}, {m['cores']} cores "
                    f"(load {m['load_average_1min_at_start']} at start) | {r['date']} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    p.add_argument("--table", action="store_true")
    p.add_argument("--out", default=OUT)
    args = p.parse_args(argv)
    if not args.table:
        results = {"machine": machine(), "runs": [install_once(args.device)]}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    with open(args.out) as f:
        print(table(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
