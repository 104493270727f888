"""Run untrusted Python (model-written code) in a throw-away sandbox: one process tree per execution, no network, hard
resource limits, everything killed and deleted afterwards.

Isolation used, and why. There is no seccomp filter (nothing to install one with from the standard library, and no
container runtime is assumed), so the sandbox is built from Linux namespaces, rlimits and an unprivileged uid, using
util-linux tools only:

    setpriv --pdeathsig=KILL -- unshare --net --pid --mount-proc --fork --kill-child [--user --map-root-user] -- \\
        sh -c SETUP ... -- setpriv [--reuid=65534 --regid=65534 --clear-groups] --no-new-privs --bounding-set=-all \\
        --inh-caps=-all --pdeathsig=KILL -- prlimit --cpu --as --fsize --nproc --core=0 -- \\
        env -i PATH LANG HOME TMPDIR LD_LIBRARY_PATH  <python> -I -S -c SHIM <status fd> main.py

- network namespace: no interfaces but a loopback that is down, so nothing (not even 127.0.0.1 of the host) is
  reachable;
- pid namespace + its own /proc: the code sees only its own processes (not the trainer's command lines or
  /proc/<pid>/environ), and killing the namespace's first process (a small supervisor, the SHIM, which runs the
  code as its child) makes the kernel kill every descendant, so fork bombs and daemonised children cannot outlive
  a run;
- mount namespace: only to mount that /proc and to bind the interpreter's installation read-only at a path the
  sandbox uid can reach (the trainer's Python may live under /root, mode 0700);
- rlimits (CPU seconds, address space, file size, processes, no core files), set by prlimit right before exec;
- as root the code runs as uid/gid 65534 (nobody) with no groups, no capabilities and no_new_privs (root ignores
  RLIMIT_NPROC, and could undo everything else); not root, an unprivileged user namespace maps the caller to root
  inside it, and all capabilities are dropped from the bounding set before the code runs;
- a fresh working directory (also HOME and TMPDIR) that is deleted afterwards, and an environment with only PATH and
  LANG of the trainer's variables.

Before the code runs, SETUP checks that the network, pid and mount namespaces really differ from the trainer's, and
the SHIM reports "started" on a private pipe. A run that fails without that report is an isolation failure and raises
SandboxUnavailable: the code is never run unisolated.

Not protected against (know these before relying on it):
- reading anything world-readable on the host filesystem (source trees, /etc, world-readable data), and writing
  world-writable places outside the working directory (/tmp, /dev/shm), which persist after the run; without root the
  code runs as the trainer's own user and can read and write everything the trainer can;
- disk filling: RLIMIT_FSIZE caps each file, not their number, and there is no quota;
- total memory: RLIMIT_AS is per process, so a run may use up to processes x memory_mb (no cgroup limit);
- RLIMIT_NPROC counts per uid: as root, concurrent sandboxes share uid 65534 and so share one process budget;
- kernel exploits (no seccomp), CPU side channels, and scoring tricks inside the same interpreter (code that ends
  the process early with exit status 0; see megarl.rewards.code for the completion check).
"""
from __future__ import annotations

import math
import os
import platform
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

UNSHARE = "unshare"  # the isolation tool; tests point this at failing programs to check we fail closed
SANDBOX_UID = 65534  # nobody: the uid the code runs as when the trainer is root

_FIX = ("Fix: run the trainer as root, or enable unprivileged user namespaces (sysctl -w "
        "kernel.unprivileged_userns_clone=1 on Debian/Ubuntu kernels, and sysctl -w user.max_user_namespaces=15000); "
        "install util-linux (unshare, setpriv, prlimit, mount); inside a container the runtime must allow "
        "unshare(2) and mount(2) (Docker's default seccomp/AppArmor profiles block them).")

# Runs as root (or mapped root) inside the new namespaces, before privileges are dropped. $1-$3: the trainer's
# net/pid/mnt namespaces (a wrapper that did not isolate must not get further), $4: the Python installation, $5: where
# to bind it read-only; the rest is the command to exec.
_SETUP = r'''
fail() { echo "megarl sandbox: $*" >&2; exit 125; }
[ "$(readlink /proc/self/ns/net)" != "$1" ] || fail "no new network namespace was created"
[ "$(readlink /proc/self/ns/pid)" != "$2" ] || fail "no new pid namespace was created"
[ "$(readlink /proc/self/ns/mnt)" != "$3" ] || fail "no new mount namespace was created"
mount --bind -o ro,nosuid,nodev "$4" "$5" || fail "cannot bind-mount the Python installation $4 read-only"
shift 5
exec "$@"
'''

# Pid 1 of the sandbox: forks the code and reports how it ended on a pipe the code cannot reach (closed in the child;
# PR_SET_DUMPABLE 0 keeps same-uid code out of /proc/1/fd). Pid 1 ignores default-action signals sent from inside its
# namespace, so the code runs as its child to get normal signal semantics (SIGXCPU, self-kill). It also reaps
# orphans, which would otherwise count against RLIMIT_NPROC as zombies.
_SHIM = r'''
import ctypes, os, sys
status_fd, path = int(sys.argv[1]), sys.argv[2]
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(4, 0, 0, 0, 0) != 0:
    os.write(status_fd, b"prctl(PR_SET_DUMPABLE, 0) failed\n")
    sys.exit(125)
os.write(status_fd, b"started\n")
child = os.fork()
if child == 0:
    os.close(status_fd)
    libc.prctl(4, 1, 0, 0, 0)
    sys.argv = [path]
    sys.path.insert(0, os.getcwd())
    with open(path, encoding="utf-8") as f:
        code = compile(f.read(), path, "exec")
    exec(code, {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__})
else:
    while True:
        pid, status = os.wait()
        if pid == child:
            break
    os.write(status_fd, b"exit %d\n" % os.waitstatus_to_exitcode(status))
'''

_STARTED = "started"
_SCRIPT = "main.py"
_CHECKED: set[tuple] = set()


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be set up; nothing was run."""


@dataclass
class SandboxLimits:
    cpu_s: float = 5            # RLIMIT_CPU per process (SIGXCPU at cpu_s, SIGKILL one second later)
    wall_s: float = 10          # wall clock for the whole run, start-up included
    memory_mb: int = 1024       # RLIMIT_AS per process
    file_mb: int = 16           # RLIMIT_FSIZE: largest file the code may write
    processes: int = 32         # RLIMIT_NPROC: processes and threads the code may have at once
    output_bytes: int = 64 * 1024  # the last this many bytes of stdout and of stderr are kept

    def __post_init__(self):
        for name in ("cpu_s", "wall_s", "memory_mb", "file_mb", "processes", "output_bytes"):
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


# ---------------------------------------------------------------------------------------------------------- commands


def _is_root() -> bool:
    return os.geteuid() == 0


def isolation_command() -> list[str]:
    """The namespace wrapper. The outer setpriv makes unshare die with this thread, and --kill-child then takes the
    sandbox with it, so a crashed trainer leaves nothing running."""
    cmd = ["setpriv", "--pdeathsig=KILL", "--", UNSHARE, "--net", "--pid", "--mount-proc", "--fork", "--kill-child"]
    if not _is_root():
        cmd += ["--user", "--map-root-user"]  # unprivileged: the user namespace grants the rights to make the rest
    return cmd + ["--"]


def _drop_privileges() -> list[str]:
    cmd = ["setpriv"]
    if _is_root():
        cmd += [f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups"]
    # the user-namespace root would otherwise keep every capability in its namespaces (e.g. bring loopback up)
    return cmd + ["--no-new-privs", "--bounding-set=-all", "--inh-caps=-all", "--pdeathsig=KILL", "--"]


def _rlimits(limits: SandboxLimits, nproc: int) -> list[str]:
    cpu = math.ceil(limits.cpu_s)
    mb = 1024 * 1024
    return ["prlimit", f"--cpu={cpu}:{cpu + 1}", f"--as={int(limits.memory_mb * mb)}",
            f"--fsize={int(limits.file_mb * mb)}",
            f"--nproc={nproc}", "--core=0", "--"]


def _interpreter() -> tuple[str, str]:
    """(installation root to bind, interpreter path relative to it) for this process's own Python."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.relpath(os.path.realpath(sys.executable), prefix)
    if exe.startswith(os.pardir):
        raise SandboxUnavailable(f"sys.executable={sys.executable!r} is not inside sys.base_prefix={prefix!r}, so "
                                 "the sandbox cannot bind its installation; run the trainer with a standard Python "
                                 "installation or virtual environment")
    return prefix, exe


def _host_namespaces() -> list[str]:
    return [os.readlink(f"/proc/self/ns/{ns}") for ns in ("net", "pid", "mnt")]


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        found = tuple(int(part) for part in platform.release().split("-")[0].split(".")[:2])
    except ValueError:
        return False
    return found >= (major, minor)


def _tasks_of(uid: int) -> int:
    """Tasks (threads) whose real uid is `uid`: what RLIMIT_NPROC counts."""
    n = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except OSError:
            continue  # exited meanwhile
        if int(fields["Uid"].split()[0]) == uid:
            n += int(fields.get("Threads", "1"))
    return n


def _nproc_limit(processes: int) -> int:
    """RLIMIT_NPROC is a per-user count, so add the tasks that already count against it: as root, those of uid 65534
    elsewhere on the host, plus the SHIM; in a user namespace (kernel >= 5.14 counts per namespace), unshare and the
    SHIM; on older kernels the caller's whole process count as well."""
    if _is_root():
        return _tasks_of(SANDBOX_UID) + processes + 1
    if _kernel_at_least(5, 14):
        return processes + 2
    return _tasks_of(os.getuid()) + processes + 2


def _sandbox_argv(limits: SandboxLimits, root: str, workdir: str, status_fd: int) -> tuple[list[str], dict]:
    prefix, exe = _interpreter()
    python_mount = os.path.join(root, "python")
    env = {"PATH": os.environ.get("PATH", os.defpath), "LANG": os.environ.get("LANG", "C.UTF-8"), "HOME": workdir,
           "TMPDIR": workdir, "LD_LIBRARY_PATH": os.path.join(python_mount, "lib")}  # a shared libpython's RUNPATH
    argv = (isolation_command() + ["sh", "-c", _SETUP, "megarl-sandbox", *_host_namespaces(), prefix, python_mount]
            + _drop_privileges() + _rlimits(limits, _nproc_limit(limits.processes))
            + ["env", "-i", *(f"{k}={v}" for k, v in env.items()),
               os.path.join(python_mount, exe), "-I", "-S", "-c", _SHIM, str(status_fd), _SCRIPT])
    wrapper_env = {k: env[k] for k in ("PATH", "LANG")}
    return argv, wrapper_env


# ------------------------------------------------------------------------------------------------ working directory


def _make_dirs(code: str, files: dict[str, str] | None) -> tuple[str, str]:
    """root (0711, not listable) holding the mount point for Python and a randomly named working directory, so
    concurrent sandboxes (same uid) cannot find each other's files."""
    if _SCRIPT in (files or {}):
        raise ValueError(f"files: {_SCRIPT!r} is reserved for the code itself; give the file another name")
    root = tempfile.mkdtemp(prefix="megarl-sandbox-")
    try:
        os.chmod(root, 0o711)
        os.mkdir(os.path.join(root, "python"), 0o755)
        workdir = os.path.join(root, secrets.token_hex(8))
        os.mkdir(workdir, 0o700)
        for name, text in {**(files or {}), _SCRIPT: code}.items():
            path = _inside(workdir, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        if _is_root():
            for dirpath, dirnames, filenames in os.walk(workdir):
                for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                    os.chown(name, SANDBOX_UID, SANDBOX_UID)
    except BaseException:
        _remove(root)
        raise
    return root, workdir


def _inside(workdir: str, name: str) -> str:
    path = os.path.normpath(os.path.join(workdir, name))
    if os.path.isabs(name) or not path.startswith(workdir + os.sep):
        raise ValueError(f"files: {name!r} must be a relative path inside the working directory")
    return path


def _remove(root: str) -> None:
    """Delete the sandbox directory. The Python bind mount exists only inside the sandbox's mount namespace; if it
    were visible here, rmtree would walk into (read-only) interpreter files, so refuse instead."""
    mount = os.path.join(root, "python")
    if os.path.ismount(mount):
        raise SandboxUnavailable(f"the sandbox's bind mount {mount} is visible outside the sandbox; not deleting it. "
                                 f"Unmount it (umount {mount}) and check that `{UNSHARE}` creates mount namespaces.")
    if not _is_root():  # the code runs as our own user then, and may have left directories we cannot enter
        _make_traversable(root)
    shutil.rmtree(root)


def _make_traversable(root: str) -> None:
    for dirpath, dirnames, _ in os.walk(root):  # top-down: each directory is fixed before walk lists it
        for name in dirnames:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):  # never follow a link the code planted out of the sandbox
                os.chmod(path, 0o700)


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


def _pump(streams: dict[int, _Tail], deadline: float) -> bool:
    """Read every pipe until all reach EOF (True) or the deadline passes (False). The sandbox's pid 1 holds stdout,
    stderr and the status pipe until it exits, and the kernel kills the rest of the namespace before that, so EOF on
    all three means the run is over."""
    with selectors.DefaultSelector() as sel:
        for fd in streams:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for key, _ in sel.select(left):
                chunk = os.read(key.fd, 65536)
                if chunk:
                    streams[key.fd].add(chunk)
                else:
                    sel.unregister(key.fd)
    return True


def _children(pid: int) -> list[int]:
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


def _kill(proc: subprocess.Popen) -> None:
    """Kill the sandbox's pid 1, so the kernel kills the whole namespace and unshare reaps it (killing unshare first
    would orphan pid 1 to the host's init); with no pid 1 yet, or if unshare lingers, kill its process group."""
    children = _children(proc.pid)
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if children:
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(proc: subprocess.Popen) -> float:
    """Wait for the wrapper; returns CPU seconds used by the whole sandbox (children's rusage accumulates upward)."""
    if proc.returncode is not None:
        return 0.0
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


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
    if "Resource temporarily unavailable" in last or "can't start new thread" in last:
        return f"process limit ({limits.processes}): {last}"
    return f"exit code {code}: {last or '(no stderr)'}"


def _signal_reason(sig: int, cpu_s: float, limits: SandboxLimits) -> str:
    if sig == signal.SIGXCPU or sig == signal.SIGKILL and cpu_s >= limits.cpu_s:
        return f"cpu limit ({limits.cpu_s:g} s)"
    if sig == signal.SIGXFSZ:
        return f"file size limit ({limits.file_mb} MB)"
    if sig == signal.SIGKILL:
        return ("killed by signal 9 (SIGKILL), not by a limit the sandbox can identify (possibly the kernel OOM "
                "killer)")
    return f"killed by signal {sig} ({_signal_name(sig)})"


def _verdict(status: str, stderr: str, timed_out: bool, cpu_s: float, limits: SandboxLimits
             ) -> tuple[int | None, str | None]:
    """(exit_code, reason) from the SHIM's report."""
    lines = status.split()
    if timed_out:
        return None, f"time limit (wall {limits.wall_s:g} s)"
    if len(lines) >= 3 and lines[1] == "exit":
        code = int(lines[2])
        if code == 0:
            return 0, None
        if code < 0:
            return code, _signal_reason(-code, cpu_s, limits)
        return code, _exit_reason(code, stderr, limits)
    # started but pid 1 died without reporting: only SIGKILL from outside can do that
    return None, (f"sandbox supervisor died without a report (cpu {cpu_s:.1f} s; possibly the kernel OOM killer): "
                  f"{_last_line(stderr)}")


# ------------------------------------------------------------------------------------------------------------- API


def run_python(code: str, stdin: str = "", limits: SandboxLimits | None = None,
               files: dict[str, str] | None = None) -> SandboxResult:
    """Run `code` as main.py (with `files` beside it) in a fresh sandbox and report how it ended. Raises
    SandboxUnavailable, without running anything, when the isolation cannot be set up."""
    limits = limits or SandboxLimits()
    root, workdir = _make_dirs(code, files)
    status_r, status_w = os.pipe()
    proc = None
    start = time.monotonic()
    try:
        argv, env = _sandbox_argv(limits, root, workdir, status_w)
        with tempfile.TemporaryFile() as stdin_file:
            stdin_file.write(stdin.encode("utf-8"))
            stdin_file.seek(0)
            try:
                proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        pass_fds=(status_w,), cwd=workdir, env=env, start_new_session=True)
            except OSError as e:
                raise SandboxUnavailable(f"cannot start the sandbox ({e}). {_FIX}") from None
        os.close(status_w)
        status_w = -1
        out, err, status = _Tail(limits.output_bytes), _Tail(limits.output_bytes), _Tail(4096)
        finished = _pump({proc.stdout.fileno(): out, proc.stderr.fileno(): err, status_r: status},
                         start + limits.wall_s)
        if not finished:
            _kill(proc)
        cpu_s = _reap(proc)
        wall_s = time.monotonic() - start
        report = status.text()
        if not report.startswith(_STARTED):
            if not finished:
                return SandboxResult(False, None, out.text(), err.text(), f"time limit (wall {limits.wall_s:g} s) "
                                     "before the code started (sandbox start-up too slow)", wall_s)
            raise SandboxUnavailable(
                "the sandbox failed before the code ran (isolation, or the interpreter starting under the limits): "
                f"`{UNSHARE}` wrapper exited with status "
                f"{proc.returncode}; stderr: {err.text().strip()!r}{'; ' + report.strip() if report else ''}. {_FIX} If instead the "
                f"interpreter failed to start, raise SandboxLimits.memory_mb (now {limits.memory_mb} MB).")
        exit_code, reason = _verdict(report, err.text(), not finished, cpu_s, limits)
        return SandboxResult(reason is None, exit_code, out.text(), err.text(), reason, wall_s)
    finally:
        if proc is not None:
            if proc.returncode is None:  # an exception above: never leave the sandbox running
                _kill(proc)
                _reap(proc)
            proc.stdout.close()
            proc.stderr.close()
        os.close(status_r)
        if status_w >= 0:
            os.close(status_w)
        _remove(root)


def check_sandbox() -> None:
    """Raise SandboxUnavailable unless a trivial program runs in the sandbox; a success is remembered per process
    (and per isolation tool)."""
    key = (UNSHARE, _is_root())
    if key in _CHECKED:
        return
    result = run_python("print(1)", limits=SandboxLimits(cpu_s=5, wall_s=30))
    if not result.ok or result.stdout.strip() != "1":
        raise SandboxUnavailable(f"the sandbox probe print(1) did not succeed: {result.reason}; stdout "
                                 f"{result.stdout!r}, stderr {result.stderr[-2000:]!r}. {_FIX}")
    _CHECKED.add(key)
