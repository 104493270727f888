"""pytest fixtures (enable with `pytest_plugins = ["megarl.testing.fixtures"]` in a conftest.py)."""
import pytest

from ..models.tiny import FAMILIES
from .models import tiny_model_dir


@pytest.fixture
def tiny_model():
    """Factory: tiny_model("qwen3", **config_overrides) -> path of a tiny random HF model folder (cached)."""
    return tiny_model_dir


@pytest.fixture(params=FAMILIES)
def tiny_model_any_family(request):
    """Path of a tiny model, once per supported family."""
    return tiny_model_dir(request.param)


_early: dict = {}  # "tiny_qwen2_engine": the session server, launched when the collection is done


def pytest_collection_finish(session):
    """When a selected test uses tiny_qwen2_engine, launch its server now (a process, no thread: tests fork ranks) so
    it starts while the tests before its first user run: a start is ~25 s of one core on CPU, and a single-process
    test leaves the other core idle. The fixture then only waits for it."""
    if session.config.option.collectonly:
        return
    if any("tiny_qwen2_engine" in getattr(item, "fixturenames", ()) for item in session.items):
        from ..rollout import ServerConfig, SGLangServer

        log_dir = session.config._tmp_path_factory.mktemp("tiny-qwen2-engine")
        _early["tiny_qwen2_engine"] = SGLangServer(ServerConfig(model_path=tiny_model_dir("qwen2"),
                                                                log_dir=str(log_dir))).launch()


def pytest_sessionfinish(session):
    server = _early.pop("tiny_qwen2_engine", None)
    if server is not None:  # launched, never used (the session stopped before its first user)
        server.stop()


@pytest.fixture(scope="session")
def tiny_qwen2_engine(tmp_path_factory):
    """One real SGLang server of the default tiny Qwen2 (tiny_model_dir("qwen2")) for the whole session, shared by
    the tests that only generate from it or read its log-probs (a server start costs ~25 s on CPU). Tests that change
    its weights put them back (see tests/reshard/test_sync_dense.py); tests that kill it start their own."""
    server = _early.pop("tiny_qwen2_engine", None)
    if server is None:  # not launched early (a plugin that did not see the collection)
        from .engines import tiny_engine

        with tiny_engine("qwen2", str(tmp_path_factory.mktemp("tiny-qwen2-engine"))) as server:
            yield server
        return
    try:
        yield server.wait_ready()
    finally:
        server.stop()
