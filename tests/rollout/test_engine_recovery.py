"""An engine failure is a weight-versioned event (issue: faults without loss), the pure parts: the client's restart
budget over a time window and its refusal to generate from a restarted engine's own weights; the router moving an
engine's requests to the live engines, leaving out an engine that answers from weights this run never pushed,
EnginesDown when none is left, retirement and rollout.min_engines; the producer collecting a step again once the
engines are restored. The real-engine path is tests/trainer/test_trainer_e2e.py::test_an_engine_killed_mid_run_changes_nothing_that_is_trained."""
import pytest

from megarl.errors import PeerFailed, RemoteUserError
from megarl.parallel.env import free_port
from megarl.rollout.client import (Completion, EngineClient, EngineRestarted, EngineRetired, EngineUnavailable,
                                   engine_unavailable)
from megarl.rollout.router import EngineRouter, EnginesDown
from megarl.rollout.server import EngineError
from megarl.trainer.async_rollout import RolloutBatch, RolloutProducer
from megarl.trainer.workers import recoverable

pytestmark = pytest.mark.unit


class _DeadServer:
    """Stands in for an SGLangServer whose process is dead until restarted (restart() brings it back, counted);
    nothing listens at its URL, so every request fails to connect."""

    def __init__(self):
        self.url = f"http://127.0.0.1:{free_port()}"
        self.restarts, self.log_path, self.up = 0, "/nonexistent/sglang.log", False

    def alive(self):
        return self.up

    def restart(self):
        self.restarts += 1
        self.up = True

    def log_tail(self, lines=25):
        return "(no log)"


def _client(server, **kw):
    return EngineClient(server=server, retries=0, backoff_s=0.0, **kw)


def test_a_restarted_engine_that_held_pushed_weights_generates_nothing_until_they_are_pushed_again():
    server = _DeadServer()
    client = _client(server)
    client.pushed("step-3")  # the trainer's weights were in it
    with pytest.raises(EngineRestarted, match="until the trainer pushes 'step-3' again"):
        client.call("/generate", {})
    assert server.restarts == 1 and client.stale
    with pytest.raises(EngineRestarted):  # refused without a request: its folder's weights must not sample
        client.generate([[1, 2]], {"max_new_tokens": 1})
    assert not client.holds("step-3")
    client.pushed("step-3")
    assert not client.stale


def test_an_engine_without_pushed_weights_is_restarted_and_the_call_retried():
    """Judges, teachers and `megarl eval` serve their folder's weights: a restart changes nothing for them."""
    server = _DeadServer()
    client = _client(server)
    server.alive = lambda: False  # dead again after its restart: the retry finds nothing listening
    with pytest.raises(EngineUnavailable, match="failed after 1 attempts"):
        client.call("/generate", {})
    assert server.restarts == 1 and not client.stale


def test_restart_budget_is_per_time_window_then_the_engine_is_retired():
    server = _DeadServer()
    client = _client(server, max_restarts=2, restart_window_s=100.0)
    client.pushed("step-1")
    clock = [1000.0]
    import megarl.rollout.client as client_module

    real = client_module.time.monotonic
    client_module.time.monotonic = lambda: clock[0]
    try:
        for now in (1000.0, 1050.0, 1200.0, 1210.0):  # the first two are out of the window by the third
            clock[0] = now
            server.up = False
            assert client.revive() and not client.retired
        clock[0] = 1220.0
        server.up = False
        with pytest.raises(EngineRetired, match=r"after 2 restarts within 100 s: retired.*rollout.engine.max_restarts"):
            client.revive()
        assert client.retired and server.restarts == 4
        with pytest.raises(EngineRetired):
            client.call("/generate", {})
    finally:
        client_module.time.monotonic = real


class _SlowServer(_DeadServer):
    """A running engine that answers /health at once and every other request after 3 s; `stopped` plays SIGSTOP."""

    def __init__(self):
        import http.server
        import threading
        import time

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()

            def do_POST(self):
                time.sleep(3.0)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *a):
                pass

        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        super().__init__()
        self.url, self.up, self.is_stopped = f"http://127.0.0.1:{self.http.server_port}", True, False

    def stopped(self):
        return self.is_stopped


def test_a_timed_out_request_restarts_the_engine_only_when_it_is_stopped_or_does_not_answer_health():
    server = _SlowServer()
    try:
        client = EngineClient(server=server, retries=0, backoff_s=0.0, timeout_s=0.3)
        client.pushed("step-2")
        with pytest.raises(EngineUnavailable, match="failed after 1 attempts: ReadTimeout"):
            client.call("/generate", {})  # slow but answering /health: a busy engine, left alone
        assert server.restarts == 0
        server.is_stopped = True  # SIGSTOPped: it accepts connections and never answers
        with pytest.raises(EngineRestarted, match="until the trainer pushes 'step-2' again"):
            client.call("/generate", {})
        assert server.restarts == 1 and client.stale
    finally:
        server.http.shutdown()


class _Engine:
    """Stands in for an engine client: answers under `version`, or raises `error`."""

    def __init__(self, name, version="step-1", error=None):
        self.name, self.version, self.error, self.url, self.prompts = name, version, error, f"http://{name}", []

    def generate(self, prompts, params, **kw):
        if self.error is not None:
            raise self.error
        self.prompts += prompts
        return [Completion(list(p), [7], [-0.1], "length", self.version) for p in prompts]


def test_router_moves_a_dead_engines_requests_to_the_live_ones_and_takes_it_back_after_the_push():
    dead, live = _Engine("a", error=EngineRestarted("a restarted")), _Engine("b")
    router = EngineRouter([dead, live], "round_robin")
    router.weights_pushed("step-1")
    out = router.generate([[i] for i in range(5)], {"max_new_tokens": 1})
    assert [c.prompt_ids for c in out] == [[i] for i in range(5)] and sorted(live.prompts) == [[i] for i in range(5)]
    assert router.live() == [1] and "a restarted" in router.down[0]
    dead.error = None
    router.weights_pushed("step-1")
    assert router.live() == [0, 1]
    router.generate([[9], [10]], {"max_new_tokens": 1})
    assert dead.prompts == [[9]]


def test_router_leaves_out_an_engine_that_answers_from_weights_this_run_never_pushed():
    """A remote engine restarted by its own supervisor serves its checkpoint (SGLang's weight_version "default")."""
    restarted, good = _Engine("a", version="default"), _Engine("b", version="step-2")
    router = EngineRouter([restarted, good], "round_robin")
    for version in ("step-1", "step-2"):
        router.weights_pushed(version)
    out = router.generate([[1], [2], [3]], {"max_new_tokens": 1})
    assert {c.weight_version for c in out} == {"step-2"} and router.live() == [1]
    assert "'default', not one this run pushed" in router.down[0]
    # without pushed versions (megarl eval, the pools) every answer is the engines' own
    assert EngineRouter([_Engine("c", version="default")]).generate([[1]], {})[0].weight_version == "default"


def test_no_live_engine_is_engines_down_and_retired_engines_count_against_min_engines():
    router = EngineRouter([_Engine("a", error=EngineRestarted("a restarted"))])
    with pytest.raises(EnginesDown, match=r"no policy engine can generate: engine 0 \(http://a\): a restarted"):
        router.generate([[1]], {})
    router = EngineRouter([_Engine("a", error=EngineRetired("a retired")), _Engine("b")], min_engines=2)
    with pytest.raises(EngineError, match="only 1 of 2 policy engines remain.*rollout.min_engines=2") as error:
        router.generate([[1], [2]], {})
    assert not isinstance(error.value, EngineUnavailable)  # the end of the run, not something to wait out
    router = EngineRouter([_Engine("a"), _Engine("b")])
    router.retire([0])
    router.weights_pushed("step-1")
    assert router.live() == [1]  # a retired engine never comes back


def test_engine_unavailable_is_recognised_on_every_rank_and_the_producer_waits_for_the_restore():
    assert engine_unavailable(RemoteUserError("x", "EngineRestarted")) and engine_unavailable(EnginesDown("x"))
    assert not engine_unavailable(RemoteUserError("x", "EngineError")) and not engine_unavailable(EngineError("x"))
    assert recoverable(PeerFailed("another rollout worker failed")) and not recoverable(RuntimeError("bug"))
    attempts = []

    def collect(step):
        attempts.append(step)
        if attempts.count(step) == 1 and step == 2:
            raise EnginesDown("every engine restarts")
        return RolloutBatch(step, [], None, None, {"attempt": attempts.count(step)}, {}, {})

    producer = RolloutProducer(collect, 1, 3, max_staleness=3, version=0, recoverable=recoverable)
    try:
        assert producer.take(1).stats == {"attempt": 1}
        with pytest.raises(EnginesDown):
            producer.take(2)
        producer.engines_restored()
        batch = producer.take(2)
        assert batch.stats == {"attempt": 2} and attempts.count(2) == 2  # collected again, not dropped
        producer.put_back(batch)  # another worker's take failed: the trainer takes it again later
        assert producer.take(2) is batch and producer.take(3).step == 3
    finally:
        producer.stop()
