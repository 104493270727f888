"""Layout invariance: one RL batch with unequal sequence lengths gives the same gradients and global metrics at
TP 1/2, PP 1/2 (and VPP), DP 1/2 and 1/2/4 micro-batches, for every aggregation mode, and for the policy losses of
the algorithm zoo (several configs per multi-rank run)."""
import functools
import math
from dataclasses import replace

import pytest
import torch

import ranks
from megarl.algorithms import AGGREGATIONS, AlgorithmConfig, MismatchConfig
from megarl.testing import run_ranks, tiny_model_dir
from rl_batch import TEMPERATURE, rl_token_batch

pytestmark = pytest.mark.multirank

FAMILY = "qwen3"  # qk-norm and tied embeddings (split across pipeline stages at PP=2)
# (name, layout, world size, micro-batches per DP rank)
LAYOUTS = [("mb4", {}, 1, 4), ("tp2", {"tp": 2}, 2, 2), ("pp2", {"pp": 2}, 2, 4), ("dp2", {}, 2, 2),
           ("pp2vpp2", {"pp": 2, "vpp": 2}, 2, 4), ("tp2pp2", {"tp": 2, "pp": 2}, 4, 1), ("tp2dp2", {"tp": 2}, 4, 1)]


def _config(aggregation):
    return AlgorithmConfig(policy_loss="ppo_clip", clip_eps_low=0.1, clip_eps_high=0.15, dual_clip=3.0,
                           aggregation=aggregation, norm_length=16, kl_coef=0.05, entropy_coef=0.01,
                           temperature=TEMPERATURE, mismatch=MismatchConfig(mode="tis", cap=1.5)).validate()


@functools.cache
def _batch():
    return rl_token_batch(tiny_model_dir(FAMILY))


@functools.cache
def _reference(aggregation):
    (result,) = run_ranks(1, ranks.rl_grads, tiny_model_dir(FAMILY), {}, _batch(), _config(aggregation), 1)
    return result


def test_batch_has_unequal_lengths_and_clipping():
    lengths = _batch().loss_mask.sum(-1)
    assert len(set(lengths.tolist())) > 3
    metrics = _reference("token-mean")["metrics"]
    assert 0 < metrics["clip_frac_low"] + metrics["clip_frac_high"] < 1  # both branches of the clip are used
    assert metrics["kl"] > 0 and metrics["entropy"] > 0


def _assert_same_grads(results, ref):
    grads = {}
    for r in results:
        grads.update(r["grads"])
    assert sorted(grads) == sorted(ref["grads"])
    for key, expected in ref["grads"].items():
        scale = expected.abs().max().item()
        assert scale > 0, key
        assert (grads[key] - expected).abs().max().item() <= 1e-5 * scale + 1e-8, key


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name,layout,world,micro_batches", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_gradients_do_not_depend_on_layout(aggregation, name, layout, world, micro_batches):
    ref = _reference(aggregation)
    results = run_ranks(world, ranks.rl_grads, tiny_model_dir(FAMILY), layout, _batch(), _config(aggregation),
                        micro_batches)
    _assert_same_grads(results, ref)
    for r in results:  # every rank, every pipeline stage, reports the same global metrics
        for key in ("loss", "pg_loss", "kl", "entropy", "clip_frac_low", "clip_frac_high", "ppo_kl",
                    "logprob_abs_diff", "logprob_abs_diff_max", "ratio_p50", "ratio_p95"):
            assert abs(r["metrics"][key] - ref["metrics"][key]) <= 1e-5 * max(1.0, abs(ref["metrics"][key])), key


def test_aggregation_modes_really_differ():
    losses = {mode: _reference(mode)["metrics"]["loss"] for mode in AGGREGATIONS}
    assert len({round(v, 6) for v in losses.values()}) == len(AGGREGATIONS)


@pytest.mark.parametrize("name,layout,world,micro_batches", [l for l in LAYOUTS if l[0] in ("tp2", "pp2vpp2", "dp2")],
                         ids=["tp2", "pp2vpp2", "dp2"])
def test_sft_gradients_do_not_depend_on_layout(name, layout, world, micro_batches):
    cfg = _config("token-mean")
    (ref,) = run_ranks(1, ranks.rl_grads, tiny_model_dir(FAMILY), {}, _batch(), cfg, 1, "sft")
    results = run_ranks(world, ranks.rl_grads, tiny_model_dir(FAMILY), layout, _batch(), cfg, micro_batches, "sft")
    _assert_same_grads(results, ref)
    assert abs(results[-1]["metrics"]["nll"] - ref["metrics"]["nll"]) < 1e-5 and ref["metrics"]["nll"] > 1


# The algorithm zoo's policy losses (and the straight-through KL), several configs in one multi-rank run per layout.
ZOO = {"gmpo": dict(policy_loss="gmpo", clip_eps_low=0.1, clip_eps_high=0.1, aggregation="seq-mean-token-mean"),
       "sapo": dict(policy_loss="sapo", kl_estimator="k3+"),
       "aspo": dict(policy_loss="aspo", dual_clip=1.2, aggregation="token-sum"),
       "adv_reweight": dict(policy_loss="adv_reweight", kl_estimator="abs+"),
       # part 2: token selections decided over the global batch before the loss (megarl.algorithms.token_selection)
       "fipo": dict(policy_loss="fipo", fipo_decay_rate=4.0, fipo_clip_high_only=False),
       "clip_cov": dict(policy_loss="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=0.05, clip_cov_ub=5.0),
       "kl_cov": dict(policy_loss="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=0.5, aggregation="seq-mean-token-mean"),
       "lopti": dict(lopti=True, lopti_eta=0.02),  # the tiny model's probabilities are ~1/384
       "high_entropy": dict(high_entropy_only=True, high_entropy_rho=0.3)}


def _zoo_configs():
    return [replace(_config("token-mean"), **kwargs).validate() for kwargs in ZOO.values()]


def _zoo_names():
    """One name per optimizer step: Lopti gives two (low-probability tokens first)."""
    return [f"{name}/{p}" for name, kwargs in ZOO.items() for p in range(2 if kwargs.get("lopti") else 1)]


def _rl_grads_per_config(path, layout, global_batch, cfgs, num_microbatches):
    """ranks.rl_grads for several configs on one model build: [{"grads", "metrics"}] per optimizer step (the
    phases of megarl.algorithms.loss_phases, as the trainer runs them), in the order of cfgs. The "entropy" the
    high-entropy selection reads is the old log-prob's surprisal, a per-token value that does not depend on the
    layout (the trainer's comes from the recompute pass)."""
    from megarl.algorithms import loss_phases
    from megarl.algorithms.dynamics import UpdateSparsity
    from megarl.losses import forward_backward, prepare_global_batch, reduce_metrics

    ps, bridge, chunks = ranks.build(path, **layout)
    model = ranks.wrap_ddp(chunks, pg=bridge.pg)
    local, _ = ranks.dp_share(global_batch)
    out = []
    for cfg in cfgs:
        for phase in loss_phases(local, cfg, entropy=-local.old_log_probs, group=ps.get_data_parallel_group(),
                                 seed=5):
            batch = prepare_global_batch(phase, cfg.aggregation, cfg.norm_length, pg=bridge.pg)
            for m in model:
                m.zero_grad_buffer()
            metrics = reduce_metrics(forward_backward(model, batch, num_microbatches, cfg, bridge.vocab_size,
                                                      pg=bridge.pg), bridge.pg)
            out.append({"grads": dict(bridge.export_hf_weights(chunks, grads=True)), "metrics": metrics})
    # Update sparsity's count (megarl.algorithms.dynamics): a layout-free "update" that doubles the positive elements
    tracker = UpdateSparsity(chunks, bridge.pg, bridge.vocab_size).snapshot()
    with torch.no_grad():
        for p in tracker.params:
            p.mul_(torch.where(p > 0, 2.0, 1.0))
    out.append({"changed": tracker.changed()})
    return out


@functools.cache
def _zoo_reference():
    (result,) = run_ranks(1, _rl_grads_per_config, tiny_model_dir(FAMILY), {}, _batch(), _zoo_configs(), 1)
    return result


def test_zoo_losses_are_exercised_and_differ():
    ref = dict(zip(_zoo_names(), _zoo_reference()))
    assert ref["gmpo/0"]["metrics"]["clip_frac_low"] + ref["gmpo/0"]["metrics"]["clip_frac_high"] > 0
    assert ref["aspo/0"]["metrics"]["dual_clip_frac"] > 0
    assert ref["fipo/0"]["metrics"]["fipo_weight"] != 1.0
    assert 0 < ref["clip_cov/0"]["metrics"]["cov_selected_frac"] < 0.5
    assert 0 < ref["kl_cov/0"]["metrics"]["cov_selected_frac"] < 0.5
    from megarl.algorithms import loss_phases  # the selections the ranks made, on the whole batch

    cfgs, batch = dict(zip(ZOO, _zoo_configs())), _batch()
    low, high = (p.loss_mask.sum() for p in loss_phases(batch, cfgs["lopti"]))
    assert low > 0 and high > 0 and low + high == batch.loss_mask.sum()
    (selected,) = loss_phases(batch, cfgs["high_entropy"], entropy=-batch.old_log_probs)
    assert selected.loss_mask.sum() == math.ceil(0.3 * batch.loss_mask.sum())
    # update sparsity on one rank counts every parameter of the HF model once, and exactly the changed ones
    from transformers import AutoModelForCausalLM

    hf = list(AutoModelForCausalLM.from_pretrained(tiny_model_dir(FAMILY), dtype=torch.float32).parameters())
    assert _zoo_reference()[-1]["changed"] == (sum(float((p > 0).sum()) for p in hf), sum(p.numel() for p in hf))
    assert not torch.allclose(ref["lopti/0"]["grads"][next(iter(ref["lopti/0"]["grads"]))],
                              ref["lopti/1"]["grads"][next(iter(ref["lopti/1"]["grads"]))], atol=1e-6)
    ppo = _reference("token-mean")["grads"]
    for name, result in ref.items():  # each loss really changes the gradient
        key = next(iter(ppo))
        assert not torch.allclose(result["grads"][key], ppo[key], atol=1e-6), name


@pytest.mark.parametrize("name,layout,world,micro_batches", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_zoo_gradients_do_not_depend_on_layout(name, layout, world, micro_batches):
    per_rank = run_ranks(world, _rl_grads_per_config, tiny_model_dir(FAMILY), layout, _batch(), _zoo_configs(),
                         micro_batches)
    for index, (loss_name, ref) in enumerate(zip(_zoo_names(), _zoo_reference())):
        _assert_same_grads([r[index] for r in per_rank], ref)
        for r in per_rank:
            assert r[-1]["changed"] == _zoo_reference()[-1]["changed"]  # TP/PP/DP copies counted once
            for key in ("loss", "pg_loss", "kl", "ratio_p50", "ratio_p95"):
                assert abs(r[index]["metrics"][key] - ref["metrics"][key]) <= \
                    1e-5 * max(1.0, abs(ref["metrics"][key])), (loss_name, key)
