"""`reward.name: reasoning_gym`: a response scored by its reasoning-gym task's own `score_answer`.

The answer the prompt carries is either the recipe of a generated problem ({"dataset": ..., "index": i}, written by
megarl.data.reasoning_gym: the problem is rebuilt here, exactly) or an exported reasoning-gym entry ({"answer": ...,
"metadata": {"source_dataset": <task>, ...}, "question"?: ...}, e.g. a JSONL a user wrote from reasoning-gym), scored
by that task's default scorer (reasoning_gym.get_score_answer_fn).

The final answer is extracted the way reasoning-gym's prompts ask for it: the last <answer>...</answer> (reasoning_gym
.utils.extract_answer); a response without one scores 0. reward.kwargs:
    extract:       tag (default: the last <tag>...</tag>) | last_number (the last number in the response: lm-eval's
                   "flexible extract", for a small model that does not write tags) | response (the whole response)
    format_weight: w in [0, 0.5) (default 0): reward = (1 - w) * task score + w * [an answer was extracted];
                   below 0.5, so a well-formed wrong answer never counts as correct in held-out pass@1 (score > 0.5)
    tag:           the answer tag (default "answer")
"""
from __future__ import annotations

import functools
import json
import re

from .functions import register_reward


@functools.lru_cache(maxsize=64)
def _default_scorer(task: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(task)


def problem(answer: str) -> tuple[dict, object]:
    """(entry, score_answer) for a reasoning_gym answer (a recipe or an exported entry, as JSON)."""
    try:
        spec = json.loads(answer)
    except (TypeError, json.JSONDecodeError):
        spec = None
    if isinstance(spec, dict) and "dataset" in spec and "index" in spec:
        from ..data.reasoning_gym import dataset

        ds = dataset(spec["dataset"])
        return ds[spec["index"]], ds.score_answer
    if isinstance(spec, dict) and "answer" in spec and isinstance(spec.get("metadata"), dict) \
            and "source_dataset" in spec["metadata"]:
        return spec, _default_scorer(spec["metadata"]["source_dataset"])
    raise ValueError("reward reasoning_gym: the answer must be a reasoning-gym problem ({\"dataset\", \"index\"}, as "
                     "data.train: reasoning_gym writes it) or an entry ({\"answer\", \"metadata\": {\"source_dataset\","
                     " ...}}), as JSON")


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _extract(response: str, how: str, tag: str) -> str | None:
    """The final answer in a response (see reward.kwargs.extract), or None."""
    if how == "tag":
        from reasoning_gym.utils import extract_answer

        return extract_answer(response, tag_name=tag)
    if how == "last_number":
        numbers = _NUMBER.findall(response)
        return numbers[-1].replace(",", "") if numbers else None
    if how == "response":
        return response.strip() or None
    raise ValueError(f"reward reasoning_gym: reward.kwargs.extract={how!r}; choose tag, last_number or response")


@register_reward("reasoning_gym")
def reasoning_gym_reward(response: str, answer: str | None, extract: str = "tag", format_weight: float = 0.0,
                         tag: str = "answer", **unknown) -> float:
    if unknown:
        raise ValueError(f"reward reasoning_gym: unknown reward.kwargs {sorted(unknown)}; accepted: extract, "
                         "format_weight, tag")
    if not 0.0 <= format_weight < 0.5:
        raise ValueError(f"reward reasoning_gym: reward.kwargs.format_weight={format_weight} must be in [0, 0.5)")
    entry, score_answer = problem(answer)
    extracted = _extract(response, extract, tag)
    score = float(score_answer(extracted, entry)) if extracted is not None else 0.0
    return (1.0 - format_weight) * score + format_weight * float(extracted is not None)
