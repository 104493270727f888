"""The environment interface for multi-turn rollouts, and the name -> environment registry.

An environment sees the model's turns as text and answers with observations; the rollout (megarl.envs.episode) owns
the token ids. Per episode:

    env.reset(record)                  the prompt record (its token ids were already rendered by the chat template)
    env.step(turn_text) -> EnvStep      after every model turn: an observation to append (tool messages, text or
                                        token ids), a reward for this step, done
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Union

from ..algorithms.registry import registrar, resolve

# What an environment answers with: chat messages (rendered by the model's chat template, e.g. role "tool"), a string
# (one tool message with that content), or token ids appended as they are.
Observation = Union[list[dict], str, list[int], None]


@dataclass
class EnvStep:
    observation: Observation
    reward: float = 0.0  # added to the episode's reward (the reward function scores the final answer on top)
    done: bool = False
    info: dict = field(default_factory=dict)  # counters summed into rollout metrics (e.g. tool_calls, tool_errors)


class Env(Protocol):
    """One episode at a time. Built per sample by the rollout as cls(tools=env.tools, tool_call_format=
    env.tool_call_format, **env.kwargs) (take **_ for what you do not use); registered with @register_env(name) or
    named by env.name: "package.module:Class"."""

    def reset(self, record) -> None: ...

    def step(self, turn_text: str) -> EnvStep: ...


ENVS: dict[str, Callable[..., Env]] = {}
register_env = registrar(ENVS)


def make_env(name: str, **kwargs) -> Env:
    """The environment env.name names (registered, or "package.module:Class"), built with `kwargs`."""
    return resolve(ENVS, name, "env.name")(**kwargs)
