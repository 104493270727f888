"""Token-in/token-out multi-turn rollouts.

Every turn continues from the exact token ids of the episode so far (prompt, the model's earlier turns as the engine
generated them, observations): nothing is ever re-tokenised. The model's tokens carry loss (mask 1) and keep the
engine's log-probs; observation tokens (tool results, and the template's header for the next assistant turn) carry no
loss (mask 0, log-prob 0). Turns of all live episodes go to the engines as one batch; environments step in threads.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from .base import Env


@dataclass
class Episode:
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)  # model turns and observations, in order
    loss_mask: list[int] = field(default_factory=list)  # 1: a model token, 0: an observation token
    log_probs: list[float] = field(default_factory=list)  # the engine's log-prob of each model token (0 elsewhere)
    finish_reason: str = "stop"  # stop | length (token budget) | max_turns
    turns: int = 0
    final_text: str = ""  # the last model turn, decoded: what the reward function scores
    env_reward: float = 0.0
    info: dict = field(default_factory=dict)  # summed EnvStep.info counters
    weight_version: str | None = None
    routed_experts: object = None  # MoE routing of prompt + response[:-1], a flat int32 tensor (from the last turn)
    # runs of (token count, weight_version) over response_ids: which weights sampled each model token, across turns
    # (observation tokens: version None)
    segments: list = field(default_factory=list)

    def add(self, ids: list[int], trained: bool, log_probs: list[float] | None = None, segments=None) -> None:
        self.response_ids += ids
        self.loss_mask += [int(trained)] * len(ids)
        self.log_probs += list(log_probs) if log_probs is not None else [0.0] * len(ids)
        self.segments += segments if segments is not None else [(len(ids), None)]


def observation_ids(tok, observation, tools=None) -> list[int]:
    """The observation as token ids: ids as they are, text as one tool message, messages through the chat template."""
    if observation is None:
        return []
    if isinstance(observation, list) and all(isinstance(x, int) for x in observation):
        return list(observation)
    messages = [{"role": "tool", "content": observation}] if isinstance(observation, str) else observation
    return tok.continuation_ids(messages, tools=tools)


def check_turn(completion) -> None:
    """The engine must give one log-prob per generated token (they are trained against, token by token)."""
    if len(completion.output_log_probs) != len(completion.output_ids):
        raise RuntimeError(f"engine returned {len(completion.output_ids)} tokens but "
                           f"{len(completion.output_log_probs)} log-probs for one turn")


def run_episodes(generate: Callable, tok, envs: list[Env], records: list, params: Callable[[int, int], dict],
                 max_turns: int, max_new_tokens: int, max_response_tokens: int, tools=None,
                 threads: ThreadPoolExecutor | None = None) -> list[Episode]:
    """One episode per (env, record). generate(prompt_ids_list, sampling_params_list) -> completions (the engine
    router); params(i, turn) -> sampling params of episode i's turn (seeds); each turn may generate at most
    max_new_tokens and the whole response (model + observation tokens) at most max_response_tokens."""
    episodes = [Episode(prompt_ids=list(r.prompt_ids)) for r in records]
    for env, record in zip(envs, records):
        env.reset(record)
    live = list(range(len(episodes)))
    for turn in range(max_turns):
        if not live:
            break
        budgets = {i: min(max_new_tokens, max_response_tokens - len(episodes[i].response_ids)) for i in live}
        completions = generate([episodes[i].prompt_ids + episodes[i].response_ids for i in live],
                               [dict(params(i, turn), max_new_tokens=budgets[i]) for i in live])
        texts = []
        for i, c in zip(live, completions):
            check_turn(c)
            ep = episodes[i]
            ep.add(c.output_ids, True, c.output_log_probs, c.segments)
            ep.turns, ep.weight_version, ep.routed_experts = turn + 1, c.weight_version, c.routed_experts
            ep.final_text = tok.decode(c.output_ids)
            texts.append(ep.final_text)
        steps = list((threads.map if threads else map)(lambda a: envs[a[0]].step(a[1]), zip(live, texts)))
        still = []
        for i, c, step in zip(live, completions, steps):
            ep = episodes[i]
            ep.env_reward += step.reward
            for key, value in step.info.items():
                ep.info[key] = ep.info.get(key, 0) + value
            if c.finish_reason == "length":  # cut mid-turn: the budget, not the model, ended it
                ep.finish_reason = "length"
                continue
            if step.done:
                ep.finish_reason = "stop"
                continue
            if turn == max_turns - 1:
                ep.finish_reason = "max_turns"
                continue
            obs = observation_ids(tok, step.observation, tools)
            if len(ep.response_ids) + len(obs) >= max_response_tokens:
                ep.finish_reason = "length"  # no room for the observation and a next turn
                continue
            ep.add(obs, False)
            still.append(i)
        live = still
    return episodes
