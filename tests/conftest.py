"""Import torch + megatron-core once and apply the CPU platform before any test forks its ranks."""
import os
import tempfile
import warnings

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MEGARL_TEST_CACHE", tempfile.mkdtemp(prefix="megarl-test-cache-"))
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")

import torch  # noqa: E402

torch.set_num_threads(1)

from megarl import platform  # noqa: E402

platform.setup()
# Heavy imports in the parent, so forked ranks start with them loaded.
import megatron.core.dist_checkpointing  # noqa: E402,F401
import megatron.core.distributed  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.optimizer  # noqa: E402,F401
import megatron.core.pipeline_parallel  # noqa: E402,F401
import mbridge  # noqa: E402,F401
import transformers  # noqa: E402,F401

pytest_plugins = ["megarl.testing.fixtures"]

TIERS = ("unit", "multirank", "engine", "e2e", "slurm")  # lightest to heaviest; a test that does several takes the heaviest


@pytest.hookimpl(tryfirst=True)  # before -m deselects: every collected test is checked
def pytest_collection_modifyitems(config, items):
    """Every test declares exactly one tier (pytestmark = pytest.mark.<tier> in its module, or a decorator on each test
    of a module that mixes tiers), so `-m unit` and friends select what they claim to. A test without one, or with
    two, stops the collection naming it."""
    wrong = []
    for item in items:
        tiers = [m.name for m in item.iter_markers() if m.name in TIERS]
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {tiers or 'no tier'}")
    if wrong:
        raise pytest.UsageError(
            f"{len(wrong)} test(s) need exactly one tier marker out of {', '.join(TIERS)} (tests/README.md):\n  "
            + "\n  ".join(wrong[:50]))



class _LightestTierFirst:
    """Runs the tiers lightest first (a stable sort: each tier keeps pytest's order): a broken unit fails in the first
    minutes, and the session engine launched when the collection is done (megarl.testing.fixtures) starts while the
    single-process tiers leave a core idle, instead of being waited for by the first engine test. A plugin of its own
    because a module holds one function per hook name; trylast: after pytest's own reordering (which groups the
    tests of a module-scoped parametrised engine) and after -m deselects."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda item: TIERS.index(next(m.name for m in item.iter_markers() if m.name in TIERS)))


def pytest_configure(config):
    config.pluginmanager.register(_LightestTierFirst(), "megarl-lightest-tier-first")
