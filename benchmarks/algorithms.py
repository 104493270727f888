"""The algorithm comparison: every policy-gradient algorithm in megarl's registries on the quickstart task.

    .venv/bin/python benchmarks/algorithms.py                       # the whole sweep, resumable (hours on 2 cores)
    .venv/bin/python benchmarks/algorithms.py --algorithms grpo,maxrl --seeds 0 --steps 100
    .venv/bin/python benchmarks/algorithms.py --table --docs        # only print the table, plot, fill docs/algorithms.md
    .venv/bin/python benchmarks/algorithms.py --list                # the algorithms and the config each name maps to

The algorithms come from the registries, not from a list kept here: one run per advantage estimator
(`ADVANTAGE_ESTIMATORS`, with the quickstart's `ppo_clip` loss), per policy loss (`POLICY_LOSSES`, with `grpo`
advantages) and per token selection (`TOKEN_SELECTIONS`, on `grpo` + `ppo_clip`). `grpo` is the quickstart's own
algorithm (advantage_estimator grpo, policy_loss ppo_clip), so the `ppo_clip` entry is the `grpo` run. `REQUIRES`
adds what an algorithm cannot run without (config validation asks for it) or what its paper prescribes;
`EXCLUDED` says why a registered name cannot run on this task. Everything else is the same for every algorithm:
`configs/quickstart.yaml` (32 prompts x 8 samples per step, DAPO dynamic sampling, lr 3e-4, ...) plus `SHARED`.

Per seed, the SFT cold start runs once (`megarl sft`, <work>/seed<S>/sft/checkpoints); every algorithm's RL run
(`megarl train`, <work>/seed<S>/<algorithm>) starts from that checkpoint (`model.load`) and the same base-model folder
(`model.path`), with the same seed, so the runs of one seed share their starting policy, their prompt order and
the seeded held-out evaluation before RL. Each finished run is appended to the JSON at once (written to a temporary
file, fsynced and renamed, under a lock on its folder); (algorithm, seed) pairs already in it are skipped, so the
sweep continues where it stopped; a run that fails is reported, left out of the file and tried again next time.
The file also records the settings (RL steps, SFT steps, extra overrides); runs with other settings are refused
rather than mixed into one table.

A run records: pass_at_1_before / pass_at_1_after (held-out pass@1 in %, 100 problems x 4 samples at T=1, from the
trainer's rl_summary.json), entropy_final (the `entropy` metric of the last RL step: mean per-token entropy of the
policy on that step's responses) and wall_s (the `megarl train` process, engine start-up included; the shared SFT is
not counted).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from megarl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES  # noqa: E402
from megarl.algorithms.token_selection import TOKEN_SELECTIONS  # noqa: E402
from machine import machine  # noqa: E402  (benchmarks/machine.py: the machine, for the JSON)

CONFIG = os.path.join(ROOT, "configs", "quickstart.yaml")
OUT = os.path.join(HERE, "results", "algorithms.json")
DOC = os.path.join(ROOT, "docs", "algorithms.md")  # the page whose algorithms-table block --docs fills
WORK = os.path.join(ROOT, "runs", "bench-algorithms")
BASELINE = {"algorithm.advantage_estimator": "grpo", "algorithm.policy_loss": "ppo_clip"}
# The same for every run, on top of configs/quickstart.yaml. rl.mini_batches=2: with one optimizer step per batch
# every importance ratio is 1 at the update, and the ratio-based losses (ppo_clip, gspo, cispo, sapo, aspo, gmpo, fipo)
# would all take the same step; two mini-batches make the second one off-policy, where they differ.
SHARED = {"rl.mini_batches": 2, "checkpoint.export_hf": False, "logging.wandb": "disabled",
          "logging.progress": False}
# What a name needs beyond itself: config validation requires it, or its paper prescribes it.
REQUIRES = {
    "gae": {"algorithm.use_critic": True, "algorithm.whiten_advantages": True,  # PPO: a critic, whitened GAE
            "rl.critic_lr": 3.0e-4},  # the policy's lr (critic_lr's default 1e-5 is meant for large models)
    "gpg": {"algorithm.policy_loss": "reinforce"},  # GPG's loss is the plain policy gradient (arXiv:2504.02546)
    "aspo": {"algorithm.dual_clip": 3.0},  # ASPO's soft dual clip (required by the config)
    "gmpo": {"algorithm.clip_eps_low": 0.4, "algorithm.clip_eps_high": 0.4},  # the paper's log-ratio clip
    "gspo": {"algorithm.clip_eps_low": 3.0e-4, "algorithm.clip_eps_high": 4.0e-4},  # the paper's sequence-ratio clip
}
EXCLUDED = {"opd": "on-policy distillation needs a teacher model (the teacher: section); the quickstart has none"}
FIELDS = ("algorithm", "seed", "pass_at_1_before", "pass_at_1_after", "entropy_final", "wall_s")


class BenchError(Exception):
    """Input this script refuses; the message names the option and the fix."""


# ------------------------------------------------------------------------------------------------ the algorithms
def _entries() -> list[tuple[str, dict]]:
    """(name, config overrides) for every registered name that can run here, in registry order: each advantage
    estimator (with ppo_clip), each policy loss (with grpo), each token selection (on grpo + ppo_clip)."""
    own = [(n, {"algorithm.advantage_estimator": n}) for n in ADVANTAGE_ESTIMATORS]
    own += [(n, {"algorithm.policy_loss": n}) for n in POLICY_LOSSES]
    own += [(n, {f"algorithm.{n}": True}) for n in TOKEN_SELECTIONS]
    names = [n for n, _ in own]
    clash = sorted({n for n in names if names.count(n) > 1})
    if clash:
        raise BenchError(f"{clash} name both an estimator / loss / token selection: the comparison needs one name each")
    return [(n, {**BASELINE, **c, **REQUIRES.get(n, {})}) for n, c in own if n not in EXCLUDED]


def algorithms() -> dict[str, dict]:
    """name -> the config overrides (dotted keys) that select it, in registry order; a name whose config equals an
    earlier one's is not repeated (ppo_clip is the grpo run: see aliases)."""
    out: dict[str, dict] = {}
    for name, config in _entries():
        if config not in out.values():
            out[name] = config
    return out


def aliases() -> dict[str, list[str]]:
    """name -> the other registered names whose configuration is that run (grpo: [ppo_clip])."""
    table, found = algorithms(), {}
    for name, config in _entries():
        if name not in table:
            found.setdefault(next(k for k, v in table.items() if v == config), []).append(name)
    return found


def describe(config: dict) -> str:
    """The config an algorithm maps to, short: 'estimator grpo, loss ppo_clip, lopti'."""
    parts = [f"{config['algorithm.advantage_estimator']} + {config['algorithm.policy_loss']}"]
    parts += [f"{k.removeprefix('algorithm.')}={_yaml(v)}" for k, v in config.items()
              if k not in BASELINE and not (k.startswith("algorithm.") and k[10:] in TOKEN_SELECTIONS)]
    parts += [k[10:] for k, v in config.items() if k.startswith("algorithm.") and k[10:] in TOKEN_SELECTIONS and v]
    return ", ".join(parts)


def select(names: str | None) -> list[str]:
    table = algorithms()
    if not names:
        return list(table)
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    for n in chosen:
        if n in EXCLUDED:
            raise BenchError(f"--algorithms: {n} cannot run on the quickstart task ({EXCLUDED[n]}). Fix: leave it out.")
        if n not in table:
            alias = next((k for k, v in aliases().items() if n in v), None)
            fix = f"use {alias} (the same run)" if alias else f"choose from {', '.join(table)}"
            raise BenchError(f"--algorithms: {n!r} is not a run of this comparison. Fix: {fix}.")
    return chosen


# ------------------------------------------------------------------------------------------------ the JSON file
def load_results(path: str) -> dict:
    if not os.path.isfile(path):
        return {"settings": None, "runs": []}
    with open(path) as f:
        data = json.load(f)
    data.setdefault("settings", None)
    data.setdefault("runs", [])
    return data


def check_settings(results: dict, settings: dict, path: str) -> None:
    have = results.get("settings")
    if results["runs"] and have is not None and have != settings:
        diff = ", ".join(f"{k} {have.get(k)!r} there vs {settings.get(k)!r} now" for k in sorted({*have, *settings})
                         if have.get(k) != settings.get(k))
        raise BenchError(f"--out {path}: its runs used other settings ({diff}). Fix: the same options, or another "
                         "--out file.")


def pending(results: dict, names: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """The (algorithm, seed) pairs not in the results yet, seed by seed (so one seed's SFT serves its runs)."""
    done = {(r["algorithm"], int(r["seed"])) for r in results["runs"]}
    return [(n, s) for s in seeds for n in names if (n, s) not in done]


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock on the file's folder (flock on the directory: no lock file is left behind)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def append_run(path: str, run: dict, settings: dict) -> dict:
    """Add one finished run to the JSON at `path` atomically (read again under the lock, temporary file, fsync,
    rename), replacing an earlier record of the same (algorithm, seed). Returns the new contents."""
    missing = [k for k in FIELDS if k not in run]
    if missing:
        raise ValueError(f"a run record needs {missing}")
    with _locked(path):
        results = load_results(path)
        check_settings(results, settings, path)
        results["settings"] = settings
        results["machine"] = machine()  # the machine of the latest run appended
        results["runs"] = [r for r in results["runs"] if (r["algorithm"], int(r["seed"])) !=
                           (run["algorithm"], int(run["seed"]))] + [run]
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".algorithms-", suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(results, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return results


# ------------------------------------------------------------------------------------------------ the table
def _mean_sd(values: list) -> tuple[float | None, float | None]:
    values = [float(v) for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def summarize(runs: list[dict], names: list[str] | None = None) -> list[dict]:
    """One row per algorithm (the given names in order, then any other algorithm in the runs): the number of runs,
    its seeds, and mean and sample standard deviation (None below 2 runs) of pass@1 before, after, the gain (after -
    before, paired per run), the final entropy and the wall time."""
    order = list(names or []) + sorted({r["algorithm"] for r in runs} - set(names or []))
    rows = []
    for name in order:
        mine = [r for r in runs if r["algorithm"] == name]
        row = {"algorithm": name, "runs": len(mine), "seeds": sorted(int(r["seed"]) for r in mine)}
        gains = [r["pass_at_1_after"] - r["pass_at_1_before"] for r in mine
                 if r["pass_at_1_after"] is not None and r["pass_at_1_before"] is not None]
        for key, values in (("before", [r["pass_at_1_before"] for r in mine]),
                            ("after", [r["pass_at_1_after"] for r in mine]), ("gain", gains),
                            ("entropy", [r["entropy_final"] for r in mine]), ("wall_s", [r["wall_s"] for r in mine])):
            row[key], row[key + "_sd"] = _mean_sd(values)
        rows.append(row)
    return rows


def _cell(mean, sd, digits: int = 1, signed: bool = False) -> str:
    if mean is None:
        return "–"
    text = f"{mean:+.{digits}f}" if signed else f"{mean:.{digits}f}"
    return text + (f" ± {sd:.{digits}f}" if sd is not None else "")


def format_table(results: dict, names: list[str], seeds: list[int], settings: dict | None = None) -> str:
    """The markdown table of the runs in `results` (mean ± sample std over seeds), headed by how many of the
    len(names) x len(seeds) runs are in and the settings they used (`settings` while the file has none)."""
    table, alias = algorithms(), aliases()
    rows = summarize(results["runs"], names)
    expected = {(n, s) for n in names for s in seeds}
    done = sum(1 for r in results["runs"] if (r["algorithm"], int(r["seed"])) in expected)
    settings = results.get("settings") or settings or {}
    lines = [f"{done} of {len(expected)} runs in ({len(names)} algorithms x seeds {', '.join(map(str, seeds))}; "
             f"RL steps {settings.get('rl_steps', '?')}, SFT steps {settings.get('sft_steps', '?')}). "
             "Held-out pass@1 in %, mean ± sample std over the seeds run; gain = after - before, paired per seed.",
             "",
             "| algorithm | config | runs (seeds) | pass@1 before | pass@1 after | gain | final entropy | wall s |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        name = row["algorithm"] + (f" (= {', '.join(alias[row['algorithm']])})" if row["algorithm"] in alias else "")
        config = describe(table[row["algorithm"]]) if row["algorithm"] in table else "?"
        seeds_run = f"{row['runs']} ({', '.join(map(str, row['seeds']))})" if row["runs"] else "0"
        lines.append(f"| {name} | {config} | {seeds_run} | {_cell(row['before'], row['before_sd'])} | "
                     f"{_cell(row['after'], row['after_sd'])} | {_cell(row['gain'], row['gain_sd'], signed=True)} | "
                     f"{_cell(row['entropy'], row['entropy_sd'], 3)} | {_cell(row['wall_s'], row['wall_s_sd'], 0)} |")
    return "\n".join(lines)


MARK_START, MARK_END = "<!-- algorithms-table:start -->", "<!-- algorithms-table:end -->"


def fill_readme(text: str, table: str) -> str:
    """The page's text (docs/algorithms.md) with the block between the algorithms-table markers replaced by `table`."""
    start, end = text.find(MARK_START), text.find(MARK_END)
    if start < 0 or end < start:
        raise BenchError(f"--docs: the page has no {MARK_START} ... {MARK_END} block. Fix: add the two markers "
                         "where the table goes.")
    return text[:start + len(MARK_START)] + "\n" + table + "\n" + text[end:]


def plot(results: dict, names: list[str], path: str) -> str | None:
    """PNG, two panels per algorithm: held-out pass@1 before and after RL (bars: mean over seeds, lines: lowest to
    highest seed, dots: the runs), and the gain after - before of each run, one colour per seed (paired within a
    seed, so it is not blurred by how well each seed's SFT went)."""
    rows = [r for r in summarize(results["runs"], names) if r["runs"]]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(6.0, 0.45 * len(rows) + 2), 6.5), sharex=True)
    seeds = sorted({int(r["seed"]) for r in results["runs"]})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    try:
        for i, row in enumerate(rows):
            mine = [r for r in results["runs"] if r["algorithm"] == row["algorithm"]]
            for j, (key, color) in enumerate((("pass_at_1_before", "tab:gray"), ("pass_at_1_after", "tab:blue"))):
                values = [r[key] for r in mine if r[key] is not None]
                if not values:
                    continue
                x = i + (j - 0.5) * 0.36
                top.bar(x, statistics.fmean(values), width=0.34, color=color, alpha=0.6,
                        label=("before RL" if j == 0 else "after RL") if i == 0 else None)
                top.vlines(x, min(values), max(values), color="black", linewidth=1)
                top.plot([x] * len(values), values, "k.", markersize=3)
            for r in mine:
                if r["pass_at_1_after"] is not None and r["pass_at_1_before"] is not None:
                    k = seeds.index(int(r["seed"]))
                    bottom.plot(i + 0.1 * (k - (len(seeds) - 1) / 2), r["pass_at_1_after"] - r["pass_at_1_before"],
                                "o", color=colors[k % len(colors)], markersize=4)
        for k, seed in enumerate(seeds):
            bottom.plot([], [], "o", color=colors[k % len(colors)], markersize=4, label=f"seed {seed}")
        top.set_ylabel("held-out pass@1 (%)")
        top.set_ylim(0, 100)
        n = sum(r["runs"] for r in rows)
        top.set_title(f"quickstart task, one SFT checkpoint per seed ({n} runs)", fontsize=9)
        top.legend(loc="upper left", fontsize=8)
        bottom.axhline(0, color="black", linewidth=0.8)
        bottom.set_ylabel("gain (points)")
        bottom.legend(loc="upper left", fontsize=8, ncol=len(seeds))
        bottom.set_xticks(range(len(rows)))
        bottom.set_xticklabels([r["algorithm"] for r in rows], rotation=60, ha="right", fontsize=8)
        for ax in (top, bottom):
            ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fig.savefig(path, dpi=90)
    finally:
        plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------------ running
def _yaml(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def _overrides(config: dict) -> list[str]:
    return [f"{k}={_yaml(v)}" for k, v in config.items()]


def _free_port() -> int:
    from megarl.parallel.env import free_port

    return free_port()


def _megarl(command: str, overrides: list[str], log: str, config: str = CONFIG) -> float:
    """Run `megarl <command> <config> <overrides>` (default configs/quickstart.yaml) on one trainer rank; the wall
    seconds. A failure raises with the end of its log."""
    cmd = [sys.executable, "-m", "megarl.launch.torchrun", "--nproc_per_node", "1", "--master_port",
           str(_free_port()), "-m", "megarl.cli", command, config, *overrides]
    os.makedirs(os.path.dirname(log), exist_ok=True)
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise RuntimeError(f"megarl {command} failed (exit {rc}); log {log}:\n{tail}")
    return wall


def ensure_sft(work: str, seed: int, settings: dict) -> str:
    """The seed's shared SFT checkpoint folder (<work>/seed<S>/sft/checkpoints), trained once."""
    run_dir = os.path.join(work, f"seed{seed}")
    summary = os.path.join(run_dir, "sft", "sft_summary.json")
    if os.path.isfile(summary):
        with open(summary) as f:
            steps = json.load(f)["steps"]
        if steps != settings["sft_steps"]:
            raise BenchError(f"--work {work}: seed {seed}'s SFT ran {steps} steps, not --sft-steps "
                             f"{settings['sft_steps']}. Fix: another --work folder, or the same --sft-steps.")
    else:
        print(f"[algorithms] seed {seed}: SFT cold start ({settings['sft_steps']} steps) -> {run_dir}", flush=True)
        wall = _megarl("sft", [f"run_dir={run_dir}", f"seed={seed}", f"sft.steps={settings['sft_steps']}",
                               *_overrides(SHARED), *settings["set"]], os.path.join(run_dir, "sft.log"))
        print(f"[algorithms] seed {seed}: SFT done in {wall:.0f} s", flush=True)
    return os.path.join(run_dir, "sft", "checkpoints")


def last_entropy(metrics_path: str) -> float | None:
    """The `entropy` metric of the last RL step in metrics.jsonl."""
    value = None
    with open(metrics_path) as f:
        for line in f:
            row = json.loads(line) if line.strip() else {}
            if "entropy" in row:
                value = float(row["entropy"])
    return value


def run_one(name: str, seed: int, work: str, settings: dict, ckpt: str) -> dict:
    """One RL run of `name` from the seed's SFT checkpoint folder `ckpt` (ensure_sft); its record."""
    seed_dir = os.path.join(work, f"seed{seed}")
    run_dir = os.path.join(seed_dir, name)
    shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished earlier attempt: start clean, never resume half a run
    overrides = [f"run_dir={run_dir}", f"seed={seed}", "model.tiny=null",
                 f"model.path={os.path.join(seed_dir, 'base-model')}", f"model.load={ckpt}", "sft.steps=0",
                 f"rl.steps={settings['rl_steps']}", *_overrides(SHARED), *_overrides(algorithms()[name]),
                 *settings["set"]]
    print(f"[algorithms] {name} seed {seed}: RL {settings['rl_steps']} steps -> {run_dir}", flush=True)
    wall = _megarl("train", overrides, os.path.join(seed_dir, f"{name}.log"))
    with open(os.path.join(run_dir, "rl_summary.json")) as f:
        summary = json.load(f)
    return {"algorithm": name, "seed": seed, "pass_at_1_before": summary["pass_at_1_before"],
            "pass_at_1_after": summary["pass_at_1_after"],
            "entropy_final": last_entropy(os.path.join(run_dir, "metrics.jsonl")), "wall_s": round(wall, 1),
            "config": algorithms()[name]}


def _quickstart_steps(section: str) -> int:
    import yaml

    with open(CONFIG) as f:
        return int(yaml.safe_load(f)[section]["steps"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--algorithms", help="comma-separated names (default: all; see --list)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: the quickstart's)")
    p.add_argument("--sft-steps", type=int, default=None, help="SFT steps per seed (default: the quickstart's)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="one more config override for every SFT and RL run (recorded in the settings)")
    p.add_argument("--out", default=OUT, help="the results JSON (default benchmarks/results/algorithms.json)")
    p.add_argument("--work", default=WORK, help="folder of the SFT and RL run folders (default runs/bench-algorithms)")
    p.add_argument("--plot", default=None, help="the PNG (default: next to --out, <out>.png)")
    p.add_argument("--table", action="store_true", help="run nothing: print the table (and plot) from the JSON")
    p.add_argument("--docs", "--readme", dest="docs", action="store_true",
                   help="also write the table into docs/algorithms.md's algorithms block (--readme: the old name)")
    p.add_argument("--list", action="store_true", help="print each algorithm and the config it maps to, and exit")
    args = p.parse_args(argv)
    try:
        names = select(args.algorithms)
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
        if args.list:
            alias = aliases()
            for n, config in algorithms().items():
                print(f"{n:28s} {' '.join(_overrides(config))}" + (f"   (also: {', '.join(alias[n])})"
                                                                   if n in alias else ""))
            for n, why in EXCLUDED.items():
                print(f"{n:28s} excluded: {why}")
            return 0
        settings = {"rl_steps": args.steps if args.steps is not None else _quickstart_steps("rl"),
                    "sft_steps": args.sft_steps if args.sft_steps is not None else _quickstart_steps("sft"),
                    "set": list(args.set)}
        for value, flag in ((settings["rl_steps"], "--steps"), (settings["sft_steps"], "--sft-steps")):
            if value < 1:
                raise BenchError(f"{flag}={value} must be >= 1. Fix: e.g. {flag} 2 for a smoke test.")
        out = os.path.abspath(args.out)
        results, failed = load_results(out), []
        if not args.table:
            check_settings(results, settings, out)
            todo = pending(results, names, seeds)
            print(f"[algorithms] {len(todo)} of {len(names) * len(seeds)} runs to do -> {out}", flush=True)
            work = os.path.abspath(args.work)
            for name, seed in todo:
                ckpt = ensure_sft(work, seed, settings)  # a failed SFT stops the sweep: every run of the seed needs it
                try:
                    results = append_run(out, run_one(name, seed, work, settings, ckpt), settings)
                except RuntimeError as e:  # one algorithm that fails does not stop the others; it is retried next time
                    failed.append(f"{name} seed {seed}")
                    print(f"[algorithms] FAILED {name} seed {seed}: {e}", file=sys.stderr, flush=True)
        table = format_table(results, names, seeds, settings)
        print(table)
        png = plot(results, names, args.plot or os.path.splitext(out)[0] + ".png")
        if png:
            print(f"[algorithms] plot {png}")
        if args.docs:
            with open(DOC) as f:
                text = f.read()
            with open(DOC, "w") as f:
                f.write(fill_readme(text, table))
            print(f"[algorithms] table written into {DOC}")
        if failed:
            print(f"[algorithms] {len(failed)} runs failed (not recorded; run again to retry): {', '.join(failed)}",
                  file=sys.stderr)
            return 1
    except BenchError as e:
        print(f"benchmarks/algorithms.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
