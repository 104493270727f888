"""Run checkpoints: model + optimizer (megatron-core dist_checkpointing, any layout can load them), LR schedule,
trainer state (step, data cursor, rollout counter, metrics needed later), every rank's RNG states and what a rank
alone holds (asynchronous RL: its finished, untrained rollouts).

    <run_dir>/checkpoints/step_000010/   dist_checkpointing files, trainer_state.json, rng/rank00000.pt,
                                         rng/state00000.pt ...
    <run_dir>/checkpoints/latest         "step_000010" — moved last

Atomic: everything is written into a temporary folder next to the final one, fsynced, renamed into place; only then
is `latest` rewritten (write temp file, fsync, rename). A run killed at any point leaves `latest` naming a complete
checkpoint, and a half-written folder is never picked up (its name is not step_*, and `latest` never names it).

A checkpoint that cannot be written (no space, no permission, on any rank) stops every rank with one line naming the
path and the space a checkpoint needs (CheckpointWriteError); its temporary folder is removed and `latest` still names
the previous checkpoint. Once a new checkpoint is in place, all but the `keep` newest step folders are removed.
"""
from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil

import numpy as np
import torch
import torch.distributed as dist

from ..errors import RemoteUserError, UserError
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


class CheckpointWriteError(UserError):
    """A checkpoint could not be written (no space, no permission); the previous one is intact."""


def save_checkpoint(ckpt_root: str, step: int, chunks: list, optimizer, scheduler, trainer_state: dict,
                    keep: int = 2, critic=None, rank_state: dict | None = None) -> str:
    """Write step_<step> under ckpt_root (a collective over all ranks) and move `latest` to it. rank_state: what
    this rank alone holds (e.g. its untrained asynchronous rollouts), read back by load_checkpoint at the same world
    size.

    A write that fails for want of space or permission, on any rank, ends on every rank as one CheckpointWriteError
    naming the path and the space a checkpoint needs, once the half-written folder is removed: `latest` and the
    checkpoint it names are untouched. The free space is checked first, so a disk that is known to be too small
    fails before anything is written."""
    from megatron.core import dist_checkpointing

    rank, root = dist.get_rank(), os.path.abspath(ckpt_root)
    final = os.path.join(root, f"step_{step:06d}")
    names = [f"{final}.tmp-{os.getpid()}" if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    tmp = names[0]
    sharded = _sharded_state(chunks, optimizer, is_loading=False, critic=critic)
    need = _bytes_needed(root, sharded)

    def begin():  # rank 0
        os.makedirs(root, exist_ok=True)
        if shutil.disk_usage(root).free < need:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), tmp)
        os.makedirs(tmp)

    def write():  # every rank
        dist_checkpointing.save(sharded, tmp)
        os.makedirs(os.path.join(tmp, "rng"), exist_ok=True)  # after the save: it wants an empty folder
        torch.save(_rng_state(), os.path.join(tmp, "rng", f"rank{rank:05d}.pt"))
        if rank_state is not None:
            torch.save(rank_state, os.path.join(tmp, "rng", f"state{rank:05d}.pt"))

    def publish():  # rank 0
        state = dict(trainer_state, step=step, scheduler=scheduler.state_dict() if scheduler else None,
                     critic_scheduler=critic.scheduler.state_dict() if critic else None,
                     world_size=dist.get_world_size())
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump(state, f, indent=1)
        publish_dir(tmp, final)
        write_atomic(os.path.join(root, "latest"), os.path.basename(final))
        _prune(root, keep)

    # each phase ends in an agreement (a collective, so also the barrier between them): a rank that failed to
    # write must not leave the others waiting in the next phase's collective
    for phase, here in ((begin, rank == 0), (write, True), (publish, rank == 0)):
        _on_disk(phase, here, root, tmp, need)
    return final


def _on_disk(phase, here: bool, root: str, tmp: str, need: int) -> None:
    """phase() where `here`, then every rank learns how every rank fared (a collective). A failure to write (an
    OSError, raised or wrapped by dist_checkpointing) on any rank is raised on every rank as one CheckpointWriteError
    (rank 0 says it; the others raise it quietly), after rank 0 removed the temporary folder: its space is given back.
    Anything else is a bug and keeps its traceback on the rank that hit it; the others stop too rather than wait."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    error, report = None, None
    if here:
        try:
            phase()
        except (Exception, CheckpointException) as e:
            cause = _os_error(e)
            error, report = e, ("disk", _write_failed(cause, root, tmp, need)) if cause is not None else \
                ("bug", f"{type(e).__name__}: {e}")
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, report)
    if all(r is None for r in reports):
        return
    rank = dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    disk = [r[1] for r in reports if r is not None and r[0] == "disk"]
    if disk:  # e.g. dist_checkpointing raises its CheckpointException on every rank, the OSError only on rank 0
        if rank == 0:
            raise CheckpointWriteError(disk[0]) from None
        raise RemoteUserError(disk[0], CheckpointWriteError.__name__) from None
    if error is not None:
        raise error
    first = next(i for i, r in enumerate(reports) if r is not None)
    raise RuntimeError(f"saving {tmp} failed on rank {first} ({reports[first][1]}); this rank stopped with it")


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed write: raised as it is, chained, one of the per-rank failures torch's
    CheckpointException holds, or only named in a message. dist_checkpointing's writer threads pass a worker's
    exception on as text, "[Errno 28] No space left on device" or just its class, "<class 'OSError'>"
    (megatron-core's filesystem_async.check_local_output), so the text is read too."""
    import builtins

    todo, seen = [error], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        found = re.search(r"\[Errno (\d+)\] ([^:'\"\]\)]+)", str(e))
        if found:
            return OSError(int(found[1]), found[2].strip())
        for name in re.findall(r"<class '(\w+)'>", str(e)):
            kind = getattr(builtins, name, None)
            if isinstance(kind, type) and issubclass(kind, OSError):
                return kind(f"{name} in dist_checkpointing's writer")
        todo += [e.__cause__, e.__context__]
        todo += [f[0] if isinstance(f, tuple) else f for f in (getattr(e, "failures", None) or {}).values()]
    return None


def _write_failed(cause: OSError, root: str, tmp: str, need: int) -> str:
    """The one line: what failed where, the space a checkpoint needs and what is free, the previous checkpoint, the
    fix."""
    path = cause.filename or tmp
    where = root
    while not os.path.exists(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    pointer = os.path.join(root, "latest")
    previous = open(pointer).read().strip() if os.path.isfile(pointer) else None
    kept = f"the previous checkpoint {os.path.join(root, previous)} is intact" if previous else \
        "no earlier checkpoint exists"
    if cause.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"make {root} writable (or set run_dir to a writable folder)"
    else:
        fix = f"free at least {_size(need)} there (checkpoint.keep: how many checkpoints are kept) or set run_dir on " \
              "a larger disk"
    return (f"checkpoint: cannot write {path}: {cause.strerror or cause}; a checkpoint of this run needs about "
            f"{_size(need)}, {_size(free)} are free on that disk, and {kept}. Fix: {fix}, then start the run again "
            "(it resumes from the latest checkpoint)")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _bytes_needed(root: str, sharded: dict) -> int:
    """About how many bytes this checkpoint takes (a collective): the tensors it writes (each once: their main
    replicas, summed over ranks), or the previous checkpoint's size when that is larger (it also counts the metadata,
    and a run's checkpoints are all one size)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, is_main_replica

    local = sum(v.data.numel() * v.data.element_size() for v in nested_values(sharded)
                if isinstance(v, ShardedBase) and isinstance(v.data, torch.Tensor) and is_main_replica(v.replica_id))
    previous = 0
    if dist.get_rank() == 0 and os.path.isfile(os.path.join(root, "latest")):
        folder = os.path.join(root, open(os.path.join(root, "latest")).read().strip())
        previous = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files)
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, (local, previous))
    return max(sum(s[0] for s in sizes), max(s[1] for s in sizes))


def _prune(ckpt_root: str, keep: int) -> None:
    """Remove all but the `keep` newest step folders (0: none), never the one `latest` names."""
    steps = sorted((d for d in os.listdir(ckpt_root) if _STEP.match(d)), key=lambda d: int(_STEP.match(d)[1]))
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
