"""Built-in verifiable tasks, generated locally: integer arithmetic with exact answers."""
from __future__ import annotations

import operator
import random

_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def arithmetic_problems(n: int, digits: int = 2, ops=("+",), seed: int = 0, exclude: set | None = None,
                        max_operand: int | None = None) -> list[dict]:
    """n distinct problems {"prompt": "37+58=", "answer": "95"} with operands in [0, max_operand] (default: every
    number of at most `digits` digits).

    `exclude` holds prompts that must not appear (the held-out split is generated first and excluded from training).
    """
    for op in ops:
        if op not in _OPS:
            raise ValueError(f"data.synthetic.ops: unknown operator {op!r}; choose from {sorted(_OPS)}")
    rng = random.Random(seed)
    high = 10 ** digits - 1 if max_operand is None else max_operand
    space = (high + 1) ** 2 * len(ops) - len(exclude or ())
    if n > space:
        raise ValueError(f"data.synthetic: {n} distinct problems requested but only {space} exist with operands "
                         f"0..{high} and ops={list(ops)}; lower num_train/num_eval or widen the operands")
    seen, out = set(exclude or ()), []
    while len(out) < n:
        a, b, op = rng.randint(0, high), rng.randint(0, high), rng.choice(list(ops))
        prompt = f"{a}{op}{b}="
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "answer": str(_OPS[op](a, b))})
    return out


def synthetic_splits(cfg) -> tuple[list[dict], list[dict]]:
    """(train, held-out) problems for a SyntheticConfig; the two never share a prompt."""
    if cfg.task != "arithmetic":
        raise ValueError(f"data.synthetic.task={cfg.task!r} is unknown; choose one of ['arithmetic']")
    held_out = arithmetic_problems(cfg.num_eval, cfg.digits, cfg.ops, seed=cfg.seed + 1, max_operand=cfg.max_operand)
    train = arithmetic_problems(cfg.num_train, cfg.digits, cfg.ops, seed=cfg.seed,
                                exclude={p["prompt"] for p in held_out}, max_operand=cfg.max_operand)
    return train, held_out


def noisy_answers(problems: list[dict], share: float, seed: int) -> list[dict]:
    """A copy of `problems` where a `share` of the answers are wrong by a small nonzero amount (-3..3): imperfect
    demonstrations for an SFT cold start, which a verifier-rewarded RL stage can then correct."""
    if not 0.0 <= share < 1.0:
        raise ValueError(f"data.synthetic.sft_answer_noise={share} must be in [0, 1)")
    rng = random.Random(seed)
    out = []
    for p in problems:
        if rng.random() < share:
            p = dict(p, answer=str(int(p["answer"]) + rng.choice([-3, -2, -1, 1, 2, 3])))
        out.append(p)
    return out


def wrong_answers(problems: list[dict], seed: int) -> list[dict]:
    """A copy of `problems` with every answer wrong by a small nonzero amount (-3..3): the rejected side of synthetic
    preference pairs."""
    rng = random.Random(seed)
    return [dict(p, answer=str(int(p["answer"]) + rng.choice([-3, -2, -1, 1, 2, 3]))) for p in problems]


def tool_use_demonstrations(problems: list[dict], share: float, seed: int) -> list[list[dict]]:
    """SFT conversations for a tool-use cold start: a `share` of the problems (seeded) are solved by calling the
    calculator tool and answering with its result; the rest are answered directly with the problem's answer."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"data.synthetic.sft_tool_share={share} must be in [0, 1]")
    rng = random.Random(seed)
    out = []
    for p in problems:
        user = {"role": "user", "content": p["prompt"]}
        if rng.random() < share:
            call = {"type": "function", "function": {"name": "calculator",
                                                     "arguments": {"expression": p["prompt"].rstrip("=")}}}
            out.append([user, {"role": "assistant", "content": "", "tool_calls": [call]},
                        {"role": "tool", "name": "calculator", "content": p["answer_true"]},
                        {"role": "assistant", "content": p["answer_true"]}])
        else:
            out.append([user, {"role": "assistant", "content": p["answer"]}])
    return out
