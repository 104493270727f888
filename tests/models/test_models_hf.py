"""Opening HF model folders: supported families, and a clear error for every kind of bad folder."""
import json
import os
import shutil

import pytest

from megarl.models import SUPPORTED_ARCHITECTURES, FAMILIES, ModelFolderError, open_model_folder

pytestmark = pytest.mark.unit


@pytest.fixture
def folder(tmp_path, tiny_model):
    dst = tmp_path / "model"
    shutil.copytree(tiny_model("qwen2"), dst)
    return dst


def _edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del config[key]
    (folder / "config.json").write_text(json.dumps(config))


# Routed experts and one expert's FFN width of each tiny MoE model (megarl/models/tiny.py), read back through the
# field names each family uses (num_experts / num_local_experts; moe_intermediate_size / Mixtral's intermediate_size).
MOE_SHAPES = {"qwen3_moe": (4, 32), "qwen2_moe": (4, 32), "mixtral": (4, 64), "deepseek_v3": (8, 32),
              "glm4_moe": (8, 32)}


def test_every_family_opens(tiny_model_any_family):
    model = open_model_folder(tiny_model_any_family)
    family = model.model_type
    assert family in FAMILIES and model.is_moe == (family in MOE_SHAPES)
    assert "model.embed_tokens.weight" in model.weight_files
    shape = model.shape()
    assert shape.num_layers == 4
    assert (shape.num_experts, shape.moe_ffn_hidden_size) == MOE_SHAPES.get(family, (None, None))


def test_missing_folder(tmp_path):
    with pytest.raises(ModelFolderError, match="does not exist. Fix: point model.path at a local"):
        open_model_folder(str(tmp_path / "nope"))


def test_missing_config(folder):
    os.remove(folder / "config.json")
    with pytest.raises(ModelFolderError, match="config.json is missing"):
        open_model_folder(str(folder))


def test_invalid_json(folder):
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match="config.json is not valid JSON"):
        open_model_folder(str(folder))


def test_unsupported_architecture_lists_supported(folder):
    _edit_config(folder, model_type="gpt2", architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelFolderError) as error:
        open_model_folder(str(folder))
    message = str(error.value)
    assert "model_type='gpt2'" in message and "GPT2LMHeadModel" in message
    for model_type, arch in SUPPORTED_ARCHITECTURES.items():
        assert f"{model_type} ({arch})" in message


def test_missing_and_invalid_fields(folder):
    _edit_config(folder, num_attention_heads=None)
    with pytest.raises(ModelFolderError, match=r"required field\(s\) \['num_attention_heads'\] missing"):
        open_model_folder(str(folder))
    _edit_config(folder, num_attention_heads="four")
    with pytest.raises(ModelFolderError, match="field num_attention_heads must be a positive integer"):
        open_model_folder(str(folder))


def test_rope_scaling_is_refused(folder):
    _edit_config(folder, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0})
    with pytest.raises(ModelFolderError, match="rope type 'yarn' is not supported"):
        open_model_folder(str(folder))


@pytest.mark.parametrize("family,changes,message", [
    ("qwen2_moe", {"mlp_only_layers": [1]}, r"dense MLP layers in a qwen2_moe model are not supported. Fix: use a "
                                            r"model whose every layer is MoE \(mlp_only_layers: \[\]"),
    ("qwen2_moe", {"decoder_sparse_step": 2}, r"decoder_sparse_step=2: dense MLP layers in a qwen2_moe model"),
    ("deepseek_v3", {"norm_topk_prob": False}, r"norm_topk_prob=false is not supported for deepseek_v3 .* Fix: use a "
                                               r"model with norm_topk_prob: true"),
    ("deepseek_v3", {"rope_interleave": False}, r"rope_interleave=false is not supported for deepseek_v3 .* Fix: use "
                                                r"a model with rope_interleave: true"),
    ("deepseek_v3", {"num_experts_per_tok": 2}, r"num_experts_per_tok=2 / topk_group=2: group-limited routing is only "
                                                r"exact when .* Fix: use a model with num_experts_per_tok == 2 \* "
                                                r"topk_group, or n_group: 1"),
], ids=["qwen2_moe-mlp_only_layers", "qwen2_moe-sparse_step", "deepseek_v3-norm_topk_prob",
        "deepseek_v3-rope_interleave", "deepseek_v3-group_topk"])
def test_variants_megarl_cannot_build_exactly_are_refused(tmp_path, tiny_model, family, changes, message):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model(family), folder)
    open_model_folder(str(folder))  # the tiny model itself opens
    _edit_config(folder, **changes)
    with pytest.raises(ModelFolderError, match=message):
        open_model_folder(str(folder))


def test_no_safetensors(folder):
    os.remove(folder / "model.safetensors")
    with pytest.raises(ModelFolderError, match=r"no \*.safetensors weights"):
        open_model_folder(str(folder))


def test_missing_tensor_is_named(folder):
    from safetensors.torch import load_file, save_file

    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    model = open_model_folder(str(folder))
    with pytest.raises(ModelFolderError, match="model.layers.1.mlp.up_proj.weight"):
        model.read(["model.layers.1.mlp.up_proj.weight"])
