"""Run untrusted Python (model-written code) in a throw-away sandbox built with bubblewrap: one process tree per
execution in its own namespaces, a minimal read-only root, per-execution limits, everything killed and gone after.

What one execution sees and may do (each line is checked by an adversarial test in tests/sandbox/test_sandbox.py):

- files: a root of its own. Read-only: /usr (system libraries and tools), the /bin, /lib... links, and the trainer's
  Python installation at /python (run with -I -S: the standard library only, no site-packages). Read-write: its
  working directory /work (also HOME) and private /tmp and /dev/shm, three tmpfs of SandboxLimits.disk_mb each that
  vanish with the execution (nothing carries over to the next one, nothing is left on the host, there is nothing to
  clean up). Also a fresh /proc of its own pid namespace and bwrap's minimal /dev. No other host path exists inside:
  not the project tree, not /etc, /root, the host's /tmp or /dev/shm, nor the host's Unix sockets;
- namespaces: new network (only a loopback that is down: nothing, not even the host's 127.0.0.1, is reachable), PID,
  mount, IPC (host System V shared memory and semaphores are invisible), UTS and user namespaces; creating further
  user namespaces inside is disabled (bwrap --disable-userns), no capabilities, no_new_privs;
- system calls (megarl.sandbox.seccomp, a seccomp filter): AF_VSOCK sockets are refused (namespaces do not isolate
  vsock: on a VM it reaches the host), and so is io_uring (it opens sockets without the socket system call); calls of
  another ABI (i386, x32, arm32) kill the process. All other system calls are allowed;
- identity: as root, every execution runs as a uid of its own (megarl.sandbox.isolation.UidSlot, taken from a range
  no account uses), so the per-uid process limit and file ownership are per execution; not root, as the trainer's uid
  inside a user namespace that maps only that uid;
- limits, per execution (megarl.sandbox.cgroups): with a writable cgroup hierarchy (v2, or v1 as on this project's CI
  machines) one memory budget (memory_mb, swap included) and one process budget (processes) for all its processes
  together, and its total CPU time is checked every 0.1 s (cpu_s); always rlimits per process (RLIMIT_CPU cpu_s,
  RLIMIT_AS memory_mb, RLIMIT_FSIZE file_mb, RLIMIT_NPROC, no core files) and a wall-clock limit (wall_s) on the
  whole. Without a usable cgroup (the fallback: `describe()["cgroup"]` is None) the per-execution uid still makes
  RLIMIT_NPROC per execution, but memory is bounded per process only (processes x memory_mb in total) and CPU time
  per process only;
- supervision: the execution's pid 1 is bwrap's init, which the kernel shields from every signal sent from inside
  its pid namespace (SIGINT and SIGKILL included); the code is pid 2. How the code ended is bwrap's exit status, read
  by the trainer from the outermost bwrap, which lives in the host's pid namespace where the code cannot reach it.
  When the code's first process ends, the init ends and the kernel kills everything else in the namespace; killing
  the outermost bwrap (wall-clock limit, or the trainer dying) does the same.

Fail closed: before the code runs, its first lines (the PREAMBLE) check that all six namespaces differ from the
trainer's, that it holds no capabilities and that the seccomp filter is in place, then report "started". A run
without that report raises SandboxUnavailable naming what failed and the fix (e.g. bubblewrap missing: `apt-get
install -y bubblewrap`, which launchers/install.sh does as root), as does a machine the filter is not written for
(x86_64 and aarch64 only); the code is never run unisolated.

Two ways to run code: run_python runs a program to its end (stdin in; stdout, stderr and how it ended out); a Session
(megarl.sandbox.session) loads a module once and serves calls of its functions by name, with arguments and results
as plain data (megarl.sandbox.plain), each call with its own limits.

Not protected against: kernel exploits through the system calls that remain (the filter only closes the holes
above), CPU and cache side channels, and whatever the trainer's user can read in /usr and the Python installation
(both read-only). Scoring is not this module's business: megarl.rewards.code judges outside the sandboxed process.
"""
from __future__ import annotations

import tempfile
import time

from . import cgroups, isolation
from .execution import Execution, SandboxLimits, SandboxResult
from .isolation import FIX, SandboxUnavailable
from .session import Session, SessionFailed, SolutionError

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "Session", "SessionFailed", "SolutionError",
           "check_sandbox", "describe", "run_python"]

_CHECKED: set[tuple] = set()


def describe() -> dict:
    """How executions are isolated on this machine (for logs, the benchmark and the tests)."""
    return {"tool": "bubblewrap", "cgroup": cgroups.available(),
            "uid": "per execution" if isolation.is_root() else "the trainer's, in a user namespace"}


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None,
               files: dict[str, str] | None = None) -> SandboxResult:
    """Run `code` as /work/main.py (with `files` beside it) in a fresh sandbox and report how it ended. Raises
    SandboxUnavailable, without running anything, when the isolation cannot be set up."""
    limits = limits or SandboxLimits()
    with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode("utf-8"))
        stdin_file.seek(0)
        with Execution(code, limits, files, stdin=stdin_file) as run:
            stopped = run.pump(run.start + limits.wall_s, limits.cpu_s)
            exit_code, reason = run.finish(stopped)
            return SandboxResult(reason is None, exit_code, run.out.text(), run.err.text(), reason,
                                 time.monotonic() - run.start)


def check_sandbox() -> None:
    """Raise SandboxUnavailable unless a trivial program runs in the sandbox; a success is remembered per process
    (and per isolation tool)."""
    key = (isolation.BWRAP, isolation.is_root())
    if key in _CHECKED:
        return
    result = run_python("print(1)", limits=SandboxLimits(cpu_s=5, wall_s=30))
    if not result.ok or result.stdout.strip() != "1":
        raise SandboxUnavailable(f"the sandbox probe print(1) did not succeed: {result.reason}; stdout "
                                 f"{result.stdout!r}, stderr {result.stderr[-2000:]!r}. {FIX}")
    _CHECKED.add(key)
