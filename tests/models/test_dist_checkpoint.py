"""dist_checkpointing: save at one layout, load at another, get identical logits and weights."""
import pytest
import torch

import ranks
from megarl.testing import run_ranks, tiny_model_dir

pytestmark = pytest.mark.multirank


@pytest.mark.parametrize("family,save_layout,load_layout,world", [
    ("qwen3", {"tp": 2, "pp": 2}, {}, 4),
    ("qwen3", {"pp": 2, "vpp": 2}, {"tp": 2}, 2),
    ("llama", {}, {"tp": 2, "pp": 2}, 4),
    ("qwen3_moe", {"tp": 2, "ep": 2}, {"pp": 2}, 4),
    ("deepseek_v3", {"tp": 2, "ep": 2}, {"ep": 2, "pp": 2}, 4),
    ("glm4_moe", {"tp": 2, "ep": 2}, {"pp": 2}, 4),
    ("mixtral", {"ep": 2, "pp": 2}, {"tp": 2}, 4),
    ("qwen2_moe", {"tp": 2}, {"ep": 2, "pp": 2}, 4),
], ids=["qwen3-tp2pp2-to-tp1", "qwen3-pp2vpp2-to-tp2", "llama-tp1-to-tp2pp2", "qwen3_moe-tp2ep2-to-pp2",
        "deepseek_v3-tp2ep2-to-ep2pp2", "glm4_moe-tp2ep2-to-pp2", "mixtral-ep2pp2-to-tp2", "qwen2_moe-tp2-to-ep2pp2"])
def test_checkpoint_reshards_between_layouts(tmp_path, family, save_layout, load_layout, world):
    from safetensors.torch import load_file

    path = tiny_model_dir(family)
    results = run_ranks(world, ranks.save_then_load, path, str(tmp_path / "ckpt"), save_layout, load_layout)
    last = [r for r in results if r["after"] is not None]
    assert last
    for r in last:
        for before, after, expected in zip(r["before"], r["after"], r["expected"]):
            assert not torch.allclose(before, expected, atol=1e-3)  # the random init really differed
            assert torch.equal(after, expected)
    weights = {}
    for r in results:
        weights.update(r["weights"])
    hf = load_file(f"{path}/model.safetensors")
    assert sorted(weights) == sorted(hf)
    assert all(torch.equal(weights[k], hf[k]) for k in hf)
    assert not list(tmp_path.glob("ckpt.tmp-*"))  # the atomic save left no temporary folder


def _save_hf(path, out, layout):
    _, bridge, chunks = ranks.build(path, **layout)
    bridge.save_hf(chunks, out)
    bridge.save_hf(chunks, out)  # overwriting an existing export works too


def test_save_hf_folder_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("qwen3_moe")
    out = tmp_path / "exported"
    run_ranks(4, _save_hf, path, str(out), {"tp": 2, "ep": 2})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # no temporary folder left behind
    assert (out / "config.json").exists() and (out / "tokenizer.json").exists()
    original = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    exported = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    batch = ranks.input_batches(n=1)[0]
    with torch.no_grad():
        assert torch.equal(original(batch).logits, exported(batch).logits)
