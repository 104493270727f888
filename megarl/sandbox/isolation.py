"""The command that isolates one execution: bubblewrap (bwrap) for the namespaces and the minimal root, util-linux for
the few steps around it, and a per-execution uid when the trainer is root.

    [unshare --mount --propagation private --] sh -c SETUP  (joins the cgroup; as root: binds the interpreter)
      setpriv [--reuid=U --regid=U --clear-groups] --pdeathsig=KILL --      (as root: U is this execution's own uid)
      prlimit --cpu --as --fsize --nproc --core=0 --
      bwrap --unshare-all --unshare-user --disable-userns --die-with-parent --new-session --seccomp FD
            --ro-bind /usr /usr (+ the /bin, /lib... links) --ro-bind <python> /python --proc /proc --dev /dev
            --size N --tmpfs /tmp --size N --tmpfs /dev/shm --size N --tmpfs /work --file FD /work/main.py ...
            --chdir /work --remount-ro / --remount-ro /dev --
      /python/bin/python -I -S -c SHIM ...

Why the steps around bwrap: bwrap runs unprivileged (as U, in a user namespace of its own that maps only U), because
--disable-userns needs that user namespace and because root inside a sandbox would ignore RLIMIT_NPROC. Unprivileged,
it can only bind paths U can reach, and the trainer's Python often lives under /root (mode 0700): so, as root, SETUP
bind-mounts the installation onto a world-reachable mount point inside a private mount namespace of its own (nothing
changes on the host), and bwrap binds it from there.
"""
from __future__ import annotations

import fcntl
import math
import os
import secrets
import shutil
import stat
import sys
import tempfile

from ..errors import UserError

BWRAP = "bwrap"  # the isolation tool; tests point this at failing programs to check that the sandbox fails closed
UID_BASE = 1_900_000_000  # as root, execution k runs as uid UID_BASE + slot (a uid no host account uses)
UID_SLOTS = 4096
WORK = "/work"  # the execution's working directory (HOME) inside the sandbox
PYTHON = "/python"  # where the interpreter's installation appears inside the sandbox
NAMESPACES = ("net", "pid", "mnt", "ipc", "uts", "user")  # each must differ from the trainer's (checked by the SHIM)

_INSTALL_FIX = ("Fix: install bubblewrap (as root: apt-get install -y bubblewrap, which launchers/install.sh does; "
                "or your distribution's bubblewrap package).")
FIX = ("Fix: install bubblewrap (as root: apt-get install -y bubblewrap, which launchers/install.sh does) and "
       "util-linux; the kernel "
       "must allow user namespaces (sysctl user.max_user_namespaces > 0, and kernel.unprivileged_userns_clone=1 on "
       "Debian/Ubuntu kernels that have it); inside a container the runtime must allow unshare(2) and mount(2) "
       "(Docker's default seccomp/AppArmor profiles block them).")


class SandboxUnavailable(UserError, RuntimeError):
    """The sandbox could not be set up; nothing was run."""


def is_root() -> bool:
    return os.geteuid() == 0


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if name == BWRAP or os.path.basename(name) == "bwrap":
            raise SandboxUnavailable(f"bubblewrap ({name!r}) is not installed, so code cannot be isolated. "
                                     f"{_INSTALL_FIX}")
        raise SandboxUnavailable(f"{name!r} is not installed (util-linux). {FIX}")
    return path


def interpreter() -> tuple[str, str]:
    """(installation root to bind, interpreter path relative to it) for this process's own Python."""
    prefix = os.path.realpath(sys.base_prefix)
    exe = os.path.relpath(os.path.realpath(sys.executable), prefix)
    if exe.startswith(os.pardir):
        raise SandboxUnavailable(f"sys.executable={sys.executable!r} is not inside sys.base_prefix={prefix!r}, so "
                                 "the sandbox cannot bind its installation; run the trainer with a standard Python "
                                 "installation or virtual environment")
    return prefix, exe


def host_namespaces() -> list[str]:
    return [os.readlink(f"/proc/self/ns/{ns}") for ns in NAMESPACES]


def _private_dir(name: str, mode: int) -> str:
    """A root-owned directory in the temp dir (created once, reused): refuses one someone else planted."""
    path = os.path.join(tempfile.gettempdir(), name)
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != 0 or info.st_mode & 0o022:
        raise SandboxUnavailable(f"{path} exists but is not a directory owned by root and writable only by it; "
                                 f"remove it (rm -rf {path}) so the sandbox can create its own")
    os.chmod(path, mode)
    return path


class UidSlot:
    """As root: a uid that no other live execution uses, held by an flock (released if the holder dies), so
    RLIMIT_NPROC (a per-uid count) and file ownership are per execution."""

    def __init__(self):
        self.fd, self.uid = -1, None
        if not is_root():
            return
        locks = _private_dir("megarl-sandbox-uids", 0o700)
        start = secrets.randbelow(UID_SLOTS)
        for i in range(UID_SLOTS):
            slot = (start + i) % UID_SLOTS
            fd = os.open(os.path.join(locks, str(slot)), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.fd, self.uid = fd, UID_BASE + slot
            return
        raise SandboxUnavailable(f"all {UID_SLOTS} sandbox uids are in use (more concurrent executions than "
                                 "megarl.sandbox.isolation.UID_SLOTS); run fewer reward workers / tool calls at once")

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# Runs on the host side as the trainer's user (root: in a private mount namespace of its own), before bwrap.
# $1: cgroup.procs files to join, $2/$3: as root, the Python installation and the mount point to bind it on.
SETUP = r'''
fail() { echo "megarl sandbox: $*" >&2; exit 125; }
for f in $1; do echo $$ > "$f" || fail "cannot join the execution's cgroup ($f)"; done
if [ -n "$2" ]; then mount --bind -o ro,nosuid,nodev "$2" "$3" || fail "cannot bind-mount $2 read-only on $3"; fi
shift 3
exec "$@"
'''


def _system_dirs() -> list[str]:
    """/usr read-only, and the top-level /bin, /lib... links (merged /usr) or directories, for the interpreter's
    shared libraries and loader."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    return args


def command(*, procs_files: list[str], uid: int | None, cpu_s: float, memory_bytes: int, file_bytes: int,
            nproc: int, disk_bytes: int, files: dict[str, int], seccomp_fd: int, shim: list[str]) -> list[str]:
    """argv of one execution. `files`: path under WORK -> readable fd with its contents; `seccomp_fd`: a readable fd
    with the compiled filter (megarl.sandbox.seccomp); `shim`: what runs inside, after the interpreter path."""
    prefix, exe = interpreter()
    bwrap = tool(BWRAP)
    cpu = math.ceil(cpu_s)
    if uid is not None:  # root: bind the installation somewhere uid can reach, in a private mount namespace
        mount_point = _private_dir("megarl-sandbox-python", 0o755)
        argv = [tool("unshare"), "--mount", "--propagation", "private", "--", tool("sh"), "-c", SETUP,
                "megarl-sandbox", " ".join(procs_files), prefix, mount_point,
                tool("setpriv"), f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--pdeathsig=KILL", "--"]
    else:
        mount_point = prefix
        argv = [tool("sh"), "-c", SETUP, "megarl-sandbox", " ".join(procs_files), "", "",
                tool("setpriv"), "--pdeathsig=KILL", "--"]
    argv += [tool("prlimit"), f"--cpu={cpu}:{cpu + 1}", f"--as={memory_bytes}", f"--fsize={file_bytes}",
             f"--nproc={nproc}", "--core=0", "--"]
    argv += [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
             "--seccomp", str(seccomp_fd), "--hostname", "sandbox", *_system_dirs(), "--ro-bind", mount_point, PYTHON,
             "--proc", "/proc", "--dev", "/dev"]
    for where in ("/tmp", "/dev/shm", WORK):
        argv += ["--size", str(disk_bytes), "--tmpfs", where]
    dirs = {os.path.dirname(name) for name in files}
    for d in list(dirs):
        while d:
            dirs.add(d)
            d = os.path.dirname(d)
    for d in sorted(dirs - {""}):  # parents sort before their children
        argv += ["--dir", os.path.join(WORK, d)]
    for name, fd in files.items():
        argv += ["--perms", "0644", "--file", str(fd), os.path.join(WORK, name)]
    argv += ["--chdir", WORK, "--remount-ro", "/", "--remount-ro", "/dev", "--",
             os.path.join(PYTHON, exe), "-I", "-S", *shim]
    return argv


def environment() -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": WORK, "TMPDIR": "/tmp",
            "LD_LIBRARY_PATH": os.path.join(PYTHON, "lib")}  # a shared libpython's RUNPATH may be absolute
