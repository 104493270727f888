"""Per-execution cgroups: one memory budget, one process budget and one CPU-time account for everything an execution
starts, so executions cannot disturb one another.

The sandbox's first host process writes itself into the group's cgroup.procs before it execs bubblewrap, so every
process of the execution, bwrap's own included, is inside from the start. Which hierarchy is used:

- cgroup v2 (the unified hierarchy at /sys/fs/cgroup): a leaf under the trainer's own cgroup, when that cgroup
  already delegates the memory and pids controllers to its children (cgroup.subtree_control), or can be made to
  (only possible for a cgroup without processes of its own: v2's no-internal-processes rule);
- cgroup v1 (/sys/fs/cgroup/{memory,pids,cpuacct}): a leaf under the trainer's own cgroup in each hierarchy, when
  those are writable (as root on hosts and containers that mount v1 read-write, like this project's CI machines);
- neither: `available()` says why and the sandbox falls back to rlimits (see megarl.sandbox's docstring).

Leaves are created under the trainer's own cgroup, so limits set on the trainer (a container's) still apply.
"""
from __future__ import annotations

import os
import secrets
import signal
import time
from dataclasses import dataclass

ROOT = "/sys/fs/cgroup"  # tests point this elsewhere to check the fallback
_V1 = ("memory", "pids", "cpuacct")
_PREFIX = "megarl-sandbox-"


def _own_path(controller: str) -> str | None:
    """The trainer's cgroup path in hierarchy `controller` ("" = cgroup v2), from /proc/self/cgroup."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (controller in controllers.split(",")) if controller else controllers == "":
                return path
    return None


def _v2_parent() -> str | None:
    if not os.path.exists(os.path.join(ROOT, "cgroup.controllers")):
        return None
    own = _own_path("")
    if own is None:
        return None
    parent = os.path.join(ROOT, own.lstrip("/"))
    control = os.path.join(parent, "cgroup.subtree_control")
    try:
        with open(control) as f:
            enabled = set(f.read().split())
        if not {"memory", "pids"} <= enabled:
            with open(control, "w") as f:
                f.write("+memory +pids")
    except OSError:
        return None
    return parent


def _v1_parents() -> dict[str, str] | None:
    parents = {}
    for controller in _V1:
        own = _own_path(controller)
        base = os.path.join(ROOT, controller)
        if own is None or not os.path.isdir(base):
            return None
        parents[controller] = os.path.join(base, own.lstrip("/"))
    return parents if all(os.access(p, os.W_OK) for p in parents.values()) else None


_DETECTED: tuple | None = None


def _detect() -> tuple:
    global _DETECTED
    if _DETECTED is None or _DETECTED[0] != ROOT:
        v2 = _v2_parent()
        v1 = None if v2 else _v1_parents()
        _DETECTED = (ROOT, "v2", {"": v2}) if v2 else (ROOT, "v1", v1) if v1 else (ROOT, None, None)
    return _DETECTED


def available() -> str | None:
    """"v2", "v1", or None when no writable hierarchy with the memory and pids controllers exists here."""
    return _detect()[1]


@dataclass
class Group:
    """One execution's cgroup (a directory per hierarchy)."""
    version: str
    dirs: dict[str, str]

    @classmethod
    def create(cls, memory_bytes: int, processes: int) -> "Group | None":
        """A fresh leaf with these limits, or None when no cgroup hierarchy is usable (the rlimit fallback)."""
        _, version, parents = _detect()
        if version is None:
            return None
        name = f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"  # the creator's pid: see remove_left_by
        group = cls(version, {c: os.path.join(p, name) for c, p in parents.items()})
        try:
            for d in group.dirs.values():
                os.mkdir(d)
            if version == "v2":
                group._write("", "memory.max", memory_bytes)
                group._write("", "memory.swap.max", 0, optional=True)
                group._write("", "pids.max", processes)
            else:
                group._write("memory", "memory.limit_in_bytes", memory_bytes)
                group._write("memory", "memory.memsw.limit_in_bytes", memory_bytes, optional=True)  # no swap either
                group._write("pids", "pids.max", processes)
        except BaseException:
            group.remove()
            raise
        return group

    def _write(self, controller: str, name: str, value: int, optional: bool = False) -> None:
        path = os.path.join(self.dirs[controller], name)
        if optional and not os.path.exists(path):
            return
        with open(path, "w") as f:
            f.write(str(value))

    def _read(self, controller: str, name: str) -> str:
        with open(os.path.join(self.dirs[controller], name)) as f:
            return f.read()

    def procs_files(self) -> list[str]:
        """The cgroup.procs files the execution's first process writes its pid into."""
        return [os.path.join(d, "cgroup.procs") for d in self.dirs.values()]

    def cpu_s(self) -> float:
        """CPU seconds used so far by every process the execution ever had."""
        if self.version == "v2":
            stat = dict(line.split() for line in self._read("", "cpu.stat").splitlines())
            return int(stat["usage_usec"]) / 1e6
        return int(self._read("cpuacct", "cpuacct.usage")) / 1e9

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this execution for exceeding the memory budget."""
        text = self._read("", "memory.events") if self.version == "v2" else self._read("memory",
                                                                                         "memory.oom_control")
        fields = dict(line.split() for line in text.splitlines())
        return int(fields.get("oom_kill", 0)) > 0

    def kill(self) -> None:
        """SIGKILL every process still inside (v2: cgroup.kill; v1: each pid of cgroup.procs)."""
        for d in self.dirs.values():
            try:
                if self.version == "v2" and os.path.exists(os.path.join(d, "cgroup.kill")):
                    with open(os.path.join(d, "cgroup.kill"), "w") as f:
                        f.write("1")
                    continue
                with open(os.path.join(d, "cgroup.procs")) as f:
                    pids = [int(p) for p in f.read().split()]
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def remove(self) -> None:
        """rmdir each leaf (the kernel refuses while a process is still inside; callers remove after the execution's
        processes are gone)."""
        for d in self.dirs.values():
            for attempt in range(50):  # a killed process may take a moment to leave (EBUSY meanwhile)
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)


def remove_left_by(pid: int) -> int:
    """Kill and remove the leaves that process `pid` created and could not remove itself (it was SIGKILLed mid-run,
    e.g. by the reward pool's timeout, so its `finally` never ran); returns how many were found. Without this every
    timed-out execution would leave its cgroup directories behind, and a long run would exhaust the host's cgroups."""
    _, version, parents = _detect()
    if version is None:
        return 0
    prefix = f"{_PREFIX}{pid}-"
    names = set()
    for parent in parents.values():
        try:
            names.update(n for n in os.listdir(parent) if n.startswith(prefix))
        except OSError:
            pass
    for name in sorted(names):
        group = Group(version, {c: os.path.join(p, name) for c, p in parents.items()})
        group.kill()
        group.remove()
    return len(names)
