"""Every process megarl starts dies with the process that started it (Linux: PR_SET_PDEATHSIG), whatever stops that
one (SIGKILL, the OOM killer, a launcher tearing down its tree): the SGLang servers (megarl.rollout.server), the torchrun
workers (megarl.cli) and the reward pools' forkserver and workers (megarl.rewards.pool).

The reward pools' forkserver gets the same through its preload (forkserver_context): Python's forkserver and its
ProcessPoolExecutor workers outlive a SIGKILLed owner (measured with Python 3.11: both, and the resource tracker beside
them, were still there minutes later), so each killed run left its reward workers behind. Light on purpose (no torch):
the forkserver imports it before it forks any worker.
"""
from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import signal
import sys


def die_with_parent() -> None:
    """This process is killed (SIGKILL) when the thread that started it exits; if that parent is gone already (it died
    before this call), the process exits now."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    parent = os.getppid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def forkserver_context() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver context, its server started now from this thread (PR_SET_PDEATHSIG follows the
    thread that started a process, so it must not be a short-lived worker thread) with megarl._forkserver_preload,
    which ties it to this process. Pools on it pass `initializer=die_with_parent` so each worker dies with the server.
    A forkserver some other library started first is left as it is."""
    context = multiprocessing.get_context("forkserver")
    from multiprocessing import forkserver

    if forkserver._forkserver._forkserver_pid is None:  # not started yet: no public way to ask
        context.set_forkserver_preload(["megarl._forkserver_preload"])
        forkserver.ensure_running()
    return context


def exit_without_teardown(code: int):
    """End this process as Python's own exit does, then skip the interpreter's finalization: wait for the non-daemon
    threads (threading._shutdown, which also lets executors finish their work), run the atexit handlers (logging's
    flush, multiprocessing's children and finalizers, wandb's), flush stdout and stderr, and os._exit - the order of
    CPython 3.11's Py_FinalizeEx up to the point where it deallocates every module one by one. That last part costs
    2-3 s in a process that imported megatron-core, mbridge and transformers (measured: importing them and exiting
    7.8 s, importing them and os._exit 5.7 s), paid by every rank of every megarl command."""
    import atexit
    import threading

    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be said there
            pass
    os._exit(code)
