"""Uneven pipeline stages: layer counts that pp (x vpp) does not divide, placed with megatron-core's
num_layers_in_first/last_pipeline_stage and account_for_{embedding,loss}_in_pipeline_split (set in ParallelConfig, or
chosen automatically), checked against Hugging Face transformers, one rank, a dist-checkpoint round trip and a real
SGLang engine."""
import functools
import json
import re

import pytest
import torch

import ranks
from megarl import cli
from megarl.algorithms import AlgorithmConfig
from megarl.config import ConfigError
from megarl.launch.topology import format_topology, plan
from megarl.parallel import ModelShape, ParallelConfig, ParallelConfigError
from megarl.testing import run_ranks, tiny_model_dir
from megarl.testing.fixtures import early_engine
from megarl.trainer.config import load_train_config
from rl_batch import TEMPERATURE, rl_token_batch

FIRST, LAST = "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"
EMBEDDING, LOSS = "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"


def _shape(layers: int) -> ModelShape:
    return ModelShape(num_layers=layers, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128)


def _sizes(stage_layers) -> list[list[int]]:
    return [[len(chunk) for chunk in row] for row in stage_layers]


# ------------------------------------------------------------------------------------------------ the split itself
@pytest.mark.unit
@pytest.mark.parametrize("layers,pp,vpp,sizes", [
    (3, 2, None, [[2], [1]]),  # the last stage also holds the output layer and the loss: it gets the lighter share
    (5, 2, None, [[3], [2]]),
    (7, 3, None, [[2], [3], [2]]),
    (61, 16, None, [[3]] + [[4]] * 14 + [[2]]),  # DeepSeek-V3's 61 layers: largest stage ceil(61/16) = 4
    (10, 3, 2, [[2, 2], [2, 2], [1, 1]]),  # with vpp every stage's count is a multiple of vpp: 4 + 4 + 2
    (4, 2, None, [[2], [2]]),  # even: megatron-core's own split, no fields set
])
def test_automatic_split(layers, pp, vpp, sizes):
    p = ParallelConfig(pp=pp, vpp=vpp)
    p.validate(pp, _shape(layers), on_gpu=False)
    stages = p.stage_layers(layers)
    assert _sizes(stages) == sizes
    # every layer on exactly one chunk, in pipeline order (virtual stage major, then pipeline rank)
    assert [i for v in range(vpp or 1) for row in stages for i in row[v]] == list(range(layers))
    split = p.pipeline_split(layers)
    if layers % (pp * (vpp or 1)) == 0:
        assert split == {}
    else:
        assert split == {FIRST: sum(sizes[0]), LAST: sum(sizes[-1])}


@pytest.mark.unit
@pytest.mark.parametrize("config,layers,needles", [
    # no split expressible at vpp 2 (first/last counts must be even, 5 is odd): values that work are suggested
    (ParallelConfig(pp=2, vpp=2), 5, ["num_hidden_layers=5 cannot be split over parallel.pp=2 x parallel.vpp=2",
                                      f"Fix: unset parallel.vpp (megarl then sets parallel.{FIRST}=3 and "
                                      f"parallel.{LAST}=2) or use parallel.vpp=3 with parallel.{EMBEDDING}=true"]),
    # explicit values megatron-core refuses: its reason is quoted, and a split that works is suggested
    (ParallelConfig(pp=4, **{FIRST: 1, LAST: 1}), 5,
     [f"parallel.{FIRST}=1, parallel.{LAST}=1 cannot place num_hidden_layers=5 on pp=4",
      "middle stage: 3 must be divisible", f"Fix: set parallel.{FIRST}=2 and parallel.{LAST}=1"]),
    (ParallelConfig(pp=2, **{FIRST: 1, LOSS: True}), 3, ["cannot be", f"parallel.{LOSS}=true", "Fix: set"]),
    # megatron-core 0.19.2 accepts this in TransformerConfig but divides by zero placing it (no middle stage)
    (ParallelConfig(pp=2, vpp=2, **{FIRST: 4, LAST: 2}), 6,
     [f"parallel.{FIRST}=4, parallel.{LAST}=2 cannot place num_hidden_layers=6 on pp=2 x vpp=2",
      "with vpp at pp=2", f"Fix: set parallel.{EMBEDDING}=true and parallel.{LOSS}=true"]),
    (ParallelConfig(pp=2, **{FIRST: 3}), 3, [f"parallel.{FIRST}=3 cannot place num_hidden_layers=3 on pp=2"]),
    (ParallelConfig(**{FIRST: 2}), 4, [f"parallel.{FIRST}=2 places layers on pipeline stages but parallel.pp=1",
                                       "Fix: unset it, or set pp >= 2"]),
    (ParallelConfig(pp=2, **{FIRST: 0}), 4, [f"parallel.{FIRST} must be a positive integer, got 0"]),
    (ParallelConfig(pp=2, **{LOSS: "yes"}), 4, [f"parallel.{LOSS} must be true or false, got 'yes'"]),
])
def test_bad_split_is_one_line_naming_the_fields_and_the_fix(config, layers, needles):
    with pytest.raises(ParallelConfigError) as error:
        config.validate(config.pp, _shape(layers), on_gpu=False)
    message = str(error.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


@pytest.mark.unit
def test_suggested_fixes_are_accepted():
    ParallelConfig(pp=2).validate(2, _shape(5), on_gpu=False)
    ParallelConfig(pp=2, vpp=3, **{EMBEDDING: True}).validate(2, _shape(5), on_gpu=False)
    ParallelConfig(pp=4, **{FIRST: 2, LAST: 1}).validate(4, _shape(5), on_gpu=False)


@pytest.mark.unit
def test_trainer_config_and_dry_run_show_the_stages():
    cfg = load_train_config(None, ["model.path=x", "parallel.pp=2", f"parallel.{FIRST}=1"])
    assert getattr(cfg.parallel, FIRST) == 1 and getattr(cfg.parallel, LAST) is None
    with pytest.raises(ConfigError, match=FIRST):  # a misspelt key suggests the real one
        load_train_config(None, ["model.path=x", "parallel.num_layers_in_first_stage=1"])
    tiny3 = "model.tiny.overrides={num_hidden_layers: 3}"
    topo = plan(load_train_config("configs/quickstart.yaml", [tiny3, "parallel.pp=2"]), 1, 2)
    text = format_topology(topo)
    assert f"automatic split, as if parallel.{FIRST}=2, parallel.{LAST}=1" in text
    assert "pp rank 0: layers 0-1 (2)" in text and "pp rank 1: layers 2 (1)" in text
    overrides = ["model.tiny.overrides={num_hidden_layers: 5}", "parallel.pp=2", "parallel.vpp=3",
                 f"parallel.{EMBEDDING}=true"]
    topo = plan(load_train_config("configs/quickstart.yaml", overrides), 1, 2)
    text = format_topology(topo)
    assert f"split set in the config: parallel.{EMBEDDING}=true" in text
    assert "pp rank 0: layers none | 1 | 3 (2)" in text and "pp rank 1: layers 0 | 2 | 4 (3)" in text


# -------------------------------------------------------------------------------------- the model, on many ranks
# (name, family, layers, layout, world)
CASES = [
    ("3L-pp2-auto", "qwen2", 3, {"pp": 2}, 2),
    ("3L-pp2-first1", "qwen2", 3, {"pp": 2, FIRST: 1}, 2),
    ("3L-tp2pp2-auto", "qwen2", 3, {"tp": 2, "pp": 2}, 4),
    ("5L-pp2vpp3-embedding", "qwen3", 5, {"pp": 2, "vpp": 3, EMBEDDING: True}, 2),  # tied embeddings, qk-norm
    ("5L-pp2vpp3-loss", "qwen3", 5, {"pp": 2, "vpp": 3, LOSS: True}, 2),
]


def _id(case):
    return case[0]


def _layout(case) -> ParallelConfig:
    return ParallelConfig(**case[3])


@functools.cache
def _hf_reference(family, layers):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(family, num_hidden_layers=layers)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [model(batch).logits for batch in ranks.input_batches()]
    return logits, load_file(f"{path}/model.safetensors")


@functools.cache
def _megatron(name):
    _, family, layers, layout, world = next(c for c in CASES if c[0] == name)
    return run_ranks(world, ranks.logits_and_export, tiny_model_dir(family, num_hidden_layers=layers), layout)


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=_id)
def test_logits_match_transformers_and_roundtrip_is_bit_exact(case):
    name, family, layers, layout, world = case
    ref_logits, hf_weights = _hf_reference(family, layers)
    results = _megatron(name)
    last_stage = [r["logits"] for r in results if r["logits"] is not None]
    assert len(last_stage) == world // layout["pp"]
    for logits in last_stage:
        for ours, ref in zip(logits, ref_logits, strict=True):
            assert (ours - ref).abs().max().item() < 1e-4
    assert ref_logits[0].abs().max() > 1.0
    exported = {}
    for r in results:
        assert not set(exported) & set(r["weights"]), "an HF tensor exported by two ranks"
        exported.update(r["weights"])
    assert sorted(exported) == sorted(hf_weights)
    for key, tensor in hf_weights.items():
        assert torch.equal(exported[key], tensor), key
    # each pipeline rank holds exactly the layers megatron-core's placement (the dry run's printout) gives it
    per_stage = world // layout["pp"]
    for pp_rank, chunks in enumerate(_layout(case).stage_layers(layers)):
        owned = {int(m.group(1)) for r in results[pp_rank * per_stage:(pp_rank + 1) * per_stage]
                 for k in r["weights"] for m in [re.match(r"model\.layers\.(\d+)\.", k)] if m}
        assert owned == {i for chunk in chunks for i in chunk}, (pp_rank, owned)
    sizes = [sum(len(c) for c in row) for row in _layout(case).stage_layers(layers)]
    assert len(set(sizes)) > 1  # the stages really are uneven


@functools.cache
def _reference_grads(family, layers):
    (result,) = run_ranks(1, ranks.train_grads, tiny_model_dir(family, num_hidden_layers=layers), {})
    return result


@pytest.mark.multirank
@pytest.mark.parametrize("case", [c for c in CASES if c[0] != "3L-tp2pp2-auto"], ids=_id)
def test_grads_match_single_rank(case):
    _, family, layers, layout, world = case
    reference = _reference_grads(family, layers)
    grads, losses = {}, None
    for r in run_ranks(world, ranks.train_grads, tiny_model_dir(family, num_hidden_layers=layers), layout):
        assert not set(grads) & set(r["grads"])
        grads.update(r["grads"])
        losses = r["losses"] or losses
    assert sorted(grads) == sorted(reference["grads"])
    for key, ref in reference["grads"].items():
        assert ref.abs().max() > 0, f"reference grad of {key} is zero: the check would be vacuous"
        assert (grads[key] - ref).abs().max().item() < 1e-5, key
    assert torch.allclose(torch.stack(losses), torch.stack(reference["losses"]), atol=1e-5)


@pytest.mark.multirank
def test_rl_train_step_matches_single_rank():
    path = tiny_model_dir("qwen2", num_hidden_layers=3)
    cfg = AlgorithmConfig(policy_loss="ppo_clip", clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.02,
                          temperature=TEMPERATURE).validate()
    batch = rl_token_batch(path)
    (ref,) = run_ranks(1, ranks.rl_train_step, path, {}, batch, cfg, 2)
    results = run_ranks(2, ranks.rl_train_step, path, {"pp": 2}, batch, cfg, 4)
    weights = {}
    for r in results:
        weights.update(r["weights"])
        assert abs(r["metrics"]["grad_norm"] - ref["metrics"]["grad_norm"]) < 1e-5 * ref["metrics"]["grad_norm"]
        assert abs(r["metrics"]["loss"] - ref["metrics"]["loss"]) < 1e-6
    before = _hf_reference("qwen2", 3)[1]
    for key, expected in ref["weights"].items():
        assert not torch.equal(expected, before[key]), key  # the step moved every tensor
        assert torch.allclose(weights[key], expected, atol=1e-6), key
    last = next(r for r in results if r["log_probs"] is not None)
    assert torch.allclose(last["log_probs"], ref["log_probs"], atol=1e-5)


@pytest.mark.multirank
@pytest.mark.parametrize("family,layers,save_layout,load_layout,world", [
    ("qwen2", 3, {"pp": 2}, {}, 2),  # auto split 2 + 1 -> one rank
    ("qwen2", 3, {}, {"pp": 2, FIRST: 1}, 2),  # one rank -> 1 + 2
    ("qwen3", 5, {"pp": 2, "vpp": 3, EMBEDDING: True}, {"pp": 2}, 2),  # interleaved -> auto split 3 + 2
], ids=["3L-pp2-to-pp1", "3L-pp1-to-pp2first1", "5L-pp2vpp3emb-to-pp2"])
def test_dist_checkpoint_between_uneven_layouts(tmp_path, family, layers, save_layout, load_layout, world):
    path = tiny_model_dir(family, num_hidden_layers=layers)
    results = run_ranks(world, ranks.save_then_load, path, str(tmp_path / "ckpt"), save_layout, load_layout)
    last = [r for r in results if r["after"] is not None]
    assert last
    for r in last:
        for before, after, expected in zip(r["before"], r["after"], r["expected"], strict=True):
            assert not torch.allclose(before, expected, atol=1e-3)  # the random init really differed
            assert torch.equal(after, expected)
    weights = {k: v for r in results for k, v in r["weights"].items()}
    hf = _hf_reference(family, layers)[1]
    assert sorted(weights) == sorted(hf) and all(torch.equal(weights[k], hf[k]) for k in hf)


@pytest.mark.e2e
def test_smoke_run_on_three_layers_at_pp2(tmp_path):
    path = tiny_model_dir("qwen2", num_hidden_layers=3)
    codes = run_ranks(2, cli.main, ["smoke", "--model", path, "--tp", "1", "--pp", "2", "--out", str(tmp_path)])
    assert codes == [0, 0]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["logits_max_abs_diff_vs_transformers"] < 1e-4
    assert summary["roundtrip_mismatched_tensors"] == [] and summary["hf_tensors"] > 0


# ------------------------------------------------------------------------------------------- sync into SGLang
engine = early_engine("qwen2", num_hidden_layers=3)


@pytest.mark.engine
@pytest.mark.parametrize("layout,transport", [({"pp": 2}, "tensor"), ({"pp": 2, FIRST: 1}, "distributed")],
                         ids=["auto-tensor", "first1-distributed"])
def test_sync_into_sglang_matches_trainer(engine, layout, transport):
    path = tiny_model_dir("qwen2", num_hidden_layers=3)
    results = run_ranks(2, ranks.sync_and_compare, path, engine.url, layout, transport, 300 + len(layout))
    r = results[0]
    engine_lp, trainer_lp = torch.tensor(r["engine"]), torch.tensor(r["trainer"])
    assert engine_lp.shape == trainer_lp.shape == (2, 6)
    assert (engine_lp - trainer_lp).abs().max() < 1e-3
    assert (torch.tensor(r["before"]) - torch.tensor(r["after"])).abs().max() > 1e-2  # the sync changed the engine
    # every engine tensor (all 3 layers) checked by checksum, and the probe log-probs agree
    assert r["stats"]["verified_tensors"] >= 3 * 7 + 2 and r["stats"]["probe_max_abs_diff"] < 1e-3
