"""Engine pools: SGLang servers of models other than the policy (`pools.<name>`: judges, verifiers, meta-verifiers;
the `teacher:` section is one more), each pool with its own EngineRouter.

A pool with `model` is started by rank 0 of this job, `num_engines` servers through the policy engines' one
ServerConfig builder (megarl.rollout.server.engine_server_config: the run seed, deterministic sampling, start-up
timeouts and retries), with the pool's TP size, dtype and log folder <run_dir>/engine/<name>; on a GPU node its servers
take the GPUs after the policy engines' and the teacher's. A pool with `urls` is reached there. No pool is ever in the
trainer's weight syncs: those are built from the policy's engines only (megarl.trainer.rl).
"""
from __future__ import annotations

import os
from dataclasses import replace

from .. import platform
from .client import EngineClient
from .router import EngineRouter
from .server import FleetSpec, ServerConfig, SGLangServer, engine_server_config


def model_pools(spec: FleetSpec) -> list:
    """(name, PoolConfig) of every other model the run serves: the OPD teacher (when enabled), then pools: in config
    order. Those with `model` are started by rank 0 in this order."""
    return ([("teacher", spec.teacher)] if spec.teacher is not None else []) + list(spec.pools.items())


def first_gpus(spec: FleetSpec, policy_gpus: int | None = None) -> dict[str, int]:
    """The first GPU of each started pool's servers on rank 0's node: after the policy engines' (`policy_gpus`, default
    rollout.engine.num_engines x tp_size when rank 0 starts them, 0 with rollout.engine.urls), the teacher, then the
    pools in config order (each server takes tp_size GPUs)."""
    e = spec.engine
    if policy_gpus is None:
        policy_gpus = 0 if e.urls else e.num_engines * e.tp_size
    offset, out = policy_gpus, {}
    for name, pool in ((name, pool) for name, pool in model_pools(spec) if pool.model):
        out[name] = offset
        offset += pool.num_engines * pool.tp_size
    return out


def pool_server_config(spec: FleetSpec, name: str, pool, index: int = 0,
                       policy_gpus: int | None = None) -> ServerConfig:
    """Server `index` of pool `name` (a PoolConfig; the teacher's too): the policy engines' ServerConfig with the pool's
    model, TP size, dtype and KV budget, its own log folder, its GPUs (see first_gpus), and no MoE routing flag (a
    pool's routing is never replayed) nor LoRA."""
    e = spec.engine
    base = engine_server_config(spec, pool.model, e.num_engines + index, log_dir=os.path.join(spec.log_dir, name),
                                base_gpu_id=first_gpus(spec, policy_gpus)[name] + index * pool.tp_size)
    return replace(base, tp_size=pool.tp_size, dtype=pool.dtype, extra_args=list(e.extra_args),
                   max_total_tokens=pool.max_total_tokens or base.max_total_tokens,
                   lora_rank=None, lora_target_modules=[])  # the policy's adapters are never loaded into a pool


class EnginePools:
    """The pools of `spec.pools`: rank 0 owns the servers of those with `model`; every rollout worker gets a router per
    pool (routers()) from the URLs rank 0 hands out (wait_ready())."""

    def __init__(self, spec: FleetSpec, rank: int):
        self.spec, self.rank = spec, rank
        self.servers: dict[str, list[SGLangServer]] = {}

    def launch(self, now: bool = False) -> "EnginePools":
        """Rank 0 launches the servers of the pools with `model` and returns at once. On CPU as soon as called (start-up
        overlaps the trainer's build); on a GPU only with now=True, once the trainer holds its memory (SGLang sizes its
        KV cache from the memory free at its start: see megarl.rollout.fleet)."""
        if self.rank != 0 or (platform.on_gpu() and not now):
            return self
        for name, pool in self.spec.pools.items():
            if pool.model and name not in self.servers:
                self.servers[name] = []  # filled one by one: stop() reaches those launched before a failure
                for i in range(pool.num_engines):
                    self.servers[name].append(SGLangServer(pool_server_config(self.spec, name, pool, i)).launch())
        return self

    def wait_ready(self) -> dict[str, list[str]]:
        """Rank 0: every pool's URLs (its `urls`, or its servers' once they generate)."""
        self.launch(now=True)
        return {name: list(pool.urls) or [server.wait_ready().url for server in self.servers[name]]
                for name, pool in self.spec.pools.items()}

    def routers(self, urls: dict[str, list[str]]) -> dict[str, EngineRouter]:
        """One EngineRouter per pool, over the URLs wait_ready() gave (rank 0: over its own servers, so a server that
        dies is restarted by its client)."""
        out = {}
        for name, pool in self.spec.pools.items():
            owned = self.servers.get(name)
            clients = [EngineClient(server=s) for s in owned] if owned else [EngineClient(u) for u in urls[name]]
            out[name] = EngineRouter(clients, pool.router_policy)
        return out

    def stop(self) -> None:
        for servers in self.servers.values():
            for server in servers:
                server.stop()


def pool_tokenizer_path(pool, client: EngineClient, field: str) -> str:
    """The tokenizer folder of a pool: pool.tokenizer, pool.model, or the folder its first server reports (SGLang
    /model_info), which must be on this machine."""
    from ..errors import UserError

    path = pool.tokenizer or pool.model
    if path is None:
        info = client.call("/model_info", method="GET") or {}
        path = info.get("tokenizer_path") or info.get("model_path")
    if not path or not os.path.isdir(path):
        raise UserError(f"{field}.tokenizer: the pool's tokenizer ({path!r}, from {client.url}) is not a folder on "
                        f"this machine. Fix: set {field}.tokenizer to a local copy of the judge model's tokenizer files")
    return path
