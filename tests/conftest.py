"""Import torch + megatron-core once and apply the CPU platform before any test forks its ranks."""
import os
import tempfile
import warnings

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
