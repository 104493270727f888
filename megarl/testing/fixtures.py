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
