"""Every process megarl starts dies with the process that started it (Linux: PR_SET_PDEATHSIG), whatever stops that
one (SIGKILL, the OOM killer, a launcher tearing down its tree): the SGLang servers (megarl.rollout.server), the torchrun
workers (megarl.cli) and the reward pools' forkserver and workers (megarl.rewards.pool).

An SGLang server runs under a guard (`guarded`, this module run as `python -m megarl.lifetime`): its own process group,
which it kills whole when its owner dies. PR_SET_PDEATHSIG on the server alone is not enough: SGLang's scheduler and
detokenizer set their own (sglang/srt/utils kill_itself_when_parent_died) only once their spawned interpreter has
imported SGLang, seconds after they start, and never check whether their parent died before that - an owner killed
during an engine's start-up left a `sglang::detokenizer` re-parented to init, holding its memory (and on a GPU node its
GPU memory and ports). The guard is also their subreaper: whatever the server leaves behind is the guard's to kill.

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


def guarded(cmd: list[str]) -> list[str]:
    """`cmd` run under a guard that belongs to this process: start it with start_new_session=True; killing its
    process group (os.killpg(guard.pid, SIGKILL)) ends the command and everything it started."""
    return [sys.executable, "-m", "megarl.lifetime", str(os.getpid()), "--", *cmd]


def _guard(owner: int, cmd: list[str]) -> None:
    """The guard's life: run `cmd` in this process group (this process leads it), kill the whole group when the owner
    process is gone or this guard is told to stop (SIGTERM, SIGINT, SIGHUP), and when `cmd` ends, kill what it left in
    the group and end as it did (its exit code, or its signal). The owner is watched by polling, not with
    PR_SET_PDEATHSIG, which fires when the owner's *thread* that started the guard ends: an engine restarted from a
    request thread would die with that thread."""
    import ctypes
    import subprocess
    import threading
    import time

    def end_all(*_):
        os.killpg(0, signal.SIGKILL)  # this guard included

    def watch_owner():
        while os.getppid() == owner:  # once the owner is gone, this guard is re-parented
            time.sleep(0.2)
        end_all()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, end_all)
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: the server's orphans come here
    threading.Thread(target=watch_owner, daemon=True).start()
    child = subprocess.Popen(cmd, preexec_fn=die_with_parent)  # stdout, stderr, environment: the guard's
    while True:
        pid, status = os.waitpid(-1, 0)  # the server, or an orphan of its tree this subreaper adopted
        if pid == child.pid:
            break
    for pid in group_states(os.getpid()):  # what the server left behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        while os.waitpid(-1, 0):
            pass
    except ChildProcessError:  # all reaped
        pass
    code = os.waitstatus_to_exitcode(status)
    if code < 0:  # killed by a signal: so is the guard, so its owner sees what the server saw
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot have a handler
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def group_states(group: int) -> dict[int, str]:
    """The processes of process group `group` but this one, each with its state (/proc/PID/stat: R, S, T stopped,
    Z zombie, ...)."""
    states = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except OSError:  # exited meanwhile
            continue
        if int(pgrp) == group and int(pid) != os.getpid():
            states[int(pid)] = state
    return states


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


if __name__ == "__main__":  # python -m megarl.lifetime OWNER_PID -- CMD...: the guard (guarded)
    _guard(int(sys.argv[1]), sys.argv[sys.argv.index("--") + 1:])
