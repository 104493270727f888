"""benchmarks/gpu_check.py, as far as a CPU can check it: its configs load and pass the pre-flight checks, its
parameter count (for MFU) equals transformers' on the same shape, and without a GPU it refuses with exit 2."""
import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(ROOT, "benchmarks", "gpu_check.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_parameter_count_matches_transformers():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    gpu_check = _gpu_check()
    for tied in (True, False):  # the check's shape, scaled down
        shape = dict(gpu_check.MODEL, hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000, tie_word_embeddings=tied)
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
        assert gpu_check.params_of(shape) == sum(p.numel() for p in model.parameters())
    assert abs(gpu_check.train_mfu(1e4, 1.0, 10**9, peak_flops=6e13) - 1.0) < 1e-12


def test_plan_checks_the_configs_and_no_gpu_exits_2(tmp_path):
    gpu_check = _gpu_check()
    result = gpu_check.plan(str(tmp_path))
    assert set(result["configs"]) == {"tensor", "distributed", "deepseek_v3"}
    assert any("model.tiny (deepseek_v3)" in c for c in result["configs"]["deepseek_v3"])
    assert all(any("data.train" in c for c in checks) for checks in result["configs"].values())
    if not torch.cuda.is_available():
        assert gpu_check.main(["--work", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
