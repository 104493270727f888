"""Data for the coding-agent example (configs/coding_agent.yaml, launchers/coding_agent.sh): code tasks in MBPP's own
format, and SFT cold-start trajectories that use the `python` tool the way a coding agent does.

    python -m megarl.examples.coding_agent <folder> [--tasks 400] [--held-out 40] [--seed 0]

writes <folder>/train.jsonl and <folder>/eval.jsonl (MBPP records: "text", "code", "test_list" (the hidden tests),
read with data.answer_format: mbpp) and <folder>/sft.jsonl (chat trajectories). Each task asks for a small function
`f` of one integer (a linear or quadratic expression, an absolute value, a parity choice) and shows three example
calls; the hidden tests check other inputs.

A trajectory is what the agent loop does at RL time: the model drafts `f`, calls the `python` tool to run it on the
visible examples, reads the printed values (a tool message: no loss), fixes the draft when they are wrong, and
submits the final function in a ```python block, which the `code` reward judges against the hidden tests. Half the
drafts are wrong (a constant off by one), so half the trajectories show a fix. The outputs in the tool messages are
computed by running the drafts in megarl.sandbox, as the tool would.
"""
from __future__ import annotations

import argparse
import json
import os
import random

_SHAPES = [  # (name, parameters a and b, body): 4 x ~300 distinct tasks
    ("linear", lambda r: (r.randint(2, 12), r.randint(1, 30)), "{a} * x + {b}"),
    ("quadratic", lambda r: (r.randint(1, 9), r.randint(1, 30)), "{a} * x * x + {b}"),
    ("absolute", lambda r: (r.randint(1, 11), r.randint(1, 30)), "abs(x - {a}) + {b}"),
    ("parity", lambda r: (r.randint(2, 12), r.randint(1, 30)), "x // 2 + {a} if x % 2 == 0 else x + {b}"),
]


def _function(body: str) -> str:
    return f"def f(x):\n    return {body}\n"


def task(rng: random.Random) -> dict:
    name, params, template = rng.choice(_SHAPES)
    a, b = params(rng)
    body = template.format(a=a, b=b)
    f = eval(f"lambda x: {body}")  # noqa: S307 - our own generated expression
    visible = [1, 2, 12]
    hidden = rng.sample([x for x in range(3, 40) if x not in visible], 4)
    examples = ", ".join(f"f({x}) == {f(x)}" for x in visible)
    return {"text": f"Write a Python function f(x) ({name}). Examples: {examples}.",
            "code": _function(body), "test_list": [f"assert f({x}) == {f(x)}" for x in hidden],
            "visible": visible, "draft": _function(template.format(a=a, b=b + rng.choice([-1, 1])))
            if rng.random() < 0.5 else None}


def _probe(code: str, visible: list[int]) -> str:
    return code + "print(" + ", ".join(f"f({x})" for x in visible) + ")\n"


def _call(code: str) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "python", "arguments": {"code": code}}}]}


def trajectory(t: dict) -> list[dict]:
    """draft -> run -> (fix -> run) -> submit, with the tool's outputs from the sandbox."""
    from ..envs.tools import python

    messages = [{"role": "user", "content": t["text"]}]
    for code in ([t["draft"]] if t["draft"] else []) + [t["code"]]:
        probe = _probe(code, t["visible"])
        messages += [_call(probe), {"role": "tool", "name": "python", "content": python(probe)}]
    messages.append({"role": "assistant", "content": f"```python\n{t['code']}```"})
    return messages


def write(folder: str, tasks: int = 400, held_out: int = 40, seed: int = 0) -> dict:
    rng = random.Random(seed)
    seen, rows = set(), []
    for _ in range(20 * (tasks + held_out)):
        if len(rows) == tasks + held_out:
            break
        t = task(rng)
        if t["text"] not in seen:  # held-out tasks never share a prompt with training ones
            seen.add(t["text"])
            rows.append(t)
    if len(rows) < tasks + held_out:
        raise ValueError(f"only {len(rows)} distinct tasks exist, fewer than --tasks {tasks} + --held-out {held_out}")
    os.makedirs(folder, exist_ok=True)
    paths = {name: os.path.join(folder, f"{name}.jsonl") for name in ("train", "eval", "sft")}
    mbpp = [{k: t[k] for k in ("text", "code", "test_list")} for t in rows]
    for name, records in (("train", mbpp[:tasks]), ("eval", mbpp[tasks:]),
                          ("sft", [{"messages": trajectory(t)} for t in rows[:tasks]])):
        with open(paths[name] + ".tmp", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        os.replace(paths[name] + ".tmp", paths[name])
    return paths


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--tasks", type=int, default=400)
    p.add_argument("--held-out", type=int, default=40)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if all(os.path.isfile(os.path.join(args.folder, f"{n}.jsonl")) for n in ("train", "eval", "sft")):
        print(f"{args.folder}: coding-agent data exists; nothing to do")
        return 0
    print(json.dumps(write(args.folder, args.tasks, args.held_out, args.seed)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
