"""An SGLang server as a child process: start (CPU or GPU settings), wait for /health, warm up, stop the whole process
group.

On CPU the server runs SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, torch_native attention, no CUDA graphs) with the
the patches and stand-in modules of megarl/compat/sglang_cpu on its PYTHONPATH (megarl.compat.sglang); on a GPU it runs
with SGLang's defaults.

`server_command` is the one place the `sglang.launch_server` command line is built (trainer-started engines, the
Slurm engine nodes and the `--dry-run` plan all go through it; `engine_server_config` maps a run's FleetSpec onto it).

Start-up on a loaded machine: SGLang's own warm-up request has a fixed 10 s read timeout and the server exits when it
runs out (sglang/srt/entrypoints/http_server.py, _execute_server_warmup), so megarl passes --skip-server-warmup and
warms the engine itself (one 1-token generation, bounded by the start-up timeout). A start-up that times out is
retried `startup_retries` times; a deterministic failure (a bad model path, a bad flag) is reported at once.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import requests

from .. import platform
from ..compat.sglang import CPU_STANDINS  # noqa: F401 - where the server finds them
from ..compat.sglang import DELTA_LOADER, cpu_server_env
from ..errors import UserError
from ..lifetime import group_states, guarded
from ..parallel.env import free_port

if TYPE_CHECKING:
    from ..models.lora import LoraConfig
    from ..trainer.config import EngineConfig, TeacherConfig

logger = logging.getLogger(__name__)
_FATAL_MARKERS = ("Received sigquit from a child process",)
_TRAINER_ENV = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"}


class EngineError(UserError, RuntimeError):
    """The rollout engine failed; the message quotes what the engine said."""


class _StartupTimeout(EngineError):
    """Start-up ran out of time (retried by SGLangServer.start)."""


class _PortTaken(_StartupTimeout):
    """Another process bound the server's port first (retried by SGLangServer.start, on a new port when megarl chose
    it)."""


_PORT_TAKEN_MARKER = "address already in use"


# What SGLang's log says when one of its own start-up steps ran out of time (not a deterministic failure)
_TIMEOUT_MARKERS = ("warmup error", "ReadTimeout", "TimeoutError", "timed out")


def _mentions_timeout(log: str) -> bool:
    return any(marker in log for marker in _TIMEOUT_MARKERS)


@dataclass
class ServerConfig:
    model_path: str
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free port
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on GPU
    tp_size: int = 1
    max_total_tokens: int | None = 4096
    mem_fraction_static: float | None = None
    random_seed: int = 0
    seeded_sampling: bool = False  # honour per-request sampling_seed (exact rollouts on resume)
    startup_timeout_s: float = 300.0  # per attempt: process start, /health and megarl's own warm-up generation
    startup_retries: int = 1  # further attempts after a start-up that timed out (a loaded machine)
    base_gpu_id: int | None = None  # GPU: the first GPU of this server (several servers on one node)
    log_dir: str = "runs/engine"
    extra_args: list[str] = field(default_factory=list)
    # Adapter-only weight sync (reshard.lora_sync=adapter): the server serves LoRA adapters up to this rank on these
    # HF modules (model.lora's rank and target_modules); None: no LoRA
    lora_rank: int | None = None
    lora_target_modules: list[str] = field(default_factory=list)
    # reshard.mode=delta: the server loads megarl's delta buckets (megarl.compat.sglang.load_weight_delta)
    delta_sync: bool = False


def server_command(cfg: ServerConfig, port: int | str, on_gpu: bool | None = None) -> tuple[list[str], dict]:
    """The `python -m sglang.launch_server` command line and environment for this device (on_gpu: plan for a GPU or
    CPU device instead of the one this process runs on; port may be a placeholder when only printed)."""
    on_gpu = platform.on_gpu() if on_gpu is None else on_gpu
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
           "--port", str(port), "--tp-size", str(cfg.tp_size)]
    if cfg.base_gpu_id is not None and on_gpu:
        cmd += ["--base-gpu-id", str(cfg.base_gpu_id)]
    cmd += ["--random-seed", str(cfg.random_seed), "--dtype", cfg.dtype or ("bfloat16" if on_gpu else "float32"),
            "--log-level", "warning", "--skip-server-warmup"]  # SGLang's warm-up: see the module docstring
    if cfg.max_total_tokens:
        cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.mem_fraction_static:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    if cfg.lora_rank:
        # Adapters are loaded at run time (megarl.reshard.adapter); a batch holds at most two: the adapter of the
        # previous sync, finishing its requests, and the new one (or the base model's warm-up request).
        cmd += ["--enable-lora", "--max-lora-rank", str(cfg.lora_rank), "--max-loras-per-batch", "2",
                "--lora-target-modules", *cfg.lora_target_modules]
        if not on_gpu:  # the other LoRA backends are Triton / CUDA kernels
            cmd += ["--lora-backend", "torch_native"]
    if cfg.delta_sync:
        cmd += ["--custom-weight-loader", DELTA_LOADER]
    # The trainer runs under torchrun/Slurm; the server is its own distributed job and must not see the trainer's
    # rendezvous variables (with RANK/WORLD_SIZE/MASTER_PORT inherited, SGLang's startup waits on the trainer's store).
    env = {k: v for k, v in os.environ.items() if k not in _TRAINER_ENV and not k.startswith(("TORCHELASTIC_",
                                                                                               "TORCH_ELASTIC_"))}
    # megarl never downloads at run time: a missing local model must fail at once, not after hub time-outs.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    skipped = unused_model_modules(cfg.model_path)
    if skipped:
        env.setdefault("SGLANG_DISABLED_MODEL_ARCHS", ",".join(skipped))
    if not on_gpu:
        # --sleep-on-idle: an idle SGLang scheduler otherwise polls for requests in a busy loop, one core at 100%
        # (sglang's device.sleep_on_idle defaults off), taken from the trainer on a CPU machine; with it the scheduler
        # waits on its sockets (zmq poll: a request wakes it at once). Measured idle: 0.01 core instead of a busy one.
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph", "--sleep-on-idle"]
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        cpu_server_env(env, cfg.seeded_sampling)  # megarl/compat/sglang_cpu: stand-ins, patches (seeded sampling)
        env.setdefault("OMP_NUM_THREADS", "1")
        if cfg.tp_size > 1:
            # SGLang's CPU engine binds each TP rank to one NUMA node unless told which cores to use, and refuses
            # more ranks than NUMA nodes (sglang/srt/utils/numa_utils.py, init_threads_binding).
            env.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_threads_bind(cfg.tp_size))
    elif cfg.seeded_sampling:
        cmd += ["--enable-deterministic-inference"]
    return cmd + [str(a) for a in cfg.extra_args], env


def unused_model_modules(model_path: str) -> list[str]:
    """The modules of sglang.srt.models that do not name the model's architectures (config.json), for SGLang's own
    SGLANG_DISABLED_MODEL_ARCHS: its model registry imports every one of its ~270 model modules at start-up (about 5 s
    of CPU per server; sglang/srt/models/registry.py, import_model_classes) to find one class. A module is kept when
    its source names an architecture; when none does (SGLang would fall back to its transformers backend), or the
    folder has no config.json, nothing is skipped. Read as text: nothing is imported here."""
    import importlib.util
    import json
    import re

    try:
        with open(os.path.join(model_path, "config.json")) as f:
            archs = [a for a in json.load(f).get("architectures") or [] if isinstance(a, str)]
        spec = importlib.util.find_spec("sglang.srt.models")
    except (OSError, ValueError, ImportError):
        return []
    if not archs or spec is None or not spec.submodule_search_locations:
        return []
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, archs)) + r")\b")
    folder = spec.submodule_search_locations[0]
    kept, skipped = [], []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py") and not name.startswith("_"):
            with open(os.path.join(folder, name), errors="replace") as f:
                (kept if pattern.search(f.read()) else skipped).append(name[:-3])
    return skipped if kept else []


def cpu_threads_bind(ranks: int, cores: list[int] | None = None) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for `ranks` CPU engine ranks: this process's cores split into `ranks` groups
    ("0|1", "0,1|2,3"); with fewer cores than ranks, ranks share cores."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else sorted(cores)
    if len(cores) < ranks:
        return "|".join(str(cores[i % len(cores)]) for i in range(ranks))
    per = len(cores) // ranks
    return "|".join(",".join(str(c) for c in cores[i * per:(i + 1) * per]) for i in range(ranks))


@dataclass(frozen=True)
class FleetSpec:
    """Every SGLang server a run uses and what they share: the policy engines (the rollout.engine section), the OPD
    teacher (None when it is off) and the other models' pools (pools.<name>), the run seed and log folder, and two
    switches other sections decide. megarl.trainer.config.fleet_spec is the one place that builds it from a run's
    config; the fleet, the pools and the launch plan read only this."""
    engine: "EngineConfig"
    log_dir: str  # <run_dir>/engine: one folder per pool under it
    seed: int = 0  # engine i samples with random seed seed + i
    seeded_sampling: bool = False  # rollout.deterministic: per-request sampling seeds are honoured
    routed_experts: bool = False  # MoE: SGLang returns each position's routed experts (rollout.engine_routing)
    # Partial rollouts abort requests while they decode (megarl.rollout.router). SGLang 0.5.23's overlap scheduler
    # can crash on that abort (IndexError in ScheduleBatch.filter_batch -> sampling_info.filter_batch, seen on CPU
    # in benchmarks/async_rl.py): those engines run the plain event loop.
    plain_event_loop: bool = False
    teacher: "TeacherConfig | None" = None
    pools: dict = field(default_factory=dict)  # name -> PoolConfig
    # reshard.lora_sync=adapter: the policy engines serve LoRA adapters of this shape (model.lora: a LoraConfig);
    # None: they serve the weights pushed into them
    lora: "LoraConfig | None" = None
    delta_sync: bool = False  # reshard.mode=delta: the policy engines load delta buckets


def engine_server_config(spec: FleetSpec, model_path: str, index: int = 0, host: str = "127.0.0.1",
                         port: int | None = None, log_dir: str | None = None,
                         base_gpu_id: int | None = None) -> ServerConfig:
    """The ServerConfig of policy engine `index` (pools' servers start from it too, megarl.rollout.pools): the
    rollout.engine section's fields, the seed, deterministic sampling and the MoE routing flag. base_gpu_id: several
    engines on one GPU node."""
    e = spec.engine
    return ServerConfig(
        model_path=model_path, host=host, port=port, dtype=e.dtype, tp_size=e.tp_size,
        max_total_tokens=e.max_total_tokens, mem_fraction_static=e.mem_fraction_static,
        random_seed=spec.seed + index, seeded_sampling=spec.seeded_sampling, startup_timeout_s=e.startup_timeout_s,
        startup_retries=e.startup_retries, base_gpu_id=base_gpu_id, log_dir=log_dir or spec.log_dir,
        extra_args=list(e.extra_args) + (["--enable-return-routed-experts"] if spec.routed_experts else []) +
        (["--disable-overlap-schedule"] if spec.plain_event_loop else []),
        lora_rank=spec.lora.rank if spec.lora else None,
        lora_target_modules=list(spec.lora.target_modules) if spec.lora else [], delta_sync=spec.delta_sync)


class SGLangServer:
    """Owns one `sglang.launch_server` process (and its children)."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self.port = cfg.port or free_port()
        self.url = f"http://{cfg.host}:{self.port}"
        os.makedirs(cfg.log_dir, exist_ok=True)
        self.log_path = os.path.join(cfg.log_dir, f"sglang-{self.port}.log")
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self._log_start = 0

    def start(self) -> "SGLangServer":
        """Start the server and wait until it generates (launch + wait_ready)."""
        return self.launch().wait_ready()

    def launch(self) -> "SGLangServer":
        """Start the server process and return at once (wait_ready waits for it), so a trainer can build its models
        while SGLang starts."""
        cmd, env = server_command(self.cfg, self.port)
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()  # log_tail reads this start's lines only (the file keeps every start)
            log.write(f"\n$ {' '.join(cmd)}\n".encode())
            # Own process group (stop() ends all of it), under a guard (megarl.lifetime) that ends the group when
            # the trainer process that started it dies, even by SIGKILL, even during SGLang's start-up.
            self.process = subprocess.Popen(guarded(cmd), env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        return self

    def wait_ready(self) -> "SGLangServer":
        """Wait until the launched server generates; a start-up that timed out (or whose port was taken) is started
        again, cfg.startup_retries more times; any other failure raises EngineError at once."""
        for attempt in range(self.cfg.startup_retries + 1):
            if attempt:
                self.launch()
            try:
                self.wait_healthy()
                return self
            except _StartupTimeout as e:
                self.stop()
                if isinstance(e, _PortTaken) and not self.cfg.port:
                    self.port = free_port()
                    self.url = f"http://{self.cfg.host}:{self.port}"
                if attempt == self.cfg.startup_retries:
                    raise EngineError(f"{e} (attempt {attempt + 1} of {self.cfg.startup_retries + 1}; raise "
                                      "rollout.engine.startup_timeout_s or rollout.engine.startup_retries on a "
                                      "loaded machine)") from None
                logger.warning("SGLang server start-up timed out (attempt %d of %d), starting it again: %s",
                               attempt + 1, self.cfg.startup_retries + 1, str(e).splitlines()[0])
        raise AssertionError("unreachable")

    def wait_healthy(self) -> None:
        """Wait for /health, then warm up with one 1-token generation, all within cfg.startup_timeout_s. Raises
        _StartupTimeout (an EngineError) when that time runs out, EngineError when the server failed."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                message = (f"SGLang server exited with code {self.process.returncode} during start-up (model "
                           f"{self.cfg.model_path!r}). Its log ({self.log_path}) ends with:\n"
                           f"{self.log_tail(lines=40)}")
                if self._port_taken():
                    raise _PortTaken(message)
                # SGLang exits by itself when one of its own start-up requests times out on a loaded machine
                raise (_StartupTimeout if _mentions_timeout(self.log_tail(lines=40)) else EngineError)(message)
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if self._port_taken():  # SGLang's HTTP server failed to bind but its other processes live on
                raise _PortTaken(f"SGLang server could not listen on port {self.port} (taken by another process "
                                 f"since it was chosen). Its log ({self.log_path}) ends with:\n{self.log_tail()}")
            if any(marker in self.log_tail(lines=10) for marker in _FATAL_MARKERS):
                # SGLang's launcher can stay alive after a child process failed: do not wait for the timeout.
                tail = self.log_tail(lines=40)
                self.stop()
                raise EngineError(f"SGLang server failed during start-up (model {self.cfg.model_path!r}). Its log "
                                  f"({self.log_path}) ends with:\n{tail}")
            time.sleep(0.5)
        else:
            raise _StartupTimeout(f"SGLang server not healthy after {self.cfg.startup_timeout_s:.0f}s. Log tail:\n"
                                  f"{self.log_tail()}")
        self._warm_up(deadline)

    def _warm_up(self, deadline: float) -> None:
        """megarl's own warm-up (SGLang's is skipped): one greedy 1-token generation, allowed whatever is left of the
        start-up timeout, so the first real request does not pay the engine's lazy initialisation."""
        try:
            response = requests.post(self.url + "/generate", json={
                "input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}},
                timeout=max(deadline - time.monotonic(), 1.0))
        except requests.Timeout:
            raise _StartupTimeout(f"SGLang server's warm-up generation did not finish within "
                                  f"{self.cfg.startup_timeout_s:.0f}s of its start. Log tail:\n{self.log_tail()}")
        except requests.RequestException as e:
            raise (_StartupTimeout if self.alive() else EngineError)(
                f"SGLang server's warm-up generation failed ({type(e).__name__}: {e}). Log tail:\n"
                f"{self.log_tail()}") from None
        if response.status_code != 200:
            raise EngineError(f"SGLang server's warm-up generation failed (HTTP {response.status_code}): "
                              f"{response.text[:2000]}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stopped(self) -> bool:
        """Whether a process of the server's group (its guard, launcher, scheduler, detokenizer) is stopped: SIGSTOP,
        a debugger. Such a server holds its port and accepts connections but never answers."""
        return self.process is not None and any(state in ("T", "t")
                                                for state in group_states(self.process.pid).values())

    def _port_taken(self) -> bool:
        return _PORT_TAKEN_MARKER in self.log_tail(lines=40).lower()

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                return "".join(f.read().decode(errors="replace").splitlines(keepends=True)[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGKILL the server's process group and wait (at most `timeout` s) for its launcher to exit.

        No SIGTERM first: an engine holds nothing megarl keeps (weights come from the trainer, requests in flight are
        abandoned by whoever stops it), and SGLang 0.5.23's SIGTERM path takes 6-10 s on 2 cores - the launcher
        "drains requests", sees its scheduler die of the group's signal, and its SIGQUIT handler sleeps 5 s before
        its crash diagnostics (sglang/srt/managers/tokenizer_manager.py, dump_requests_before_crash). Measured with
        the tiny Qwen2: SIGTERM to the group 6.2 s until the launcher exits, SIGKILL 0.5 s."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("SGLang server %s (pid %d) did not exit %.0f s after SIGKILL", self.url, self.process.pid,
                           timeout)
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
