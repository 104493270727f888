"""How the commands end (megarl.output: a human summary on rank 0, or --json the summary dict as one JSON line) and
`megarl report` on the run folders it can find (RL, SFT, DPO), a missing one and an empty one (one line, exit 2)."""
import json
import os

import pytest

from megarl.output import describe, finish

pytestmark = pytest.mark.unit

RL = {"pass_at_1_before": 49.75, "pass_at_1_after": 74.25, "wall_s": 412.3, "seed": 0, "steps": 100,
      "resumed_from_step": 0, "run_dir": "runs/q"}
SFT = {"checkpoint": "runs/q/sft/checkpoints/step_400", "steps": 400, "samples": 5000, "wall_s": 120.5}
DPO = {"checkpoint": "runs/d/dpo/checkpoints/step_5", "steps": 5, "pairs": 13, "loss_type": "dpo", "wall_s": 9.1,
       "loss_first": 0.693, "loss_last": 0.41, "reward_accuracy_first": 0.5, "reward_accuracy_last": 0.9,
       "margin_first": 0.0, "margin_last": 0.8}
EVAL = {"step": 100, "eval/pass_at_1": 74.25, "eval/pass_at_2": 80.0, "eval/pass_at_4": 85.5, "eval/maj_at_4": 79.0,
        "eval/prompts": 100, "eval/samples_per_prompt": 4, "pass_at_k_png": "runs/q/eval/pass_at_k.png"}
RUN = {"pass_at_1_before": 49.75, "pass_at_1_after": 74.25, "wall_s": 600.0, "seed": 0, "rl_steps": 100,
       "resumed_from_step": 0, "sft_steps": 400, "sft_wall_s": 120.5}


@pytest.mark.parametrize("command, summary, run_dir, words", [
    ("train", RL, "runs/q", ["megarl train runs/q:", "49.8% before RL -> 74.2% after", "100 RL steps",
                             "rl_summary.json", "metrics.jsonl", "megarl report runs/q"]),
    ("sft", SFT, "runs/q", ["megarl sft runs/q:", "400 SFT steps on 5000 samples", "step_400", "sft_summary.json"]),
    ("dpo", DPO, "runs/d", ["megarl dpo runs/d:", "5 DPO steps on 13 pairs", "loss 0.693 -> 0.41",
                            "reward accuracy 0.5 -> 0.9", "dpo_summary.json"]),
    ("eval", EVAL, "runs/q", ["megarl eval runs/q:", "step 100", "pass@1 74.2%", "pass@4 85.5%", "maj@4 79.0%",
                              "100 prompts x 4 samples", os.path.join("runs/q", "eval", "eval.json"),
                              "pass_at_k.png"]),
    ("run", RUN, "runs/q", ["megarl run runs/q:", "49.8% before RL -> 74.2% after", "400 SFT steps, 100 RL steps",
                            "summary.json"]),
])
def test_human_summary_and_json(capsys, command, summary, run_dir, words):
    text = describe(command, summary, run_dir)
    lines = [line for line in text.splitlines() if line.strip()]
    assert 2 <= len(lines) <= 6, text
    for word in words:
        assert word in text, (word, text)
    assert "{" not in text  # no raw JSON in the human form
    finish(command, summary, True, run_dir)
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and json.loads(out[0]) == summary  # --json: exactly the summary dict, one line
    finish(command, summary, False, run_dir)
    assert capsys.readouterr().out.strip() == text.strip()


def test_summary_variants():
    assert "held-out pass@1: no held-out prompts" in describe(
        "train", dict(RL, pass_at_1_before=None, pass_at_1_after=None, held_out="no held-out prompts"), "r")
    assert "resumed from step 40" in describe("train", dict(RL, resumed_from_step=40), "r")
    assert "stopped after RL step 7 (checkpoint saved)" in describe("train", {"preempted": True, "steps": 7}, "r")
    assert "no held-out prompts" in describe("eval", {"step": 0}, "r")
    assert "trainer PPL 3.2" in describe("eval", dict(EVAL, **{"responses/trainer_ppl": 3.2,
                                                              "responses/engine_ppl": 3.21}), "r")


def test_sft_summary_reads_the_loss(tmp_path):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "sft_metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "nll": 3.0 / s}) + "\n" for s in (1, 2, 3)))
    assert "nll 3 -> 1" in describe("sft", SFT, str(tmp_path))


def test_every_training_command_takes_json():
    from megarl.cli import _parser

    parser = _parser()
    for command in ("train", "sft", "dpo", "run", "eval"):
        assert parser.parse_args([command, "c.yaml", "--json"]).json
        assert not parser.parse_args([command, "c.yaml"]).json


# ------------------------------------------------------------------------------------------------- megarl report
def _jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def _rl_run(run_dir, eval_every=0, drop=False, kl_coef=0.0, mini_batches=1):
    rows = [{"step": 0, "eval/pass_at_1": 40.0, "eval/pass_at_2": 55.0, "eval/pass_at_4": 70.0}]
    for s in range(1, 6):
        rows.append({"step": s, "reward/mean": 0.1 * s, "entropy": 1.0 - 0.1 * s, "ppo_kl": 0.0, "clip_frac_low": 0.0,
                     "clip_frac_high": 0.0, "grad_norm": 1.0, "response_len/mean": 5.0, "time/step_s": 2.0})
        if eval_every and s % eval_every == 0 and s < 5:
            rows[-1].update({"eval/pass_at_1": 40.0 + s})
    rows.append({"step": 5, "eval/pass_at_1": 60.0, "eval/pass_at_2": 62.0, "eval/pass_at_4": 65.0 if drop else 75.0})
    _jsonl(os.path.join(run_dir, "metrics.jsonl"), rows)
    with open(os.path.join(run_dir, "run_config.json"), "w") as f:
        json.dump({"algorithm": {"kl_coef": kl_coef}, "rl": {"mini_batches": mini_batches, "ppo_epochs": 1,
                                                              "eval_every": eval_every}}, f)
    with open(os.path.join(run_dir, "rl_summary.json"), "w") as f:
        json.dump(dict(RL, steps=5), f)


def _report(capsys, run_dir):
    from megarl import cli

    rc = cli.main(["report", str(run_dir)])
    out = capsys.readouterr()
    return rc, out.out, [line for line in out.err.splitlines() if line.strip()]


def test_report_on_an_rl_run(tmp_path, capsys):
    _rl_run(str(tmp_path), drop=True)
    rc, out, err = _report(capsys, tmp_path)
    assert rc == 0 and "RL" in out and "report.png" in out
    png, md = tmp_path / "report.png", (tmp_path / "report.md").read_text()
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 10_000
    assert "| rl: reward/mean |" in md and "| RL summary | value |" in md
    # the zero panels say why, from the recorded config
    assert "clip fraction: 0 throughout: no clipping happened: one optimizer step per batch" in md
    assert "0 throughout: no KL to a reference is computed: kl_coef is 0" in md
    # two held-out points: the panel says evaluation ran only before and after
    assert "evaluated before and after training only (rl.eval_every=0)" in md
    # pass@4 fell from 70 to 65: called out; pass@1 and pass@2 rose: not listed
    assert "Held-out pass@k went down" in md and "pass@4 70.0% -> 65.0%" in md and "pass@1 40" not in md


def test_report_zero_notes_follow_the_config(tmp_path):
    from megarl.report import zero_note

    rows = [{"step": s, "kl": 0.0, "ppo_kl": 0.0, "clip_frac_low": 0.0} for s in (1, 2)]
    assert zero_note(["kl", "ppo_kl"], rows, {"algorithm": {"kl_coef": 0}}).startswith("0 throughout: kl: kl_coef is 0")
    two_updates = {"algorithm": {"kl_coef": 0.1}, "rl": {"mini_batches": 2, "ppo_epochs": 1}}
    assert "on-policy" not in zero_note(["clip_frac_low"], rows, two_updates)
    assert zero_note(["clip_frac_low"], rows, {}) == "0 throughout: no clipping happened"
    assert zero_note(["ppo_kl"], [{"step": 1, "ppo_kl": 0.01}], {}) is None


def test_report_with_evaluation_during_training_has_no_sparse_note(tmp_path, capsys):
    _rl_run(str(tmp_path), eval_every=2)
    rc, _, _ = _report(capsys, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert rc == 0 and "evaluated before and after" not in md and "went down" not in md


def test_report_on_sft_and_dpo_runs(tmp_path, capsys):
    sft, dpo = tmp_path / "sft_run", tmp_path / "dpo_run"
    _jsonl(str(sft / "sft" / "sft_metrics.jsonl"), [{"step": s, "nll": 2.0 / s, "grad_norm": 1.0} for s in (1, 2, 3)])
    (sft / "sft" / "sft_summary.json").write_text(json.dumps(SFT))
    _jsonl(str(dpo / "dpo" / "dpo_metrics.jsonl"), [{"step": s, "loss": 0.7 - 0.1 * s, "reward_accuracy": 0.2 * s,
                                                     "margin": 0.1 * s, "chosen_reward": 0.05 * s,
                                                     "rejected_reward": -0.05 * s, "grad_norm": 1.0}
                                                    for s in (1, 2, 3)] + ["{truncated"])
    (dpo / "dpo" / "dpo_summary.json").write_text(json.dumps(DPO))
    rc, out, _ = _report(capsys, sft)
    md = (sft / "report.md").read_text()
    assert rc == 0 and "SFT" in out and "| sft: nll |" in md and "| SFT summary | value |" in md
    assert (sft / "report.png").stat().st_size > 5_000
    rc, out, _ = _report(capsys, dpo)
    md = (dpo / "report.md").read_text()
    assert rc == 0 and "DPO" in out and "| dpo: loss |" in md and "| dpo: reward_accuracy |" in md
    assert "| DPO summary | value |" in md and (dpo / "report.png").stat().st_size > 5_000
    # all three in one folder (megarl run with SFT, a DPO run beside it)
    _rl_run(str(sft))
    os.rename(dpo / "dpo", sft / "dpo")
    rc, out, _ = _report(capsys, sft)
    md = (sft / "report.md").read_text()
    assert rc == 0 and "SFT + DPO + RL" in out
    assert all(f"| {k}: " in md for k in ("sft", "dpo", "rl"))


@pytest.mark.parametrize("make", ["missing", "empty", "empty metrics"])
def test_report_without_a_run_is_one_line(tmp_path, capsys, make):
    run_dir = tmp_path / "run"
    if make != "missing":
        run_dir.mkdir()
    if make == "empty metrics":
        (run_dir / "metrics.jsonl").write_text("")
    rc, out, err = _report(capsys, run_dir)
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("megarl: error: ") and "Fix:" in err[0] and "Traceback" not in err[0]
    assert ("does not exist" if make == "missing" else "holds no run") in err[0]
