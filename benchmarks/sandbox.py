"""Sandbox throughput: the per-execution overhead of megarl.sandbox (an empty program, start to result, against the
same interpreter started bare), and executions per second with `--workers` executions at once, plus the code reward
end to end (assert tests judged outside the sandbox).

    .venv/bin/python benchmarks/sandbox.py [--runs 60] [--workers 2]

Writes benchmarks/results/sandbox.json (overhead_ms_median, executions_per_s, workers) and sandbox_details.json
(the other measurements).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from megarl.rewards.code import code_reward
from megarl.sandbox import describe, run_python

HERE = os.path.dirname(os.path.abspath(__file__))
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    def empty():
        result = run_python("pass")
        assert result.ok, result

    empty()  # warm-up: directories, first exec of the tools
    bare = [_timed(lambda: subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True))
            for _ in range(args.runs)]
    sandboxed = [_timed(empty) for _ in range(args.runs)]
    reward = [_timed(lambda: code_reward(GOOD, TESTS)) for _ in range(args.runs // 2)]
    start = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(lambda _: empty(), range(args.runs * 2)))
    concurrent_s = time.perf_counter() - start

    ms = lambda xs: round(1000 * statistics.median(xs), 1)  # noqa: E731
    out = {
        "overhead_ms_median": round(ms(sandboxed) - ms(bare), 1),
        "execution_ms_median": ms(sandboxed),
        "bare_interpreter_ms_median": ms(bare),
        "code_reward_ms_median": ms(reward),
        "executions_per_s": round(args.runs * 2 / concurrent_s, 1),
        "workers": args.workers,
        "runs": args.runs,
        "cpus": os.cpu_count(),
        "isolation": describe(),
    }
    print(f"bare interpreter start {out['bare_interpreter_ms_median']} ms; sandboxed empty program "
          f"{out['execution_ms_median']} ms (overhead {out['overhead_ms_median']} ms); code reward "
          f"{out['code_reward_ms_median']} ms; {out['executions_per_s']} executions/s with {args.workers} at once")
    # sandbox.json holds exactly the keys the issue names; the other measurements go beside it
    headline = ("overhead_ms_median", "executions_per_s", "workers")
    for name, part in (("sandbox.json", {k: out[k] for k in headline}),
                       ("sandbox_details.json", {k: v for k, v in out.items() if k not in headline})):
        path = os.path.join(HERE, "results", name)
        with open(path, "w") as f:
            json.dump(part, f, indent=2)
            f.write("\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
