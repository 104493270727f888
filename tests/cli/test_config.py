"""YAML presets + dotted overrides -> typed dataclasses, with errors that name the field."""
import pytest

from megarl.config import ConfigError, load_config
from megarl.trainer.config import TrainConfig, load_train_config, rl_algorithm

pytestmark = pytest.mark.unit


def _write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_preset_overrides_and_defaults(tmp_path):
    base = _write(tmp_path, "base.yaml", "run_dir: runs/a\nrl: {steps: 5}\nmodel: {tiny: {family: qwen3}}\n")
    child = _write(tmp_path, "child.yaml", "defaults: base.yaml\nrl: {ppo_epochs: 2}\n")
    cfg = load_train_config(child, ["rl.steps=7", "algorithm.clip_eps_high=0.28", "rollout.engine.urls=[a, b]",
                                    "model.tiny.overrides={hidden_size: 32}"])
    assert (cfg.rl.steps, cfg.rl.ppo_epochs, cfg.run_dir) == (7, 2, "runs/a")
    assert cfg.algorithm.clip_eps_high == 0.28 and cfg.rollout.engine.urls == ["a", "b"]
    assert cfg.model.tiny.family == "qwen3" and cfg.model.tiny.overrides == {"hidden_size": 32}
    assert cfg.optim.lr == TrainConfig().optim.lr  # untouched fields keep their defaults


def test_unknown_key_suggests_the_closest(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown config key 'rl.stepz'.*Did you mean 'rl.steps'"):
        load_config(TrainConfig, None, ["rl.stepz=3"])
    path = _write(tmp_path, "bad.yaml", "rollout:\n  n_sample: 4\n")
    with pytest.raises(ConfigError, match=r"rollout.n_sample'.*Did you mean 'rollout.n_samples'"):
        load_config(TrainConfig, path)


@pytest.mark.parametrize("override,message", [
    ("rl.steps=ten", r"rl.steps must be an integer, got str 'ten'"),
    ("optim.lr=[1]", r"optim.lr must be a number"),
    ("rollout.deterministic=3", r"rollout.deterministic must be true or false"),
    ("rollout.engine.urls=abc", r"rollout.engine.urls must be a list"),
    ("algorithm=3", r"algorithm must be a mapping"),
])
def test_wrong_type_names_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TrainConfig, None, [override])


def test_semantic_validation_names_field_and_fix():
    with pytest.raises(ConfigError, match="exactly one of model.path"):
        load_train_config(None, [])
    with pytest.raises(ConfigError, match=r"rollout.overlong='cut' is unknown"):
        load_train_config(None, ["model.path=x", "rollout.overlong=cut"])
    with pytest.raises(ConfigError, match="algorithm.temperature=1.0 must equal rollout.temperature=0.7"):
        load_train_config(None, ["model.path=x", "rollout.temperature=0.7"])
    with pytest.raises(ConfigError, match="prompts_per_step=6 must be divisible by rl.mini_batches=4"):
        load_train_config(None, ["model.path=x", "rollout.prompts_per_step=6", "rl.mini_batches=4"])
    with pytest.raises(ConfigError, match=r"rl.max_skipped_steps must be >= 1, got 0. Fix"):
        load_train_config(None, ["model.path=x", "rl.max_skipped_steps=0"])
    with pytest.raises(ConfigError, match=r"checkpoint.keep must be >= 0, got -1. Fix"):
        load_train_config(None, ["model.path=x", "checkpoint.keep=-1"])


def test_shipped_presets_load():
    import glob

    presets = sorted(glob.glob("configs/*.yaml"))
    assert "configs/quickstart.yaml" in presets
    for path in presets:
        load_train_config(path)


def test_yaml_float_strings_and_missing_file(tmp_path):
    cfg = load_config(TrainConfig, _write(tmp_path, "f.yaml", "optim: {lr: 1e-6}\n"))
    assert cfg.optim.lr == 1e-6  # YAML 1.1 reads 1e-6 as a string
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(TrainConfig, str(tmp_path / "nope.yaml"))
    with pytest.raises(ConfigError, match="must look like section.key=value"):
        load_config(TrainConfig, None, ["rl.steps"])


def test_asynchronous_steps_get_the_decoupled_objective_unless_a_correction_is_chosen():
    """algorithm.mismatch.mode unset: tis (PPO's decoupled objective) with rl.max_staleness >= 1, none with
    synchronous steps; a chosen mode, "none" included, is kept. The RL entry point resolves it (rl_algorithm) on a
    copy: loading and validating the config change nothing."""
    def mode(*overrides):
        cfg = load_train_config(None, ["model.path=x", *overrides])
        chosen = cfg.algorithm.mismatch.mode
        resolved = rl_algorithm(cfg).mismatch.mode
        assert cfg.algorithm.mismatch.mode == chosen and chosen in (None, resolved)
        return resolved

    assert mode() == "none" and mode("rl.max_staleness=0") == "none"
    assert mode("rl.max_staleness=1") == "tis" and mode("rl.max_staleness=2") == "tis"
    assert mode("rl.max_staleness=1", "algorithm.mismatch.mode=none") == "none"
    assert mode("rl.max_staleness=1", "algorithm.mismatch.mode=icepop") == "icepop"
    assert mode("algorithm.mismatch.mode=seq_tis") == "seq_tis"
    with pytest.raises(ConfigError, match="rollout.old_log_probs=rollout"):
        load_train_config(None, ["model.path=x", "rollout.old_log_probs=rollout", "rl.mini_batches=2",
                                 "algorithm.mismatch.mode=none"])
    with pytest.raises(ConfigError, match="rollout.old_log_probs=rollout"):  # unset, synchronous: none
        load_train_config(None, ["model.path=x", "rollout.old_log_probs=rollout", "rl.mini_batches=2"])
    load_train_config(None, ["model.path=x", "rollout.old_log_probs=rollout", "rl.mini_batches=2",
                             "rl.max_staleness=1"])  # unset, asynchronous: tis corrects the engine's anchor
