"""How a command ends: rank 0 prints a short human summary (what ran, the key numbers, where the files are), or with
`--json` the command's summary dict as one JSON line (the machine-readable form scripts parse). megarl.cli calls
`finish(command, summary, as_json)` at the end of train, sft, dpo, eval and run; `describe` is the text alone."""
from __future__ import annotations

import json
import math
import os


def finish(command: str, summary: dict, as_json: bool, run_dir: str, **where) -> None:
    """Print the end of `command` (rank 0 only: the caller checks): json.dumps(summary) with --json, else the
    human summary (describe)."""
    print(json.dumps(summary) if as_json else describe(command, summary, run_dir, **where), flush=True)


def describe(command: str, summary: dict, run_dir: str, **where) -> str:
    """A few lines: `megarl <command> <run_dir>: <the result>`, then the files it wrote, one a line."""
    if summary.get("preempted"):  # checkpointed for a requeue (megarl.trainer.preemption)
        what = "RL" if command in ("train", "run") else command.upper()
        return (f"\nmegarl {command} {run_dir}: stopped after {what} step {summary.get('steps')} (checkpoint saved); "
                "run again to resume")
    head, files = _DESCRIBE[command](summary, run_dir, **where)
    width = max(len(label) for label, _ in files) if files else 0
    lines = [f"\nmegarl {command} {run_dir}: {head}"]
    lines += [f"  {label.ljust(width)}  {path}" for label, path in files if path]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- per command
def _pct(value) -> str:
    return "n/a" if not isinstance(value, (int, float)) or math.isnan(value) else f"{value:.1f}%"


def _num(value) -> str:
    return "n/a" if not isinstance(value, (int, float)) else f"{value:.4g}"


def _wall(summary: dict) -> str:
    wall = summary.get("wall_s")
    resumed = summary.get("resumed_from_step")
    text = f"wall {wall:.0f} s" if isinstance(wall, (int, float)) else ""
    if resumed:
        text += f", resumed from step {resumed}"
    return text


def _held_out(summary: dict) -> str:
    if summary.get("held_out"):  # no held-out prompts: the summary says why pass@1 is null
        return f"held-out pass@1: {summary['held_out']}"
    return (f"held-out pass@1 {_pct(summary.get('pass_at_1_before'))} before RL -> "
            f"{_pct(summary.get('pass_at_1_after'))} after")


def _rl(summary: dict, run_dir: str, **_) -> tuple[str, list]:
    head = f"{_held_out(summary)} ({summary.get('steps')} RL steps, {_wall(summary)})"
    return head, [("summary", os.path.join(run_dir, "rl_summary.json")),
                  ("metrics", os.path.join(run_dir, "metrics.jsonl")),
                  ("checkpoints", os.path.join(run_dir, "checkpoints")),
                  ("report", f"megarl report {run_dir}")]


def _run(summary: dict, run_dir: str, report: str | None = None, plots: str | None = None, **_) -> tuple[str, list]:
    sft = f"{summary['sft_steps']} SFT steps, " if summary.get("sft_steps") else ""
    head = f"{_held_out(summary)} ({sft}{summary.get('rl_steps')} RL steps, {_wall(summary)})"
    return head, [("summary", os.path.join(run_dir, "summary.json")), ("report", report), ("plots", plots)]


def _sft(summary: dict, run_dir: str, **_) -> tuple[str, list]:
    folder = os.path.join(run_dir, "sft")
    nll = _first_last(os.path.join(folder, "sft_metrics.jsonl"), "nll")
    loss = f", nll {_num(nll[0])} -> {_num(nll[1])}" if nll else ""
    head = f"{summary.get('steps')} SFT steps on {summary.get('samples')} samples{loss} ({_wall(summary)})"
    return head, [("checkpoint", summary.get("checkpoint")), ("summary", os.path.join(folder, "sft_summary.json")),
                  ("metrics", os.path.join(folder, "sft_metrics.jsonl")),
                  ("next", "megarl train with model.load=sft (or megarl run)")]


def _dpo(summary: dict, run_dir: str, **_) -> tuple[str, list]:
    folder = os.path.join(run_dir, "dpo")
    moves = ", ".join(f"{name} {_num(summary.get(key + '_first'))} -> {_num(summary.get(key + '_last'))}"
                      for key, name in (("loss", "loss"), ("reward_accuracy", "reward accuracy"),
                                        ("margin", "margin")) if key + "_first" in summary)
    head = (f"{summary.get('steps')} {str(summary.get('loss_type', 'dpo')).upper()} steps on "
            f"{summary.get('pairs')} pairs{', ' + moves if moves else ''} ({_wall(summary)})")
    return head, [("checkpoint", summary.get("checkpoint")), ("summary", os.path.join(folder, "dpo_summary.json")),
                  ("metrics", os.path.join(folder, "dpo_metrics.jsonl"))]


def _eval(summary: dict, run_dir: str, out: str | None = None, **_) -> tuple[str, list]:
    out = out or os.path.join(run_dir, "eval")
    parts = []
    ks = sorted((int(k.rsplit("_", 1)[1]), v) for k, v in summary.items()
                if k.startswith("eval/pass_at_") and k.rsplit("_", 1)[1].isdigit())
    if ks:
        parts.append(", ".join(f"pass@{k} {_pct(v)}" for k, v in ks))
    parts += [f"maj@{k.rsplit('_', 1)[1]} {_pct(v)}" for k, v in summary.items() if k.startswith("eval/maj_at_")]
    if "eval/prompts" in summary:
        parts.append(f"{summary['eval/prompts']} prompts x {summary.get('eval/samples_per_prompt')} samples")
    if "responses/trainer_ppl" in summary:
        parts.append(f"responses: trainer PPL {_num(summary['responses/trainer_ppl'])}, engine PPL "
                     f"{_num(summary.get('responses/engine_ppl'))}, entropy "
                     f"{_num(summary.get('responses/trainer_entropy'))}")
    if not parts:
        parts.append("no held-out prompts (set data.eval, or data.eval_fraction)")
    head = f"step {summary.get('step', 0)}: " + "; ".join(parts)
    return head, [("results", os.path.join(out, "eval.json")), ("pass@k", summary.get("pass_at_k_png"))]


_DESCRIBE = {"train": _rl, "run": _run, "sft": _sft, "dpo": _dpo, "eval": _eval}


def _first_last(path: str, key: str) -> tuple | None:
    """(first, last) value of `key` in a metrics JSONL, or None."""
    from .report import read_metrics, series

    values = series(read_metrics(path), key)[1]
    return (values[0], values[-1]) if values else None
