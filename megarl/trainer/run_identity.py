"""A run folder belongs to one run: each phase's run_config.json (<run_dir>/ for RL, <run_dir>/sft/, <run_dir>/dpo/)
records the config that made it, and starting again resumes a phase only when the fields that define the run are
unchanged.

The fields that may change on resume (MAY_CHANGE) are the length of the run, how it is observed and checkpointed,
and where and how its engines and reward workers run: none of them changes what a step computes. Every other field
(the model, data, algorithm, optimizer, sampling, reward, seed, parallel layout, ...) defines the run; changing one
with a checkpoint in the folder stops with one line naming the changed fields and the two ways out: a new run_dir, or
`--resume force` (continue this run with the new values; the record then holds them).
"""
from __future__ import annotations

import json
import os

from ..config import ConfigError, to_dict

RECORD = "run_config.json"
# dotted prefixes of the fields that may change when a run resumes (docs/configuration.md lists them too)
MAY_CHANGE = (
    "run_dir", "rl.steps", "sft.steps", "dpo.steps",  # how long: a resumed run goes on to the new count
    "rl.eval_every", "rl.eval_samples", "rl.eval_temperature", "rl.dump_rollouts", "rl.log_update_sparsity",
    "rl.forgetting_kl",  # what is measured and written
    "rl.max_skipped_steps",  # when a run that keeps producing NaNs stops (a finite run never reads it)
    "rl.max_tokens_per_microbatch", "sft.max_tokens_per_microbatch", "dpo.max_tokens_per_microbatch",
    "rl.offload_ref", "algorithm.fused_logprobs",  # how a step is computed, not what (tested layout-invariant)
    "rollout.engine", "rollout.request_size", "rollout.workers", "rollout.placement", "rollout.min_engines",
    # (above: where the engines run and how many must be left)
    "reward.workers", "reward.timeout_s", "reshard", "checkpoint", "logging", "model.shape",
)
# each phase's folder in run_dir (its checkpoints/ and its record) and the phases each command trains
PHASES = {"rl": "", "sft": "sft", "dpo": "dpo"}
COMMAND_PHASES = {"train": ("rl",), "sft": ("sft",), "dpo": ("dpo",), "run": ("sft", "rl")}

def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and name != "pools" and not name.endswith("kwargs"):
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _may_change(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in MAY_CHANGE)


def changed_fields(recorded: dict, current: dict) -> list[tuple[str, object, object]]:
    """(field, recorded value, current value) for each field that defines the run and differs. A field only one side
    has (a config written by another megarl version) is not compared."""
    old, new = _flatten(recorded), _flatten(_as_json(current))
    return [(name, old[name], new[name]) for name in sorted(set(old) & set(new))
            if not _may_change(name) and old[name] != new[name]]


def has_checkpoint(run_dir: str, phase: str = "rl") -> bool:
    return os.path.isfile(os.path.join(run_dir, PHASES[phase], "checkpoints", "latest"))


def _phases(cfg, command: str) -> tuple[str, ...]:
    return tuple(p for p in COMMAND_PHASES.get(command, ()) if p != "sft" or command == "sft" or cfg.sft.steps > 0)


def check_run_identity(cfg, command: str, force: bool = False) -> str:
    """Raise ConfigError when `command` would resume a phase (RL, SFT, DPO) in cfg.run_dir that another config made
    (unless force, or checkpoint.resume is off); returns what was checked. Only a phase with a checkpoint is
    compared, with the config its record holds: `megarl sft` then `megarl train` with other RL fields is a new RL
    run. Reads only: every rank may run it."""
    if not cfg.checkpoint.resume:
        return f"run_dir {cfg.run_dir}: starts over (checkpoint.resume: false)"
    resumed = [p for p in _phases(cfg, command) if has_checkpoint(cfg.run_dir, p)]
    if not resumed:
        return f"run_dir {cfg.run_dir}: a new run"
    changes = {}
    for phase in resumed:
        path = os.path.join(cfg.run_dir, PHASES[phase], RECORD)
        if os.path.isfile(path):  # else written by an older megarl: nothing to compare with
            with open(path) as f:
                changes.update((c[0], c) for c in changed_fields(json.load(f), to_dict(cfg)))
    if not changes:
        return f"run_dir {cfg.run_dir}: resumes the same run ({', '.join(resumed)})"
    listed = ", ".join(f"{name}: {_short(old)} -> {_short(new)}" for name, old, new in list(changes.values())[:6])
    more = f" and {len(changes) - 6} more" if len(changes) > 6 else ""
    if force:
        return f"run_dir {cfg.run_dir}: resumes with changed fields ({listed}{more}) because of --resume force"
    raise ConfigError(f"run_dir={cfg.run_dir} holds a run made with another config ({listed}{more}); resuming it "
                      "would mix two runs. Fix: a new run_dir (run_dir=...), or --resume force to continue that run "
                      "with the new values")


def record_run(cfg, command: str) -> None:
    """Write the record of each phase `command` trains (<run_dir>[/sft|/dpo]/run_config.json; atomically; rank 0
    only) once the run is allowed to start."""
    from .checkpoint import write_atomic

    text = json.dumps(_as_json(to_dict(cfg)), indent=1, sort_keys=True) + "\n"
    for phase in _phases(cfg, command):
        folder = os.path.join(cfg.run_dir, PHASES[phase])
        os.makedirs(folder, exist_ok=True)
        write_atomic(os.path.join(folder, RECORD), text)


def _as_json(tree: dict) -> dict:
    return json.loads(json.dumps(tree, default=str))  # tuples -> lists: compared as the record reads back


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= 40 else text[:37] + "..."
