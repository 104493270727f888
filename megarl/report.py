"""`megarl report RUN_DIR`: PNG plots of a run's main curves and a short markdown summary, from whatever runs the
folder holds: RL (<run_dir>/metrics.jsonl), the SFT cold start (<run_dir>/sft/sft_metrics.jsonl) and DPO / IPO
(<run_dir>/dpo/dpo_metrics.jsonl), with their summaries (summary.json or rl_summary.json, sft/sft_summary.json,
dpo/dpo_summary.json).

A panel whose curve is 0 throughout says why (read from the run's recorded config, <run_dir>/run_config.json:
kl_coef 0, one optimizer step per batch, ...), and report.md says when held-out pass@k is lower at the end than at the
start. A folder that does not exist or holds no run is one line (megarl.errors.UserError), not a traceback."""
from __future__ import annotations

import json
import os

from .errors import UserError

# each kind of run: its folder in run_dir, its metrics file there, its summary files there (the first that exists)
KINDS = {
    "rl": ("", "metrics.jsonl", ("summary.json", "rl_summary.json")),
    "sft": ("sft", "sft_metrics.jsonl", ("sft_summary.json",)),
    "dpo": ("dpo", "dpo_metrics.jsonl", ("dpo_summary.json",)),
}
LABELS = {"rl": "RL", "sft": "SFT", "dpo": "DPO"}

PANELS = [  # (title, [metric keys], kind)
    ("reward (mean)", ["reward/mean"], "rl"),
    ("held-out pass@1 (%)", ["eval/pass_at_1"], "rl"),
    ("tool-call rate (multi-turn)", ["tool/call_rate", "eval/tool_call_rate"], "rl"),
    ("response length", ["response_len/mean", "response_len/max"], "rl"),
    ("entropy", ["entropy"], "rl"),
    ("KL to reference / ppo_kl", ["kl", "ppo_kl"], "rl"),
    ("clip fraction", ["clip_frac_low", "clip_frac_high"], "rl"),
    ("grad norm", ["grad_norm"], "rl"),
    ("train vs rollout |log-prob diff|", ["mismatch/logprob_abs_diff"], "rl"),
    ("step time (s)", ["time/step_s", "time/rollout_s", "time/train_s", "time/reshard_s"], "rl"),
    ("SFT loss (nll)", ["nll"], "sft"),
    ("DPO loss", ["loss"], "dpo"),
    ("DPO reward accuracy", ["reward_accuracy"], "dpo"),
    ("DPO implicit rewards", ["margin", "chosen_reward", "rejected_reward"], "dpo"),
    ("DPO grad norm", ["grad_norm"], "dpo"),
]


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics JSONL ([] without the file); a line that is not JSON (the last line of a run killed
    while writing it) is skipped."""
    if not os.path.isfile(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                continue
            if isinstance(row, dict) and "step" in row:
                rows.append(row)
    return rows


def series(rows: list[dict], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in rows if key in r and isinstance(r[key], (int, float))
              and not isinstance(r[key], bool)]
    return [p[0] for p in points], [p[1] for p in points]


def find_runs(run_dir: str) -> dict[str, list[dict]]:
    """{kind: metrics rows} for each kind of run (rl, sft, dpo) in run_dir with at least one step; a one-line
    UserError for a folder that does not exist or holds none."""
    if not os.path.isdir(run_dir):
        raise UserError(f"run folder {run_dir!r} does not exist. Fix: give the run_dir of a run (its config's "
                        "run_dir field), e.g. megarl report runs/quickstart")
    found = {kind: read_metrics(os.path.join(run_dir, folder, name)) for kind, (folder, name, _) in KINDS.items()}
    found = {kind: rows for kind, rows in found.items() if rows}
    if not found:
        raise UserError(f"{run_dir} holds no run: no step in metrics.jsonl (RL), sft/sft_metrics.jsonl (SFT) or "
                        "dpo/dpo_metrics.jsonl (DPO). Fix: give the run_dir that megarl train, sft, dpo or run wrote "
                        "(they log from the first step on), e.g. megarl report runs/quickstart")
    return found


def recorded_config(run_dir: str, kind: str) -> dict:
    """The config the run recorded (<run_dir>[/sft|/dpo]/run_config.json, megarl.trainer.run_identity); {} without."""
    path = os.path.join(run_dir, KINDS[kind][0], "run_config.json")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}


def _get(cfg: dict, dotted: str, default=None):
    for part in dotted.split("."):
        if not isinstance(cfg, dict) or part not in cfg:
            return default
        cfg = cfg[part]
    return cfg


def zero_reason(key: str, cfg: dict) -> str:
    """Why `key` is 0 at every step, as far as the recorded config says (cfg: run_config.json, may be {})."""
    updates = (_get(cfg, "rl.mini_batches", 1) or 1) * (_get(cfg, "rl.ppo_epochs", 1) or 1)
    on_policy = (f"one optimizer step per batch (rl.mini_batches x rl.ppo_epochs = 1): every update is on-policy, "
                 "ratio 1") if cfg and updates == 1 else ""
    if key == "kl":
        return "kl_coef is 0" if cfg and not _get(cfg, "algorithm.kl_coef") else "the policy stayed at the reference"
    if key == "ppo_kl":
        return on_policy or "the policy did not move between the rollout and the update"
    if key.startswith("clip_frac"):
        return "no clipping happened" + (f": {on_policy}" if on_policy else "")
    return ""


def zero_note(keys: list[str], rows: list[dict], cfg: dict, absent: tuple = ()) -> str | None:
    """The note for a panel whose curves are all 0: '0 throughout: <why>'; None when a curve moved. absent: the
    panel's keys the run did not log."""
    if any(any(v != 0 for v in series(rows, k)[1]) for k in keys):
        return None
    reasons = []
    if "kl" in absent and cfg and not _get(cfg, "algorithm.kl_coef"):
        reasons.append("no KL to a reference is computed: kl_coef is 0")
    for key in keys:
        reason = zero_reason(key, cfg)
        if reason and reason not in reasons:
            reasons.append(f"{key}: {reason}" if len(keys) > 1 and key in ("kl", "ppo_kl") else reason)
    return "0 throughout" + (": " + "; ".join(reasons) if reasons else "")


def sparse_eval_note(rows: list[dict], cfg: dict) -> str | None:
    """The held-out panel with two points or fewer: evaluation ran before and after training only."""
    if len(series(rows, "eval/pass_at_1")[0]) > 2:
        return None
    every = _get(cfg, "rl.eval_every")
    return (f"evaluated before and after training only (rl.eval_every={every or 0}); set rl.eval_every "
            "(e.g. 25) for a curve")


def pass_at_k_drops(rows: list[dict]) -> list[tuple[int, float, float, int, int]]:
    """(k, first, last, first step, last step) for each held-out pass@k lower at the last evaluation than at the
    first."""
    evals = [r for r in rows if isinstance(r.get("eval/pass_at_1"), (int, float))]
    if len(evals) < 2:
        return []
    first, last = evals[0], evals[-1]
    drops = []
    for key in sorted((k for k in first if k.startswith("eval/pass_at_") and k[13:].isdigit()),
                      key=lambda k: int(k[13:])):
        if isinstance(last.get(key), (int, float)) and last[key] < first[key]:
            drops.append((int(key[13:]), first[key], last[key], first["step"], last["step"]))
    return drops


def render(run_dir: str) -> tuple[str, str]:
    """Write <run_dir>/report.png and <run_dir>/report.md; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    data = find_runs(run_dir)
    configs = {kind: recorded_config(run_dir, kind) for kind in data}
    panels = [(t, [k for k in keys if series(data[kind], k)[0]], kind) for t, keys, kind in PANELS if kind in data]
    panels = [p for p in panels if p[1]]
    notes = {}
    for title, keys, kind in panels:
        absent = tuple(k for k in next(p[1] for p in PANELS if p[0] == title) if k not in keys)
        note = zero_note(keys, data[kind], configs[kind], absent)
        if keys == ["eval/pass_at_1"]:
            note = sparse_eval_note(data[kind], configs[kind])
        if note:
            notes[title] = note

    cols = min(3, max(1, len(panels)))
    rows = max(1, -(-len(panels) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.3 * rows + 0.5), squeeze=False, layout="constrained")
    for ax, (title, keys, kind) in zip(axes.flat, panels):
        for key in keys:
            x, y = series(data[kind], key)
            ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, label=key)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(f"{LABELS[kind]} step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7, loc="best")
        if title in notes:
            ax.text(0.5, 0.5, _wrap(notes[title]), transform=ax.transAxes, ha="center", va="center", fontsize=8,
                    bbox={"boxstyle": "round", "facecolor": "#fff8dc", "alpha": 0.9, "edgecolor": "#c8b560"})
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    kinds = " + ".join(LABELS[k] for k in ("sft", "dpo", "rl") if k in data)
    fig.suptitle(f"{os.path.basename(os.path.abspath(run_dir))} ({kinds})", fontsize=12)
    png = os.path.join(run_dir, "report.png")
    fig.savefig(png, dpi=90)
    plt.close(fig)

    lines = [f"# megarl run report: `{run_dir}`", "", f"Runs found: {kinds}.", ""]
    for kind in ("sft", "dpo", "rl"):
        summary = _summary(run_dir, kind) if kind in data else None
        if summary:
            lines += [f"| {LABELS[kind]} summary | value |", "|---|---|"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in summary.items()] + [""]
    drops = pass_at_k_drops(data.get("rl", []))
    if drops:
        listed = ", ".join(f"pass@{k} {a:.1f}% -> {b:.1f}%" for k, a, b, _, _ in drops)
        curves = " (the before/after curves: pass_at_k.png)" if os.path.isfile(os.path.join(run_dir, "pass_at_k.png")) \
            else ""
        lines += [f"**Held-out pass@k went down** between step {drops[0][3]} and step {drops[0][4]}: {listed}. The "
                  f"policy solves fewer problems in k tries than it did: often a sign that RL narrowed it to fewer "
                  f"answers{curves}.", ""]
    if notes:
        lines += ["Notes:", ""] + [f"- {title}: {note}" for title, note in notes.items()] + [""]
    lines += ["| metric | first | last | steps |", "|---|---|---|---|"]
    for title, keys, kind in panels:
        for key in keys:
            x, y = series(data[kind], key)
            lines.append(f"| {kind}: {key} | {_fmt(y[0])} | {_fmt(y[-1])} | {x[0]}–{x[-1]} |")
    lines += ["", "![curves](report.png)", ""]
    md = os.path.join(run_dir, "report.md")
    with open(md, "w") as f:
        f.write("\n".join(lines))
    return png, md


def _summary(run_dir: str, kind: str) -> dict | None:
    folder, _, names = KINDS[kind]
    for name in names:
        path = os.path.join(run_dir, folder, name)
        try:
            with open(path) as f:
                value = json.load(f)
            return value if isinstance(value, dict) else None
        except (OSError, json.JSONDecodeError):
            continue
    return None


def _wrap(text: str, width: int = 44) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
