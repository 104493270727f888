"""GLM-4.5 / 4.6 / 4.5-Air (glm4_moe) in the bridge: Megatron against transformers (fp32 logits within 1e-4), HF round
trip bit-exact, gradients against one rank, and the variants megarl refuses.

Two tiny models (megarl/models/tiny.py): GLM-4.5-shaped (QK-norm, q/k/v biases, head_dim != hidden/heads, partial
RoPE, one dense layer, two shared experts, sigmoid router with bias, group-limited top-k) and GLM-4.5-Air-shaped (no
QK-norm, no biases, two dense layers, one shared expert, n_group 1). Each layout is launched once for both."""
import functools
import json
import shutil

import pytest
import torch

import ranks
from megarl.models import ModelFolderError, open_model_folder
from megarl.testing import run_ranks, tiny_model_dir

# GLM-4.5-Air's switches (its config.json: use_qk_norm false, n_group 1, n_shared_experts 1); attention_bias false
# here so that the no-bias path is covered too (GLM-4.5-Air itself has q/k/v biases).
AIR = dict(use_qk_norm=False, attention_bias=False, n_group=1, topk_group=1, n_shared_experts=1,
           first_k_dense_replace=2)
MODELS = {"glm45": {}, "glm45_air": AIR}
# (name, layout, world size)
LAYOUTS = [("tp1", {}, 1), ("tp2", {"tp": 2}, 2), ("ep2", {"ep": 2}, 2), ("pp2", {"pp": 2}, 2),
           ("tp2ep2", {"tp": 2, "ep": 2}, 4), ("tp2ep2etp1", {"tp": 2, "ep": 2, "etp": 1}, 4),
           ("pp2ep2", {"pp": 2, "ep": 2}, 4)]
GRAD_LAYOUTS = [("tp2", {"tp": 2}, 2), ("ep2", {"ep": 2}, 2)]


def _path(model):
    return tiny_model_dir("glm4_moe", **MODELS[model])


def _each(fn, paths, layout):
    return [fn(path, layout) for path in paths]


@functools.cache
def _launch(fn_name, name):
    """{model: per-rank results} of ranks.<fn_name> at layout `name`, every model in one launch."""
    layout, world = next((lay, w) for n, lay, w in LAYOUTS if n == name)
    per_rank = run_ranks(world, _each, getattr(ranks, fn_name), [_path(m) for m in MODELS], layout)
    return {m: [rank[i] for rank in per_rank] for i, m in enumerate(MODELS)}


@functools.cache
def _hf_reference(model):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(_path(model), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [hf(batch).logits for batch in ranks.input_batches()]
    return logits, load_file(f"{_path(model)}/model.safetensors")


CASES = [(m, name, lay, w) for m in MODELS for name, lay, w in LAYOUTS]


def _id(case):
    return f"{case[0]}-{case[1]}"


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_logits_match_transformers(case):
    model, name, layout, world = case
    ref_logits, _ = _hf_reference(model)
    last_stage = [r["logits"] for r in _launch("logits_and_export", name)[model] if r["logits"] is not None]
    assert len(last_stage) == world // layout.get("pp", 1)
    for logits in last_stage:
        assert len(logits) == len(ref_logits)
        for ours, ref in zip(logits, ref_logits):
            assert ours.shape == ref.shape
            assert (ours - ref).abs().max().item() < 1e-4
    assert ref_logits[0].abs().max() > 1.0  # the comparison is not between near-zero numbers


@pytest.mark.multirank
@pytest.mark.parametrize("case", [c for c in CASES if c[3] > 1], ids=_id)
def test_hf_roundtrip_is_bit_exact(case):
    model, name, _, _ = case
    _, hf_weights = _hf_reference(model)
    exported = {}
    for r in _launch("logits_and_export", name)[model]:
        duplicated = set(exported) & set(r["weights"])
        assert not duplicated, f"HF tensors exported by two ranks: {sorted(duplicated)[:3]}"
        exported.update(r["weights"])
    assert sorted(exported) == sorted(hf_weights)
    for key, tensor in hf_weights.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key


@pytest.mark.unit
def test_tiny_models_hold_what_the_tests_claim():
    """The features the comparisons above are meant to cover are really in the tiny folders."""
    from safetensors.torch import load_file

    glm45, air = (load_file(f"{_path(m)}/model.safetensors") for m in MODELS)
    assert "model.layers.0.self_attn.q_norm.weight" in glm45 and "model.layers.0.self_attn.q_proj.bias" in glm45
    assert not any(".q_norm." in k or ".q_proj.bias" in k for k in air)
    assert "model.layers.0.mlp.gate_proj.weight" in glm45 and "model.layers.1.mlp.gate.weight" in glm45  # dense, MoE
    assert "model.layers.1.mlp.gate_proj.weight" in air and "model.layers.2.mlp.gate.weight" in air
    assert glm45["model.layers.1.mlp.shared_experts.gate_proj.weight"].shape[0] == 2 * 32  # two shared experts
    assert glm45["model.layers.1.mlp.gate.e_score_correction_bias"].abs().max() > 0
    folder = open_model_folder(_path("glm45"))
    assert folder.rotary_percent == 0.5 and folder.config.head_dim * 4 != folder.config.hidden_size


@pytest.mark.multirank
@pytest.mark.parametrize("name", [n for n, _, _ in GRAD_LAYOUTS])
def test_grads_match_single_rank(name):
    (reference,) = _launch("train_grads", "tp1")["glm45"]
    grads, losses = {}, None
    for r in _launch("train_grads", name)["glm45"]:
        grads.update(r["grads"])
        losses = r["losses"] or losses
    ref = reference["grads"]
    assert sorted(grads) == sorted(ref)
    for key in ref:
        assert ref[key].abs().max() > 0, f"reference grad of {key} is zero: the check would be vacuous"
        assert (grads[key] - ref[key]).abs().max().item() < 1e-5, key
    assert torch.allclose(torch.stack(losses), torch.stack(reference["losses"]), atol=1e-5)


@pytest.mark.unit
@pytest.mark.parametrize("changes,message", [
    ({"norm_topk_prob": False}, r"norm_topk_prob=false is not supported for glm4_moe .* Fix: use a model with "
                                r"norm_topk_prob: true"),
    ({"num_experts_per_tok": 2}, r"num_experts_per_tok=2 / topk_group=2: group-limited routing is only exact when .* "
                                 r"Fix: use a model with num_experts_per_tok == 2 \* topk_group, or n_group: 1"),
], ids=["norm_topk_prob", "group_topk"])
def test_variants_megarl_cannot_build_exactly_are_refused(tmp_path, changes, message):
    folder = tmp_path / "model"
    shutil.copytree(_path("glm45"), folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    with pytest.raises(ModelFolderError, match=message):
        open_model_folder(str(folder))


@pytest.mark.unit
def test_engine_layout_fuses_the_shared_experts():
    """What the weight-sync checksums compare against for glm4_moe: SGLang's glm4_moe holds each MoE layer's shared
    experts as one gate_up_proj (gate rows, then up rows) n_shared_experts x moe_intermediate_size wide, named here
    without an engine; tests/reshard/test_sync_moe.py verifies an EP2 sync into a real SGLang CPU engine with it (a
    TP2xEP2 sync was checked by hand: all 51 engine tensors, engine log-probs within 5e-7 of the trainer's)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from megarl.reshard.verify import engine_layout, engine_shapes

    hf = load_file(f"{_path('glm45')}/model.safetensors")
    shapes = engine_shapes(AutoConfig.from_pretrained(_path("glm45")), tp=1, cpu=True)
    assert shapes.shared_expert_intermediate == 2 * 32
    engine = {name: (tensor, sources) for _, name, tensor, sources in engine_layout(hf.items(), torch.float32, shapes)}
    prefix = "model.layers.1.mlp.shared_experts."
    tensor, sources = engine[prefix + "gate_up_proj.weight"]
    assert sources == [prefix + "gate_proj.weight", prefix + "up_proj.weight"]
    assert torch.equal(tensor, torch.cat([hf[s] for s in sources]))
    assert not [n for n in engine if ".shared_experts.gate_proj" in n or ".shared_experts.up_proj" in n]
    assert torch.equal(engine[prefix + "down_proj.weight"][0], hf[prefix + "down_proj.weight"])


@pytest.mark.unit
def test_bf16_engines_hold_the_router_in_fp32_and_the_sync_sends_it_so():
    """SGLang keeps GLM-4.5's router (Glm4MoeGate: weight and e_score_correction_bias) and DeepSeek-V3's expert bias in
    float32 whatever the engine's dtype: the weight sync sends them in float32 (a bf16 copy would collapse a bias spread
    over a few bf16 ULPs) and the checksums hash them so. Found with a bf16 engine serving this tiny model: every other
    tensor's checksum matched, the two router tensors of each MoE layer did not."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from megarl.reshard.buckets import BucketPacker
    from megarl.reshard.verify import engine_dtypes, engine_layout, engine_shapes

    glm = engine_dtypes(AutoConfig.from_pretrained(_path("glm45")), torch.bfloat16)
    assert glm("model.layers.1.mlp.gate.weight") == glm("model.layers.1.mlp.gate.e_score_correction_bias") == \
        torch.float32
    assert glm("model.layers.1.mlp.gate_proj.weight") == glm("model.layers.1.mlp.experts.0.gate_proj.weight") == \
        glm("model.layers.1.mlp.shared_experts.gate_proj.weight") == torch.bfloat16
    deepseek = AutoConfig.from_pretrained(tiny_model_dir("deepseek_v3"))
    assert engine_dtypes(deepseek, torch.bfloat16)("model.layers.1.mlp.gate.weight") == torch.bfloat16
    assert engine_dtypes(deepseek, torch.bfloat16)("model.layers.1.mlp.gate.e_score_correction_bias") == torch.float32
    deepseek.router_fp32 = True
    assert engine_dtypes(deepseek, torch.bfloat16)("model.layers.1.mlp.gate.weight") == torch.float32
    qwen = AutoConfig.from_pretrained(tiny_model_dir("qwen3_moe"))
    assert engine_dtypes(qwen, torch.bfloat16)("model.layers.1.mlp.gate.weight") == torch.bfloat16

    hf = load_file(f"{_path('glm45')}/model.safetensors")
    shapes = engine_shapes(AutoConfig.from_pretrained(_path("glm45")), tp=1, cpu=False)
    engine = {name: tensor for _, name, tensor, _ in engine_layout(hf.items(), glm, shapes)}
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert engine[bias].dtype == torch.float32 and torch.equal(engine[bias], hf[bias])
    assert engine["model.layers.1.self_attn.o_proj.weight"].dtype == torch.bfloat16
    names = [bias, "model.layers.1.self_attn.o_proj.weight"]
    (bucket,) = list(BucketPacker(1 << 20).pack(((n, hf[n]) for n in names), glm))
    assert [m.dtype for m in bucket.metadata] == [torch.float32, torch.bfloat16]
    first = bucket.metadata[0]
    assert torch.equal(bucket.flat[first.start_idx:first.end_idx].view(torch.float32), hf[bias])
