"""reasoning-gym tasks as a data source (data.train / data.eval / sft.data: reasoning_gym).

reasoning-gym (PyPI, offline) generates each task's problems procedurally: problem i of a dataset depends only on
(task config, seed, i). A prompt record therefore carries, as its answer, the recipe of its problem
({"dataset": spec, "index": i}, JSON): the reward worker rebuilds the same problem and scores the response with the
task's own `score_answer` (megarl.rewards.reasoning_gym), with nothing lost to serialising the task's metadata.

    train, held_out = problem_splits(cfg.data.reasoning_gym)   # [(recipe, entry)]; the held-out split never shares a
                                                               # question with the training split
"""
from __future__ import annotations

import difflib
import functools
import json

from ..config import ConfigError

_EVAL_SEED_OFFSET = 1_000_003  # eval_seed default: seed + this (far from any training seed a user would pick)
_EVAL_CANDIDATES = 4  # candidates drawn per held-out problem before giving up on a task with too few questions


def _registry() -> dict:
    from reasoning_gym.factory import DATASETS

    return DATASETS


def check_task(name, field: str) -> None:
    """An unknown task name is one line listing the close ones."""
    names = sorted(n for n in _registry() if n != "composite")
    if not isinstance(name, str) or name not in names:
        close = difflib.get_close_matches(str(name), names, n=5, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"choose one of the {len(names)} tasks, e.g. " \
                                                                 f"{', '.join(names[:8])}, ..."
        fix = f"{field}={close[0]}" if close else f"{field}=<a task name> (reasoning_gym.factory.DATASETS lists them)"
        raise ConfigError(f"{field}={name!r} is not a reasoning-gym task; {hint} Fix: {fix}")


def dataset_specs(cfg) -> list[dict]:
    """[{name, weight, config}] from a ReasoningGymConfig (one task, or several), checked."""
    if (cfg.task is None) == (not cfg.tasks):
        raise ConfigError("data.reasoning_gym: set either task (one task, with config) or tasks (a list of {name, "
                          "weight, config}). Fix: e.g. data.reasoning_gym.task=leg_counting")
    for field, config in [("config", cfg.config)] + [(f"tasks[{i}].config", t.get("config") or {})
                                                    for i, t in enumerate(cfg.tasks) if isinstance(t, dict)]:
        if {"seed", "size"} & set(config or {}):
            raise ConfigError(f"data.reasoning_gym.{field} sets seed or size, which data.reasoning_gym.seed / size / "
                              "eval_seed / eval_size decide for both splits. Fix: remove them from the task's config")
    if cfg.task is not None:
        check_task(cfg.task, "data.reasoning_gym.task")
        return [{"name": cfg.task, "weight": 1.0, "config": dict(cfg.config or {})}]
    if cfg.config:
        raise ConfigError("data.reasoning_gym.config is for one task (data.reasoning_gym.task); with tasks, each "
                          "entry has its own config. Fix: move it into tasks[i].config")
    specs = []
    for i, t in enumerate(cfg.tasks):
        if not isinstance(t, dict) or "name" not in t or set(t) - {"name", "weight", "config"}:
            raise ConfigError(f"data.reasoning_gym.tasks[{i}]={t!r} must be {{name, weight, config}}. Fix: e.g. "
                              "{name: leg_counting, weight: 1, config: {}}")
        check_task(t["name"], f"data.reasoning_gym.tasks[{i}].name")
        weight = t.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"data.reasoning_gym.tasks[{i}].weight={weight!r} must be a number > 0")
        specs.append({"name": t["name"], "weight": float(weight), "config": dict(t.get("config") or {})})
    return specs


def _recipe(specs: list[dict], seed: int, size: int) -> dict:
    """What rebuilds a dataset: JSON-able, the key of the reward worker's cache."""
    return {"tasks": specs, "seed": seed, "size": size}


@functools.lru_cache(maxsize=16)
def _build(recipe_json: str):
    import reasoning_gym
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec

    recipe = json.loads(recipe_json)
    specs, seed, size = recipe["tasks"], recipe["seed"], recipe["size"]
    field = "data.reasoning_gym.config" if len(specs) == 1 else "data.reasoning_gym.tasks"
    try:
        if len(specs) == 1:
            return reasoning_gym.create_dataset(specs[0]["name"], **specs[0]["config"], seed=seed, size=size)
        config = CompositeConfig(size=size, seed=seed, datasets=[DatasetSpec(s["name"], s["weight"], s["config"])
                                                                 for s in specs])
        config.validate()
        return CompositeDataset(config)
    except (TypeError, ValueError, AssertionError, KeyError) as e:  # the task's config dataclass / its validate()
        raise ConfigError(f"{field}: reasoning-gym refused it ({type(e).__name__}: {e}). Fix: the task's config "
                          "fields (see the task's *Config class in reasoning_gym)") from None


def dataset(recipe: dict):
    """The reasoning-gym dataset a recipe describes (cached per process)."""
    return _build(json.dumps(recipe, sort_keys=True))


def entry(recipe: dict, index: int) -> dict:
    return dataset(recipe)[index]


def system_prompt(cfg) -> str | None:
    if cfg.system_prompt is None:
        return None
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS.get(cfg.system_prompt, cfg.system_prompt)


def problem_splits(cfg) -> tuple[list[tuple[dict, int, dict]], list[tuple[dict, int, dict]]]:
    """(train, held-out): [(recipe, index, entry)]. The held-out problems come from eval_seed, skipping any whose
    question is in the training split, so the two never share a question (asserted)."""
    for name in ("size", "eval_size"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"data.reasoning_gym.{name}={value!r} must be an integer >= 1")
    specs = dataset_specs(cfg)
    train_recipe = _recipe(specs, cfg.seed, cfg.size)
    train = [(train_recipe, i, entry(train_recipe, i)) for i in range(cfg.size)]
    questions = {e["question"] for _, _, e in train}
    eval_seed = cfg.seed + _EVAL_SEED_OFFSET if cfg.eval_seed is None else cfg.eval_seed
    candidates = cfg.eval_size * _EVAL_CANDIDATES
    # problem i of a dataset is generated from Random(seed + i): the two splits' seed ranges must not overlap
    if cfg.seed - candidates < eval_seed < cfg.seed + cfg.size:
        raise ConfigError(f"data.reasoning_gym.eval_seed={eval_seed}: problem i is generated from seed + i, so the "
                          f"held-out problems (eval_seed .. eval_seed + {candidates - 1}) would repeat training ones "
                          f"(seed {cfg.seed} .. {cfg.seed + cfg.size - 1}). Fix: an eval_seed outside "
                          f"[{cfg.seed - candidates + 1}, {cfg.seed + cfg.size - 1}], or leave it unset")
    eval_recipe = _recipe(specs, eval_seed, candidates)
    held_out = []
    for i in range(candidates):
        e = entry(eval_recipe, i)
        if e["question"] not in questions:
            held_out.append((eval_recipe, i, e))
            if len(held_out) == cfg.eval_size:
                break
    if len(held_out) < cfg.eval_size:
        raise ConfigError(f"data.reasoning_gym.eval_size={cfg.eval_size}: only {len(held_out)} of {candidates} "
                          f"problems drawn with eval_seed={eval_seed} are not in the training split (the task's "
                          "config allows few distinct questions). Fix: lower eval_size or size, or widen the "
                          "task's config")
    assert not questions & {e["question"] for _, _, e in held_out}
    return train, held_out


def _messages(system: str | None, question: str) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]


def prompt_records(cfg, split: str) -> list[tuple[str, dict]]:
    """[(where, {"messages", "answer"})] for RL prompts: the task's question as the user turn (after the configured
    system prompt) and the problem's recipe as the answer the reward worker scores against."""
    train, held_out = problem_splits(cfg)
    system = system_prompt(cfg)
    return [(f"reasoning_gym:{split}[{index}]",
             {"messages": _messages(system, e["question"]),
              "answer": json.dumps({"dataset": recipe, "index": index}, sort_keys=True)})
            for recipe, index, e in (train if split == "train" else held_out)]


def sft_records(cfg) -> list[tuple[str, dict]]:
    """[(where, {"messages"})]: the training problems answered with the task's reference answer in the form its
    prompt asks for (<answer>...</answer>), for an SFT cold start."""
    system = system_prompt(cfg)
    return [(f"reasoning_gym:train[{index}]", {"messages": _messages(system, e["question"]) + [
        {"role": "assistant", "content": f"<answer>{e['answer']}</answer>"}]})
            for _, index, e in problem_splits(cfg)[0]]
