"""Run checkpoints: model + optimizer (megatron-core dist_checkpointing, any layout can load them), LR schedule,
trainer state (step, data cursor, rollout counter, metrics needed later), every rank's RNG states and what a rank
alone holds (asynchronous RL: its finished, untrained rollouts).

    <run_dir>/checkpoints/step_000010/   dist_checkpointing files, trainer_state.json, rng/rank00000.pt,
                                         rng/state00000.pt ...
    <run_dir>/checkpoints/latest         "step_000010" — moved last

Atomic: everything is written into a temporary folder next to the final one, fsynced, renamed into place; only then
is `latest` rewritten (write temp file, fsync, rename). A run killed at any point leaves `latest` naming a complete
checkpoint, and a half-written folder is never picked up (its name is not step_*, and `latest` never names it).
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from ..models.checkpoint import apply_model_state, publish_dir

_STEP = re.compile(r"^step_(\d{6,})$")


def _sharded_state(chunks: list, optimizer, is_loading: bool, critic=None) -> dict:
    """model{i} + optimizer (the policy; what model.load reads), and critic{i} + critic_optimizer under the key
    prefix "critic." when there is a critic (its tensors would otherwise share the policy's keys)."""
    state = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading)
    if critic is not None:
        critic_state = {f"critic{i}": c.sharded_state_dict(prefix="critic.") for i, c in enumerate(critic.chunks)}
        critic_state["critic_optimizer"] = critic.optimizer.sharded_state_dict(critic_state, is_loading=is_loading)
        state.update(critic_state)
    return state


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(ckpt_root: str, step: int, chunks: list, optimizer, scheduler, trainer_state: dict,
                    keep: int = 2, critic=None, rank_state: dict | None = None) -> str:
    """Write step_<step> under ckpt_root (a collective over all ranks) and move `latest` to it. rank_state: what
    this rank alone holds (e.g. its untrained asynchronous rollouts), read back by load_checkpoint at the same world
    size."""
    from megatron.core import dist_checkpointing

    rank = dist.get_rank()
    final = os.path.join(os.path.abspath(ckpt_root), f"step_{step:06d}")
    names = [f"{final}.tmp-{os.getpid()}" if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    tmp = names[0]
    if rank == 0:
        os.makedirs(tmp)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(chunks, optimizer, is_loading=False, critic=critic), tmp)
    os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)  # after the save: it wants an empty folder
    torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{rank:05d}.pt"))
    if rank_state is not None:
        torch.save(rank_state, os.path.join(tmp, "rng", f"state{rank:05d}.pt"))
    dist.barrier()
    if rank == 0:
        state = dict(trainer_state, step=step, scheduler=scheduler.state_dict() if scheduler else None,
                     critic_scheduler=critic.scheduler.state_dict() if critic else None,
                     world_size=dist.get_world_size())
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f, indent=1)
        publish_dir(tmp, final)
        write_atomic(os.path.join(ckpt_root, "latest"), os.path.basename(final))
        _prune(ckpt_root, keep)
    dist.barrier()
    return final


def _prune(ckpt_root: str, keep: int) -> None:
    steps = sorted(d for d in os.listdir(ckpt_root) if _STEP.match(d))
    latest = open(os.path.join(ckpt_root, "latest")).read().strip()
    for name in steps[:-keep] if keep > 0 else []:
        if name != latest:
            shutil.rmtree(os.path.join(ckpt_root, name), ignore_errors=True)


def latest_checkpoint(ckpt_root: str) -> str | None:
    """The step folder `latest` names, or None. A `latest` naming a missing folder is an error (never guessed)."""
    pointer = os.path.join(ckpt_root, "latest")
    if not os.path.isfile(pointer):
        return None
    name = open(pointer).read().strip()
    path = os.path.join(ckpt_root, name)
    if not _STEP.match(name) or not os.path.isfile(os.path.join(path, "trainer_state.json")):
        raise RuntimeError(f"{pointer} names {name!r}, which is not a complete checkpoint; remove the pointer to "
                           "start over or point it at a step_* folder that holds trainer_state.json")
    return path


def load_checkpoint(path: str, chunks: list, optimizer, scheduler, critic=None) -> dict:
    """Restore model, optimizer, LR schedule and this rank's RNG state; returns the trainer state."""
    from megatron.core import dist_checkpointing

    with open(os.path.join(path, "trainer_state.json")) as f:
        state = json.load(f)
    if state.get("world_size") != dist.get_world_size():
        # model + optimizer reshard through dist_checkpointing; RNG files are per rank and then start fresh
        rng_file = None
    else:
        rng_file = os.path.join(path, "rng", f"rank{dist.get_rank():05d}.pt")
    loaded = dist_checkpointing.load(_sharded_state(chunks, optimizer, is_loading=True, critic=critic), path)
    apply_model_state(chunks, loaded, path)
    if critic is not None:
        strip = lambda d: {k[len("critic."):] if k.startswith("critic.") else k: v for k, v in d.items()}  # noqa: E731
        apply_model_state(critic.chunks, {f"model{i}": strip(loaded[f"critic{i}"]) for i in range(len(critic.chunks))},
                          path)
        critic.optimizer.load_state_dict(loaded["critic_optimizer"])
        critic.scheduler.load_state_dict(state["critic_scheduler"])
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and state.get("scheduler"):
        scheduler.load_state_dict(state["scheduler"])
    if rng_file and os.path.isfile(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=False))
        rank_file = os.path.join(path, "rng", f"state{dist.get_rank():05d}.pt")
        if os.path.isfile(rank_file):
            state["rank_state"] = torch.load(rank_file, weights_only=False)
    return state
