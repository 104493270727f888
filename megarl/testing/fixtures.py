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


@pytest.fixture(scope="session")
def tiny_qwen2_engine(tmp_path_factory):
    """One real SGLang server of the default tiny Qwen2 (tiny_model_dir("qwen2")) for the whole session, shared by
    the tests that only generate from it or read its log-probs (a server start costs ~25 s on CPU). Tests that change
    its weights or kill it start their own."""
    from .engines import tiny_engine

    with tiny_engine("qwen2", str(tmp_path_factory.mktemp("tiny-qwen2-engine"))) as server:
        yield server
