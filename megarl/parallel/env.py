"""Who am I in the job: rank, world size and rendezvous address from torchrun or Slurm environment variables."""
from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from typing import Mapping

from ..errors import UserError


class LaunchEnvError(UserError, ValueError):
    pass


@dataclass(frozen=True)
class DistributedEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> "DistributedEnv":
        """torchrun's variables win (a torchrun inside an srun task is the multi-node Slurm recipe); then Slurm's
        (one srun task per rank); else a single process on localhost."""
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(rank=_int(env, "RANK"), world_size=_int(env, "WORLD_SIZE"),
                       local_rank=_int(env, "LOCAL_RANK", 0), master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                       master_port=_int(env, "MASTER_PORT", 29500), launcher="torchrun")
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
            if not nodelist:
                raise LaunchEnvError("SLURM_PROCID is set but SLURM_JOB_NODELIST is not: cannot find the master host. "
                                     "Fix: launch with srun inside an sbatch/salloc allocation, or set MASTER_ADDR.")
            job_id = _int(env, "SLURM_JOB_ID", 0)
            return cls(rank=_int(env, "SLURM_PROCID"), world_size=_int(env, "SLURM_NTASKS"),
                       local_rank=_int(env, "SLURM_LOCALID", 0),
                       master_addr=env.get("MASTER_ADDR") or first_slurm_host(nodelist),
                       # Same port on every task without talking to each other: derived from the job id.
                       master_port=_int(env, "MASTER_PORT", 20000 + job_id % 20000), launcher="slurm")
        return cls(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                   master_port=int(env.get("MASTER_PORT") or free_port()), launcher="single")

    def export(self) -> None:
        """Set the variables torch.distributed's env:// rendezvous reads."""
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
                          MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None or value == "":
        if default is None:
            raise LaunchEnvError(f"environment variable {key} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvError(f"environment variable {key}={value!r} is not an integer") from None


def expand_hostlist(nodelist: str) -> list[str]:
    """A Slurm hostlist expression -> host names: 'gpu[003-005,9],cpu1' -> gpu003 gpu004 gpu005 gpu9 cpu1
    (zero padding kept; one bracket per name, as Slurm writes them)."""
    hosts = []
    for prefix, ranges, suffix in re.findall(r"([^,\[]+)(?:\[([^\]]+)\])?([^,\[]*)", nodelist):
        if not ranges:
            hosts.append(prefix + suffix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}{suffix}")
    return hosts


def first_slurm_host(nodelist: str) -> str:
    """First host of a Slurm hostlist expression: 'gpu[003-005,9],cpu1' -> 'gpu003' (zero padding kept)."""
    hosts = expand_hostlist(nodelist.strip())
    if not hosts or not hosts[0]:
        raise LaunchEnvError(f"cannot parse SLURM_JOB_NODELIST={nodelist!r}")
    return hosts[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, chosen OUTSIDE the kernel's ephemeral range (ip_local_port_range) where one exists.

    The usual bind-to-port-0 trick returns an ephemeral port, which the kernel hands out again as the local port of
    the next outgoing connection (gloo, HTTP clients, SGLang's own sockets): a server started on it a few seconds
    later can find it taken ("address already in use"; seen with two trainers and their engines on one machine).
    Ports below the ephemeral range are only ever taken by a listener that asked for them."""
    import random

    low = _ephemeral_low()
    if low > 11000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(10000, low)
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0  # not Linux: bind to port 0
