"""The engine fleet: every SGLang server a run uses, and the clients every rank reaches them with.

    fleet = EngineFleet(spec, model_path, rank)  # rank 0 launches the servers this job runs (CPU: at once)
    ...build the trainer...
    fleet.connect()                              # a collective: rank 0 waits for them; every rank gets the URLs
    fleet.clients                                # the policy engines: the only ones weight syncs reach
    fleet.teacher(), fleet.pool_routers()        # the OPD teacher and the pools (judges, verifiers): never synced
    fleet.stop()

On CPU the servers are launched as soon as the model folder exists, so SGLang's start-up overlaps the trainer's model
build; on a GPU only in connect(), once the trainer holds its memory (SGLang sizes its KV cache from the memory free at
its start, which must not race the trainer's allocations). With rollout.engine.urls (teacher.urls, pools.<n>.urls)
the job launches nothing and reaches those.
"""
from __future__ import annotations

from .. import platform
from ..errors import on_rank0
from .client import EngineClient
from .pools import EnginePools, pool_server_config
from .server import FleetSpec, SGLangServer, engine_server_config
from .teacher import Teacher


def launch_policy_engines(spec: FleetSpec, model_path: str, rank: int, now: bool = False) -> list[SGLangServer]:
    """Rank 0: the policy engines this job runs itself (none with rollout.engine.urls), launched (not yet ready).
    Several engines on one node take their own GPUs."""
    e = spec.engine
    if rank != 0 or e.urls or (platform.on_gpu() and not now):
        return []
    return [SGLangServer(engine_server_config(spec, model_path, i, base_gpu_id=i * e.tp_size if i else None)).launch()
            for i in range(e.num_engines)]


def launch_teacher(spec: FleetSpec, rank: int, now: bool = False) -> SGLangServer | None:
    """opd with teacher.model: rank 0 launches ONE more server for the teacher through the policy engines'
    ServerConfig builder (its own log folder, TP size and dtype; GPUs after the policy engines'), at the same moment
    as those."""
    if rank != 0 or spec.teacher is None or not spec.teacher.model or (platform.on_gpu() and not now):
        return None
    return SGLangServer(pool_server_config(spec, "teacher", spec.teacher)).launch()  # the teacher is a pool too


class EngineFleet:
    def __init__(self, spec: FleetSpec, model_path: str, rank: int):
        self.spec, self.model_path, self.rank = spec, model_path, rank
        self.servers: list[SGLangServer] = []
        self.teacher_server: SGLangServer | None = None
        self.pools = EnginePools(spec, rank)
        self.clients: list[EngineClient] = []
        self.urls: list[str] = []
        self._teacher_urls: list[str] = []
        self._pool_urls: dict[str, list[str]] = {}
        try:
            self.servers = launch_policy_engines(spec, model_path, rank)
            self.teacher_server = launch_teacher(spec, rank)
            self.pools.launch()
        except BaseException:
            self.stop()
            raise

    @property
    def local(self) -> bool:
        """The policy engines run on rank 0's node (started by this job)."""
        return bool(self.servers)

    def connect(self) -> "EngineFleet":
        """A collective: rank 0 launches what is still to launch (GPU) and waits until its servers generate; every
        rank gets the URLs and a client per policy engine."""
        self.urls = on_rank0(self._policy_urls)
        self._teacher_urls = on_rank0(self._teacher) if self.spec.teacher is not None else []
        self._pool_urls = on_rank0(self.pools.wait_ready) if self.spec.pools else {}
        e = self.spec.engine
        self.clients = [EngineClient(server=s, max_restarts=e.max_restarts, restart_window_s=e.restart_window_s,
                                     timeout_s=e.request_timeout_s)
                        for s in self.servers] if self.servers else [EngineClient(u, timeout_s=e.request_timeout_s)
                                                                for u in self.urls]
        return self

    def _policy_urls(self) -> list[str]:
        if self.spec.engine.urls:
            return list(self.spec.engine.urls)
        self.servers = self.servers or launch_policy_engines(self.spec, self.model_path, self.rank, now=True)
        return [server.wait_ready().url for server in self.servers]

    def _teacher(self) -> list[str]:
        """Rank 0: the teacher's URLs (teacher.urls, tokenizers checked where visible; or its server, once it
        generates)."""
        if self.spec.teacher.urls:
            Teacher([EngineClient(u) for u in self.spec.teacher.urls]).check_tokenizer(self.model_path)
            return list(self.spec.teacher.urls)
        self.teacher_server = self.teacher_server or launch_teacher(self.spec, self.rank, now=True)
        return [self.teacher_server.wait_ready().url]

    def teacher(self) -> Teacher | None:
        """opd: the teacher's engines, asked for log-probs only (not in `clients`, so no weight sync reaches them)."""
        if not self._teacher_urls:
            return None
        return Teacher([EngineClient(server=self.teacher_server) if self.teacher_server else EngineClient(u)
                        for u in self._teacher_urls])

    def pool_routers(self) -> dict:
        """pools.<name>: one router each (also never in `clients`)."""
        return self.pools.routers(self._pool_urls)

    def release_memory(self) -> None:
        """Colocated GPUs: the policy engines give their memory to training (nothing on CPU or with remote engines)."""
        self._each_client("release_memory")

    def resume_memory(self) -> None:
        self._each_client("resume_memory")

    def flush_prefix_cache(self) -> None:
        """Empty the policy engines' prefix caches (rank 0), as every weight update does: a held-out evaluation
        between two steps then leaves the engines as the step's sync left them, so evaluating more often never
        changes what later steps sample (the prefix KV they reuse is computed by their own requests)."""
        if self.rank == 0:
            for client in self.clients:
                client.flush_cache()

    def _each_client(self, method: str) -> None:
        if self.rank == 0 and platform.on_gpu() and not self.spec.engine.urls:
            for client in self.clients:
                getattr(client, method)()

    def stop(self) -> None:
        for server in self.servers + [self.teacher_server]:
            if server is not None:
                server.stop()
        self.pools.stop()
