"""benchmarks/algorithms.py without an engine: the algorithms come from the registries (a newly registered loss
appears, every registered name is a run, an alias or excluded with a reason, every run's config selects its name and
passes the trainer's validation), the results file is appended atomically and resumed (pending pairs, replacement,
settings that differ are refused), and the table's mean / spread and the docs/algorithms.md block are computed from a hand-made
JSON with hand-worked numbers."""
import importlib.util
import json
import math
import os
import sys
from dataclasses import fields

import pytest
import torch

from megarl.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES, AlgorithmConfig, loss_phases, register_policy_loss
from megarl.algorithms.token_selection import TOKEN_SELECTIONS
from megarl.losses.rl import TokenBatch
from megarl.trainer import load_train_config

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo
SETTINGS = {"rl_steps": 100, "sft_steps": 400, "set": []}


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_algorithms", os.path.join(ROOT, "benchmarks", "algorithms.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _run(algorithm, seed, before, after, entropy=0.5, wall=300.0):
    return {"algorithm": algorithm, "seed": seed, "pass_at_1_before": before, "pass_at_1_after": after,
            "entropy_final": entropy, "wall_s": wall}


# ------------------------------------------------------------------------------------------------ enumeration
def test_every_registered_name_is_a_run_an_alias_or_excluded(bench):
    table, alias = bench.algorithms(), bench.aliases()
    covered = set(table) | {a for names in alias.values() for a in names} | set(bench.EXCLUDED)
    assert covered == set(ADVANTAGE_ESTIMATORS) | set(POLICY_LOSSES) | set(TOKEN_SELECTIONS)
    assert alias == {"grpo": ["ppo_clip"]}  # the quickstart's algorithm is the grpo run
    assert set(bench.EXCLUDED) == {"opd"} and all(bench.EXCLUDED.values())
    assert len(set(map(lambda c: json.dumps(c, sort_keys=True), table.values()))) == len(table)  # no duplicate runs
    for name, config in table.items():
        cfg = load_train_config(bench.CONFIG, bench._overrides({**bench.SHARED, **config}))  # validates
        a = cfg.algorithm
        assert name in (a.advantage_estimator, a.policy_loss) or (name in TOKEN_SELECTIONS and getattr(a, name))
        if name in POLICY_LOSSES or name in TOKEN_SELECTIONS:
            assert a.advantage_estimator == "grpo"
        if name in TOKEN_SELECTIONS or name in ADVANTAGE_ESTIMATORS and name not in bench.REQUIRES:
            assert a.policy_loss == "ppo_clip"
        assert [s for s in TOKEN_SELECTIONS if getattr(a, s)] == ([name] if name in TOKEN_SELECTIONS else [])
        assert cfg.rl.mini_batches == 2 and cfg.rl.steps == 100  # the shared budget
    assert bench.describe(table["gpg"]) == "gpg + reinforce"
    assert bench.describe(table["lopti"]) == "grpo + ppo_clip, lopti"
    assert bench.describe(table["aspo"]) == "grpo + aspo, dual_clip=3.0"


def test_a_newly_registered_loss_joins_the_comparison(bench):
    register_policy_loss("bench_probe_loss")(lambda *a: None)
    try:
        assert bench.algorithms()["bench_probe_loss"] == {"algorithm.advantage_estimator": "grpo",
                                                         "algorithm.policy_loss": "bench_probe_loss"}
        assert bench.select("bench_probe_loss,grpo") == ["bench_probe_loss", "grpo"]
    finally:
        del POLICY_LOSSES["bench_probe_loss"]
    assert "bench_probe_loss" not in bench.algorithms()


def test_token_selections_name_switches_that_change_the_trained_tokens():
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 6)
    old = torch.log(torch.rand(4, 6, generator=g).clamp(0.05, 0.95))
    batch = TokenBatch(input_ids=torch.randint(1, 50, (4, 6), generator=g), targets=torch.zeros(4, 6, dtype=torch.long),
                       loss_mask=mask, advantages=torch.randn(4, 6, generator=g), old_log_probs=old)
    entropy = torch.rand(4, 6, generator=g)
    switches = {f.name: f.default for f in fields(AlgorithmConfig)}
    (plain,) = loss_phases(batch, AlgorithmConfig(), entropy=entropy)
    for name in TOKEN_SELECTIONS:
        assert switches[name] is False  # an off-by-default AlgorithmConfig switch
        phases = loss_phases(batch, AlgorithmConfig(**{name: True}), entropy=entropy)
        trained = [p.loss_mask for p in phases]
        assert len(trained) > 1 or not torch.equal(trained[0], plain.loss_mask), name


def test_select_refuses_excluded_and_aliased_names_in_one_line(bench):
    with pytest.raises(bench.BenchError, match=r"--algorithms: opd cannot run .*teacher.*Fix: leave it out"):
        bench.select("grpo,opd")
    with pytest.raises(bench.BenchError, match=r"'ppo_clip' is not a run .*Fix: use grpo \(the same run\)"):
        bench.select("ppo_clip")
    with pytest.raises(bench.BenchError, match=r"'nope' is not a run .*Fix: choose from gae, grpo"):
        bench.select("nope")
    assert bench.select(None) == list(bench.algorithms())


# ------------------------------------------------------------------------------------------------ the JSON file
def test_append_is_atomic_resumable_and_refuses_other_settings(bench, tmp_path):
    path = str(tmp_path / "algorithms.json")
    assert bench.load_results(path) == {"settings": None, "runs": []}
    names, seeds = ["grpo", "maxrl"], [0, 1]
    assert bench.pending(bench.load_results(path), names, seeds) == [("grpo", 0), ("maxrl", 0), ("grpo", 1),
                                                                     ("maxrl", 1)]
    bench.append_run(path, _run("maxrl", 0, 10.0, 20.0), SETTINGS)
    bench.append_run(path, _run("grpo", 1, 30.0, 35.0), SETTINGS)
    on_disk = bench.load_results(path)
    assert on_disk["settings"] == SETTINGS and [(r["algorithm"], r["seed"]) for r in on_disk["runs"]] == \
        [("maxrl", 0), ("grpo", 1)]
    assert bench.pending(on_disk, names, seeds) == [("grpo", 0), ("maxrl", 1)]
    bench.append_run(path, _run("maxrl", 0, 10.0, 25.0), SETTINGS)  # a rerun replaces its pair
    runs = bench.load_results(path)["runs"]
    assert len(runs) == 2 and [r["pass_at_1_after"] for r in runs if r["algorithm"] == "maxrl"] == [25.0]
    assert os.listdir(tmp_path) == ["algorithms.json"]  # no temporary or lock file left
    with pytest.raises(bench.BenchError, match=r"rl_steps 100 there vs 2 now.*Fix: the same options, or another --out"):
        bench.append_run(path, _run("grpo", 0, 1.0, 2.0), dict(SETTINGS, rl_steps=2))
    with pytest.raises(ValueError, match="entropy_final"):
        bench.append_run(path, {k: v for k, v in _run("grpo", 0, 1.0, 2.0).items() if k != "entropy_final"}, SETTINGS)
    assert len(bench.load_results(path)["runs"]) == 2  # neither refused run was written


# ------------------------------------------------------------------------------------------------ the table
HAND = {"settings": SETTINGS, "runs": [
    _run("grpo", 0, 10.0, 20.0, 0.30, 300.0), _run("grpo", 1, 20.0, 40.0, 0.50, 320.0),
    _run("grpo", 2, 30.0, 33.0, 0.40, 310.0), _run("maxrl", 0, 10.0, 16.0, 0.20, 290.0)]}


def test_summary_means_and_spreads_by_hand(bench):
    rows = {r["algorithm"]: r for r in bench.summarize(HAND["runs"], ["grpo", "maxrl", "gspo"])}
    grpo = rows["grpo"]
    assert grpo["runs"] == 3 and grpo["seeds"] == [0, 1, 2]
    assert grpo["before"] == pytest.approx(20.0) and grpo["before_sd"] == pytest.approx(10.0)
    assert grpo["after"] == pytest.approx(31.0) and grpo["after_sd"] == pytest.approx(math.sqrt(103.0))
    # gains 10, 20, 3: mean 11, sample variance (1 + 81 + 64) / 2 = 73
    assert grpo["gain"] == pytest.approx(11.0) and grpo["gain_sd"] == pytest.approx(math.sqrt(73.0))
    assert grpo["entropy"] == pytest.approx(0.4) and grpo["wall_s"] == pytest.approx(310.0)
    assert rows["maxrl"]["gain"] == pytest.approx(6.0) and rows["maxrl"]["gain_sd"] is None  # one run: no spread
    assert rows["gspo"]["runs"] == 0 and rows["gspo"]["after"] is None


def test_table_and_readme_block_from_a_hand_made_json(bench, tmp_path):
    table = bench.format_table(HAND, ["grpo", "maxrl", "gspo"], [0, 1, 2])
    assert table.startswith("4 of 9 runs in (3 algorithms x seeds 0, 1, 2; RL steps 100, SFT steps 400)")
    lines = {line.split(" | ")[0]: line for line in table.splitlines() if line.startswith("| ")}
    assert lines["| grpo (= ppo_clip)"] == ("| grpo (= ppo_clip) | grpo + ppo_clip | 3 (0, 1, 2) | 20.0 ± 10.0 | "
                                           "31.0 ± 10.1 | +11.0 ± 8.5 | 0.400 ± 0.100 | 310 ± 10 |")
    assert lines["| maxrl"] == "| maxrl | maxrl + ppo_clip | 1 (0) | 10.0 | 16.0 | +6.0 | 0.200 | 290 |"
    assert lines["| gspo"].startswith("| gspo | grpo + gspo, clip_eps_low=0.0003, clip_eps_high=0.0004 | 0 | – |")

    readme = f"# x\n\n## Algorithm comparison\n{bench.MARK_START}\nold\n{bench.MARK_END}\nafter\n"
    filled = bench.fill_readme(readme, table)
    assert filled == f"# x\n\n## Algorithm comparison\n{bench.MARK_START}\n{table}\n{bench.MARK_END}\nafter\n"
    assert bench.fill_readme(filled, table) == filled  # idempotent
    with pytest.raises(bench.BenchError, match="no <!-- algorithms-table:start -->"):
        bench.fill_readme("# no markers\n", table)
    with open(os.path.join(ROOT, "docs", "algorithms.md")) as f:
        bench.fill_readme(f.read(), table)  # the page the table lives on has the block


def test_table_mode_prints_and_plots_without_running_anything(bench, tmp_path, capsys):
    out, png = tmp_path / "a.json", tmp_path / "a.png"
    out.write_text(json.dumps(HAND))
    assert bench.main(["--table", "--algorithms", "grpo,maxrl", "--out", str(out), "--plot", str(png),
                       "--work", str(tmp_path / "work")]) == 0
    printed = capsys.readouterr().out
    assert "4 of 6 runs in" in printed and "| maxrl | maxrl + ppo_clip | 1 (0) |" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "work").exists()
    assert bench.main(["--algorithms", "opd", "--out", str(out)]) == 2
    assert capsys.readouterr().err.count("\n") == 1  # one line


def test_docs_have_a_section_per_registered_algorithm():
    with open(os.path.join(ROOT, "docs", "algorithms.md")) as f:
        headings = [line for line in f if line.startswith("### ")]
    for name in [*ADVANTAGE_ESTIMATORS, *POLICY_LOSSES, *TOKEN_SELECTIONS]:
        assert any(f"`{name}`" in h for h in headings), f"docs/algorithms.md has no section for {name}"


def test_gdpo_takes_the_trainers_one_score_per_sample():
    """The trainer hands every estimator one score per sample ([b]); gdpo reads it as one reward column: GRPO's
    advantage whitened over the batch, computed here by hand."""
    from megarl.algorithms import compute_advantages

    scores, groups = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 0, 1, 1, 1])
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    adv, ret = compute_advantages("gdpo", scores=scores, group_ids=groups, mask=mask)
    std = math.sqrt(1 / 3)  # both groups: rewards {1, 0, 0} or {1, 1, 0}, unbiased std sqrt(1/3)
    per_sample = [(2 / 3) / std, (-1 / 3) / std, (-1 / 3) / std, (1 / 3) / std, (1 / 3) / std, (-2 / 3) / std]
    tokens = torch.tensor(per_sample)[:, None] * mask
    values = tokens[mask > 0]
    expected = (tokens - values.mean()) / values.std() * mask  # whitened over the 12 response tokens
    assert torch.allclose(adv, expected, atol=1e-5) and torch.equal(ret, scores[:, None] * mask)
