"""pytest fixtures (enable with `pytest_plugins = ["megarl.testing.fixtures"]` in a conftest.py)."""
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import pytest

from ..models.tiny import FAMILIES
from .models import tiny_model_dir

if TYPE_CHECKING:
    from ..rollout import ServerConfig


@pytest.fixture
def tiny_model():
    """Factory: tiny_model("qwen3", **config_overrides) -> path of a tiny random HF model folder (cached)."""
    return tiny_model_dir


@pytest.fixture(params=FAMILIES)
def tiny_model_any_family(request):
    """Path of a tiny model, once per supported family."""
    return tiny_model_dir(request.param)


class _EarlyEngines:
    """Engines of `early_engine` fixtures, launched ahead of their first user. When the collection is done, the engines
    the selected tests will use are put in the order of their first use and the first AHEAD are launched (processes,
    no threads: tests fork ranks); each time a fixture claims its engine, the next ones are launched. A start is ~25 s
    of CPU on 2 cores (imports in three processes, the model, megarl's warm-up), so engines start while earlier tests
    run (the single-process tiers leave a core idle) and while the engine they wait for finishes its own start, instead
    of one after another. AHEAD bounds the memory of engines not yet used (~1.4 GB each, PSS of a tiny MoE engine; an
    idle one takes no CPU: --sleep-on-idle)."""

    AHEAD = 4

    def __init__(self):
        self.specs: dict = {}  # fixture function -> (name, param -> (family, model overrides, ServerConfig kwargs))
        self.queue: list = []  # (fixture function, param) not launched yet, in the order of first use
        self.launched: dict = {}  # (fixture function, param) -> SGLangServer launched, not yet claimed
        self.log_root = None

    def plan(self, session) -> None:
        if session.config.option.collectonly:
            return
        self.log_root = session.config._tmp_path_factory.mktemp("early-engines")
        for item in session.items:
            for name, defs in item._fixtureinfo.name2fixturedefs.items():
                if defs and defs[-1].func in self.specs:
                    key = (defs[-1].func, getattr(item, "callspec", None) and item.callspec.params.get(name))
                    if key not in self.queue:
                        self.queue.append(key)
        self._top_up()

    def _launch(self, key):
        from ..rollout import SGLangServer

        name, server_of = self.specs[key[0]]
        if self.log_root is None:  # a plugin that did not see the collection
            import tempfile

            log_dir = tempfile.mkdtemp(prefix=f"megarl-{name}-")
        else:
            log_dir = self.log_root / f"{name}-{key[1]}"
            log_dir.mkdir(parents=True, exist_ok=True)
        return SGLangServer(server_of(key[1], str(log_dir))).launch()

    def _top_up(self) -> None:
        while self.queue and len(self.launched) < self.AHEAD:
            key = self.queue.pop(0)
            self.launched[key] = self._launch(key)

    def claim(self, key):
        """The engine of `key`, ready: the one launched ahead, else launched now; the next ones are launched first, so
        they start while this one finishes its start-up."""
        if key in self.queue:
            self.queue.remove(key)
        server = self.launched.pop(key, None) or self._launch(key)
        self._top_up()
        return server.wait_ready()

    def stop_unclaimed(self) -> None:  # launched, never used (the session stopped before their first user)
        for server in self.launched.values():
            server.stop()
        self.launched.clear()


_early = _EarlyEngines()


def pytest_collection_finish(session):
    _early.plan(session)


def pytest_sessionfinish(session):
    _early.stop_unclaimed()


def early_engine(family: str | None = None, *, scope: str = "module", params: list | None = None, tp_size: int = 1,
                 extra_args: tuple = (), lora_rank: int | None = None, lora_target_modules: tuple = (),
                 server: Callable[[Any, str], "ServerConfig"] | None = None, **model_overrides):
    """A fixture (module or session scope) whose value is a real SGLang server of the tiny `family` model
    (tiny_model_dir(family, **model_overrides)), launched ahead of its first user (_EarlyEngines) and stopped after
    its last. With `params`, one engine per param and `family=None` serves the param's family. Assign it to the name
    the tests ask for: `engine = early_engine("qwen2", num_hidden_layers=3)`. `server(param, log_dir)`: the engine's
    ServerConfig instead (early_run_engine: the engine a run's config would start)."""
    if scope not in ("module", "session"):
        raise ValueError("early_engine: scope must be 'module' or 'session' (one engine per key is launched ahead)")

    def server_of(param, log_dir: str) -> "ServerConfig":
        if server is not None:
            return server(param, log_dir)
        from ..rollout import ServerConfig

        return ServerConfig(model_path=tiny_model_dir(family or param, **model_overrides), log_dir=log_dir,
                            tp_size=tp_size, extra_args=list(extra_args), lora_rank=lora_rank,
                            lora_target_modules=list(lora_target_modules))

    def fixture(request):
        server = _early.claim((fixture, getattr(request, "param", None)))
        try:
            yield server
        finally:
            server.stop()

    _early.specs[fixture] = (family or "engine", server_of)
    return pytest.fixture(scope=scope, params=params)(fixture)


def early_run_engine(write_config: Callable[[Path, Any], str], model: Callable[[Any], str], *,
                     scope: str = "module", params: list | None = None):
    """An early_engine that is the SGLang server a `megarl train` run would start for itself (run_server_config:
    dtype, seed, MoE routing and LoRA flags, ...): `write_config(folder, param)` writes the run's config into `folder`
    and returns its path, `model(param)` is the model folder the engine loads. Runs given its URL
    (rollout.engine.urls=[url]) share it; each first pushes its own weights into it."""
    from .engines import run_server_config

    def server(param, log_dir: str):
        return run_server_config(write_config(Path(log_dir), param), model(param), log_dir)

    return early_engine(scope=scope, params=params, server=server)


tiny_qwen2_engine = early_engine("qwen2", scope="session")
tiny_qwen2_engine.__doc__ = """One real SGLang server of the default tiny Qwen2 (tiny_model_dir("qwen2")) for the whole
session, shared by the tests that only generate from it or read its log-probs (a server start costs ~25 s on CPU).
Tests that change its weights put them back (see tests/reshard/test_sync_dense.py); tests that kill it start their
own."""
