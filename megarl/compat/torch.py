"""torch 2.13.0 (torch.distributed.elastic): a worker restarted by torchrun must not read the previous attempt's
process-group addresses.

torchrun (--max-restarts N) starts the workers again after one fails. With the default static rendezvous
(--master-addr/--master-port: torch/distributed/elastic/rendezvous/static_tcp_rendezvous.py, next_rendezvous,
`if not self._store`), the agent creates its TCPStore once and every attempt's workers use it
(TORCHELASTIC_USE_AGENT_STORE=True), while torch/distributed/rendezvous.py `_create_c10d_store` adds no per-attempt
prefix ("We create a new TCPStore for every retry so no need to add prefix for each attempt"). The keys the previous
attempt's workers wrote - each gloo group's listening addresses - are still there, so a restarted rank that creates a
group before its peer has overwritten them connects to a dead worker: measured, "Gloo connectFullMesh failed ...
Connection refused" in megatron-core's first gloo group, and the restart fails. megarl gives each attempt its own key
prefix (TORCHELASTIC_RESTART_COUNT) on the agent's store.
"""
from __future__ import annotations

import os
from datetime import timedelta

VERSION = "2.13.0"  # the torch release this module was written for (launchers/install.sh)


def restarted_workers_store(master_addr: str, master_port: int, world_size: int, timeout: timedelta):
    """The store init_process_group should use in a worker torchrun restarted (None otherwise: torch's env://
    rendezvous as usual): the agent's store, under a prefix of this attempt's own."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    from torch.distributed import PrefixStore, TCPStore

    store = TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timeout)
    return PrefixStore(f"megarl/attempt_{attempt}", store)


def check_assumptions() -> list[str]:
    """What this module relies on in the installed torch; returns the broken assumptions (empty: all hold)."""
    import inspect

    import torch
    from torch.distributed.elastic.agent.server import local_elastic_agent

    problems = []
    if torch.__version__.split("+")[0] != VERSION:
        problems.append(f"torch {torch.__version__} is installed, this module was written for {VERSION}")
    source = inspect.getsource(local_elastic_agent)
    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"):
        if name not in source:
            problems.append(f"torchrun no longer sets {name} for its workers (local_elastic_agent.py)")
    return problems
