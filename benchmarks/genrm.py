"""Models judging models on CPU (issue 17's demonstrations): a generative verifier trained to judge the quickstart's
arithmetic, a generator trained only on that verifier's scores, and on-policy distillation from an RL-trained teacher.

    .venv/bin/python benchmarks/genrm.py              # every stage not done yet (resumable; ~1 hour on 2 cores)
    .venv/bin/python benchmarks/genrm.py --table      # only print the table and plot from the JSON

Stages, in <work> (default runs/bench-genrm/seed<S>), each skipped when its result is already there:
1. generator SFT: the quickstart's 400-step SFT cold start (shared with benchmarks/algorithms.py's layout).
2. exact: GRPO from that checkpoint with the exact checker as reward (the quickstart's RL run, held-out pass@1 every
   --eval-every steps). Its final policy is also the OPD teacher.
3. judge data: verification requests "37+58=95" for the training problems and, held out, for the 100 held-out
   problems the generator never sees; half carry the right answer (label 1), half a wrong one (label 0): off by 1-3
   (the SFT policy's typical slip), by 10 or 20 (a dropped or extra carry), or any other number.
4. verifier: a tiny model of the generator's shape, SFT from random weights on demonstrations that state the verifier's
   own sum, the solution's answer beside it, then the score ("95 vs 94 Score: 0"): an analysis ending in a score, as
   DeepSeekMath-V2's verifier writes (here reduced to a sum and a comparison). Optionally (--verifier-rl-steps) RL on
   the labelled training requests with the verifier_agreement reward (1 - |score - label|, 0 without a score), as
   DeepSeekMath-V2 trains its verifier. Accuracy: `megarl eval` on the held-out requests with that reward, one greedy
   analysis each (and the RL run's held-out curve).
5. judge: the same GRPO run as `exact`, but reward.name=judge: the verifier, served by its own SGLang pool, reads
   "{prompt}{response}" (no reference answer) and its parsed score is the reward; held-out pass@1 is still measured by
   the exact checker (reward.eval_name=exact_match), and eval/train_reward_false_pass counts the held-out samples the
   verifier passes that the checker fails (reward hacking would show as that share rising).
6. meta-verifier: the same recipe as the verifier, on meta-verification requests "37+58=94|94 vs 94 Score: 1" (the
   request, then an analysis of it): half faithful analyses (quality 1), half the verifier's slip (quality 0: a wrong
   number taken for its own sum, e.g. the solution's wrong answer, which passes a wrong solution). It writes its own
   sum, the analysis's sum, then the quality ("95 vs 94 Score: 0").
7. judge-meta: the judge run with reward = verifier score x the meta-verifier's quality of that analysis
   (reward.judge.meta_verifier, DeepSeekMath-V2's multiplicative rule): does it pass fewer wrong answers?
8. opd: the student starts from the same SFT checkpoint; advantage_estimator=opd with the `exact` run's final policy
   as teacher (its own SGLang server, prefill-only log-prob requests), no task reward, no dynamic sampling (every
   group carries a signal). Two runs: `opd`, the sampled token's reverse-KL advantage with the quickstart's 32
   prompts x 8 samples; and the recipe (run opd-top{k}[-forward]-n{n}[-lr{lr}]: --opd-top-k, --opd-top-k-kl,
   --opd-samples, --opd-lr), by default the exact reverse KL over the teacher's top-8 + rest (algorithm.opd_top_k: 8)
   on 256 prompts x 1 sample per step: the same samples per step, but 8x the distinct prompts, whose first answer
   token (the position that decides most answers) is otherwise distilled 8 times over on the same prefix.

benchmarks/results/genrm.json: verifier_accuracy (%), generator_gain_judge / generator_gain_exact (held-out pass@1
after - before, points, exact checker), teacher_pass_at_1, opd_student_pass_at_1 (the student's final), opd_steps /
grpo_steps (the first evaluated step whose held-out pass@1 is within 5 points of the teacher's final; None: never),
opd_sampled_* (the `opd` run), opd_variants (every finished OPD run folder in the work folder, e.g. earlier settings:
final and best pass@1, steps to within 5 points), plus the curves and settings; the plot: benchmarks/results/genrm.png.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
from machine import machine  # noqa: E402  (benchmarks/machine.py: the machine, for the JSON)

from algorithms import BenchError, _megarl, _quickstart_steps, ensure_sft  # noqa: E402

OUT = os.path.join(HERE, "results", "genrm.json")
WORK = os.path.join(ROOT, "runs", "bench-genrm")
COMMON = ["logging.wandb=disabled", "logging.progress=false"]
# the verifier's judge call: the request is the problem and the solution, nothing else (no reference answer)
JUDGE_TEMPLATE = "{prompt}{response}"
META_TEMPLATE = "{prompt}{response}|{analysis}"  # the meta-verifier: the request, then the verifier's analysis
WITHIN = 5.0  # OPD's target: held-out pass@1 within this many points of the teacher's
VERIFIER_TOKENS = 24  # "195 vs 194 Score: 0" and the end token


# ------------------------------------------------------------------------------------------------ verifier data
def wrong_answer(right: int, rng: random.Random) -> int:
    """A wrong sum: off by 1-3 (the SFT policy's slip), by 10 or 20 (a carry error), or any other number 0..198."""
    kind = rng.random()
    if kind < 0.4:
        wrong = right + rng.choice([-3, -2, -1, 1, 2, 3])
    elif kind < 0.7:
        wrong = right + rng.choice([-20, -10, 10, 20])
    else:
        wrong = rng.randint(0, 198)
    return wrong if wrong >= 0 and wrong != right else wrong_answer(right, rng)


def verification_rows(problems: list[dict], seed: int) -> list[dict]:
    """One request per problem: {"prompt": "37+58=94", "answer": "0", "sum": "95", "shown": "94"} (half right, half
    wrong)."""
    rng = random.Random(seed)
    rows = []
    for p in problems:
        right = int(p["answer"])
        label = rng.random() < 0.5
        shown = right if label else wrong_answer(right, rng)
        rows.append({"prompt": f"{p['prompt']}{shown}", "answer": "1" if label else "0", "sum": str(right),
                     "shown": str(shown)})
    return rows


def verifier_analysis(row: dict) -> str:
    """The verifier's demonstration: its own sum, the solution's answer beside it, then the score."""
    return f"{row['sum']} vs {row['shown']} Score: {row['answer']}"


def meta_rows(requests: list[dict], seed: int) -> list[dict]:
    """Meta-verification requests from verification requests: the request, then an analysis of it, labelled 1 when
    the analysis is faithful (its sum is the true sum, its score follows from it) and 0 when it makes the verifier's
    slip: it takes a wrong number for its own sum (the solution's answer when that is wrong, which passes a wrong
    solution; another number when the solution is right, which fails it). Half each. {"prompt":
    "37+58=94|94 vs 94 Score: 1", "answer": "0", "sum": "95", "claimed": "94"}."""
    rng = random.Random(seed)
    rows = []
    for r in requests:
        right, shown, label = int(r["sum"]), int(r["shown"]), int(r["answer"])
        own = right if rng.random() < 0.5 else (shown if not label else wrong_answer(right, rng))
        analysis = f"{own} vs {shown} Score: {int(own == shown)}"
        rows.append({"prompt": f"{r['prompt']}|{analysis}", "answer": str(int(own == right)), "sum": r["sum"],
                     "claimed": str(own)})
    return rows


def meta_analysis(row: dict) -> str:
    """The meta-verifier's demonstration: its own sum, the analysis's sum beside it, then the quality."""
    return f"{row['sum']} vs {row['claimed']} Score: {row['answer']}"


def write_judge_data(folder: str, rows: dict[str, list[dict]], demo) -> dict[str, str]:
    """sft.jsonl (chat demonstrations: the request, then demo(row)), train.jsonl and heldout.jsonl (requests with
    their labels) in `folder`."""
    os.makedirs(folder, exist_ok=True)
    paths = {name: os.path.join(folder, f"{name}.jsonl") for name in ("sft", "train", "heldout")}
    sft = [{"messages": [{"role": "user", "content": r["prompt"]}, {"role": "assistant", "content": demo(r)}]}
           for r in rows["train"]]
    for name, items in (("sft", sft), ("train", [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows["train"]]),
                        ("heldout", [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows["heldout"]])):
        with open(paths[name], "w") as f:
            f.writelines(json.dumps(item) + "\n" for item in items)
    return paths


def write_verifier_data(folder: str, synthetic) -> tuple[dict[str, str], dict[str, str]]:
    """The verifier's and the meta-verifier's data (write_judge_data) in <folder>/verifier and <folder>/meta, from the
    synthetic arithmetic splits: held-out requests are about the held-out problems only."""
    from megarl.data.synthetic import synthetic_splits

    train, held_out = synthetic_splits(synthetic)
    rows = {"train": [r for k in range(4) for r in verification_rows(train, 11 + k)],  # four requests per problem
            "heldout": verification_rows(held_out, 21) + verification_rows(held_out, 22)}
    meta = {"train": meta_rows(rows["train"], 31), "heldout": meta_rows(rows["heldout"], 32)}
    return (write_judge_data(os.path.join(folder, "verifier"), rows, verifier_analysis),
            write_judge_data(os.path.join(folder, "meta"), meta, meta_analysis))


# ------------------------------------------------------------------------------------------------ runs
def read_json(path: str) -> dict | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def eval_curve(run_dir: str) -> dict[int, dict]:
    """step -> the held-out metrics logged at that step (eval/..., the last record of a step wins)."""
    curve: dict[int, dict] = {}
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            row = json.loads(line) if line.strip() else {}
            if "eval/pass_at_1" in row:
                curve[int(row["step"])] = {k: v for k, v in row.items() if k.startswith("eval/")}
    return curve


def rl_run(name: str, work: str, seed: int, steps: int, eval_every: int, overrides: list[str]) -> dict:
    """A generator RL run from the seed's SFT checkpoint (once; a finished run's summary is reused)."""
    run_dir = os.path.join(work, name)
    summary = read_json(os.path.join(run_dir, "rl_summary.json"))
    if summary is None or summary["steps"] != steps:
        print(f"[genrm] {name}: RL {steps} steps -> {run_dir}", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)  # an unfinished earlier attempt: start clean, never resume half a run
        wall = _megarl("train", [f"run_dir={run_dir}", f"seed={seed}", "model.tiny=null",
                                 f"model.path={os.path.join(work, 'base-model')}",
                                 f"model.load={os.path.join(work, 'sft', 'checkpoints')}", "sft.steps=0",
                                 f"rl.steps={steps}", f"rl.eval_every={eval_every}", *COMMON, *overrides],
                       os.path.join(work, f"{name}.log"))
        summary = read_json(os.path.join(run_dir, "rl_summary.json"))
        summary["bench_wall_s"] = round(wall, 1)
        with open(os.path.join(run_dir, "rl_summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
    return {"summary": summary, "curve": eval_curve(run_dir), "hf": os.path.join(run_dir, "hf")}


def judge_accuracy(work: str, seed: int, role: str, data: dict, model: str, name: str) -> dict:
    """Held-out accuracy of the judge HF folder `model` (role: verifier or meta): `megarl eval` with the
    verifier_agreement reward, one greedy analysis per held-out request (<work>/<role>/<name>/eval.json)."""
    out = os.path.join(work, role, name)
    result = read_json(os.path.join(out, "eval.json"))
    if result is None:
        print(f"[genrm] {role}: held-out accuracy of {model}", flush=True)
        _megarl("eval", [f"run_dir={os.path.join(work, role, name + '-run')}", f"seed={seed}",
                         "model.tiny=null", f"model.path={model}", "model.load=null", f"data.train={data['train']}",
                         f"data.eval={data['heldout']}", "reward.name=verifier_agreement", "rl.eval_samples=1",
                         "rl.eval_temperature=0.0", f"rollout.max_new_tokens={VERIFIER_TOKENS}", *COMMON,
                         "--out", out],
                os.path.join(work, f"{role}-{name}.log"))
        result = read_json(os.path.join(out, "eval.json"))
    return {"accuracy": result["eval/pass_at_1"], "requests": result["eval/prompts"]}


def train_judge(work: str, seed: int, role: str, data: dict, sft_steps: int, rl_steps: int = 0) -> tuple[str, dict]:
    """A judge model (role: verifier or meta): SFT from random weights, then (rl_steps > 0) RL on the labelled
    requests (reward verifier_agreement, as DeepSeekMath-V2 trains its verifier); its HF folder and held-out
    accuracy."""
    run_dir = os.path.join(work, role)
    sft_hf = os.path.join(run_dir, "sft", "hf")
    if not os.path.isfile(os.path.join(run_dir, "sft", "sft_summary.json")):
        print(f"[genrm] {role}: SFT {sft_steps} steps -> {run_dir}", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        _megarl("sft", [f"run_dir={run_dir}", f"seed={seed}", f"sft.data={data['sft']}", f"sft.steps={sft_steps}",
                        f"data.train={data['train']}", "checkpoint.export_hf=true", *COMMON],
                os.path.join(work, f"{role}-sft.log"))
    after_sft = judge_accuracy(work, seed, role, data, sft_hf, "eval-sft")
    result = {"sft_accuracy": after_sft["accuracy"], "accuracy": after_sft["accuracy"],
              "requests": after_sft["requests"], "rl_steps": rl_steps}
    if not rl_steps:
        return sft_hf, result
    rl_dir = os.path.join(run_dir, "rl")
    summary = read_json(os.path.join(rl_dir, "rl_summary.json"))
    if summary is None or summary["steps"] != rl_steps:
        print(f"[genrm] {role}: RL {rl_steps} steps (verifier_agreement) -> {rl_dir}", flush=True)
        shutil.rmtree(rl_dir, ignore_errors=True)
        _megarl("train", [f"run_dir={rl_dir}", f"seed={seed}", "model.tiny=null",
                          f"model.path={os.path.join(run_dir, 'base-model')}",
                          f"model.load={os.path.join(run_dir, 'sft', 'checkpoints')}", "sft.steps=0",
                          f"data.train={data['train']}", f"data.eval={data['heldout']}",
                          "reward.name=verifier_agreement", f"rl.steps={rl_steps}", "rl.eval_every=10",
                          "rl.eval_samples=1", "rl.eval_temperature=0.0",
                          f"rollout.max_new_tokens={VERIFIER_TOKENS}", "checkpoint.export_hf=true", *COMMON],
                os.path.join(work, f"{role}-rl.log"))
    curve = eval_curve(rl_dir)
    result.update(accuracy=curve[max(curve)]["eval/pass_at_1"],
                  rl_curve={str(k): v["eval/pass_at_1"] for k, v in sorted(curve.items())})
    return os.path.join(rl_dir, "hf"), result


def judge_overrides(verifier: str, meta: str | None = None) -> list[str]:
    """The judge run: the verifier's greedy score of "{prompt}{response}" is the reward (times the meta-verifier's
    greedy quality score of that analysis, given a meta-verifier); the exact checker evaluates."""
    out = ["reward.name=judge", "reward.eval_name=exact_match", f"pools.verifier.model={verifier}",
           "reward.judge.pool=verifier", f'reward.judge.template="{JUDGE_TEMPLATE}"', "reward.judge.n=1",
           "reward.judge.temperature=0.0", f"reward.judge.max_new_tokens={VERIFIER_TOKENS}",
           "checkpoint.export_hf=false"]
    if meta is not None:
        out += [f"pools.meta.model={meta}", "reward.judge.meta_verifier.pool=meta",
                f'reward.judge.meta_verifier.template="{META_TEMPLATE}"', "reward.judge.meta_verifier.n=1",
                "reward.judge.meta_verifier.temperature=0.0",
                f"reward.judge.meta_verifier.max_new_tokens={VERIFIER_TOKENS}"]
    return out


def opd_overrides(teacher: str, top_k: int = 0) -> list[str]:
    """The OPD run: distillation to the teacher only (top_k 0: the sampled token's reverse-KL advantage; k > 0: the
    exact reverse KL over the teacher's top-k at every position, algorithm.opd_top_k); every group trains (no
    dynamic sampling)."""
    return ["algorithm.advantage_estimator=opd", f"algorithm.opd_top_k={top_k}", f"teacher.model={teacher}",
            "rollout.dynamic_sampling=false", "reward.name=exact_match", "checkpoint.export_hf=false"]


def opd_variants(work: str, teacher: float) -> dict[str, dict]:
    """Every finished OPD run in `work` (run folders opd*: this benchmark's OPD runs under other --opd-* settings,
    named by them): final and best held-out pass@1, the first evaluated step within WITHIN points of the teacher."""
    out = {}
    for name in sorted(os.listdir(work)):
        summary = read_json(os.path.join(work, name, "rl_summary.json"))
        if not name.startswith("opd") or summary is None:
            continue
        curve = eval_curve(os.path.join(work, name))
        out[name] = {"steps": summary["steps"], "after": summary["pass_at_1_after"],
                     "best": max(v["eval/pass_at_1"] for v in curve.values()),
                     "steps_within": steps_to(curve, teacher - WITHIN), "wall_s": summary.get("bench_wall_s")}
    return out


def steps_to(curve: dict[int, dict], target: float) -> int | None:
    """The first evaluated step whose held-out pass@1 reaches `target`."""
    return next((s for s in sorted(curve) if curve[s]["eval/pass_at_1"] >= target), None)


# ------------------------------------------------------------------------------------------------ report
def report(results: dict) -> str:
    r = results
    lines = ["| measure | value |", "|---|---|",
             f"| verifier held-out accuracy (greedy, {r['verifier_requests']} requests, half wrong)"
             + (f": after SFT -> after {r['verifier']['rl_steps']} RL steps | {r['verifier']['sft_accuracy']:.1f}% -> "
                if r["verifier"]["rl_steps"] else " | ") + f"**{r['verifier_accuracy']:.1f}%** |",
             f"| generator, exact reward: held-out pass@1 before -> after | {r['exact']['before']:.1f} -> "
             f"{r['exact']['after']:.1f} (**{r['generator_gain_exact']:+.1f}**) |",
             f"| generator, verifier's score as reward: before -> after (exact checker) | {r['judge']['before']:.1f} -> "
             f"{r['judge']['after']:.1f} (**{r['generator_gain_judge']:+.1f}**) |",
             f"| meta-verifier held-out accuracy (greedy, {r['meta_verifier']['requests']} analyses, half unfaithful) | "
             f"{r['meta_verifier']['accuracy']:.1f}% |",
             f"| generator, verifier x meta-verifier as reward: before -> after (exact checker) | "
             f"{r['judge_meta']['before']:.1f} -> {r['judge_meta']['after']:.1f} "
             f"(**{r['judge_meta']['after'] - r['judge_meta']['before']:+.1f}**) |",
             *[f"| {label}: held-out samples the judge passes and the checker fails, first -> last evaluation (mean) | "
               f"{r[k]['false_pass_first']:.1f}% -> {r[k]['false_pass_last']:.1f}% ({r[k]['false_pass_mean']:.1f}%) |"
               for k, label in (("judge", "verifier"), ("judge_meta", "verifier x meta-verifier"))],
             f"| teacher (the exact run's final policy) held-out pass@1 | {r['teacher_pass_at_1']:.1f} |",
             f"| OPD student (top-{r['settings']['opd_top_k']} {r['settings']['opd_top_k_kl']} KL, "
             f"{r['settings']['opd_samples_per_prompt']} sample(s) per prompt) held-out pass@1 (final) | "
             f"{r['opd_student_pass_at_1']:.1f} |",
             f"| OPD student (sampled-token reverse-KL advantage) held-out pass@1 (final) | "
             f"{r['opd_sampled_student_pass_at_1']:.1f} |",
             f"| steps to within {WITHIN:g} points of the teacher: OPD top-k / OPD sampled / GRPO | {r['opd_steps']} / "
             f"{r['opd_sampled_steps']} / {r['grpo_steps']} |", "",
             "| OPD run | held-out pass@1 final (best) | steps to within 5 of the teacher |", "|---|---|---|",
             *[f"| {name} | {v['after']:.1f} ({v['best']:.1f}) | {v['steps_within']} |"
               for name, v in r.get("opd_variants", {}).items()]]
    return "\n".join(lines)


def plot(results: dict, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        for name, label, style in (("exact", "GRPO, exact reward", "-o"), ("judge", "GRPO, verifier's score", "-s"),
                                   ("judge_meta", "GRPO, verifier x meta-verifier", "-d"),
                                   ("opd", "OPD, the recipe: top-{opd_top_k} {opd_top_k_kl} KL, {opd_samples_per_prompt} sample(s) per "
                                    "prompt".format(**results["settings"]), "-^"),
                                   ("opd_sampled", "OPD, sampled-token advantage", "-v")):
            curve = {int(k): v for k, v in results[name]["curve"].items()}
            steps = sorted(curve)
            ax.plot(steps, [curve[s]["eval/pass_at_1"] for s in steps], style, markersize=3, label=label)
            if name == "judge":
                ax.plot(steps, [curve[s]["eval/train_reward_pass_at_1"] for s in steps], ":",
                        color=ax.lines[-1].get_color(), label="the verifier's pass rate of those held-out samples")
        ax.axhline(results["teacher_pass_at_1"], color="gray", linewidth=0.8, linestyle="--", label="teacher")
        ax.set_xlabel("RL step")
        ax.set_ylabel("held-out pass@1 (%, exact checker)")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
        fig.tight_layout()
        fig.savefig(path, dpi=90)
    finally:
        plt.close(fig)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None, help="RL steps of each generator run (default: the quickstart's)")
    p.add_argument("--opd-steps", type=int, default=None, help="OPD steps (default: --steps)")
    p.add_argument("--opd-top-k", type=int, default=8,
                   help="the top-k OPD run's algorithm.opd_top_k (default 8; the sampled-token OPD run is beside it)")
    p.add_argument("--opd-top-k-kl", default="reverse", choices=["reverse", "forward"],
                   help="the top-k OPD run's algorithm.opd_top_k_kl (default reverse)")
    p.add_argument("--opd-samples", type=int, default=1,
                   help="the top-k OPD run's samples per prompt, the prompts per step scaled to keep the quickstart's "
                        "samples per step (default 1: 256 prompts x 1 sample; distillation needs no groups)")
    p.add_argument("--opd-lr", type=float, default=None,
                   help="the top-k OPD run's optim.lr (default: the quickstart's RL lr, as every other run)")
    p.add_argument("--eval-every", type=int, default=10, help="held-out evaluation every N RL steps (default 10)")
    p.add_argument("--verifier-sft-steps", type=int, default=2000, help="the verifier's SFT steps (default 2000)")
    p.add_argument("--verifier-rl-steps", type=int, default=0,
                   help="the verifier's RL steps after its SFT (default 0: SFT only)")
    p.add_argument("--work", default=WORK, help="folder of the runs (default runs/bench-genrm)")
    p.add_argument("--out", default=OUT, help="the results JSON (default benchmarks/results/genrm.json)")
    p.add_argument("--table", action="store_true", help="run nothing: print the table and plot from the JSON")
    args = p.parse_args(argv)
    out = os.path.abspath(args.out)
    png = os.path.splitext(out)[0] + ".png"
    try:
        if args.table:
            results = read_json(out)
            if results is None:
                raise BenchError(f"--table: {out} does not exist. Fix: run the benchmark first (without --table).")
            print(report(results))
            print(f"plot: {plot(results, png)}")
            return 0
        steps = args.steps or _quickstart_steps("rl")
        opd_steps = args.opd_steps or steps
        work = os.path.join(os.path.abspath(args.work), f"seed{args.seed}")
        ensure_sft(os.path.abspath(args.work), args.seed, {"sft_steps": _quickstart_steps("sft"), "set": []})
        exact = rl_run("exact", work, args.seed, steps, args.eval_every, ["reward.name=exact_match",
                                                                          "checkpoint.export_hf=true"])
        from megarl.config import load_config
        from megarl.trainer.config import TrainConfig

        synthetic = load_config(TrainConfig, os.path.join(ROOT, "configs", "quickstart.yaml"), []).data.synthetic
        data, meta_data = write_verifier_data(os.path.join(work, "judge-data"), synthetic)
        verifier_hf, verifier = train_judge(work, args.seed, "verifier", data, args.verifier_sft_steps,
                                            args.verifier_rl_steps)
        judge = rl_run("judge", work, args.seed, steps, args.eval_every, judge_overrides(verifier_hf))
        meta_hf, meta = train_judge(work, args.seed, "meta", meta_data, args.verifier_sft_steps)
        judge_meta = rl_run("judge-meta", work, args.seed, steps, args.eval_every,
                            judge_overrides(verifier_hf, meta_hf))
        opd_sampled = rl_run("opd", work, args.seed, opd_steps, args.eval_every, opd_overrides(exact["hf"]))
        rollout = load_config(TrainConfig, os.path.join(ROOT, "configs", "quickstart.yaml"), []).rollout
        per_step = rollout.prompts_per_step * rollout.n_samples
        opd_samples = args.opd_samples or rollout.n_samples
        opd = rl_run(f"opd-top{args.opd_top_k}" + ("-forward" if args.opd_top_k_kl == "forward" else "") +
                     (f"-n{opd_samples}" if args.opd_samples else "") + (f"-lr{args.opd_lr:g}" if args.opd_lr else ""),
                     work, args.seed, opd_steps, args.eval_every,
                     opd_overrides(exact["hf"], args.opd_top_k) + [f"algorithm.opd_top_k_kl={args.opd_top_k_kl}"] +
                     ([f"rollout.n_samples={opd_samples}", f"rollout.prompts_per_step={per_step // opd_samples}"]
                      if args.opd_samples else []) + ([f"optim.lr={args.opd_lr}"] if args.opd_lr else []))
        teacher = exact["summary"]["pass_at_1_after"]
        results = {
            "verifier_accuracy": verifier["accuracy"],
            "verifier_requests": verifier["requests"],
            "verifier": verifier,
            "meta_verifier": meta,
            "generator_gain_judge": judge["summary"]["pass_at_1_after"] - judge["summary"]["pass_at_1_before"],
            "generator_gain_exact": exact["summary"]["pass_at_1_after"] - exact["summary"]["pass_at_1_before"],
            "opd_student_pass_at_1": opd["summary"]["pass_at_1_after"],
            "teacher_pass_at_1": teacher,
            "opd_steps": steps_to(opd["curve"], teacher - WITHIN),
            "opd_sampled_student_pass_at_1": opd_sampled["summary"]["pass_at_1_after"],
            "opd_sampled_steps": steps_to(opd_sampled["curve"], teacher - WITHIN),
            "opd_variants": opd_variants(work, teacher),
            "grpo_steps": steps_to(exact["curve"], teacher - WITHIN),
            "settings": {"seed": args.seed, "rl_steps": steps, "opd_rl_steps": opd_steps, "eval_every": args.eval_every,
                         "verifier_sft_steps": args.verifier_sft_steps,
                         "verifier_rl_steps": args.verifier_rl_steps, "within_points": WITHIN,
                         "judge_template": JUDGE_TEMPLATE, "opd_top_k": args.opd_top_k,
                         "opd_top_k_kl": args.opd_top_k_kl, "opd_samples_per_prompt": opd_samples,
                         "opd_lr": args.opd_lr},
        }
        for name, run in (("exact", exact), ("judge", judge), ("judge_meta", judge_meta), ("opd", opd),
                          ("opd_sampled", opd_sampled)):
            curve = run["curve"]
            results[name] = {"before": run["summary"]["pass_at_1_before"], "after": run["summary"]["pass_at_1_after"],
                             "wall_s": run["summary"].get("bench_wall_s"),
                             "curve": {str(k): v for k, v in sorted(curve.items())}}
            if name.startswith("judge"):  # the judge's passes the checker fails, on held-out samples, first and last
                false_pass = [curve[k]["eval/train_reward_false_pass"] for k in sorted(curve)]
                results[name].update(false_pass_first=false_pass[0], false_pass_last=false_pass[-1],
                                     false_pass_mean=statistics.fmean(false_pass))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        results["machine"] = machine()
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
        print(report(results))
        print(f"-> {out}\nplot: {plot(results, png)}")
        return 0
    except BenchError as e:
        print(f"genrm: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
