"""megarl.losses.train_step and compute_log_probs through Megatron DDP and its optimizer."""
import functools

import pytest
import torch

import ranks
from megarl.algorithms import AlgorithmConfig
from megarl.testing import run_ranks, tiny_model_dir
from rl_batch import TEMPERATURE, rl_token_batch

pytestmark = pytest.mark.multirank

CFG = AlgorithmConfig(policy_loss="ppo_clip", clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.02,
                      temperature=TEMPERATURE).validate()


@functools.cache
def _batch():
    return rl_token_batch(tiny_model_dir("llama"))


@functools.cache
def _reference():
    (result,) = run_ranks(1, ranks.rl_train_step, tiny_model_dir("llama"), {}, _batch(), CFG, 2)
    return result


def test_step_updates_weights_and_reports_metrics():
    from safetensors.torch import load_file

    ref = _reference()
    before = load_file(f"{tiny_model_dir('llama')}/model.safetensors")
    assert all(not torch.equal(before[k], ref["weights"][k]) for k in before)
    m = ref["metrics"]
    assert m["update_successful"] == 1.0 and m["grad_norm"] > 0.05  # clipping to 0.05 was active
    assert m["lr"] == 0.5 and "ratio_p50" in m and "clip_frac_high" in m


def test_log_probs_match_transformers():
    from transformers import AutoModelForCausalLM

    batch = _batch()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir("llama"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(batch.input_ids).logits / TEMPERATURE
        expected = torch.log_softmax(logits, -1).gather(-1, batch.targets[..., None])[..., 0] * batch.loss_mask
    assert torch.allclose(_reference()["log_probs"], expected, atol=1e-5)


@pytest.mark.parametrize("name,layout,world,micro", [("tp2", {"tp": 2}, 2, 1), ("dp2", {}, 2, 1),
                                                      ("pp2", {"pp": 2}, 2, 4)])
def test_step_is_layout_invariant(name, layout, world, micro):
    """megatron-core's ProcessGroupCollection is passed at every boundary (bridge, DDP, schedule, loss, metrics,
    log-probs): megarl takes no groups from megatron's global state."""
    ref = _reference()
    results = run_ranks(world, ranks.rl_train_step, tiny_model_dir("llama"), layout, _batch(), CFG, micro)
    weights = {}
    for r in results:
        weights.update(r["weights"])
        assert abs(r["metrics"]["grad_norm"] - ref["metrics"]["grad_norm"]) < 1e-5 * ref["metrics"]["grad_norm"]
        assert abs(r["metrics"]["loss"] - ref["metrics"]["loss"]) < 1e-6
    for key, expected in ref["weights"].items():
        assert torch.allclose(weights[key], expected, atol=1e-6), key
    for r in results:
        if r["log_probs"] is not None:
            lo, hi = r["rows"]
            assert torch.allclose(r["log_probs"], ref["log_probs"][lo:hi], atol=1e-5)
