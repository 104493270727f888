"""The model-bridge smoke run (`megarl smoke`, docs/models.md) end to end, on 2 ranks."""
import json

import pytest

from megarl import cli
from megarl.testing import run_ranks

pytestmark = pytest.mark.e2e


def test_smoke_run_passes_and_writes_summary(tmp_path):
    codes = run_ranks(2, cli.main, ["smoke", "--family", "qwen2", "--tp", "1", "--pp", "2", "--out", str(tmp_path)])
    assert codes == [0, 0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["logits_max_abs_diff_vs_transformers"] < 1e-4
    assert summary["roundtrip_mismatched_tensors"] == [] and summary["hf_tensors"] > 0
    assert summary["layout"]["pp"] == 2 and summary["world_size"] == 2
