"""Megatron (every supported family, several TP/PP/VPP/EP layouts) against Hugging Face transformers and TP1/PP1."""
import functools

import pytest
import torch

import ranks
from megarl.testing import run_ranks, tiny_model_dir

pytestmark = pytest.mark.multirank

DENSE = ["llama", "qwen2", "qwen3"]
MOE = ["qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3"]
# (name, layout, world size)
DENSE_LAYOUTS = [("tp1", {}, 1), ("tp2", {"tp": 2}, 2), ("pp2", {"pp": 2}, 2), ("tp2pp2", {"tp": 2, "pp": 2}, 4)]
MOE_LAYOUTS = DENSE_LAYOUTS[:3] + [("ep2", {"ep": 2}, 2), ("tp2ep2", {"tp": 2, "ep": 2}, 4),
                                   ("tp2ep2etp1", {"tp": 2, "ep": 2, "etp": 1}, 4),
                                   ("pp2ep2", {"pp": 2, "ep": 2}, 4)]
CASES = [(f, *layout) for f in DENSE for layout in DENSE_LAYOUTS] + [(f, *l) for f in MOE for l in MOE_LAYOUTS]


def _id(case):
    return f"{case[0]}-{case[1]}"


def _each(fn, paths, layout):
    """fn(path, layout) for several models in one launch: the ranks build megatron's groups once per layout."""
    return [fn(path, layout) for path in paths]


@functools.cache
def _launch(suite, name):
    """One launch runs the suite's rank function for every family the suite holds at layout `name`;
    {family: per-rank results}. suite: "logits", "grads" or "grad_reference" (SUITES, below)."""
    fn, cases = SUITES[suite]
    families = [f for f, n, _, _ in cases if n == name]
    layout, world = next((lay, w) for _, n, lay, w in cases if n == name)
    per_rank = run_ranks(world, _each, fn, [tiny_model_dir(f) for f in families], layout)
    return {f: [rank[i] for rank in per_rank] for i, f in enumerate(families)}


@functools.cache
def _hf_reference(family):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(family)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = [model(batch).logits for batch in ranks.input_batches()]
    return logits, load_file(f"{path}/model.safetensors")


def _megatron(family, name):
    return _launch("logits", name)[family]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_logits_match_transformers(case):
    family, name, layout, world = case
    ref_logits, _ = _hf_reference(family)
    per_rank = [r["logits"] for r in _megatron(family, name)]
    last_stage = [logits for logits in per_rank if logits is not None]
    assert len(last_stage) == world // layout.get("pp", 1)  # every rank of the last stage has full logits
    for logits in last_stage:
        assert len(logits) == len(ref_logits)
        for ours, ref in zip(logits, ref_logits):
            assert ours.shape == ref.shape
            assert (ours - ref).abs().max().item() < 1e-4
    assert ref_logits[0].abs().max() > 1.0  # the comparison is not between near-zero numbers


@pytest.mark.parametrize("case", [c for c in CASES if c[3] > 1], ids=_id)
def test_hf_roundtrip_is_bit_exact(case):
    family, name, _, _ = case
    _, hf_weights = _hf_reference(family)
    exported = {}
    for r in _megatron(family, name):
        duplicated = set(exported) & set(r["weights"])
        assert not duplicated, f"HF tensors exported by two ranks: {sorted(duplicated)[:3]}"
        exported.update(r["weights"])
    assert sorted(exported) == sorted(hf_weights)
    for key, tensor in hf_weights.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key


GRAD_CASES = [(f, n, lay, w) for f in ("qwen2", "qwen3") for n, lay, w in
              [("tp2", {"tp": 2}, 2), ("pp2", {"pp": 2}, 2), ("pp2vpp2", {"pp": 2, "vpp": 2}, 2),
               ("tp2pp2", {"tp": 2, "pp": 2}, 4), ("tp2pp2vpp2", {"tp": 2, "pp": 2, "vpp": 2}, 4)]]
GRAD_CASES += [(f, n, lay, w) for f in MOE for n, lay, w in
               [("ep2", {"ep": 2}, 2), ("tp2ep2", {"tp": 2, "ep": 2}, 4), ("pp2ep2", {"pp": 2, "ep": 2}, 4)]]
GRAD_REFERENCES = [(f, "tp1", {}, 1) for f in dict.fromkeys(f for f, *_ in GRAD_CASES)]
SUITES = {"logits": (ranks.logits_and_export, CASES), "grads": (ranks.train_grads, GRAD_CASES),
          "grad_reference": (ranks.train_grads, GRAD_REFERENCES)}


@pytest.mark.parametrize("case", GRAD_CASES, ids=_id)
def test_grads_match_single_rank(case):
    family, name, _, _ = case
    (reference,) = _launch("grad_reference", "tp1")[family]
    ref = reference["grads"]
    grads, losses = {}, None
    for r in _launch("grads", name)[family]:
        grads.update(r["grads"])
        losses = r["losses"] or losses
    assert sorted(grads) == sorted(ref)
    for key in ref:
        assert ref[key].abs().max() > 0, f"reference grad of {key} is zero: the check would be vacuous"
        assert (grads[key] - ref[key]).abs().max().item() < 1e-5, key
    assert torch.allclose(torch.stack(losses), torch.stack(reference["losses"]), atol=1e-5)


def test_mla_refuses_tensor_parallel_without_sequence_parallelism_on_cpu():
    # The CPU shim mla_rope_key_grad makes MLA's gradients exact at tp > 1 with sequence parallelism (mbridge's
    # default there); a dense DeepSeek-V3 (no MoE, which would demand sequence parallelism itself) without it is refused.
    from megarl.testing import RankFailure

    with pytest.raises(RankFailure) as failure:
        run_ranks(2, ranks.build, tiny_model_dir("deepseek_v3", first_k_dense_replace=4), tp=2, load=False,
                  sequence_parallel=False)
    message = str(failure.value)
    assert "ParallelConfigError: parallel.tp=2: deepseek_v3 (multi-latent attention) needs sequence parallelism at " \
           "tp > 1 on CPU" in message and "Fix: leave sequence_parallel on" in message


def _tied_then_untied(tied_path, untied_path):
    from megarl.models import ModelBridge

    names = {}
    for path in (tied_path, untied_path):
        _, bridge, chunks = ranks.build(path)
        names[path] = sorted(name for name, _ in bridge.export_hf_weights(chunks))
        ModelBridge(path, pg=bridge.pg)  # a second bridge in the same process
    return names


def test_tied_model_does_not_leak_its_name_table_into_later_models():
    # mbridge's Qwen3 bridge rewrites the (inherited) Qwen2 class table for tied embeddings.
    tied, untied = tiny_model_dir("qwen3"), tiny_model_dir("qwen2")
    (names,) = run_ranks(1, _tied_then_untied, tied, untied)
    _, untied_weights = _hf_reference("qwen2")
    assert "lm_head.weight" not in names[tied]
    assert names[untied] == sorted(untied_weights)


@pytest.mark.parametrize("layout,world", [({}, 1), ({"tp": 2, "pp": 2}, 4)], ids=["tp1", "tp2pp2"])
def test_tied_llama_matches_transformers(layout, world):
    """Llama with tied embeddings (SmolLM2's shape): one HF tensor for embedding and output layer."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("llama", tie_word_embeddings=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = [hf(batch).logits for batch in ranks.input_batches()]
    results = run_ranks(world, ranks.logits_and_export, path, layout)
    logits = next(r["logits"] for r in results if r["logits"] is not None)
    assert max((a - b).abs().max().item() for a, b in zip(logits, reference)) < 1e-4
    exported = {k: v for r in results for k, v in r["weights"].items()}
    assert "lm_head.weight" not in exported and "model.embed_tokens.weight" in exported
