"""Engine faults and routing against a real SGLang server on CPU: a killed server is restarted within the cap (or a
clear error), never a hang; the router splits batches across engines and keeps prompt order."""
import os
import signal
import threading
import time

import pytest

from megarl.rollout import EngineClient, EngineError, EngineRouter
from megarl.testing.engines import tiny_engine


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with tiny_engine("qwen2", str(tmp_path_factory.mktemp("engine-faults"))) as server:
        yield server


def test_router_splits_and_keeps_order(server):
    clients = [EngineClient(server.url), EngineClient(server.url)]
    for policy in ("round_robin", "least_loaded"):
        router = EngineRouter(clients, policy=policy)
        prompts = [[5 + i, 6, 7] for i in range(5)]
        out = router.generate(prompts, {"max_new_tokens": 2, "temperature": 0.0})
        assert [c.prompt_ids for c in out] == prompts and all(len(c.output_ids) == 2 for c in out)
        assert router.in_flight == [0, 0]
    assert EngineRouter(clients, "round_robin")._assign(5) == [0, 1, 0, 1, 0]
    least = EngineRouter(clients, "least_loaded")
    least.in_flight = [3, 0]
    assert least._assign(4) == [1, 1, 1, 0]
    with pytest.raises(ValueError, match="rollout.router_policy='fastest' is unknown"):
        EngineRouter(clients, "fastest")


def _kill(srv, delay):
    time.sleep(delay)
    os.killpg(srv.process.pid, signal.SIGKILL)


def test_killed_server_is_restarted_then_capped(server):
    client = EngineClient(server=server, max_restarts=1, retries=3, backoff_s=0.2)
    assert client.generate([[5, 6]], {"max_new_tokens": 2})[0].output_ids
    threading.Thread(target=_kill, args=(server, 0.3)).start()
    start = time.monotonic()
    out = client.generate([[5, 6, 7]] * 8, {"max_new_tokens": 250, "temperature": 1.0, "ignore_eos": True})
    assert all(len(c.output_ids) > 0 for c in out)  # answered by the restarted server
    assert server.restarts == 1 and server.alive()
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
    with pytest.raises(EngineError) as error:
        client.generate([[5, 6]], {"max_new_tokens": 2})
    assert "already restarted 1 times (cap 1)" in str(error.value)
    assert time.monotonic() - start < 240
    server.start()  # leave the module's server running for teardown
