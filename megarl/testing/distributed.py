"""Run a function on N gloo ranks by forking the (already imported) test process.

torchrun starts N fresh interpreters that each import torch + megatron (~10 s for a 4-rank test on 2 cores). Forking
after one import costs about a second. Each rank gets the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT), so the code under test initialises exactly as it does under torchrun.

    results = run_ranks(4, my_fn, arg1, tp=2)   # my_fn(arg1, tp=2) on each rank -> [result of rank 0, 1, 2, 3]

A rank that raises reports its traceback; a run that exceeds `timeout` is killed and every rank that was still
running reports the Python stack it was stuck in (faulthandler).
"""
from __future__ import annotations

import faulthandler
import io
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback

import torch

from ..parallel.env import free_port


class RankFailure(AssertionError):
    """One or more ranks failed or hung; the message holds every rank's traceback."""


def _forget_parent_forkserver():
    """A forked rank inherits the parent's multiprocessing forkserver handle (started by a RewardPool in an earlier
    test), but that server is the parent's child, not the rank's: the rank's first forkserver Process then fails in
    os.waitpid with "ChildProcessError: No child processes". Python does not reset it at fork; the rank starts its
    own forkserver instead."""
    import multiprocessing.forkserver as forkserver
    import threading

    server = forkserver._forkserver
    if server._forkserver_alive_fd is not None:
        os.close(server._forkserver_alive_fd)  # the parent keeps its own copy: its server lives on
    server._forkserver_address = server._forkserver_alive_fd = server._forkserver_pid = None
    server._lock = threading.Lock()  # another thread of the parent may have held it at fork


def _child(fn, args, kwargs, rank, world, port, results, stack_file, timeout):
    _forget_parent_forkserver()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    stacks = open(stack_file, "w")
    faulthandler.dump_traceback_later(timeout, file=stacks, exit=False)
    try:
        value = fn(*args, **kwargs)
        _teardown()
        # torch.save bytes, not the tensors: torch's queue reductions share tensor memory with a process that
        # is about to exit.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - everything is reported to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
        stacks.close()
        sys.stdout.flush()
        sys.stderr.flush()


def _teardown():
    import torch.distributed as dist

    if dist.is_initialized():
        from ..compat.megatron import destroy_model_parallel

        dist.barrier()
        destroy_model_parallel()
        dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, timeout: float = 180.0, **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` forked ranks; return the per-rank results (rank order)."""
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="megarl-ranks-") as tmp:
        stack_files = [os.path.join(tmp, f"rank{r}.stack") for r in range(world_size)]
        procs = [ctx.Process(target=_child, daemon=False,  # a rank may start its own helper processes
                             args=(fn, args, kwargs, r, world_size, port, results, stack_files[r], timeout))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        outcome: dict[int, tuple[str, object]] = {}
        deadline = time.monotonic() + timeout + 5
        while len(outcome) < world_size:
            remaining = deadline - time.monotonic()
            try:
                rank, status, value = results.get(timeout=max(0.1, min(remaining, 1.0)))
                outcome[rank] = (status, value)
                if status == "error":  # the others are likely stuck in a collective with the failed rank
                    deadline = min(deadline, time.monotonic() + 5)
                continue
            except queue.Empty:
                pass
            if remaining <= 0:
                break
            dead = [r for r, p in enumerate(procs) if r not in outcome and not p.is_alive()]
            if dead:  # a rank died without reporting (segfault, os._exit): give others a moment, then stop
                time.sleep(0.5)
                if all(r not in outcome for r in dead) and results.empty():
                    for r in dead:
                        outcome[r] = ("error", f"exited with code {procs[r].exitcode} without a result")
                    break
        for p in procs:
            if p.is_alive():
                p.join(timeout=2 if len(outcome) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
        errors = []
        another_failed = any(status == "error" for status, _ in outcome.values())
        for r in range(world_size):
            status, value = outcome.get(r, ("hung", None))
            if status == "error":
                errors.append(f"--- rank {r} failed:\n{value}")
            elif status == "hung" and another_failed:
                errors.append(f"--- rank {r} was still running when another rank failed (stopped)")
            elif status == "hung":
                with open(stack_files[r]) as f:
                    stack = f.read().strip() or "(no stack dumped)"
                errors.append(f"--- rank {r} did not finish within {timeout:.0f}s; its stack:\n{stack}")
        if errors:
            raise RankFailure(f"{fn.__name__} on {world_size} ranks:\n" + "\n".join(errors))
        return [torch.load(io.BytesIO(outcome[r][1]), weights_only=False) for r in range(world_size)]
