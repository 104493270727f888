"""`megarl report RUN_DIR`: PNG plots of a run's main curves and a short markdown summary, from its metrics files
(<run_dir>/metrics.jsonl for RL, <run_dir>/sft/sft_metrics.jsonl for the SFT cold start)."""
from __future__ import annotations

import json
import os

PANELS = [  # (title, [metric keys], file)
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
]


def read_metrics(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def series(rows: list[dict], key: str) -> tuple[list, list]:
    points = [(r["step"], r[key]) for r in rows if key in r and isinstance(r[key], (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def render(run_dir: str) -> tuple[str, str]:
    """Write <run_dir>/report.png and <run_dir>/report.md; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {"rl": read_metrics(os.path.join(run_dir, "metrics.jsonl")),
            "sft": read_metrics(os.path.join(run_dir, "sft", "sft_metrics.jsonl"))}
    if not data["rl"] and not data["sft"]:
        raise FileNotFoundError(f"{run_dir} has no metrics.jsonl or sft/sft_metrics.jsonl: nothing to report")
    panels = [(t, [k for k in keys if series(data[src], k)[0]], src) for t, keys, src in PANELS]
    panels = [p for p in panels if p[1]]
    cols = 3
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, (title, keys, src) in zip(axes.flat, panels):
        for key in keys:
            x, y = series(data[src], key)
            ax.plot(x, y, marker="o" if len(x) < 30 else None, markersize=3, label=key)
        ax.set_title(title)
        ax.set_xlabel("SFT step" if src == "sft" else "RL step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(os.path.basename(os.path.abspath(run_dir)))
    fig.tight_layout()
    png = os.path.join(run_dir, "report.png")
    fig.savefig(png, dpi=90)
    plt.close(fig)

    lines = [f"# megarl run report: `{run_dir}`", ""]
    summary_path = os.path.join(run_dir, "summary.json")
    if os.path.isfile(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        lines += ["| summary | value |", "|---|---|"] + [f"| {k} | {_fmt(v)} |" for k, v in summary.items()] + [""]
    lines += ["| metric | first | last | steps |", "|---|---|---|---|"]
    for title, keys, src in panels:
        for key in keys:
            x, y = series(data[src], key)
            lines.append(f"| {src}: {key} | {_fmt(y[0])} | {_fmt(y[-1])} | {x[0]}–{x[-1]} |")
    lines += ["", f"![curves](report.png)", ""]
    md = os.path.join(run_dir, "report.md")
    with open(md, "w") as f:
        f.write("\n".join(lines))
    return png, md


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
