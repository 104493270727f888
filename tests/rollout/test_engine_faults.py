"""Engine faults and routing against a real SGLang server on CPU: a killed server is restarted within the cap (or a
clear error), never a hang; the router splits batches (generation and prompt log-probs) across engines and keeps
their order."""
import os
import signal
import threading
import time

import pytest

from megarl.rollout import EngineClient, EngineError, EngineRouter
from megarl.testing.fixtures import early_engine

pytestmark = pytest.mark.engine


class _Recording(EngineClient):
    """An engine client that records the sequences each prefill call sends."""

    def __init__(self, url):
        super().__init__(url)
        self.sent = []

    def prefill(self, sequences, top_k=0):
        self.sent.append([list(s) for s in sequences])
        return super().prefill(sequences, top_k)


def test_router_splits_and_keeps_order(tiny_qwen2_engine):
    server = tiny_qwen2_engine  # read-only here: the session's server (megarl.testing.fixtures)
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
    # prompt log-probs (a teacher's prefill): each engine gets one request with its share, results in sequence order
    recording = [_Recording(server.url), _Recording(server.url)]
    router = EngineRouter(recording, "round_robin")
    sequences = [[5 + i, 6, 7, 8 + i] for i in range(5)]
    expected = EngineClient(server.url).prompt_log_probs(sequences)
    got = router.prompt_log_probs(sequences)
    assert [len(g) for g in got] == [3] * 5 and router.in_flight == [0, 0]
    assert got == [pytest.approx(e, abs=1e-5) for e in expected]
    assert recording[0].sent == [sequences[0::2]] and recording[1].sent == [sequences[1::2]]


def _kill(srv, delay):
    time.sleep(delay)
    os.killpg(srv.process.pid, signal.SIGKILL)


# the test kills it: its own engine, launched ahead; its stop() also handles a server the test left dead
server = early_engine("qwen2")


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
