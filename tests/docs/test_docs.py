"""The documents quote the committed results: every measured number in README.md, docs/*.md and
benchmarks/README.md comes from a JSON under benchmarks/results/ (benchmarks/docs_numbers.py says how).

The rules checked here:

1. Every generated block (`<!-- generated: NAME from benchmarks/results/FILE.json ... -->` ... `<!-- end
   generated -->`) is exactly what benchmarks/docs_numbers.py renders from its JSON today; the algorithm table in
   docs/algorithms.md is exactly what benchmarks/algorithms.py writes from algorithms.json. A number that changes in
   a JSON and not in the text fails here.
2. Every inline quote (`24.5<!-- quickstart.json: EXPR -->`) follows a number, and that number, as written, is the
   expression's value rounded to the decimals the text shows.
3. Every JSON a document refers to exists and records the machine it ran on (`machine` with `cpu` and `cores`),
   except the ones in NOT_YET, which a document names as not produced yet and never quotes.
4. No unsourced result: outside fenced code, inline code, HTML comments and generated blocks, a number written as a
   result - followed by a unit of a measurement (`%`, a ratio `0.66x` / `4.8×`, ` s`, ` ms`, ` GB/s`, ` GB`, ` MB`,
   ` points`, ` minutes`, ` hours`) or signed like a gain (`+24.5`) - must carry an inline quote. Versions, config
   values, sizes and tolerances (`1e-4`, `64 MiB`, `TP2`, `lr 3e-4`, `100 steps`) have no such unit and pass. The few
   results-shaped numbers that are not results (a target, a band, a config fraction written as a percentage) are in
   ALLOWED below, each with its reason.
"""
import importlib.util
import json
import os
import re
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
spec = importlib.util.spec_from_file_location("docs_numbers", os.path.join(ROOT, "benchmarks", "docs_numbers.py"))
dn = importlib.util.module_from_spec(spec)
spec.loader.exec_module(dn)

# (document, the phrase around the number: a regex) -> why it is not a measured result
ALLOWED = {
    ("README.md", r"target:\s+\+10 points"): "the quickstart's target, not a measurement",
    ("benchmarks/README.md", r"target:\s+\+10 points"): "the quickstart's target",
    ("benchmarks/README.md", r"\[5%, 60%\]"): "the task-selection band (a setting of real_model.py)",
    ("docs/benchmarks.md", r"\+10 points or more"): "the quickstart's target",
    ("docs/benchmarks.md", r"≥ 0\.5× memcpy"): "the weight-sync target",
    ("docs/benchmarks.md", r"≤ 1\.0×"): "the fused log-prob time target",
    ("docs/benchmarks.md", r"≤ 0\.05×"): "the fused log-prob memory target",
    ("docs/benchmarks.md", r"≥ 5×"): "the dispatch target",
    ("docs/benchmarks.md", r"1\.25 ×"): "the bytes-per-rank target",
    ("docs/async_rl.md", r"≤ 0\.67x"): "the asynchronous speed target",
    ("docs/async_rl.md", r"3-point target"): "the asynchronous learning target",
    ("docs/real_tasks.md", r"\[5%, 60%\]"): "the task-selection band (a setting of real_model.py)",
    ("docs/real_tasks.md", r"\+10 points of held-out"): "the SmolLM2 runs' target",
    ("docs/agentic.md", r"in only 20% of the demonstrations"): "a setting of the tool quickstart's SFT data",
    ("docs/judges.md", r"within 5 points"): "the distillation criterion (genrm.py's within_points setting)",
    ("docs/algorithms.md", r"within 5 points"): "the distillation criterion (genrm.py's within_points setting)",
    ("docs/judges.md", r"\(a pass: product > 0\.5\)"): "the pass threshold",
    ("docs/algorithms.md", r"20% highest-entropy|other 80%"): "the definition of the dynamics/entropy_top20 metric",
}
# results files the documents name as not produced yet (never quoted, never in a generated block)
NOT_YET = {"gpu_check.json": "benchmarks/gpu_check.py is prepared and not run: no GPU lent so far"}
UNIT = r"(?:%|[x×](?![\w-])|\s(?:s|ms|GB/s|GB|MB|points?|minutes|hours)\b)"
RESULT_NUMBER = re.compile(r"(?<![\w.\-/])(?:[+]\d+(?:\.\d+)?|\d[\d,]*(?:\.\d+)?(?=" + UNIT + r"))")
MASK = re.compile(r"^[ \t]*```.*?^[ \t]*```|<!-- generated: .*?<!-- end generated -->|<!-- algorithms-table:start -->.*?"
                  r"<!-- algorithms-table:end -->|<!--.*?-->|`[^`\n]*`|\]\([^)]*\)", re.S | re.M)


def _text(path):
    with open(os.path.join(ROOT, path)) as f:
        return f.read()


def _masked(text):
    """The text with code, comments and generated blocks blanked (same length, newlines kept)."""
    return MASK.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


@pytest.mark.parametrize("path", dn.DOCUMENTS)
def test_generated_blocks_and_quotes_match_the_json(path):
    assert dn.problems(path) == []


def test_the_algorithm_table_is_the_one_algorithms_py_writes():
    written, expected = dn.algorithms_block(_text("docs/algorithms.md"))
    assert written == expected, "docs/algorithms.md: run benchmarks/algorithms.py --table --docs"


def test_every_referenced_json_exists_and_records_its_machine():
    referenced = set()
    for path in dn.DOCUMENTS:
        text = _text(path)
        referenced |= {m.group("file") for m in dn.BLOCK.finditer(text)}
        referenced |= {m.group("file") for m in dn.QUOTE.finditer(text)}
        referenced |= set(re.findall(r"benchmarks/results/([\w.-]+\.json)", text))
    assert {"quickstart.json", "async_rl.json", "orchestration.json", "reshard.json"} <= referenced
    quoted = set()
    for path in dn.DOCUMENTS:
        text = _text(path)
        quoted |= {m.group("file") for m in dn.BLOCK.finditer(text)} | {m.group("file") for m in dn.QUOTE.finditer(text)}
    assert not quoted & set(NOT_YET)
    for name in sorted(referenced - set(NOT_YET)):
        path = os.path.join(ROOT, "benchmarks", "results", name)
        assert os.path.exists(path), f"a document refers to benchmarks/results/{name}, which does not exist"
        with open(path) as f:
            machine = json.load(f).get("machine")
        assert isinstance(machine, dict) and machine.get("cpu") and machine.get("cores"), \
            f"benchmarks/results/{name} records no machine (cpu, cores)"


@pytest.mark.parametrize("path", dn.DOCUMENTS)
def test_no_result_without_a_source(path):
    text = _text(path)
    masked = _masked(text)
    quoted = {m.start() for m in dn.QUOTE.finditer(text)}
    allowed = [m.span() for (doc, phrase) in ALLOWED if doc == path for m in re.finditer(phrase, text)]
    bad = []
    for m in RESULT_NUMBER.finditer(masked):
        rest = text[m.end():m.end() + 16]
        unit = re.match(r"\**" + UNIT + r"?\**\)?", rest)
        if any(q == m.end() + unit.end() for q in quoted):
            continue
        if any(a <= m.start() < b for a, b in allowed):
            continue
        line = text.count("\n", 0, m.start()) + 1
        bad.append(f"{path}:{line}: {text[max(0, m.start() - 30):m.end() + 10]!r}")
    assert bad == [], "numbers that look like results but quote no JSON (quote one, or drop it):\n" + "\n".join(bad)


def test_the_checker_catches_a_changed_number(tmp_path, monkeypatch):
    """A JSON value that changes while the text keeps the old number fails; so does a stale generated block."""
    results = tmp_path / "results"
    results.mkdir()
    (results / "q.json").write_text(json.dumps({"machine": {"cpu": "c", "cores": 2},
                                                "runs": [{"seed": 0, "a": 49.75, "b": 74.25}]}))
    monkeypatch.setattr(dn, "RESULTS", str(results))
    text = "gain **+24.5**<!-- q.json: runs[seed=0].b - runs[seed=0].a --> and 74.2%<!-- q.json: runs[0].b -->"
    assert [n for _, n, _, _, _ in dn.quotes(text)] == ["24.5", "74.2"]
    for sign, num, file, expr, _ in dn.quotes(text):
        assert dn.check_number(num, sign, dn.evaluate(dn.load(file), expr)) is None
    (results / "q.json").write_text(json.dumps({"runs": [{"seed": 0, "a": 49.75, "b": 75.0}]}))
    assert dn.check_number("24.5", "+", dn.evaluate(dn.load("q.json"), "runs[seed=0].b - runs[seed=0].a")) == "+25.2"
    assert dn.check_number("24.5", "+", -24.5) == "-24.5"
    dn.GENERATORS["t"] = lambda d: str(d["runs"][0]["b"])
    block = "<!-- generated: t from benchmarks/results/q.json by benchmarks/docs_numbers.py -->\n\n74.25\n\n" \
            "<!-- end generated -->"
    assert dn.regenerate(block) == block.replace("74.25", "75.0")
    del dn.GENERATORS["t"]


def test_the_heuristic_flags_results_and_spares_settings():
    def flagged(s):
        return [m.group(0) for m in RESULT_NUMBER.finditer(_masked(s))]
    assert flagged("took 956 s, 0.66x of it, 74.2% and +24.5, 4.8× faster, 3 minutes") == \
        ["956", "0.66", "74.2", "+24.5", "4.8", "3"]
    assert flagged("TP2×PP2, 32 × 8 samples, lr 3e-4, 64 MiB, within 1e-4, SGLang 0.5.23, `0.66x` in code") == []
