"""Engine faults and routing against a real SGLang server on CPU: a stopped server is found hung and restarted, a
killed one is restarted within its budget (or retired with a clear error), never a hang; an owner killed during an
engine's start-up leaves no engine process; the router splits batches (generation and prompt log-probs) across engines
and keeps their order."""
import os
import signal
import threading
import time

import pytest

from megarl.rollout import EngineClient, EngineRouter
from megarl.rollout.client import EngineRetired
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


def test_a_stopped_server_is_found_hung_killed_and_restarted(server):
    """SIGSTOP on the server's group (every process of it): it accepts connections and never answers. A request that
    timed out finds it stopped, kills and restarts it, and is answered by the restarted server (it had no pushed
    weights, so the request is simply sent again). The old client sent it again to the stopped server, for ever."""
    client = EngineClient(server=server, timeout_s=5.0, retries=2, backoff_s=0.2)
    assert client.generate([[5, 6]], {"max_new_tokens": 2})[0].output_ids
    restarts = server.restarts
    os.killpg(server.process.pid, signal.SIGSTOP)
    assert server.stopped()
    out = client.generate([[5, 6, 7]], {"max_new_tokens": 4, "temperature": 0.0})
    assert len(out[0].output_ids) == 4 and server.restarts == restarts + 1
    assert server.alive() and not server.stopped()


def test_killed_server_is_restarted_then_capped(server):
    client = EngineClient(server=server, max_restarts=1, retries=3, backoff_s=0.2)
    assert client.generate([[5, 6]], {"max_new_tokens": 2})[0].output_ids
    restarts = server.restarts  # (the test before restarted it too)
    threading.Thread(target=_kill, args=(server, 0.3)).start()
    start = time.monotonic()
    out = client.generate([[5, 6, 7]] * 8, {"max_new_tokens": 250, "temperature": 1.0, "ignore_eos": True})
    assert all(len(c.output_ids) > 0 for c in out)  # answered by the restarted server
    assert server.restarts == restarts + 1 and server.alive()
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait()
    with pytest.raises(EngineRetired) as error:  # its restart budget (1 within the window) is spent
        client.generate([[5, 6]], {"max_new_tokens": 2})
    assert "after 1 restarts within 3600 s: retired" in str(error.value) and client.retired
    assert time.monotonic() - start < 240


_OWNER = """
import sys, time
from megarl.rollout import ServerConfig, SGLangServer

server = SGLangServer(ServerConfig(model_path=sys.argv[1], log_dir=sys.argv[2])).launch()
print(server.process.pid, flush=True)
time.sleep(3600)
"""


def test_an_owner_killed_during_engine_start_up_leaves_no_engine_process(tmp_path):
    """The process that started an engine (a trainer, `megarl eval`, a test fixture) is SIGKILLed while the engine
    starts up - when SGLang's scheduler and detokenizer are spawned but have not yet tied themselves to their
    parent. Every process of the engine's group dies with it: its guard (megarl.lifetime) kills the group. Before, a
    `sglang::detokenizer` could survive, re-parented to init. (A SIGTERM to the tree: tests/cli/test_lifetime.py.)"""
    import random
    import subprocess
    import sys

    from megarl.lifetime import group_states
    from megarl.testing.models import tiny_model_dir

    owner = subprocess.Popen([sys.executable, "-c", _OWNER, tiny_model_dir("qwen2"), str(tmp_path)],
                             stdout=subprocess.PIPE, text=True)
    group = int(owner.stdout.readline())
    deadline = time.monotonic() + 120
    while len(group_states(group)) < 3 and time.monotonic() < deadline:  # guard, launcher, its first child
        time.sleep(0.05)
    time.sleep(random.Random().uniform(0.0, 3.0))  # somewhere in the children's start-up
    members = group_states(group)
    assert len(members) >= 3, (members, open(next(tmp_path.glob("sglang-*.log"))).read()[-2000:])
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 120  # the kernel kills them at once; a loaded machine may take a while to reap
    while time.monotonic() < deadline and any(s != "Z" for s in group_states(group).values()):
        time.sleep(0.2)
    left = {pid: s for pid, s in group_states(group).items() if s != "Z"}
    assert not left, [open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:120] for pid in left]
