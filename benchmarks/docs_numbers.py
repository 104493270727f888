"""The numbers in README.md and docs/*.md, from the committed JSON under benchmarks/results/.

    .venv/bin/python benchmarks/docs_numbers.py            # rewrite every generated block from its JSON
    .venv/bin/python benchmarks/docs_numbers.py --check    # change nothing; list stale blocks and wrong quotes, exit 1

A result reaches a document in one of two forms, and tests/docs/test_docs.py checks both:

1. A generated block (tables, mostly):

       <!-- generated: NAME from benchmarks/results/FILE.json by benchmarks/docs_numbers.py -->
       ...
       <!-- end generated -->

   Its content is exactly GENERATORS[NAME](the JSON). Edit the generator, never the block; this script rewrites
   the blocks. (docs/algorithms.md's algorithm table is benchmarks/algorithms.py's own block, checked the same way.)

2. An inline quote: a number in prose followed at once (after its unit, if any: %, x, s, ...) by a comment naming
   the JSON and an expression over it:

       gains **+24.5**<!-- quickstart.json: runs[seed=0].pass_at_1_after - runs[seed=0].pass_at_1_before -->

   The number as written must equal the expression's value rounded to as many decimals as the text shows (a `+`
   in the text asks for a value >= 0). The comment does not render. Expressions: paths (`a.b`, `a["key-with-dash"]`,
   `a[0]`, `runs[seed=0,partial=true]`: the one element of a list whose fields have those values), numbers,
   + - * / and parentheses.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
DOCUMENTS = ["README.md", *sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                                  if f.endswith(".md")), "benchmarks/README.md"]

BLOCK = re.compile(r"<!-- generated: (?P<name>[\w-]+) from benchmarks/results/(?P<file>[\w.-]+\.json) "
                   r"by benchmarks/docs_numbers.py -->\n(?P<body>.*?)<!-- end generated -->", re.S)
QUOTE = re.compile(r"<!-- (?P<file>[\w.-]+\.json): (?P<expr>.+?) -->")
# the number a quote refers to: the last one before the comment, after an optional unit and bold markers
NUMBER_BEFORE = re.compile(r"(?P<sign>[+\-−]?)(?P<num>\d[\d,]*(?:\.\d+)?)"
                           r"(?P<unit>\s?(?:%|x|×|s|ms|GB/s|GB|MB|k|points?|min|minutes|hours?))?\**\)?$")


class DocsError(Exception):
    pass


def load(file: str) -> dict:
    with open(os.path.join(RESULTS, file)) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------ expressions
_SEGMENT = re.compile(r"\.([A-Za-z_]\w*)|\[([^\]]*)\]")
_TOKEN = re.compile(r"\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<op>[-+*/()])|"
                    r"(?P<path>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*|\[[^\]]*\])*))")


def _literal(text: str):
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        return text


def resolve(data, path: str):
    """The value at `path` (see the module docstring) in `data`."""
    head = re.match(r"[A-Za-z_]\w*", path)
    value, rest = data[head.group(0)], path[head.end():]
    pos = 0
    while pos < len(rest):
        m = _SEGMENT.match(rest, pos)
        if not m:
            raise DocsError(f"bad path {path!r} at {rest[pos:]!r}")
        pos = m.end()
        if m.group(1) is not None:
            value = value[m.group(1)]
            continue
        inner = m.group(2).strip()
        if inner.startswith('"'):
            value = value[json.loads(inner)]
        elif re.fullmatch(r"-?\d+", inner) and isinstance(value, list):
            value = value[int(inner)]
        elif "=" in inner:
            want = {k.strip(): _literal(v) for k, v in (part.split("=", 1) for part in inner.split(","))}
            found = [x for x in value if all(x.get(k) == v for k, v in want.items())]
            if len(found) != 1:
                raise DocsError(f"{path!r}: {len(found)} elements match [{inner}], need exactly one")
            value = found[0]
        else:
            value = value[inner]
    return value


def evaluate(data, expr: str) -> float:
    """The value of `expr`: paths into `data`, numbers, + - * / and parentheses."""
    parts, pos = [], 0
    while pos < len(expr.rstrip()):
        m = _TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            raise DocsError(f"cannot read {expr!r} at {expr[pos:]!r}")
        pos = m.end()
        if m.group("path"):
            value = resolve(data, m.group("path"))
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise DocsError(f"{m.group('path')!r} is {value!r}, not a number")
            parts.append(repr(float(value)))
        else:
            parts.append(m.group("num") or m.group("op"))
    tree = ast.parse(" ".join(parts), mode="eval")
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Expression, ast.BinOp, ast.UnaryOp, ast.Constant, ast.operator, ast.unaryop)):
            raise DocsError(f"{expr!r}: only numbers and + - * / ( ) are allowed")
    return float(eval(compile(tree, "<quote>", "eval"), {"__builtins__": {}}))


def check_number(written: str, sign: str, value: float) -> str | None:
    """None if `sign` + `written` (e.g. "+", "24.5") is `value` as the text rounds it, else what it should be."""
    decimals = len(written.split(".")[1]) if "." in written else 0
    expected = f"{abs(value):,.{decimals}f}" if "," in written else f"{abs(value):.{decimals}f}"
    negative = sign in ("-", "−")
    if expected == written and (negative == (value < 0) or float(expected.replace(",", "")) == 0):
        return None
    return f"{'-' if value < 0 else ('+' if sign == '+' else '')}{expected}"


def quotes(text: str):
    """(number as written with its sign, file, expr, position) of every inline quote in `text`."""
    for m in QUOTE.finditer(text):
        before = NUMBER_BEFORE.search(text[max(0, m.start() - 40):m.start()])
        yield (before.group("sign") if before else None, before.group("num") if before else None,
               m.group("file"), m.group("expr"), m.start())


# ------------------------------------------------------------------------------------------------ generators
def _pct(v, d=1):
    return "–" if v is None else f"{v:.{d}f}%"


def _gen_quickstart(d):
    lines = ["| seed | held-out pass@1 before RL | after RL | gain | wall time | machine | date |",
             "|---|---|---|---|---|---|---|"]
    for r in sorted(d["runs"], key=lambda r: r["seed"]):
        gain = r["pass_at_1_after"] - r["pass_at_1_before"]
        lines.append(f"| {r['seed']} | {_pct(r['pass_at_1_before'])} | {_pct(r['pass_at_1_after'])} | "
                     f"**{gain:+.1f}** | {r['wall_s']:.0f} s | {r['cpu']}, {r['cores']} cores | {r['date']} |")
    return "\n".join(lines)


def _config(c: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in c.items()) or "defaults"


def _gen_real_model_probe(d):
    lines = ["| task (config) | base pass@1 | chosen |", "|---|---|---|"]
    for r in d["task_selection"]:
        lines.append(f"| {r['task']} ({_config(r['config'])}) | {_pct(r['pass_at_1'])} | "
                     f"{'yes' if r['chosen'] else 'no'} |")
    m = d["machine"]
    lines.append(f"\n{d['task_selection'][0]['prompts']} problems x {d['task_selection'][0]['samples']} samples "
                 f"per task; {m['cpu']}, {m['cores']} cores.")
    return "\n".join(lines)


def _gen_real_model_runs(d):
    """One row per run (with its mean step time and where it goes), then each task's mean gain."""
    if not d.get("runs"):
        return "Not yet run: `benchmarks/results/real_model.json` holds no runs."
    lines = ["| task | seed | steps | pass@1 before | after | gain | wall | mean step: rollout / train / sync |",
             "|---|---|---|---|---|---|---|---|"]
    by_task: dict[str, list[float]] = {}
    for r in sorted(d["runs"], key=lambda r: (r["task"], r["seed"])):
        gain = r["pass_at_1_after"] - r["pass_at_1_before"]
        by_task.setdefault(r["task"], []).append(gain)
        t = r.get("step_breakdown_s", {})
        step = f"{t['step']:.0f} s: {t.get('rollout', 0):.0f} / {t.get('train', 0):.0f} / {t.get('reshard', 0):.1f}" \
            if "step" in t else ""
        lines.append(f"| {r['task']} | {r['seed']} | {r['steps']} | {_pct(r['pass_at_1_before'])} | "
                     f"{_pct(r['pass_at_1_after'])} | {gain:+.1f} | {r['wall_s'] / 60:.0f} min | {step} |")
    for task, gains in by_task.items():
        lines.append(f"| **{task}** | mean of {len(gains)} | | | | **{sum(gains) / len(gains):+.1f}** | | |")
    return "\n".join(lines)


def _gen_genrm(d):
    rows = [("verifier held-out accuracy", f"**{d['verifier']['accuracy']:.1f}%**"),
            ("meta-verifier held-out accuracy", f"{d['meta_verifier']['accuracy']:.1f}%")]
    for key, label in (("exact", "generator, exact reward"),
                       ("judge", "generator, the verifier's score as the only reward"),
                       ("judge_meta", "generator, verifier x meta-verifier (DeepSeekMath-V2's product)")):
        r = d[key]
        rows.append((f"{label}: held-out pass@1 before -> after",
                     f"{r['before']:.1f} -> {r['after']:.1f} (**{r['after'] - r['before']:+.1f}**)"))
    for key, label in (("judge", "held-out samples the verifier passes and the checker fails"),
                       ("judge_meta", "the same with verifier x meta-verifier (a pass: product > 0.5)")):
        r = d[key]
        rows.append((f"{label}, first -> last evaluation (mean)",
                     f"{r['false_pass_first']:.1f}% -> {r['false_pass_last']:.1f}% ({r['false_pass_mean']:.1f}%)"))
    v = d["opd_variants"]
    rows += [("OPD teacher (the exact-reward run's final policy)", f"{d['teacher_pass_at_1']:.1f}"),
             ("OPD student, top-8 reverse KL, 256 prompts x 1 sample (`opd-top8-n1`): final (best)",
              f"{v['opd-top8-n1']['after']:.1f} ({v['opd-top8-n1']['best']:.1f})"),
             ("OPD student, sampled token's log-ratio, 32 prompts x 8 samples (`opd`): final (best)",
              f"{v['opd']['after']:.1f} ({v['opd']['best']:.1f})"),
             ("steps to within 5 points of the teacher: OPD (`opd-top8-n1`) / GRPO (exact reward)",
              f"**{d['opd_steps']} / {d['grpo_steps']}**")]
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows)])


_OPD = {"opd": ("sampled token's log-ratio", "32 x 8"),
        "opd-mix1": ("the same + the task reward's GRPO advantage (`opd_reward_weight: 1`)", "32 x 8"),
        "opd-top0-n1": ("sampled token's log-ratio", "256 x 1"),
        "opd-top8": ("top-8 reverse KL (`opd_top_k: 8`)", "32 x 8"),
        "opd-top8-forward": ("top-8 forward KL (`opd_top_k_kl: forward`)", "32 x 8"),
        "opd-top8-lr0.001": ("top-8 reverse KL, lr 1e-3", "32 x 8"),
        "opd-top8-n1": ("top-8 reverse KL", "256 x 1")}


def _gen_genrm_opd(d):
    lines = ["| OPD run | signal | prompts x samples | held-out pass@1 final (best) | steps to within 5 points |",
             "|---|---|---|---|---|"]
    for name, r in d["opd_variants"].items():
        signal, shape = _OPD.get(name, ("?", "?"))
        within = r["steps_within"] if r["steps_within"] is not None else "not reached"
        lines.append(f"| `{name}` | {signal} | {shape} | {r['after']:.1f} ({r['best']:.1f}) | {within} |")
    return "\n".join(lines)


def _gen_async_rl(d):
    runs = d["runs"]
    sync = {r["seed"]: r for r in runs if r["max_staleness"] == 0}
    lines = ["| k | partial | mismatch | seed | RL steps wall s | vs k=0 | whole command wall s | vs k=0 | step s | "
             "engine busy | trainer busy | held-out pass@1 before -> after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    order = sorted(runs, key=lambda r: (r["seed"], r["max_staleness"], r["partial"], r["mismatch"] == "tis"))
    for r in order:
        s = sync[r["seed"]]
        k0 = r["max_staleness"] == 0
        lines.append(f"| {r['max_staleness']} | {'-' if k0 else ('yes' if r['partial'] else 'no')} | "
                     f"{'-' if k0 else r['mismatch']} | {r['seed']} | {r['rl_wall_s']:.0f} | "
                     f"{r['rl_wall_s'] / s['rl_wall_s']:.2f}x | {r['wall_s']:.0f} | {r['wall_s'] / s['wall_s']:.2f}x | "
                     f"{r['step_s_mean']:.2f} | {r['rollout_busy_frac'] * 100:.0f}% | {r['train_busy_frac'] * 100:.0f}% | "
                     f"{r['pass_at_1_before']:.1f} -> {r['pass_at_1_after']:.1f} |")
    st = d["settings"]
    lines.append(f"\n{st['steps']} RL steps after a {st['sft_steps']}-step SFT, `{st['config']}`; engine side on "
                 f"CPU {st['engine_cpus']}, trainer on CPU {st['trainer_cpus']}; machine: {_machine(d)}.")
    return "\n".join(lines)


def _machine(d) -> str:
    m = d["machine"]
    return f"{m['cpu']}, {m['cores']} cores"


def _gen_foundation(d):
    b = d["bridge"]
    rows = [("4-rank TP2×PP2 forward+backward, fork runner vs torchrun",
             f"{d['fork_runner_s']:.2f} s vs {d['torchrun_s']:.1f} s (torchrun {d['torchrun_over_fork']:.0f}× slower)"),
            ("HF → Megatron load, ~42M-param Qwen3, TP1 / TP2 / PP2",
             " / ".join(f"{b[k]['load_hf_s']:.2f} s" for k in ("tp1", "tp2", "pp2"))),
            ("Megatron → HF export, same model, TP1 / TP2 / PP2",
             " / ".join(f"{b[k]['export_hf_s']:.2f} s" for k in ("tp1", "tp2", "pp2")))]
    return "\n".join(["| measurement | result |", "|---|---|", *(f"| {a} | {v} |" for a, v in rows),
                      f"\nMachine: {_machine(d)}."])


def _mb(x):
    return f"{x / 1024:.2f} GB" if x >= 1024 else f"{x:.0f} MB"


def _gen_logprob(d):
    lines = ["| implementation | TP | tokens | time | peak extra memory | its naive reference | time ratio | memory ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for c in d["cases"]:
        mine, ref = c[c["impl"]], c["naive"]
        lines.append(f"| {c['impl']} | {c['tp']} | {c['tokens']} | {mine['time_s']:.2f} s | {_mb(mine['peak_extra_mb'])} | "
                     f"{c['naive_impl']}: {ref['time_s']:.2f} s, {_mb(ref['peak_extra_mb'])} | "
                     f"{c['time_ratio']:.2f}× | {c['peak_mem_ratio']:.3f}× |")
    return "\n".join(lines + [f"\nMachine: {_machine(d)}."])


def _gen_orchestration(d):
    lines = ["| layout | samples × 1k tokens | MoE routing | bytes per rank: before → after | extra peak RSS per rank "
             "| rollouts complete → first micro-batch | metrics reduction |", "|---|---|---|---|---|---|---|"]
    for before, after in zip(d["baseline"], d["cases"]):
        layout = f"DP={after['dp']}" if after["tp"] == 1 else f"TP{after['tp']}×DP{after['dp']}"
        moe = f"{after['moe_layers']} layers × top-{after['topk']}" if after["moe_layers"] else "–"
        n = after["samples"]
        samples = f"{n // 1024}k" if n >= 1024 else str(n)
        if before.get("skipped"):
            cells = (f"skipped ({before['skipped'].split(' resident')[0]}) → {after['bytes_max_rank'] / 1e6:.1f} MB",
                     f"→ {after['peak_rss_mb_max_rank']:.0f} MB", f"→ {after['dispatch_s']:.2f} s",
                     f"→ {after['metrics_s']:.3f} s")
        else:
            cells = (f"{before['bytes_max_rank'] / 1e6:.1f} → {after['bytes_max_rank'] / 1e6:.1f} MB",
                     f"{before['peak_rss_mb_max_rank']:.0f} → {after['peak_rss_mb_max_rank']:.0f} MB",
                     f"{before['dispatch_s']:.2f} → {after['dispatch_s']:.2f} s "
                     f"({before['dispatch_s'] / after['dispatch_s']:.2f}×)",
                     f"{before['metrics_s']:.3f} → {after['metrics_s']:.3f} s")
        lines.append(f"| {layout} | {samples} | {moe} | " + " | ".join(cells) + " |")
    return "\n".join(lines + [f"\nMachine: {_machine(d)}."])


def _gen_orchestration_rank0(d):
    lines = ["| layout | samples × 1k tokens | MoE routing | bytes to the busiest rank | rollouts complete → first "
             "micro-batch |", "|---|---|---|---|---|"]
    for c in d["cases"]:
        layout = f"DP={c['dp']}" if c["tp"] == 1 else f"TP{c['tp']}×DP{c['dp']}"
        moe = f"{c['moe_layers']} layers × top-{c['topk']}" if c["moe_layers"] else "–"
        n = c["samples"]
        lines.append(f"| {layout} | {f'{n // 1024}k' if n >= 1024 else n} | {moe} | "
                     f"{c['bytes_max_rank'] / 1e6:.1f} MB | {c['dispatch_s']:.2f} s |")
    return "\n".join(lines + [f"\nMachine: {_machine(d)}."])


def _gen_reshard(d):
    mem = d["memcpy_gbps"]
    lines = ["| model | step | layout | bucket | GB/s | × memcpy | 1st pass GB/s | × gloo gather |",
             "|---|---|---|---|---|---|---|---|"]
    for c in d["cases"]:
        if c["model"] != "qwen2-0.5b-random":
            continue
        bucket = f"{c['bucket_bytes'] >> 20} MiB"
        if c["transport"] == "none":
            step, gbps = "gather + convert + bucket", c["gather_convert_gbps"]
            gloo = f"{gbps / c['gloo_gather_gbps']:.2f}" if c.get("gloo_gather_gbps") else "–"
            first = f"{c['first_pass_gbps']:.2f}"
        else:
            step, gbps, gloo, first = f"full push into SGLang, `{c['transport']}`", c["push_gbps"], "–", "–"
        layout = c["layout"].upper() + (" (gloo gather)" if c["layout"] == "tp2" and c["transport"] == "none" else "")
        lines.append(f"| Qwen2-0.5B-shaped, random ({c['params'] / 1e6:.0f}M params) | {step} | {layout} | {bucket} | "
                     f"{gbps:.2f} | {gbps / mem:.2f} | {first} | {gloo} |")
    return "\n".join(lines + [f"\nmemcpy in the same run: {mem:.2f} GB/s. Machine: {_machine(d)}."])


def _gen_packing(d):
    lines = ["| case | tokens computed: padded → packed (real) | RL train forward+backward | forward-only log-probs | "
             "log-prob max diff / grad relative diff |", "|---|---|---|---|---|"]
    labels = {"quickstart": "quickstart shape", "long_tail": "long-tailed RL batch"}
    for name, c in d["cases"].items():
        t, pa, pk = c["tokens"], c["padded"], c["packed"]
        lines.append(f"| {labels.get(name, name)} ({c['samples']} samples, hidden {c['model']['hidden_size']}) | "
                     f"{t['padded']:,} → {t['packed']:,} ({t['real']:,}) | "
                     f"{pa['train_s']:.2f} → {pk['train_s']:.2f} s ({c['train_time_ratio']:.2f}×) | "
                     f"{pa['log_probs_s']:.2f} → {pk['log_probs_s']:.2f} s ({c['log_probs_time_ratio']:.2f}×) | "
                     f"{c['log_probs_max_abs_diff']:.1e} / {c['grad_rel_diff']:.1e} |")
    return "\n".join(lines + [f"\nMachine: {_machine(d)}."])


def _gen_sandbox(d):
    rows = [("empty program in the sandbox, median", f"{d['overhead_ms_median']:.1f} ms"),
            (f"executions per second, {d['workers']} at once", f"{d['executions_per_s']:.1f}"),
            ("HumanEval through the `code` reward, median per problem", f"{d['humaneval_ms_per_problem_median']:.1f} ms"),
            (f"HumanEval problems per second, reward pool of {d['workers']}", f"{d['humaneval_problems_per_s_pool']:.1f}"),
            ("HumanEval canonical solutions scored 1", f"{d['humaneval_canonical_scored_1']} of {d['humaneval_problems']}"),
            ("perturbed solutions scored 0 where the original harness fails them",
             f"{d['humaneval_perturbed_scored_0_where_original_fails']} of "
             f"{d['humaneval_perturbed_failed_by_original_harness']}")]
    m = d["machine"]
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows),
                      f"\nMachine: {m['cpu']}, {m['cores']} cores, load {m['load_average_1min_at_start']} at start."])


def _gen_coding_agent(d):
    rows = [("SFT final NLL", f"{d['sft_final_nll']:.3f}"),
            ("held-out pass@1 before -> after RL", f"{_pct(d['pass_at_1_before'])} -> {_pct(d['pass_at_1_after'])}"),
            ("held-out tool-call rate before -> after RL",
             f"{_pct(d['tool_call_rate_before'])} -> {_pct(d['tool_call_rate_after'])}"),
            ("training tool-call rate per RL step (%)", ", ".join(f"{x:.1f}" for x in d["train_tool_call_rate"])),
            ("training reward per RL step", ", ".join(f"{x:.3f}" for x in d["train_reward"])),
            ("wall time, whole example", f"{d['wall_s']:.0f} s")]
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {a} | {b} |" for a, b in rows),
                      f"\nSeed {d['seed']}, `{d['config']['file']}`; machine: {_machine(d)}."])


def _gen_humaneval(d):
    r = d["result"]
    return "\n".join([
        "| model | problems | samples | temperature | pass@1 | pass@2 |", "|---|---|---|---|---|---|",
        f"| {d['model']} | {r['eval/prompts']} | {d['samples_per_problem']} | {d['temperature']} | "
        f"{_pct(r['eval/pass_at_1'])} | {_pct(r['eval/pass_at_2'])} |",
        f"\nMachine: {_machine(d)}; {d['date']}."])


def _gen_delta_sync(d):
    lines = ["| model | transport | delta syncs | values changed per sync | bytes vs full | sync time vs full (full, delta) "
             "| verified |", "|---|---|---|---|---|---|---|"]
    for s in d.get("summary", []):
        lines.append(f"| {s['model']} | `{s['transport']}` | {s['delta_syncs']} | {100 * s['changed_frac_mean']:.2f}% | "
                     f"{s['bytes_vs_full']:.3f}x | {s['time_vs_full']:.2f}x ({s['full_sync_s']:.3f} s, "
                     f"{s['delta_sync_s']:.3f} s) | {'every sync' if s['all_verified'] else 'NOT every sync'} |")
    return "\n".join(lines + [f"\nMachine: {_machine(d)}."])


def _gen_chaos(d):
    lines = ["| fault | at step | phase it hit | survived | samples lost | samples off policy | extra wall time | "
             "metrics equal to the fault-free run |", "|---|---|---|---|---|---|---|---|"]
    for f in d["faults"]:
        equal = "yes" if f["metrics_equal"] else f"no: {f['expected_to_differ'] or 'NOT expected'}"
        lines.append(f"| {f['fault'].replace('_', ' ')} | {f['step']} | {f['phase']} | "
                     f"{'yes' if f['survived'] else '**no**'} | {f['samples_lost']} | {f['samples_off_policy']} | "
                     f"{f['recovery_s']:+.0f} s | {equal} |")
    return "\n".join(lines + [f"\nNot in this table: {'; '.join(d['not_run'])}. Machine: {_machine(d)}."])


GENERATORS = {"quickstart": _gen_quickstart, "real-model-probe": _gen_real_model_probe,
              "real-model-runs": _gen_real_model_runs, "genrm": _gen_genrm, "genrm-opd": _gen_genrm_opd,
              "async-rl": _gen_async_rl, "foundation": _gen_foundation, "logprob-entropy": _gen_logprob,
              "orchestration": _gen_orchestration, "orchestration-rank0": _gen_orchestration_rank0,
              "reshard": _gen_reshard, "packing": _gen_packing, "sandbox": _gen_sandbox,
              "coding-agent": _gen_coding_agent, "smollm2-humaneval": _gen_humaneval,
              "delta-sync": _gen_delta_sync, "chaos": _gen_chaos}


def render(name: str, file: str) -> str:
    """The block's body: a blank line, the generator's markdown, a blank line (so tables render between comments)."""
    if name not in GENERATORS:
        raise DocsError(f"no generator {name!r} (known: {', '.join(GENERATORS)})")
    return "\n" + GENERATORS[name](load(file)).strip("\n") + "\n\n"


def regenerate(text: str) -> str:
    def fill(m):
        head = m.group(0)[:m.start("body") - m.start()]
        return head + render(m.group("name"), m.group("file")) + "<!-- end generated -->"
    return BLOCK.sub(fill, text)


def algorithms_block(text: str) -> tuple[str, str] | None:
    """(the algorithms-table block as written, as benchmarks/algorithms.py writes it from its JSON), if present."""
    sys.path.insert(0, HERE)
    import algorithms as bench  # noqa: E402  (imports megarl.algorithms: torch)

    start, end = text.find(bench.MARK_START), text.find(bench.MARK_END)
    if start < 0:
        return None
    results = load("algorithms.json")
    table = bench.format_table(results, bench.select(None), [0, 1, 2], results.get("settings"))
    return text[start:end + len(bench.MARK_END)], bench.MARK_START + "\n" + table + "\n" + bench.MARK_END


def problems(path: str) -> list[str]:
    """Every stale generated block and wrong inline quote in the document at `path` (relative to the root)."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    out = []
    for m in BLOCK.finditer(text):
        try:
            if m.group("body") != render(m.group("name"), m.group("file")):
                out.append(f"{path}: generated block {m.group('name')} differs from {m.group('file')} "
                           f"(run benchmarks/docs_numbers.py)")
        except (DocsError, OSError, KeyError) as e:
            out.append(f"{path}: generated block {m.group('name')}: {e}")
    for sign, num, file, expr, pos in quotes(text):
        line = text.count("\n", 0, pos) + 1
        if num is None:
            out.append(f"{path}:{line}: quote of {file} ({expr}) follows no number")
            continue
        try:
            want = check_number(num, sign, evaluate(load(file), expr))
        except (DocsError, OSError, KeyError, IndexError, TypeError, ZeroDivisionError) as e:
            out.append(f"{path}:{line}: {file}: {expr}: {e}")
            continue
        if want is not None:
            out.append(f"{path}:{line}: {sign}{num} but {file}: {expr} gives {want}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="change nothing; report and exit 1 if anything is stale")
    args = p.parse_args(argv)
    bad = []
    for path in DOCUMENTS:
        full = os.path.join(ROOT, path)
        with open(full) as f:
            text = f.read()
        if not args.check:
            new = regenerate(text)
            if new != text:
                with open(full, "w") as f:
                    f.write(new)
                print(f"[docs_numbers] rewrote {path}")
        bad += problems(path)
    for line in bad:
        print(line, file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
