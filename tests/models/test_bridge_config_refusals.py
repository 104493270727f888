"""HF config fields the bridge would otherwise ignore or trip over (megarl.models.hf._unsupported_variant, and the
expert widths in ParallelConfig.validate): a variant megarl cannot build exactly is refused with one line naming the
field, its value and the fix, while the same field without effect still opens; the variants it builds match
transformers (fp32 logits within 1e-5, HF round trip bit-exact)."""
import json
import shutil

import pytest
import torch

import ranks
from megarl.models import ModelFolderError, open_model_folder
from megarl.models.hf import model_shape
from megarl.parallel import ParallelConfig, ParallelConfigError
from megarl.testing import run_ranks, tiny_model_dir

DROP = object()  # remove the key from config.json (transformers then derives it, e.g. layer_types)
# The written tiny configs hold the layer_types transformers derived from use_sliding_window / max_window_layers;
# real Qwen2/Qwen3 config.json files have none, so transformers derives them from the edited fields.
QWEN_WINDOW = dict(layer_types=DROP, use_sliding_window=True, sliding_window=4)


def _edit(folder, original: dict, changes: dict):
    config = {**original, **changes}
    for key in [k for k, v in changes.items() if v is DROP]:
        del config[key]
    (folder / "config.json").write_text(json.dumps(config))


# (id, family, edits that leave the field without effect: each must open, the edit refused, the message)
CASES = [
    ("qwen2-sliding_window", "qwen2",
     [dict(QWEN_WINDOW, use_sliding_window=False), dict(QWEN_WINDOW, sliding_window=256, max_window_layers=0),
      dict(QWEN_WINDOW, max_window_layers=4)],
     dict(QWEN_WINDOW, max_window_layers=2),
     r"config.json: sliding_window=4 \(use_sliding_window=true, layer\(s\) \[2, 3\] of 4 per max_window_layers=2\): "
     r"sliding-window attention is not supported for qwen2 \(.*\)\. Fix: use a model without it \(use_sliding_window: "
     r"false\), or with sliding_window >= max_position_embeddings \(256\)\.$"),
    ("qwen3-sliding_window", "qwen3", [dict(QWEN_WINDOW, use_sliding_window=False)],
     dict(QWEN_WINDOW, max_window_layers=0),
     r"sliding_window=4 \(use_sliding_window=true, layer\(s\) \[0, 1, 2, 3\] of 4 per max_window_layers=0\): "
     r"sliding-window attention is not supported for qwen3"),
    # Qwen2-MoE slides on the even layers below max_window_layers (transformers' Qwen2MoeConfig)
    ("qwen2_moe-sliding_window", "qwen2_moe",
     [dict(QWEN_WINDOW, use_sliding_window=False), dict(QWEN_WINDOW, max_window_layers=0)],
     dict(QWEN_WINDOW, max_window_layers=28),
     r"sliding_window=4 \(use_sliding_window=true, layer\(s\) \[0, 2\] of 4 per max_window_layers=28\): "
     r"sliding-window attention is not supported for qwen2_moe"),
    ("qwen3_moe-sliding_window", "qwen3_moe",
     [dict(use_sliding_window=False, sliding_window=4), dict(use_sliding_window=True, sliding_window=256)],
     dict(use_sliding_window=True, sliding_window=4),
     r"sliding_window=4 \(use_sliding_window=true, layer\(s\) \[0, 1, 2, 3\] of 4\): sliding-window attention is not "
     r"supported for qwen3_moe .* Fix: use a model without it \(use_sliding_window: false\)"),
    ("mixtral-sliding_window", "mixtral", [dict(sliding_window=None), dict(sliding_window=256)],
     dict(sliding_window=4),
     r"sliding_window=4 \(every layer\): sliding-window attention is not supported for mixtral .* Fix: use a model "
     r"without it \(sliding_window: null\), or with sliding_window >= max_position_embeddings \(256\)\.$"),
    ("llama-attention_bias", "llama", [dict(attention_bias=False, mlp_bias=False)], dict(attention_bias=True),
     r"config.json: attention_bias=true \(q/k/v/o_proj biases\) is not supported for llama \(.*\)\. Fix: use a model "
     r"with attention_bias: false\.$"),
    ("qwen3-attention_bias", "qwen3", [dict(attention_bias=False)], dict(attention_bias=True),
     r"attention_bias=true \(q/k/v/o_proj biases\) is not supported for qwen3 .* Fix: use a model with "
     r"attention_bias: false"),
    ("qwen3_moe-attention_bias", "qwen3_moe", [dict(attention_bias=False)], dict(attention_bias=True),
     r"attention_bias=true \(q/k/v/o_proj biases\) is not supported for qwen3_moe"),
    ("deepseek_v3-attention_bias", "deepseek_v3", [dict(attention_bias=False)], dict(attention_bias=True),
     r"attention_bias=true \(q_a_proj/kv_a_proj_with_mqa/o_proj biases\) is not supported for deepseek_v3"),
    ("llama-mlp_bias", "llama", [dict(mlp_bias=False)], dict(mlp_bias=True),
     r"config.json: mlp_bias=true \(gate/up/down_proj biases\) is not supported for llama \(.*\)\. Fix: use a model "
     r"with mlp_bias: false\.$"),
    ("llama-hidden_act", "llama", [dict(hidden_act="swish")], dict(hidden_act="gelu_pytorch_tanh"),
     r"config.json: hidden_act='gelu_pytorch_tanh' is not supported for llama \(.*SwiGLU.*\)\. Fix: use a model with "
     r"hidden_act: silu\.$"),
    ("qwen3_moe-hidden_act", "qwen3_moe", [], dict(hidden_act="gelu"),
     r"hidden_act='gelu' is not supported for qwen3_moe"),
    ("deepseek_v3-top1", "deepseek_v3", [], dict(n_group=1, topk_group=1, num_experts_per_tok=1),
     r"config.json: num_experts_per_tok=1 is not supported for deepseek_v3 \(.*renormalises the top-1 sigmoid score.*"
     r"\)\. Fix: use a model with num_experts_per_tok >= 2\.$"),
    ("glm4_moe-top1", "glm4_moe", [], dict(n_group=1, topk_group=1, num_experts_per_tok=1),
     r"num_experts_per_tok=1 is not supported for glm4_moe .* Fix: use a model with num_experts_per_tok >= 2\.$"),
    ("qwen3_moe-top1", "qwen3_moe", [dict(num_experts_per_tok=1, norm_topk_prob=False)],
     dict(num_experts_per_tok=1, norm_topk_prob=True),
     r"config.json: num_experts_per_tok=1 with norm_topk_prob=true is not supported for qwen3_moe \(.*\)\. Fix: use "
     r"a model with num_experts_per_tok >= 2, or norm_topk_prob: false\.$"),
    ("qwen2_moe-top1", "qwen2_moe", [dict(num_experts_per_tok=1)], dict(num_experts_per_tok=1, norm_topk_prob=True),
     r"num_experts_per_tok=1 with norm_topk_prob=true is not supported for qwen2_moe"),
    ("mixtral-top1", "mixtral", [], dict(num_experts_per_tok=1),
     r"config.json: num_experts_per_tok=1 is not supported for mixtral \(.*\)\. Fix: use a model with "
     r"num_experts_per_tok >= 2\.$"),
    ("qwen2_moe-no_shared_expert", "qwen2_moe", [], dict(shared_expert_intermediate_size=0),
     r"config.json: shared_expert_intermediate_size=0 \(no shared expert\) is not supported for qwen2_moe \(.*\)\. "
     r"Fix: use a model with shared_expert_intermediate_size > 0\.$"),
    ("deepseek_v3-no_shared_expert", "deepseek_v3", [], dict(n_shared_experts=0),
     r"config.json: n_shared_experts=0 \(no shared experts\) is not supported for deepseek_v3 \(.*\)\. Fix: use a "
     r"model with n_shared_experts >= 1\.$"),
    ("glm4_moe-no_shared_expert", "glm4_moe", [], dict(n_shared_experts=0),
     r"n_shared_experts=0 \(no shared experts\) is not supported for glm4_moe"),
    ("deepseek_v3-q_lora_rank", "deepseek_v3", [], dict(q_lora_rank=None),
     r"config.json: q_lora_rank=null \(.*\) is not supported for deepseek_v3 \(.*\)\. Fix: use a model with "
     r"q_lora_rank set \(DeepSeek-V3: 1536\)\.$"),
]


@pytest.mark.unit
@pytest.mark.parametrize("family,harmless,refused,message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_field_that_changes_the_model_is_refused_in_one_line(tmp_path, family, harmless, refused, message):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir(family), folder)
    original = json.loads((folder / "config.json").read_text())
    open_model_folder(str(folder))  # the tiny model itself opens
    for changes in harmless:
        _edit(folder, original, changes)
        open_model_folder(str(folder))
    _edit(folder, original, refused)
    with pytest.raises(ModelFolderError, match=message) as error:
        open_model_folder(str(folder))
    assert "\n" not in str(error.value)


def _shape(family, **changes):
    with open(f"{tiny_model_dir(family)}/config.json") as f:
        return model_shape({**json.load(f), **changes})


@pytest.mark.unit
@pytest.mark.parametrize("family,changes,layout,message", [
    # Mixtral's experts are intermediate_size wide (it has no moe_intermediate_size)
    ("mixtral", dict(intermediate_size=33), dict(tp=2),
     "model intermediate_size=33 is not divisible by parallel.etp=2. Fix: pick a etp that divides 33."),
    # shared experts are split over tp (megatron-core's SharedExpertMLP), whatever etp is
    ("qwen2_moe", dict(shared_expert_intermediate_size=33), dict(tp=2),
     "model shared_expert_intermediate_size=33 is not divisible by parallel.tp=2. Fix: pick a tp that divides 33."),
    ("deepseek_v3", dict(moe_intermediate_size=33, n_shared_experts=1), dict(tp=2, etp=1),
     "model n_shared_experts x moe_intermediate_size=33 is not divisible by parallel.tp=2."),
], ids=["mixtral-expert_width", "qwen2_moe-shared_expert", "deepseek_v3-shared_experts"])
def test_expert_width_the_layout_cannot_split_names_its_field(family, changes, layout, message):
    with pytest.raises(ParallelConfigError) as error:
        ParallelConfig(**layout).validate(2, _shape(family, **changes))
    assert str(error.value).startswith(message)


# ------------------------------------------------------------------------------------ variants the bridge builds
BUILT = {
    # Qwen2-MoE without q/k/v biases (mbridge always builds them)
    "qwen2_moe-no_qkv_bias": ("qwen2_moe", dict(qkv_bias=False)),
    # top-1 without renormalisation: megatron-core's pre-softmax router, which mbridge's Qwen3-MoE config refused
    "qwen3_moe-top1": ("qwen3_moe", dict(num_experts_per_tok=1, norm_topk_prob=False)),
}


def _assert_matches_transformers(path, results):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = [hf(batch).logits for batch in ranks.input_batches()]
    logits = [r["logits"] for r in results if r["logits"] is not None]
    assert logits
    for ours in logits:
        assert max((a - b).abs().max().item() for a, b in zip(ours, reference)) < 1e-5
    assert reference[0].abs().max() > 1.0
    exported = {k: v for r in results for k, v in r["weights"].items()}
    weights = load_file(f"{path}/model.safetensors")
    assert sorted(exported) == sorted(weights)
    for key, tensor in weights.items():
        assert torch.equal(exported[key], tensor), key


@pytest.mark.multirank
@pytest.mark.parametrize("name", list(BUILT))
def test_built_variant_matches_transformers(name):
    family, overrides = BUILT[name]
    path = tiny_model_dir(family, **overrides)
    _assert_matches_transformers(path, run_ranks(1, ranks.logits_and_export, path, {}))
    if overrides.get("qkv_bias") is False:  # the folder really has no q/k/v biases
        assert not [k for k in open_model_folder(path).weight_files if k.endswith("_proj.bias")]


@pytest.mark.multirank
def test_tied_glm4_moe_over_two_pipeline_stages_matches_transformers():
    # mbridge's GLM-4.5 name table hard-codes lm_head.weight; the last stage's output layer reads embed_tokens.
    path = tiny_model_dir("glm4_moe", tie_word_embeddings=True, num_hidden_layers=2)
    results = run_ranks(2, ranks.logits_and_export, path, {"pp": 2})
    _assert_matches_transformers(path, results)
    assert "lm_head.weight" not in open_model_folder(path).weight_files
