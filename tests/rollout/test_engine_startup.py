"""Engine start-up on a loaded machine: a start-up that times out is retried (bounded), a deterministic failure is
not, and the engine counts as started only once it has generated (megarl's own warm-up). A stand-in server script
plays SGLang here (no timing involved: it fails or serves on command)."""
import sys
import textwrap

import pytest

from megarl.rollout import server as server_module
from megarl.parallel.env import free_port
from megarl.rollout.server import EngineError, ServerConfig, SGLangServer, cpu_threads_bind

pytestmark = pytest.mark.unit

FAKE = textwrap.dedent('''
    import json, os, sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    port, state, failures, message = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    starts = int(open(state).read()) if os.path.exists(state) else 0
    open(state, "w").write(str(starts + 1))
    if starts < failures:
        print(message, flush=True)
        sys.exit(3)
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with open(state + ".generated", "w") as f:
                json.dump(body, f)
            self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
        def log_message(self, *args):
            pass
    HTTPServer(("127.0.0.1", port), Handler).serve_forever()
''')


def _fake(monkeypatch, tmp_path, failures, message):
    script = tmp_path / "fake_sglang.py"
    script.write_text(FAKE)
    state = tmp_path / "starts"

    def command(cfg, port, on_gpu=None):
        return [sys.executable, str(script), str(port), str(state), str(failures), message], {}

    monkeypatch.setattr(server_module, "server_command", command)
    return state


def test_timed_out_start_is_retried_and_warmed_up(monkeypatch, tmp_path):
    state = _fake(monkeypatch, tmp_path, 1, "Initialization failed. warmup error: ReadTimeout(read timeout=10)")
    server = SGLangServer(ServerConfig(model_path="m", log_dir=str(tmp_path / "log"), startup_retries=1))
    try:
        server.start()
        assert server.alive() and state.read_text() == "2"  # the first start timed out, the second served
        generated = (tmp_path / "starts.generated").read_text()
        assert '"max_new_tokens": 1' in generated  # megarl's own warm-up request reached the engine
    finally:
        server.stop()


def test_retries_are_bounded(monkeypatch, tmp_path):
    state = _fake(monkeypatch, tmp_path, 5, "ReadTimeout")
    server = SGLangServer(ServerConfig(model_path="m", log_dir=str(tmp_path / "log"), startup_retries=2))
    with pytest.raises(EngineError) as error:
        server.start()
    assert state.read_text() == "3" and "attempt 3 of 3" in str(error.value)
    assert "rollout.engine.startup_retries" in str(error.value) and not server.alive()


def test_deterministic_failure_is_not_retried(monkeypatch, tmp_path):
    state = _fake(monkeypatch, tmp_path, 5, "OSError: no such model")
    server = SGLangServer(ServerConfig(model_path="m", log_dir=str(tmp_path / "log"), startup_retries=2))
    with pytest.raises(EngineError) as error:
        server.start()
    assert state.read_text() == "1" and "OSError: no such model" in str(error.value)


def test_taken_port_is_retried_on_a_new_port(monkeypatch, tmp_path):
    """Another process listens on the port megarl chose (it was free when chosen): the start is retried on a new
    port, and the retry is judged on its own log lines (the first start's "address already in use" stays in the
    file)."""
    import socket

    _fake(monkeypatch, tmp_path, 0, "")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        ports = iter([taken.getsockname()[1]])
        monkeypatch.setattr(server_module, "free_port", lambda: next(ports, None) or free_port())
        server = SGLangServer(ServerConfig(model_path="m", log_dir=str(tmp_path / "log"), startup_retries=1))
        try:
            server.start()
            assert server.alive() and server.port != taken.getsockname()[1]
            assert server.url.endswith(f":{server.port}")
            assert "address already in use" in open(server.log_path).read().lower()
        finally:
            server.stop()


def test_free_port_is_outside_the_ephemeral_range():
    """Outgoing connections take their local port from ip_local_port_range; a server port chosen there can be taken
    before the server binds it."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    if low <= 11000:
        pytest.skip("no room below this machine's ephemeral port range")
    assert all(10000 <= free_port() < low for _ in range(20))


def test_sglang_imports_only_the_model_modules_that_name_the_architecture(tmp_path):
    """SGLANG_DISABLED_MODEL_ARCHS skips the model modules that cannot hold the model's class; the one that defines
    it is kept (found by SGLang's registry in a real start: every engine test), and an unknown architecture or a
    folder without config.json skips nothing (SGLang's own fallback decides)."""
    import json

    from megarl.rollout.server import unused_model_modules, server_command

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"]}))
    skipped = unused_model_modules(str(folder))
    assert "qwen2" not in skipped and {"llama", "qwen3_moe", "deepseek_v2"} <= set(skipped)
    _, env = server_command(ServerConfig(model_path=str(folder)), 1234, on_gpu=False)
    assert env["SGLANG_DISABLED_MODEL_ARCHS"].split(",") == skipped
    (folder / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    assert unused_model_modules(str(folder)) == []
    assert unused_model_modules(str(tmp_path / "nowhere")) == []


def test_cpu_threads_bind_splits_the_cores():
    assert cpu_threads_bind(2, [0, 1]) == "0|1"
    assert cpu_threads_bind(2, [0, 1, 2, 3]) == "0,1|2,3"
    assert cpu_threads_bind(2, [5]) == "5|5"
