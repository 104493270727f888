"""A real Slurm cluster on one host, for tests of the sbatch scripts (slurm/).

    ensure_slurm_installed()                       # apt-get install slurm-wlm munge when slurmctld is missing
    with LocalSlurmCluster(scratch, nodes=("n1", "n2")) as cluster:
        job = cluster.sbatch("slurm/train.sbatch", ["configs/x.yaml"], options=["-N2"], env={...})
        info = cluster.wait_for(job, {"COMPLETED"}, timeout=300)   # `scontrol show job` fields
        # or: wait while the job keeps writing under log_dir (300 s without a new byte = stuck; 1800 s in all)
        info = cluster.wait_for(job, {"COMPLETED"}, timeout=300, progress=Progress(log_dir), ceiling=1800)

Everything lives in `scratch`: slurm.conf, a private munged (its own key and socket, not /run/munge), slurmctld and
one slurmd per node name (all on 127.0.0.1 with their own ports: `slurmd -N n1`), state, spool and logs. The daemons
run in the foreground as children of this process and are stopped by their pid files on exit; jobs still running
are cancelled first, and any process left that carries this cluster's SLURM_CONF in its environment (a job step
that escaped) is killed by pid. Running it twice in a row starts from clean state.

`BashSlurm` has the same interface without daemons: it runs the batch script with bash, faked SLURM_* variables and
stub `srun`/`scontrol` commands (one node, srun runs its command locally, `scontrol requeue` reruns the script with
SLURM_RESTART_COUNT+1). Tests use it where Slurm cannot be installed or started.
"""
from __future__ import annotations

import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time

SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin", "/usr/local/sbin", "/usr/local/bin")
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL",
            "DEADLINE"}


class SlurmUnavailable(RuntimeError):
    """Slurm cannot be installed or started here; the message says what failed and quotes the output."""


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(SBIN))


def _tail(text: str | bytes, lines: int = 30) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join(text.strip().splitlines()[-lines:])


def ensure_slurm_installed(timeout: float = 600) -> None:
    """Install Debian's slurm-wlm and munge when slurmctld is missing; SlurmUnavailable with apt's output if not."""
    needed = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "sinfo", "scancel")
    if all(_which(n) for n in needed):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"Slurm is not installed ({[n for n in needed if not _which(n)]} missing) and this "
                               "process is not root, so it cannot apt-get install slurm-wlm munge")
    if not _which("apt-get"):
        raise SlurmUnavailable("Slurm is not installed and apt-get is not available to install slurm-wlm munge")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    attempts = []
    for cmd in (["apt-get", "install", "-y", "slurm-wlm", "munge"], ["apt-get", "update"],
                ["apt-get", "install", "-y", "slurm-wlm", "munge"]):
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            attempts.append(f"$ {' '.join(cmd)}: timed out after {timeout:.0f}s\n{_tail(e.stdout or b'')}")
            continue
        attempts.append(f"$ {' '.join(cmd)}: exit {proc.returncode}\n{_tail(proc.stdout + proc.stderr)}")
        if cmd[1] == "install" and proc.returncode == 0 and all(_which(n) for n in needed):
            return
    raise SlurmUnavailable("could not install Slurm (apt-get install -y slurm-wlm munge):\n" + "\n".join(attempts))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse_scontrol(text: str) -> dict:
    """`scontrol show job -o` output -> {field: value} (the first record)."""
    out: dict = {}
    for token in shlex.split(text.strip().splitlines()[0] if text.strip() else "", posix=False):
        key, eq, value = token.partition("=")
        if eq and key not in out:
            out[key] = value
    return out


class _Jobs:
    """wait_for on top of job_info (shared by the real and the bash-only cluster)."""

    def job_info(self, job_id: str) -> dict:
        raise NotImplementedError

    def job_state(self, job_id: str) -> str:
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait_for(self, job_id: str, states, timeout: float, poll: float = 0.5, progress=None,
                 ceiling: float | None = None) -> dict:
        """Wait until the job is in one of `states`; AssertionError (with the job's fields) when it reaches another
        terminal state or the wait runs out. Without `progress`, after `timeout` seconds. With `progress` (a function
        returning anything comparable, e.g. Progress(files)), the wait follows the job: it runs out only when neither
        the job's state nor progress() changed for `timeout` seconds, or after `ceiling` seconds in all (a loaded
        machine makes a job slower, not stuck)."""
        states = {states} if isinstance(states, str) else set(states)
        clock = Deadline(timeout, progress, ceiling)
        while True:
            info = self.job_info(job_id)
            state = info.get("JobState", "UNKNOWN")
            if state in states:
                return info
            if state in TERMINAL - states:
                raise AssertionError(f"job {job_id} ended {state} (waiting for {sorted(states)}): {info}")
            expired = clock.expired(state)
            if expired:
                raise AssertionError(f"job {job_id} not in {sorted(states)}: {expired}: {info}")
            time.sleep(poll)


class Deadline:
    """A wait's limit. Fixed (`stall` seconds) without `progress`; with it, `stall` seconds without any change in
    progress() or in the `seen` value passed to expired() (a job state), capped at `ceiling` seconds in all
    (default 6 x stall)."""

    def __init__(self, stall: float, progress=None, ceiling: float | None = None):
        self.stall, self.progress = stall, progress
        self.ceiling = ceiling if ceiling is not None else 6 * stall
        self.start = self.changed = time.monotonic()
        self.last = None

    def expired(self, seen=None) -> str | None:
        """None while the wait may go on, else why it ran out."""
        now = time.monotonic()
        if self.progress is None:
            return f"not done after {self.stall:.0f}s" if now - self.start > self.stall else None
        current = (seen, self.progress())
        if current != self.last:
            self.last, self.changed = current, now
        if now - self.start > self.ceiling:
            return f"still waiting after {self.ceiling:.0f}s in all"
        if now - self.changed > self.stall:
            return f"no progress (state or a byte written) for {self.stall:.0f}s"
        return None


class Progress:
    """What a job has written so far: (path, size) of every file under the given files and folders (logs, metrics,
    checkpoints). A job that writes nothing for a while is stuck; one that keeps writing is only slow."""

    def __init__(self, *paths):
        self.paths = [str(p) for p in paths]

    def __call__(self) -> tuple:
        found = []
        for path in self.paths:
            if os.path.isfile(path):
                found.append((path, os.path.getsize(path)))
            for folder, _, files in os.walk(path):
                for name in files:
                    full = os.path.join(folder, name)
                    try:
                        found.append((full, os.path.getsize(full)))
                    except OSError:  # removed meanwhile (a checkpoint being replaced)
                        pass
        return tuple(sorted(found))


class LocalSlurmCluster(_Jobs):
    kind = "slurm"

    def __init__(self, scratch: str, nodes=("n1", "n2"), cpus_per_node: int = 1, start_timeout: float = 30.0,
                 real_memory_mb: int = 4000):
        self.scratch = os.path.abspath(scratch)
        self.nodes, self.cpus_per_node = tuple(nodes), cpus_per_node
        self.start_timeout, self.real_memory_mb = start_timeout, real_memory_mb
        self.conf = os.path.join(self.scratch, "slurm.conf")
        self.logs = os.path.join(self.scratch, "log")
        self.procs: dict[str, subprocess.Popen] = {}
        self.pid_files: dict[str, str] = {}
        self.submitted: list[str] = []
        self.munge_dir: str | None = None

    # ------------------------------------------------------------------------------------------------ set-up
    @property
    def env(self) -> dict:
        """Environment for Slurm commands (and what jobs inherit through sbatch's default --export=ALL)."""
        return dict(os.environ, SLURM_CONF=self.conf)

    def __enter__(self) -> "LocalSlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        ensure_slurm_installed()
        if os.geteuid() != 0:
            raise SlurmUnavailable("LocalSlurmCluster needs root (slurmd runs jobs as the submitting user from a root "
                                   "daemon)")
        for sub in ("state", "spool", "log"):
            shutil.rmtree(os.path.join(self.scratch, sub), ignore_errors=True)
            os.makedirs(os.path.join(self.scratch, sub))
        for node in self.nodes:
            os.makedirs(os.path.join(self.scratch, "spool", f"slurmd_{node}"))
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-f", self.conf],
                    os.path.join(self.scratch, "slurmctld.pid"))
        self._wait_controller()
        for node in self.nodes:
            self._spawn(f"slurmd_{node}", [_which("slurmd"), "-D", "-N", node, "-f", self.conf],
                        os.path.join(self.scratch, f"slurmd_{node}.pid"))
        self._wait_idle()

    def _start_munge(self) -> None:
        # A private munged (own key, socket, pid file) so the cluster does not depend on, or disturb, /run/munge. A
        # unix socket path must stay under 108 bytes: it lives in a short folder under /tmp.
        import tempfile

        self.munge_dir = tempfile.mkdtemp(prefix="megarl-munge-", dir="/tmp")
        key = os.path.join(self.munge_dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = os.path.join(self.munge_dir, "munge.socket")
        self._spawn("munged", [_which("munged"), "-F", "--force", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--pid-file={os.path.join(self.munge_dir, 'munged.pid')}",
                               f"--seed-file={os.path.join(self.munge_dir, 'munged.seed')}",
                               f"--log-file={os.path.join(self.logs, 'munged.log')}"],
                    os.path.join(self.munge_dir, "munged.pid"))
        deadline = time.monotonic() + 10
        while not os.path.exists(self.munge_socket):
            self._check_alive("munged")
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"munged did not create {self.munge_socket} in 10 s:\n{self._log('munged')}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        s = self.scratch
        self.ctld_port = _free_port()
        node_lines = []
        for node in self.nodes:
            node_lines.append(f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={_free_port()} "
                              f"CPUs={self.cpus_per_node} RealMemory={self.real_memory_mb} State=UNKNOWN")
        conf = f"""\
ClusterName=megarltest
SlurmctldHost=localhost
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10,socket={self.munge_socket}
StateSaveLocation={s}/state
SlurmdSpoolDir={s}/spool/slurmd_%n
SlurmctldPidFile={s}/slurmctld.pid
SlurmdPidFile={s}/slurmd_%n.pid
SlurmctldLogFile={s}/log/slurmctld.log
SlurmdLogFile={s}/log/slurmd_%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2,sched_interval=2
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
KillWait=5
MinJobAge=3600
InactiveLimit=0
FirstJobId={random.randint(1000, 9000)}
{chr(10).join(node_lines)}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        with open(self.conf, "w") as f:
            f.write(conf)

    def _spawn(self, name: str, cmd: list, pid_file: str) -> None:
        if cmd[0] is None:
            raise SlurmUnavailable(f"{name}: executable not found")
        out = open(os.path.join(self.logs, f"{name}.stdout"), "wb")
        self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                            start_new_session=True, stdin=subprocess.DEVNULL)
        self.pid_files[name] = pid_file

    def _log(self, name: str, lines: int = 30) -> str:
        text = ""
        for path in (os.path.join(self.logs, f"{name}.stdout"), os.path.join(self.logs, f"{name}.log")):
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    text += f"--- {path}\n" + _tail(f.read(), lines) + "\n"
        return text or "(no log)"

    def _check_alive(self, name: str) -> None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise SlurmUnavailable(f"{name} exited with code {proc.returncode} during start-up:\n{self._log(name)}")

    def _wait_controller(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            self._check_alive("slurmctld")
            if subprocess.run(["scontrol", "ping"], env=self.env, capture_output=True, text=True).stdout.count("UP"):
                return
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"slurmctld not answering after {self.start_timeout:.0f}s:\n"
                                       f"{self._log('slurmctld')}")
            time.sleep(0.2)

    def _wait_idle(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            for node in self.nodes:
                self._check_alive(f"slurmd_{node}")
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True,
                                 text=True).stdout
            states = dict(line.split() for line in out.splitlines() if len(line.split()) == 2)
            if all(states.get(n) == "idle" for n in self.nodes):
                return
            if time.monotonic() > deadline:
                raise SlurmUnavailable(f"nodes not idle after {self.start_timeout:.0f}s (sinfo: {states}):\n" +
                                       "\n".join(self._log(f"slurmd_{n}") for n in self.nodes) +
                                       self._log("slurmctld"))
            time.sleep(0.2)

    # ------------------------------------------------------------------------------------------------ jobs
    def _run(self, cmd: list, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True)
        if check and proc.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def sbatch(self, script: str, args=(), env: dict | None = None, options=(), cwd: str | None = None) -> str:
        """Submit `script args` with sbatch `options`; `env` is added to the job's environment. Returns the job id."""
        full_env = dict(self.env, **(env or {}))
        proc = subprocess.run(["sbatch", "--parsable", *options, script, *args], env=full_env, cwd=cwd,
                              capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"sbatch failed ({proc.returncode}): {proc.stderr.strip()}")
        job_id = proc.stdout.strip().split(";")[0]
        self.submitted.append(job_id)
        return job_id

    def job_info(self, job_id: str) -> dict:
        proc = self._run(["scontrol", "show", "job", "-o", str(job_id)], check=False)
        if proc.returncode:
            return {"JobState": "UNKNOWN", "error": proc.stderr.strip()}
        return parse_scontrol(proc.stdout)

    def scancel(self, job_id: str, signal_name: str | None = None, batch: bool = False) -> None:
        cmd = ["scancel"] + ([f"--signal={signal_name}"] if signal_name else []) + (["--batch"] if batch else [])
        self._run(cmd + [str(job_id)])

    # ------------------------------------------------------------------------------------------------ tear-down
    def _daemon_pid(self, name: str) -> int | None:
        try:
            with open(self.pid_files[name]) as f:
                return int(f.read().strip())
        except (OSError, ValueError, KeyError):
            proc = self.procs.get(name)
            return proc.pid if proc is not None and proc.poll() is None else None

    def _cancel_jobs(self, timeout: float = 20.0) -> None:
        if "slurmctld" not in self.procs or self.procs["slurmctld"].poll() is not None:
            return
        active = [j for j in self.submitted if self.job_state(j) not in TERMINAL | {"UNKNOWN"}]
        for job in active:
            self._run(["scancel", job], check=False)
        deadline = time.monotonic() + timeout
        while active and time.monotonic() < deadline:
            active = [j for j in active if self.job_state(j) not in TERMINAL | {"UNKNOWN"}]
            time.sleep(0.3)

    def stray_pids(self) -> list[int]:
        """Processes (other than the daemons) whose environment carries this cluster's SLURM_CONF: job steps."""
        marker = f"SLURM_CONF={self.conf}".encode()
        daemons = {p.pid for p in self.procs.values()}
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in daemons or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
        return found

    def stop(self) -> None:
        try:
            self._cancel_jobs()
        except Exception:  # noqa: BLE001 - tear-down goes on
            pass
        order = [n for n in self.procs if n.startswith("slurmd_")] + ["slurmctld", "munged"]
        for name in order:
            if name not in self.procs:
                continue
            pid = self._daemon_pid(name)
            proc = self.procs[name]
            for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                if proc.poll() is not None:
                    break
                try:
                    os.kill(pid or proc.pid, sig)
                except ProcessLookupError:
                    pass
                try:
                    proc.wait(wait)
                except subprocess.TimeoutExpired:
                    continue
            if proc.poll() is None and pid and pid != proc.pid:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for pid in self.stray_pids():  # job processes that outlived their step (by pid, never by name)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs.clear()
        if self.munge_dir:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None


# ---------------------------------------------------------------------------------------- without daemons
_SRUN_STUB = r"""#!/bin/bash
# stub srun (slurm_cluster.BashSlurm): one node, runs the command here; --output with %n/%t/%N/%j/%x.
out="" ; mode=truncate
while [ $# -gt 0 ]; do
  case "$1" in
    --output=*|-o?*) out=${1#--output=}; out=${out#-o}; shift ;;
    --output|-o) out=$2; shift 2 ;;
    --open-mode=*) mode=${1#--open-mode=}; shift ;;
    --open-mode) mode=$2; shift 2 ;;
    --nodes=*|--ntasks=*|--ntasks-per-node=*|--cpus-per-task=*|--kill-on-bad-exit*|--export=*|--label|-l|-u|\
--unbuffered|--gpus*=*|--mem=*|--nodelist=*|--exact|--overlap) shift ;;
    --nodes|-N|--ntasks|-n|--ntasks-per-node|--cpus-per-task|-c|--export|--nodelist|-w|--mem) shift 2 ;;
    --) shift; break ;;
    -*) echo "stub srun: unsupported option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
export SLURM_NODEID=0 SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_STEP_NUM_NODES=1 SLURM_STEP_NUM_TASKS=1
if [ -n "$out" ]; then
  out=${out//%n/0}; out=${out//%t/0}; out=${out//%N/$(hostname -s)}; out=${out//%j/$SLURM_JOB_ID}
  out=${out//%x/$SLURM_JOB_NAME}
  if [ "$mode" = append ]; then exec "$@" >>"$out" 2>&1; else exec "$@" >"$out" 2>&1; fi
fi
exec "$@"
"""

_SCONTROL_STUB = r"""#!/bin/bash
# stub scontrol (slurm_cluster.BashSlurm)
case "$1 $2" in
  "show hostnames") echo "${3:-$SLURM_JOB_NODELIST}" | tr ',' '\n' ;;
  "show node") echo "NodeName=$3 NodeAddr=$3 State=ALLOCATED" ;;
  "requeue "*) touch "$BASH_SLURM_DIR/requeue.$2"; echo "stub scontrol: requeue $2" ;;
  *) echo "stub scontrol: unsupported: $*" >&2; exit 1 ;;
esac
"""


class BashSlurm(_Jobs):
    """The sbatch script run with bash, faked SLURM_* variables and stub srun/scontrol (one node, no daemons)."""
    kind = "bash"

    def __init__(self, scratch: str, cpus: int = 2):
        self.scratch, self.cpus = os.path.abspath(scratch), cpus
        self.bin = os.path.join(self.scratch, "bin")
        self.jobs: dict[str, dict] = {}
        self.next_id = random.randint(1000, 9000)

    def __enter__(self) -> "BashSlurm":
        os.makedirs(self.bin, exist_ok=True)
        for name, text in (("srun", _SRUN_STUB), ("scontrol", _SCONTROL_STUB)):
            path = os.path.join(self.bin, name)
            with open(path, "w") as f:
                f.write(text)
            os.chmod(path, 0o755)
        return self

    def __exit__(self, *exc) -> None:
        for job in self.jobs.values():
            proc = job["proc"]
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    @property
    def env(self) -> dict:
        return dict(os.environ)

    def sbatch(self, script: str, args=(), env: dict | None = None, options=(), cwd: str | None = None) -> str:
        opts, output, name, nodes = list(options), "slurm-%j.out", "megarl", 1
        while opts:
            opt = opts.pop(0)
            key, eq, value = opt.partition("=")
            if not eq and key in ("-N", "--nodes", "-o", "--output", "-J", "--job-name", "-D", "--chdir"):
                value = opts.pop(0)
            elif not eq and key[:2] in ("-N", "-o", "-J", "-D") and len(key) > 2:
                key, value = key[:2], key[2:]
            if key in ("-N", "--nodes"):
                nodes = int(value)
            elif key in ("-o", "--output"):
                output = value
            elif key in ("-J", "--job-name"):
                name = value
            elif key in ("-D", "--chdir"):
                cwd = value
        if nodes != 1:
            raise ValueError(f"BashSlurm runs one node, got -N {nodes}")
        job_id = str(self.next_id)
        self.next_id += 1
        self.jobs[job_id] = {"script": script, "args": list(args), "env": dict(env or {}), "cwd": cwd,
                             "output": output.replace("%j", job_id).replace("%x", name), "name": name,
                             "restarts": 0}
        self._launch(job_id)
        return job_id

    def _launch(self, job_id: str) -> None:
        job = self.jobs[job_id]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(job["env"])
        env.update(PATH=self.bin + os.pathsep + env.get("PATH", ""), BASH_SLURM_DIR=self.scratch,
                   SLURM_JOB_ID=job_id, SLURM_JOB_NAME=job["name"], SLURM_JOB_NODELIST="localhost",
                   SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1", SLURM_NODEID="0", SLURM_CPUS_ON_NODE=str(self.cpus),
                   SLURM_SUBMIT_DIR=job["cwd"] or os.getcwd(), SLURM_RESTART_COUNT=str(job["restarts"]))
        with open(job["output"], "ab") as out:
            job["proc"] = subprocess.Popen(["bash", job["script"], *job["args"]], env=env, cwd=job["cwd"],
                                           stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def job_info(self, job_id: str) -> dict:
        job = self.jobs[job_id]
        rc = job["proc"].poll()
        marker = os.path.join(self.scratch, f"requeue.{job_id}")
        if rc is not None and os.path.exists(marker):  # what slurmctld does after `scontrol requeue`
            os.remove(marker)
            job["restarts"] += 1
            self._launch(job_id)
            rc = None
        state = "RUNNING" if rc is None else ("COMPLETED" if rc == 0 else "FAILED")
        return {"JobId": job_id, "JobState": state, "ExitCode": f"{rc if rc is not None else 0}:0",
                "Restarts": str(job["restarts"]), "StdOut": job["output"]}

    def scancel(self, job_id: str, signal_name: str | None = None, batch: bool = False) -> None:
        proc = self.jobs[job_id]["proc"]
        if signal_name:
            sig = getattr(signal, "SIG" + signal_name.upper().removeprefix("SIG"))
            if batch:  # the batch shell only, as `scancel --batch`
                os.kill(proc.pid, sig)
            else:
                os.killpg(proc.pid, sig)
        else:
            os.killpg(proc.pid, signal.SIGTERM)


def open_cluster(scratch: str, nodes=("n1", "n2"), cpus_per_node: int = 1):
    """A LocalSlurmCluster, or, when Slurm cannot be installed or started, (BashSlurm, the reason). Callers must
    report the reason (xfail/skip text), never drop it."""
    try:
        return LocalSlurmCluster(scratch, nodes, cpus_per_node).__enter__(), None
    except SlurmUnavailable as e:
        return BashSlurm(os.path.join(scratch, "bash-slurm")).__enter__(), str(e)


if __name__ == "__main__":  # python tests/slurm_cluster.py SCRATCH: start a cluster, print SLURM_CONF, wait
    with LocalSlurmCluster(sys.argv[1] if len(sys.argv) > 1 else "scratch/slurm") as c:
        print(f"export SLURM_CONF={c.conf}   # Ctrl-C stops the cluster", flush=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
