"""A run folder belongs to one run: starting again resumes only when the fields that define the run are unchanged
(megarl.trainer.run_identity), as one line with the fix otherwise, in-process and through --dry-run."""
import json
import os

import pytest
from tiny_rl import write_config

from megarl.config import ConfigError
from megarl.trainer.config import load_train_config
from megarl.trainer.run_identity import MAY_CHANGE, RECORD, changed_fields, check_run_identity, record_run

pytestmark = pytest.mark.unit


def _checkpointed_run(tmp_path, *overrides):
    """A run folder as a run leaves it after its first checkpoint: its config recorded, checkpoints/latest."""
    cfg = load_train_config(write_config(tmp_path, "run"), list(overrides))
    record_run(cfg, "train")
    os.makedirs(os.path.join(cfg.run_dir, "checkpoints"))
    with open(os.path.join(cfg.run_dir, "checkpoints", "latest"), "w") as f:
        f.write("step_000002\n")
    return cfg


def test_a_changed_seed_or_data_is_refused_and_may_change_fields_resume(tmp_path):
    config = write_config(tmp_path, "run")
    _checkpointed_run(tmp_path)
    same = check_run_identity(load_train_config(config, []), "train")
    assert same.endswith("resumes the same run (rl)")
    # the run's length, what it measures, where engines and reward workers run: the same run, resumed
    longer = load_train_config(config, ["rl.steps=50", "rl.eval_every=5", "logging.wandb=disabled",
                                        "checkpoint.save_every=7", "reward.timeout_s=30", "reshard.bucket_mb=64",
                                        "rl.max_tokens_per_microbatch=512"])
    assert check_run_identity(longer, "train").endswith("resumes the same run (rl)")
    with pytest.raises(ConfigError) as e:
        check_run_identity(load_train_config(config, ["seed=1", "optim.lr=0.5"]), "train")
    line = str(e.value)
    assert "\n" not in line and "optim.lr: 0.002 -> 0.5" in line and "seed: 0 -> 1" in line
    assert "Fix: a new run_dir" in line and "--resume force" in line
    with pytest.raises(ConfigError, match=r"algorithm.advantage_estimator: grpo -> rloo"):
        check_run_identity(load_train_config(config, ["algorithm.advantage_estimator=rloo"]), "run")
    forced = check_run_identity(load_train_config(config, ["seed=1"]), "train", force=True)
    assert "resumes with changed fields (seed: 0 -> 1)" in forced
    # checkpoint.resume off: the folder starts over; no checkpoint yet: a new run, whatever was recorded
    assert "starts over" in check_run_identity(load_train_config(config, ["seed=1", "checkpoint.resume=false"]), "train")
    # only a phase with a checkpoint is compared: SFT (none here) and DPO start new whatever the record says
    assert check_run_identity(load_train_config(config, ["seed=1"]), "sft").endswith("a new run")
    assert check_run_identity(load_train_config(config, ["seed=1"]), "dpo").endswith("a new run")
    os.remove(os.path.join(tmp_path, "run", "checkpoints", "latest"))
    assert check_run_identity(load_train_config(config, ["seed=1"]), "train").endswith("a new run")


def test_the_record_holds_the_config_and_fields_of_other_versions_are_not_compared(tmp_path):
    cfg = _checkpointed_run(tmp_path, "seed=3")
    with open(os.path.join(cfg.run_dir, RECORD)) as f:
        recorded = json.load(f)
    assert recorded["seed"] == 3 and recorded["rollout"]["n_samples"] == cfg.rollout.n_samples
    del recorded["rl"]["max_staleness"]  # a record an older megarl wrote, without a field this one has
    recorded["algorithm"]["future_knob"] = 1.0  # ... or a newer one, with a field this one lacks
    from megarl.config import to_dict

    assert changed_fields(recorded, to_dict(cfg)) == []
    assert all(not p.endswith(".") for p in MAY_CHANGE)


def test_the_command_and_its_dry_run_say_it_in_one_line(tmp_path, capsys):
    from megarl import cli

    config = write_config(tmp_path, "run")
    _checkpointed_run(tmp_path)
    for flags in ([], ["--dry-run"]):
        assert cli.main(["train", config, *flags, "data.synthetic.seed=9"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert len(err) == 1 and err[0].startswith("megarl: error: run_dir=") and "data.synthetic.seed: " in err[0]
    assert cli.main(["train", config, "--dry-run", "--resume", "force", "data.synthetic.seed=9"]) == 0
    assert "resumes with changed fields (data.synthetic.seed" in capsys.readouterr().out


def test_the_docs_list_every_field_that_may_change():
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "reliability.md")) as f:
        text = f.read()
    assert [p for p in MAY_CHANGE if f"`{p}" not in text] == []
