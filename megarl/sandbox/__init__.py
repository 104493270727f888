"""Run untrusted Python (model-written code) in a throw-away sandbox built with bubblewrap: one process tree per
execution in its own namespaces, a minimal read-only root, per-execution limits, everything killed and gone after.

What one execution sees and may do (each line is checked by an adversarial test in tests/test_sandbox.py):

- files: a root of its own. Read-only: /usr (system libraries and tools), the /bin, /lib... links, and the trainer's
  Python installation at /python (run with -I -S: the standard library only, no site-packages). Read-write: its
  working directory /work (also HOME) and private /tmp and /dev/shm, three tmpfs of SandboxLimits.disk_mb each that
  vanish with the execution (nothing carries over to the next one, nothing is left on the host, there is nothing to
  clean up). Also a fresh /proc of its own pid namespace and bwrap's minimal /dev. No other host path exists inside:
  not the project tree, not /etc, /root, the host's /tmp or /dev/shm, nor the host's Unix sockets;
- namespaces: new network (only a loopback that is down: nothing, not even the host's 127.0.0.1, is reachable), PID,
  mount, IPC (host System V shared memory and semaphores are invisible), UTS and user namespaces; creating further
  user namespaces inside is disabled (bwrap --disable-userns), no capabilities, no_new_privs;
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

Fail closed: before the code runs, its first lines (the PREAMBLE) check that all six namespaces differ from the trainer's and that it holds
no capabilities, then reports "started". A run without that report raises SandboxUnavailable naming what failed and
the fix (e.g. bubblewrap missing: `apt-get install -y bubblewrap`, which launchers/install.sh does as root); the code
is never run unisolated.

Not protected against: kernel exploits through the syscalls that remain (there is no seccomp filter), CPU and cache
side channels, and whatever the trainer's user can read in /usr and the Python installation (both read-only).
Scoring is not this module's business: megarl.rewards.code judges outside the sandboxed process.
"""
from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from . import cgroups, isolation
from .isolation import FIX, SandboxUnavailable, UidSlot

__all__ = ["SandboxLimits", "SandboxResult", "SandboxUnavailable", "check_sandbox", "describe", "run_python"]

# Runs inside the sandbox as the code's first lines, in the code's own process (pid 2; bwrap's init is pid 1): checks
# the isolation, reports "started" on a pipe it then closes, and runs main.py. Nothing after that is trusted: how the
# code ended comes from bwrap's exit status, which the code cannot reach (the outer bwrap lives in the host's pid
# namespace). Kept free of imports beyond os/sys: every millisecond here is paid by every execution.
_PREAMBLE = r'''
import os, sys
status_fd, path, host = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
def fail(why):
    os.write(status_fd, ("isolation failed: " + why + "\n").encode())
    os._exit(125)
for ns, theirs in zip(("net", "pid", "mnt", "ipc", "uts", "user"), host):
    if os.readlink("/proc/self/ns/" + ns) == theirs:
        fail("no new %s namespace was created" % ns)
with open("/proc/self/status") as f:
    if any(int(line.split()[1], 16) for line in f if line.startswith(("CapEff", "CapPrm"))):
        fail("the sandbox process still holds capabilities")
try:
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("1000")  # the kernel's OOM killer picks the code, never bwrap's init
except OSError:
    pass
os.write(status_fd, b"started\n")
os.close(status_fd)
sys.argv = [path]
sys.path.insert(0, os.getcwd())
with open(path, encoding="utf-8") as f:
    code = compile(f.read(), path, "exec")
del status_fd, host, fail, f, ns, theirs
exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})
'''

_STARTED = "started"
_SCRIPT = "main.py"
_CHECKED: set[tuple] = set()
_MB = 1024 * 1024


@dataclass
class SandboxLimits:
    cpu_s: float = 5            # CPU seconds: RLIMIT_CPU per process, and the execution's total (with a cgroup)
    wall_s: float = 10          # wall clock for the whole run, start-up included
    memory_mb: int = 1024       # the execution's total (with a cgroup), and RLIMIT_AS per process
    file_mb: int = 16           # RLIMIT_FSIZE: largest file the code may write
    processes: int = 32         # processes and threads the code may have at once (cgroup pids.max and RLIMIT_NPROC)
    disk_mb: int = 64           # size of each of the execution's tmpfs: /work, /tmp, /dev/shm
    output_bytes: int = 64 * 1024  # the last this many bytes of stdout and of stderr are kept

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_mb", "file_mb", "processes", "disk_mb", "output_bytes"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"SandboxLimits.{name}={value!r}: must be a positive number")


@dataclass
class SandboxResult:
    ok: bool                 # exit status 0 and no limit hit
    exit_code: int | None    # the code's exit status, -N if killed by signal N, None if it never finished
    stdout: str
    stderr: str
    reason: str | None       # None when ok, else a short human reason
    wall_s: float


def describe() -> dict:
    """How executions are isolated on this machine (for logs, the benchmark and the tests)."""
    return {"tool": "bubblewrap", "cgroup": cgroups.available(),
            "uid": "per execution" if isolation.is_root() else "the trainer's, in a user namespace"}


# -------------------------------------------------------------------------------------------------- process control


class _Tail:
    """The last `keep` bytes of a stream, so a flood of output cannot exhaust the trainer's memory."""

    def __init__(self, keep: int):
        self.keep, self.data, self.dropped = keep, bytearray(), 0

    def add(self, chunk: bytes) -> None:
        self.data += chunk
        if len(self.data) > 2 * self.keep:
            self.trim()

    def trim(self) -> None:
        extra = len(self.data) - self.keep
        if extra > 0:
            del self.data[:extra]
            self.dropped += extra

    def text(self) -> str:
        self.trim()
        note = f"[... {self.dropped} earlier bytes dropped]\n" if self.dropped else ""
        return note + self.data.decode("utf-8", errors="replace")


def _pump(streams: dict[int, _Tail], deadline: float, group: cgroups.Group | None, cpu_s: float) -> str:
    """Read every pipe until all reach EOF ("done"), the deadline passes ("wall") or, with a cgroup, the execution's
    CPU time exceeds cpu_s ("cpu"). The outer bwrap and its init hold stdout, stderr and the status pipe until they
    exit, and the kernel kills the rest of the pid namespace with its init, so EOF on all three means the
    run is over."""
    with selectors.DefaultSelector() as sel:
        for fd in streams:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return "wall"
            if group is not None and group.cpu_s() > cpu_s:
                return "cpu"
            for key, _ in sel.select(min(left, 0.1) if group is not None else left):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    streams[key.fd].add(chunk)
                else:
                    sel.unregister(key.fd)
    return "done"


def _kill(proc: subprocess.Popen) -> None:
    """SIGKILL the outermost process (bwrap once it started; --die-with-parent then kills its init, and the kernel the
    whole pid namespace) and its process group (anything of the start-up chain)."""
    for kill, target in ((os.kill, proc.pid), (os.killpg, proc.pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _reap(proc: subprocess.Popen) -> float:
    """Wait for the wrapper; returns CPU seconds used by the whole sandbox (children's rusage accumulates upward)."""
    if proc.returncode is not None:
        return 0.0
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def _drain(pipes: list[int], streams: list[_Tail]) -> None:
    """After a kill: read what is left in the pipes (the writers are dead, so this ends)."""
    for fd, tail in zip(pipes, streams):
        try:
            while chunk := os.read(fd, 65536):
                tail.add(chunk)
        except (BlockingIOError, OSError):
            pass


# --------------------------------------------------------------------------------------------------------- verdicts


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


# "ValueError: ..." or a bare "MemoryError" at column 0, unlike traceback frames (indented) and "Traceback (...":
# other processes of the run may still print half a traceback after the one that decided the exit status
_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(:.*)?$", re.MULTILINE)


def _final_error(stderr: str) -> str:
    found = [m.group(0) for m in _ERROR_LINE.finditer(stderr)]
    return found[-1].strip()[:300] if found else _last_line(stderr)


def _signal_name(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


def _exit_reason(code: int, stderr: str, limits: SandboxLimits) -> str:
    """Why the code exited non-zero; a limit only when the final error line says so (Python turns the failing
    syscalls of RLIMIT_AS/FSIZE/NPROC into exceptions, SIGXFSZ is ignored by Python)."""
    last = _final_error(stderr)
    if "MemoryError" in last or "Cannot allocate memory" in last:
        return f"memory limit ({limits.memory_mb} MB): {last}"
    if "File too large" in last:
        return f"file size limit ({limits.file_mb} MB): {last}"
    if "No space left on device" in last:
        return f"disk limit ({limits.disk_mb} MB): {last}"
    if "Resource temporarily unavailable" in last or "can't start new thread" in last:
        return f"process limit ({limits.processes}): {last}"
    return f"exit code {code}: {last or '(no stderr)'}"


def _signal_reason(sig: int, cpu_s: float, oom: bool, limits: SandboxLimits) -> str:
    if oom:
        return f"memory limit ({limits.memory_mb} MB in total): killed by the kernel's OOM killer"
    if sig == signal.SIGXCPU or sig == signal.SIGKILL and cpu_s >= limits.cpu_s:
        return f"cpu limit ({limits.cpu_s:g} s)"
    if sig == signal.SIGXFSZ:
        return f"file size limit ({limits.file_mb} MB)"
    if sig == signal.SIGKILL:
        return "killed by signal 9 (SIGKILL), not by a limit the sandbox can identify"
    return f"killed by signal {sig} ({_signal_name(sig)})"


def _verdict(returncode: int, stderr: str, stopped: str, cpu_s: float, oom: bool, limits: SandboxLimits
             ) -> tuple[int | None, str | None]:
    """(exit_code, reason) from bwrap's exit status: the code's, or 128+N when signal N killed it (bwrap's init)."""
    if stopped == "wall":
        return None, f"time limit (wall {limits.wall_s:g} s)"
    if stopped == "cpu":
        return None, f"cpu limit ({limits.cpu_s:g} s in total)"
    code = -(returncode - 128) if 128 < returncode < 128 + 65 else -returncode if returncode < 0 else returncode
    if oom:  # even when the first process exited 0: one of its processes was killed for the execution's memory
        return code, _signal_reason(signal.SIGKILL, cpu_s, oom, limits)
    if code == 0:
        return 0, None
    if code < 0:
        return code, _signal_reason(-code, cpu_s, oom, limits)
    return code, _exit_reason(code, stderr, limits)


# ------------------------------------------------------------------------------------------------------------- API


def _file_fds(code: str, files: dict[str, str] | None) -> dict[str, int]:
    files = dict(files or {})
    if _SCRIPT in files:
        raise ValueError(f"files: {_SCRIPT!r} is reserved for the code itself; give the file another name")
    files[_SCRIPT] = code
    fds = {}
    try:
        for name, text in files.items():
            path = os.path.normpath(name)
            if os.path.isabs(name) or path == "." or path.startswith(os.pardir):
                raise ValueError(f"files: {name!r} must be a relative path inside the working directory")
            fd = os.memfd_create("megarl-sandbox-file")
            fds[path] = fd
            os.write(fd, text.encode("utf-8"))
            os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None,
               files: dict[str, str] | None = None) -> SandboxResult:
    """Run `code` as /work/main.py (with `files` beside it) in a fresh sandbox and report how it ended. Raises
    SandboxUnavailable, without running anything, when the isolation cannot be set up."""
    limits = limits or SandboxLimits()
    fds = _file_fds(code, files)
    slot, group, proc = None, None, None
    status_r, status_w = os.pipe()
    start = time.monotonic()
    try:
        slot = UidSlot()
        # pids.max: the code's processes + the start-up chain/outer bwrap, bwrap's init; RLIMIT_NPROC counts the same tasks of the uid
        nproc = limits.processes + 3
        try:
            group = cgroups.Group.create(int(limits.memory_mb * _MB), nproc)
        except OSError as e:  # e.g. the host's cgroup limit: no per-execution limits, so run nothing (fail closed)
            raise SandboxUnavailable(f"cannot create the execution's cgroup ({e}). {FIX}") from None
        argv = isolation.command(
            procs_files=group.procs_files() if group else [], uid=slot.uid, cpu_s=limits.cpu_s,
            memory_bytes=int(limits.memory_mb * _MB), file_bytes=int(limits.file_mb * _MB), nproc=nproc,
            disk_bytes=int(limits.disk_mb * _MB), files=fds,
            shim=["-c", _PREAMBLE, str(status_w), _SCRIPT, *isolation.host_namespaces()])
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
            try:
                proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=(status_w, *fds.values()), cwd="/", env=isolation.environment(),
                                        start_new_session=True)
            except OSError as e:
                raise SandboxUnavailable(f"cannot start the sandbox ({e}). {FIX}") from None
        os.close(status_w)
        status_w = -1
        out, err, status = _Tail(limits.output_bytes), _Tail(limits.output_bytes), _Tail(4096)
        pipes = {proc.stdout.fileno(): out, proc.stderr.fileno(): err, status_r: status}
        stopped = _pump(pipes, start + limits.wall_s, group, limits.cpu_s)
        if stopped != "done":
            _kill(proc)
        cpu_s = _reap(proc)
        if stopped != "done":
            _drain(list(pipes), list(pipes.values()))
        if group is not None:
            cpu_s = max(cpu_s, group.cpu_s())
        wall_s = time.monotonic() - start
        report = status.text()
        if not report.startswith(_STARTED):
            if stopped == "wall":
                return SandboxResult(False, None, out.text(), err.text(), f"time limit (wall {limits.wall_s:g} s) "
                                     "before the code started (sandbox start-up too slow)", wall_s)
            raise SandboxUnavailable(
                f"the sandbox failed before the code ran: {report.strip() or 'no report from inside'}; the "
                f"`{isolation.BWRAP}` wrapper exited with status {proc.returncode}; stderr: "
                f"{err.text().strip()[-1000:]!r}. {FIX} If instead the interpreter failed to start, raise "
                f"SandboxLimits.memory_mb (now {limits.memory_mb} MB).")
        oom = group is not None and group.oom_killed()
        exit_code, reason = _verdict(proc.returncode, err.text(), stopped, cpu_s, oom, limits)
        return SandboxResult(reason is None, exit_code, out.text(), err.text(), reason, wall_s)
    finally:
        if proc is not None:
            if proc.returncode is None:  # an exception above: never leave the sandbox running
                _kill(proc)
                _reap(proc)
            proc.stdout.close()
            proc.stderr.close()
        for fd in [status_r, status_w, *fds.values()]:
            if fd >= 0:
                os.close(fd)
        if group is not None:
            group.remove()
        if slot is not None:
            slot.release()


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
