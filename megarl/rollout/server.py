"""An SGLang server as a child process: start (CPU or GPU settings), wait for /health, stop the whole process group.

On CPU the server runs SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1, torch_native attention, no CUDA graphs) with the
two stand-in modules in megarl/platform/sglang_cpu on its PYTHONPATH; on a GPU it runs with SGLang's defaults.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import requests

from .. import platform
from ..parallel.env import free_port

CPU_STANDINS = os.path.join(os.path.dirname(platform.__file__), "sglang_cpu")
_FATAL_MARKERS = ("Received sigquit from a child process",)
_TRAINER_ENV = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"}


class EngineError(RuntimeError):
    """The rollout engine failed; the message quotes what the engine said."""


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
    startup_timeout_s: float = 300.0
    log_dir: str = "runs/engine"
    extra_args: list[str] = field(default_factory=list)


def server_command(cfg: ServerConfig, port: int) -> tuple[list[str], dict]:
    """The `python -m sglang.launch_server` command line and environment for this device."""
    on_gpu = platform.on_gpu()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", cfg.model_path, "--host", cfg.host,
           "--port", str(port), "--tp-size", str(cfg.tp_size), "--random-seed", str(cfg.random_seed),
           "--dtype", cfg.dtype or ("bfloat16" if on_gpu else "float32"), "--log-level", "warning",
           "--skip-server-warmup"]
    if cfg.max_total_tokens:
        cmd += ["--max-total-tokens", str(cfg.max_total_tokens)]
    if cfg.mem_fraction_static:
        cmd += ["--mem-fraction-static", str(cfg.mem_fraction_static)]
    # The trainer runs under torchrun/Slurm; the server is its own distributed job and must not see the trainer's
    # rendezvous variables (with RANK/WORLD_SIZE/MASTER_PORT inherited, SGLang's startup waits on the trainer's store).
    env = {k: v for k, v in os.environ.items() if k not in _TRAINER_ENV and not k.startswith(("TORCHELASTIC_",
                                                                                               "TORCH_ELASTIC_"))}
    # megarl never downloads at run time: a missing local model must fail at once, not after hub time-outs.
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    if not on_gpu:
        cmd += ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph"]
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (CPU_STANDINS, env.get("PYTHONPATH")) if p)
        env.setdefault("OMP_NUM_THREADS", "1")
        if cfg.seeded_sampling:  # see sglang_cpu/sitecustomize.py
            env["MEGARL_SGLANG_SEEDED_SAMPLING"] = "1"
    elif cfg.seeded_sampling:
        cmd += ["--enable-deterministic-inference"]
    return cmd + list(cfg.extra_args), env


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


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

    def start(self) -> "SGLangServer":
        cmd, env = server_command(self.cfg, self.port)
        with open(self.log_path, "ab") as log:
            log.write(f"\n$ {' '.join(cmd)}\n".encode())
            # Own process group (stop() ends all of it), and on Linux the server dies with the trainer process that
            # started it, even after a SIGKILL of the trainer (SGLang's own children follow their parent).
            self.process = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, preexec_fn=_die_with_parent)
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EngineError(f"SGLang server exited with code {self.process.returncode} during start-up "
                                  f"(model {self.cfg.model_path!r}). Its log ({self.log_path}) ends with:\n"
                                  f"{self.log_tail(lines=40)}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if any(marker in self.log_tail(lines=10) for marker in _FATAL_MARKERS):
                # SGLang's launcher can stay alive after a child process failed: do not wait for the timeout.
                tail = self.log_tail(lines=40)
                self.stop()
                raise EngineError(f"SGLang server failed during start-up (model {self.cfg.model_path!r}). Its log "
                                  f"({self.log_path}) ends with:\n{tail}")
            time.sleep(0.5)
        self.stop()
        raise EngineError(f"SGLang server not healthy after {self.cfg.startup_timeout_s:.0f}s. Log tail:\n"
                          f"{self.log_tail()}")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the server's process group, then SIGKILL what is left."""
        if self.process is None:
            return
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self.process = None

    def restart(self) -> None:
        self.stop()
        self.restarts += 1
        self.start()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
