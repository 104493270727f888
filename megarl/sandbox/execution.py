"""One sandboxed execution, from start to clean-up: the command (megarl.sandbox.isolation) started with its limits,
its pipes pumped, its CPU time and wall clock watched, its end turned into a verdict, and everything it had (processes,
cgroup, uid slot, fds) gone after close(). megarl.sandbox.run_python runs a program to its end with one; a
megarl.sandbox.session.Session keeps one running and talks to it. See megarl.sandbox for what the isolation covers.
"""
from __future__ import annotations

import dataclasses
import os
import re
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Callable

from . import cgroups, isolation, seccomp
from .isolation import FIX, SandboxUnavailable, UidSlot

# Runs inside the sandbox as the code's first lines, in the code's own process (pid 2; bwrap's init is pid 1): checks
# the isolation (namespaces, no capabilities, the seccomp filter in place), reports "started" on a pipe it then
# closes, and runs main.py. Nothing after that is trusted: how the code ended comes from bwrap's exit status, which the
# code cannot reach (the outer bwrap lives in the host's pid namespace). Kept free of imports beyond os/sys: every
# millisecond here is paid by every execution.
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
    status = dict(line.split(":", 1) for line in f)
if int(status["CapEff"], 16) or int(status["CapPrm"], 16):
    fail("the sandbox process still holds capabilities")
if status.get("Seccomp", "").strip() != "2":
    fail("no seccomp filter is applied")
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
del status_fd, host, fail, f, ns, theirs, status
exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})
'''

_STARTED = "started"
_SCRIPT = "main.py"
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
    # a Session only (megarl.sandbox.session): each call (and the module's loading, start-up included)
    call_cpu_s: float = 2       # CPU seconds of one call (checked with a cgroup; without, its wall clock bounds it)
    call_wall_s: float = 10     # wall clock of one call (the session's wall_s bounds all of them together)
    result_bytes: int = 1 << 20  # largest encoded result of one call

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"SandboxLimits.{field.name}={value!r}: must be a positive number")


@dataclass
class SandboxResult:
    ok: bool                 # exit status 0 and no limit hit
    exit_code: int | None    # the code's exit status, -N if killed by signal N, None if it never finished
    stdout: str
    stderr: str
    reason: str | None       # None when ok, else a short human reason
    wall_s: float


# -------------------------------------------------------------------------------------------------- process control


class _Tail:
    """The last `keep` bytes of a stream, so a flood of output cannot exhaust the trainer's memory."""

    def __init__(self, keep: int):
        self.keep, self.data, self.dropped, self.eof = keep, bytearray(), 0, False

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


def _pump(streams: dict[int, _Tail], deadline: float, cpu_over: Callable[[], bool] | None,
          until: Callable[[], bool] | None = None, send: tuple[int, bytearray] | None = None) -> str:
    """Read every pipe not at EOF yet (and write `send`'s bytes as its pipe takes them) until `until()` holds and all
    of `send` is written ("until"), all pipes reach EOF ("eof"), the deadline passes ("wall") or cpu_over() holds
    ("cpu", checked every 0.1 s). The outer bwrap and its init hold the pipes until they exit, and the kernel kills
    the rest of the pid namespace with its init, so EOF on all of them means the run is over. A pipe's EOF is
    remembered in its tail."""
    with selectors.DefaultSelector() as sel:
        for fd, tail in streams.items():
            if not tail.eof:
                sel.register(fd, selectors.EVENT_READ)
        if send is not None and send[1]:
            sel.register(send[0], selectors.EVENT_WRITE)
        while True:
            if until is not None and until() and not (send and send[1]):  # and all of `send` is written
                return "until"
            if all(tail.eof for tail in streams.values()):  # the run is over: `send` can never be written, but what
                return "until" if until is not None and until() else "eof"  # it wrote before its end still counts
            left = deadline - time.monotonic()
            if left <= 0:
                return "wall"
            if cpu_over is not None and cpu_over():
                return "cpu"
            for key, _ in sel.select(min(left, 0.1) if cpu_over is not None else left):
                if key.fd not in streams:
                    _write(sel, key.fd, send[1])
                elif chunk := os.read(key.fd, 65536):
                    streams[key.fd].add(chunk)
                else:
                    sel.unregister(key.fd)
                    streams[key.fd].eof = True


def _write(sel: selectors.BaseSelector, fd: int, data: bytearray) -> None:
    """Write what the pipe takes now; unregister it once all is written or its reader is gone (what ended the reader
    shows on the other pipes)."""
    try:
        del data[:os.write(fd, data[:65536])]
    except BrokenPipeError:
        data.clear()
    if not data:
        sel.unregister(fd)


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


def _drain(streams: dict[int, _Tail]) -> None:
    """Read what the (non-blocking) pipes hold now; after a kill, all that is left (the writers are dead)."""
    for fd, tail in streams.items():
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


def error_reason(error: str, limits: SandboxLimits) -> str:
    """An error line ("OSError: [Errno 27] File too large"), prefixed with the limit it shows when it shows one:
    Python turns the failing syscalls of RLIMIT_AS/FSIZE/NPROC into exceptions (SIGXFSZ is ignored by Python)."""
    if "MemoryError" in error or "Cannot allocate memory" in error:
        return f"memory limit ({limits.memory_mb} MB): {error}"
    if "File too large" in error:
        return f"file size limit ({limits.file_mb} MB): {error}"
    if "No space left on device" in error:
        return f"disk limit ({limits.disk_mb} MB): {error}"
    if "Resource temporarily unavailable" in error or "can't start new thread" in error:
        return f"process limit ({limits.processes}): {error}"
    return error


def _exit_reason(code: int, stderr: str, limits: SandboxLimits) -> str:
    """Why the code exited non-zero: its final error line, and the limit it shows if any."""
    last = _final_error(stderr)
    reason = error_reason(last, limits)
    return reason if reason != last else f"exit code {code}: {last or '(no stderr)'}"


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


# ------------------------------------------------------------------------------------------------------ execution


def _memfd(data: bytes) -> int:
    """A readable fd with `data`, for bwrap to read (--file, --seccomp)."""
    fd = os.memfd_create("megarl-sandbox-file")
    try:
        os.write(fd, data)
        os.lseek(fd, 0, os.SEEK_SET)
    except BaseException:
        os.close(fd)
        raise
    return fd


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
            fds[path] = _memfd(text.encode("utf-8"))
    except BaseException:
        for fd in fds.values():
            os.close(fd)
        raise
    return fds


class Execution:
    """`code` running as /work/main.py (with `files` beside it) in a fresh sandbox, from start to clean-up. Raises
    SandboxUnavailable, without running anything, when the isolation cannot be set up. `pass_fds` reach the code
    with their numbers; `merge_output` sends stderr into the stdout pipe. Use it as a context manager: leaving it
    kills whatever still runs and removes the cgroup and the uid slot."""

    def __init__(self, code: str, limits: SandboxLimits, files: dict[str, str] | None = None,
                 stdin=subprocess.DEVNULL, merge_output: bool = False, pass_fds: tuple[int, ...] = ()):
        self.limits, self.start = limits, time.monotonic()
        self.slot, self.group, self.proc = None, None, None
        self.status_r, status_w = os.pipe()
        passed = [status_w]  # the child's copies are all it needs: closed here once it has them
        try:
            filter_fd = _memfd(seccomp.program())
            passed.append(filter_fd)
            fds = _file_fds(code, files)
            passed += fds.values()
            self.slot = UidSlot()
            # pids.max: the code's processes + the start-up chain/outer bwrap, bwrap's init; RLIMIT_NPROC counts the
            # same tasks of the uid
            nproc = limits.processes + 3
            try:
                self.group = cgroups.Group.create(int(limits.memory_mb * _MB), nproc)
            except OSError as e:  # e.g. the host's cgroup limit: no per-execution limits, so run nothing (fail closed)
                raise SandboxUnavailable(f"cannot create the execution's cgroup ({e}). {FIX}") from None
            argv = isolation.command(
                procs_files=self.group.procs_files() if self.group else [], uid=self.slot.uid, cpu_s=limits.cpu_s,
                memory_bytes=int(limits.memory_mb * _MB), file_bytes=int(limits.file_mb * _MB), nproc=nproc,
                disk_bytes=int(limits.disk_mb * _MB), files=fds, seccomp_fd=filter_fd,
                shim=["-c", _PREAMBLE, str(status_w), _SCRIPT, *isolation.host_namespaces()])
            try:
                self.proc = subprocess.Popen(
                    argv, stdin=stdin, stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT if merge_output else subprocess.PIPE, pass_fds=(*passed, *pass_fds),
                    cwd="/", env=isolation.environment(), start_new_session=True)
            except OSError as e:
                raise SandboxUnavailable(f"cannot start the sandbox ({e}). {FIX}") from None
        except BaseException:
            self.close()
            raise
        finally:
            for fd in passed:
                os.close(fd)
        self.out, self.status = _Tail(limits.output_bytes), _Tail(4096)
        self.err = self.out if merge_output else _Tail(limits.output_bytes)
        self.streams = {self.proc.stdout.fileno(): self.out, self.status_r: self.status}
        if not merge_output:
            self.streams[self.proc.stderr.fileno()] = self.err
        for fd in self.streams:
            os.set_blocking(fd, False)

    def __enter__(self) -> "Execution":
        return self

    def __exit__(self, *_) -> None:
        self.close()

    def cpu_s(self) -> float:
        """CPU seconds used so far by all its processes (its cgroup's account; 0.0 without a cgroup)."""
        return self.group.cpu_s() if self.group is not None else 0.0

    def pump(self, deadline: float, cpu_limit: float, until: Callable[[], bool] | None = None,
             send: tuple[int, bytearray] | None = None) -> str:
        """_pump on its pipes; "cpu" once its cgroup's CPU account passes cpu_limit (not checked without one)."""
        over = (lambda: self.group.cpu_s() > cpu_limit) if self.group is not None else None
        return _pump(self.streams, deadline, over, until, send)

    def oom_killed(self) -> bool:
        """The kernel's OOM killer killed one of its processes for the execution's memory budget (cgroup only)."""
        return self.group is not None and self.group.oom_killed()

    def started(self) -> bool:
        """The preamble checked the isolation and reported (the code may have run)."""
        _drain({self.status_r: self.status})  # what it wrote so far (a non-blocking pipe: this returns)
        return self.status.text().startswith(_STARTED)

    def finish(self, stopped: str) -> tuple[int | None, str | None]:
        """End the run after pump returned `stopped` (killed unless "eof": it ended by itself) and say how it ended:
        (exit code, reason), reason None when it succeeded. SandboxUnavailable when the code never started (unless
        the wall clock ran out first: start-up too slow)."""
        if stopped != "eof":
            _kill(self.proc)
        cpu_s = _reap(self.proc)
        if stopped != "eof":
            _drain(self.streams)
        if self.group is not None:
            cpu_s = max(cpu_s, self.group.cpu_s())
        if not self.started():
            if stopped == "wall":
                return None, (f"time limit (wall {self.limits.wall_s:g} s) before the code started (sandbox "
                              "start-up too slow)")
            raise SandboxUnavailable(
                f"the sandbox failed before the code ran: {self.status.text().strip() or 'no report from inside'}; "
                f"the `{isolation.BWRAP}` wrapper exited with status {self.proc.returncode}; stderr: "
                f"{self.err.text().strip()[-1000:]!r}. {FIX} If instead the interpreter failed to start, raise "
                f"SandboxLimits.memory_mb (now {self.limits.memory_mb} MB).")
        return _verdict(self.proc.returncode, self.err.text(), stopped, cpu_s, self.oom_killed(), self.limits)

    def close(self) -> None:
        """Kill whatever still runs (the kernel then kills the whole pid namespace), close the pipes, remove the
        cgroup and release the uid slot. Idempotent."""
        if self.proc is not None:
            if self.proc.returncode is None:
                _kill(self.proc)
                _reap(self.proc)
            for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                if pipe is not None:
                    pipe.close()
            self.proc = None
        if self.status_r >= 0:
            os.close(self.status_r)
            self.status_r = -1
        if self.group is not None:
            self.group.remove()
            self.group = None
        if self.slot is not None:
            self.slot.release()
            self.slot = None
