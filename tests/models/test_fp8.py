"""Block-quantised FP8 checkpoints (DeepSeek-V3/R1, Kimi-K2 style) load dequantised into the trainer.

The FP8 folder is made here from the tiny DeepSeek-V3: every 2-D linear weight but the embedding, the LM head and
the routers is quantised to float8_e4m3fn in (32 x 48) blocks, with a float32 `*.weight_scale_inv` per block, as
DeepSeek's own quantisation does (scale = block amax / 448). 32 x 48 does not divide most shapes here (kv_a_proj 24 x
64, kv_b_proj 128 x 16, experts 32 x 64 ...), so partial edge blocks occur in both dimensions, and the block is not
square, so a swapped row/column block size would show. The reference dequantisation below is written block by block,
independently of megarl's."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import ranks
from megarl.models import open_model_folder
from megarl.models.hf import ModelFolderError
from megarl.testing import run_ranks, tiny_model_dir

BLOCK = (32, 48)
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic"}
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _quantised(name: str, tensor: torch.Tensor) -> bool:
    not_converted = ("embed_tokens", "lm_head", "norm", ".mlp.gate.weight")  # as in DeepSeek-V3's checkpoint
    return tensor.dim() == 2 and name.endswith(".weight") and not any(p in name for p in not_converted)


def _quantise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    q, scale = torch.empty(rows, cols, dtype=torch.float8_e4m3fn), torch.empty(grid)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = w[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scale[i, j] = block.abs().max().clamp(min=1e-12) / FP8_MAX
            q[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = \
                (block / scale[i, j]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def _reference_dequantise(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            rows, cols = slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1])
            out[rows, cols] = q[rows, cols].float() * scale_inv[i, j]
    return out


def _folder(src: str, dst: str, tensors: dict, quantization_config: dict | None) -> str:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return dst


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """(FP8 folder, the same weights dequantised by the reference in fp32, the original weights, quantised names)."""
    src = tiny_model_dir("deepseek_v3")
    original = load_file(os.path.join(src, "model.safetensors"))
    fp8, dequantised, names = {}, {}, []
    for name, tensor in original.items():
        if _quantised(name, tensor):
            q, scale_inv = _quantise(tensor)
            fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
            dequantised[name] = _reference_dequantise(q, scale_inv)
            names.append(name)
        else:
            fp8[name] = dequantised[name] = tensor
    root = tmp_path_factory.mktemp("fp8")
    return (_folder(src, str(root / "fp8"), fp8, QUANT), _folder(src, str(root / "dequantised"), dequantised, None),
            original, names)


@pytest.mark.unit
def test_fp8_weights_are_dequantised_blockwise(folders):
    fp8_dir, _, original, names = folders
    shapes = {tuple(original[n].shape) for n in names}
    assert any(r % BLOCK[0] for r, _ in shapes) and any(c % BLOCK[1] for _, c in shapes)  # partial edge blocks
    assert any(".experts." in n for n in names) and any("kv_a_proj_with_mqa" in n for n in names)
    folder = open_model_folder(fp8_dir)
    assert folder.fp8_block == BLOCK
    raw = load_file(os.path.join(fp8_dir, "model.safetensors"))
    loaded = dict(zip(original, folder.read(original)))
    for name in names:
        assert torch.equal(loaded[name], _reference_dequantise(raw[name], raw[name + "_scale_inv"])), name
        # the quantisation is real (not the identity) and close: e4m3 keeps 3 mantissa bits
        assert not torch.equal(loaded[name], original[name]), name
        torch.testing.assert_close(loaded[name], original[name], rtol=0.07, atol=original[name].abs().max() / 64)
    for name in set(original) - set(names):
        assert torch.equal(loaded[name], original[name]), name


def _load_export_and_save(path: str, layout: dict, out: str) -> dict:
    ps, bridge, chunks = ranks.build(path, **layout)
    logits = ranks.forward_logits(chunks, ranks.input_batches(), vocab_size=bridge.vocab_size, pg=bridge.pg)
    weights = dict(bridge.export_hf_weights(chunks))
    bridge.save_hf(chunks, out)
    return {"logits": logits, "weights": weights}


@pytest.mark.multirank
def test_fp8_model_equals_model_of_dequantised_weights(folders, tmp_path):
    fp8_dir, dequantised_dir, _, _ = folders
    from_fp8 = run_ranks(2, _load_export_and_save, fp8_dir, {"ep": 2}, str(tmp_path / "export"))
    reference = run_ranks(2, ranks.logits_and_export, dequantised_dir, {"ep": 2})
    compared = [all(torch.equal(x, y) for x, y in zip(a["logits"], b["logits"]))
                for a, b in zip(from_fp8, reference) if b["logits"] is not None]
    assert compared == [True, True]  # EP 2 without PP: both ranks compute the logits
    exported = {n: t for r in from_fp8 for n, t in r["weights"].items()}
    expected = load_file(os.path.join(dequantised_dir, "model.safetensors"))
    assert sorted(exported) == sorted(expected)  # no *_scale_inv: the trainer holds (and syncs) dequantised weights
    assert all(torch.equal(exported[n], expected[n]) for n in expected)
    # the exported folder is an unquantised checkpoint: no quantization_config left in its config.json
    with open(tmp_path / "export" / "config.json") as f:
        assert "quantization_config" not in json.load(f)
    assert open_model_folder(str(tmp_path / "export")).fp8_block is None


@pytest.mark.unit
@pytest.mark.parametrize("quant,field", [
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quantization_config"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "quantization_config"),  # per-tensor FP8
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}, "weight_block_size"),
    (None, "quantization_config"),  # FP8 weights and scales, but the config lost its quantization_config
], ids=["awq", "fp8-static", "fp8-no-block", "scales-without-config"])
def test_other_quantisation_is_refused_with_one_line(folders, tmp_path, quant, field):
    fp8_dir = folders[0]
    path = shutil.copytree(fp8_dir, tmp_path / "model")
    with open(path / "config.json") as f:
        config = json.load(f)
    config.pop("quantization_config")
    with open(path / "config.json", "w") as f:
        json.dump(config if quant is None else dict(config, quantization_config=quant), f)
    with pytest.raises(ModelFolderError) as error:
        open_model_folder(str(path))
    message = str(error.value)
    assert "\n" not in message and "config.json" in message and field in message and "Fix:" in message


@pytest.mark.unit
def test_wrong_block_size_is_named(folders, tmp_path):
    path = shutil.copytree(folders[0], tmp_path / "model")
    with open(path / "config.json") as f:
        config = json.load(f)
    with open(path / "config.json", "w") as f:
        json.dump(dict(config, quantization_config=dict(QUANT, weight_block_size=[64, 64])), f)
    folder = open_model_folder(str(path))
    with pytest.raises(ModelFolderError, match=r"kv_a_proj_with_mqa\.weight: .*weight_block_size"):
        folder.read(["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])
