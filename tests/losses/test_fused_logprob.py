"""Fused output-layer log-probs (megarl.losses.fused_linear): values and gradients against the logits path.

Unit level: fused_logprob_entropy(hidden, weight) against a naive full-vocabulary log_softmax of hidden @ weight.T
(temperature != 1, padded vocabulary rows, one target per position or K), at TP=1 and TP=2 (vocabulary split, with
and without sequence parallelism), and Megatron's main_grad protocol (tied and untied weight). Model level: a
GPTModel's RL loss,
gradients (HF-named, after Megatron's finalize_model_grads) and forward-only log-probs with algorithm.fused_logprobs
on and off, tied and untied, at TP=1, TP=2 (sequence parallel) and PP=2.
"""
import dataclasses
import functools

import pytest
import torch

import ranks
from megarl.algorithms import AlgorithmConfig
from megarl.losses.fused_linear import fused_logprob_entropy
from megarl.testing import run_ranks, tiny_model_dir
from rl_batch import TEMPERATURE, rl_token_batch

VOCAB, PADDED, HIDDEN, SEQ, BATCH = 50, 64, 24, 6, 2  # 14 padded rows, as Megatron's vocabulary padding leaves


def _inputs(seed=0, k=None):
    """k None: one target per position; k: [s, b, k] targets, the last column repeating the first."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(SEQ, BATCH, HIDDEN, generator=g)  # [s, b, h] as GPTModel's decoder hands it over
    weight = 0.5 * torch.randn(PADDED, HIDDEN, generator=g)
    weight[VOCAB:] = 1.0  # padded rows must not count, whatever they hold
    shape = (SEQ, BATCH) if k is None else (SEQ, BATCH, k)
    targets = torch.randint(0, VOCAB, shape, generator=g)
    if k is not None:
        targets[..., -1] = targets[..., 0]  # a repeated id: its gradients must add up
    w_lp, w_h = torch.randn(shape, generator=g), torch.randn(SEQ, BATCH, generator=g)
    return hidden, weight, targets, w_lp, w_h


def _naive(hidden, weight, targets, w_lp, w_h, temperature):
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    logp_all = torch.log_softmax((hidden @ weight.t())[..., :VOCAB] / temperature, dim=-1)
    log_prob = logp_all.gather(-1, targets.reshape(SEQ, BATCH, -1)).reshape(targets.shape)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((w_lp * log_prob).sum() + (w_h * entropy).sum()).backward()
    return log_prob.detach(), entropy.detach(), hidden.grad, weight.grad


def _fused(hidden, weight, targets, w_lp, w_h, temperature, **kwargs):
    hidden, weight = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    # tiles of 5 tokens x 24 vocabulary rows: neither divides 12 tokens or 64 (32 per TP rank) rows, and at TP=2
    # rank 1's second block is padding only
    log_prob, entropy = fused_logprob_entropy(hidden, weight, targets, vocab_size=VOCAB, temperature=temperature,
                                              chunk_tokens=5, vocab_block=24, **kwargs)
    ((w_lp * log_prob).sum() + (w_h * entropy).sum()).backward()
    return log_prob.detach(), entropy.detach(), hidden.grad, weight.grad


def _close(a, b, atol=1e-5):
    return torch.allclose(a, b, atol=atol, rtol=0)


@pytest.mark.unit
@pytest.mark.parametrize("temperature,k", [(1.0, None), (0.7, None), (0.7, 4)])
def test_single_rank_matches_naive(temperature, k):
    args = _inputs(k=k)
    ref = _naive(*args, temperature)
    ours = _fused(*args, temperature)
    for a, b in zip(ours, ref):
        assert a.shape == b.shape and _close(a, b)
    assert torch.all(ours[3][VOCAB:] == 0)  # no gradient into the padded rows
    assert ref[1].mean() > 0.1 and ref[2].abs().max() > 0.1 and ref[3].abs().max() > 0.1  # non-trivial


@pytest.mark.unit
def test_targets_must_match_the_hidden_positions():
    hidden, weight, _, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"targets \[6, 3\] do not match the positions \[6, 2\] of the hidden states"):
        fused_logprob_entropy(hidden, weight, torch.zeros(SEQ, 3, dtype=torch.long), vocab_size=VOCAB)


@pytest.mark.unit
def test_main_grad_protocol_untied_and_tied():
    """With a Megatron main_grad the weight gradient is added into it; DDP's hook must see a placeholder it skips
    (untied), or the embedding's own gradient it must add (weight_shared: tied on the same stage)."""
    hidden, weight, targets, w_lp, w_h = _inputs()
    _, _, _, ref_wgrad = _naive(hidden, weight, targets, w_lp, w_h, 0.7)
    start = torch.randn(PADDED, HIDDEN, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(2))
    for shared in (False, True):
        w = weight.clone().requires_grad_(True)
        w.main_grad, w.grad_added_to_main_grad = start.clone(), False
        log_prob, entropy = fused_logprob_entropy(hidden, w, targets, vocab_size=VOCAB, temperature=0.7,
                                                  weight_shared=shared, chunk_tokens=5, vocab_block=24)
        loss = (w_lp * log_prob).sum() + (w_h * entropy).sum()
        if shared:  # the same weight as an input embedding: its gradient reaches w.grad through autograd
            loss = loss + torch.nn.functional.embedding(ids, w).square().sum()
        loss.backward()
        assert _close(w.main_grad, start + ref_wgrad)
        assert w.grad_added_to_main_grad is (not shared)
        if shared:
            emb = torch.zeros(PADDED, HIDDEN).index_add_(0, ids, 2 * weight[ids])
            assert _close(w.grad, emb)  # only the embedding's gradient, for the DDP hook to add
        else:
            assert w.grad.shape == w.shape  # the placeholder the hook skips


def _tp2(temperature, sequence_parallel, k):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    hidden, weight, targets, w_lp, w_h = _inputs(k=k)
    shard = weight[rank * PADDED // 2:(rank + 1) * PADDED // 2]
    if sequence_parallel:  # this rank's half of the sequence (dim 0)
        hidden = hidden[rank * SEQ // 2:(rank + 1) * SEQ // 2]
    return _fused(hidden, shard, targets, w_lp, w_h, temperature, group=dist.group.WORLD,
                  sequence_parallel=sequence_parallel)


@pytest.mark.multirank
@pytest.mark.parametrize("sequence_parallel,k", [(False, None), (True, None), (True, 3)])
def test_tp2_matches_naive(sequence_parallel, k):
    ref_lp, ref_h, ref_hgrad, ref_wgrad = _naive(*_inputs(k=k), 0.7)
    results = run_ranks(2, _tp2, 0.7, sequence_parallel, k)
    for rank, (log_prob, entropy, hgrad, wgrad) in enumerate(results):
        assert log_prob.shape == ref_lp.shape and _close(log_prob, ref_lp) and _close(entropy, ref_h)
        # grad_hidden summed over both vocabulary halves (all-reduce, or reduce-scatter of the sequence)
        expected = ref_hgrad[rank * SEQ // 2:(rank + 1) * SEQ // 2] if sequence_parallel else ref_hgrad
        assert _close(hgrad, expected)
    assert _close(torch.cat([r[3] for r in results]), ref_wgrad)


# ------------------------------------------------------------------------------------------------- model level
CFG = AlgorithmConfig(policy_loss="ppo_clip", clip_eps_low=0.2, clip_eps_high=0.28, kl_coef=0.02, entropy_coef=0.01,
                      temperature=TEMPERATURE).validate()
MODELS = {"untied": ("llama", {"vocab_size": 380}), "tied": ("qwen3", {"vocab_size": 380})}  # padded to 384


@functools.cache
def _model(kind):
    family, overrides = MODELS[kind]
    path = tiny_model_dir(family, **overrides)
    return path, rl_token_batch(path)


def _fused_vs_unfused(path, layout, batch, cfg, num_microbatches):
    """Loss metrics, HF-named gradients and forward-only log-probs/entropies of one RL batch, without and with the
    fused output layer, on the same model."""
    from megarl.losses import compute_log_probs, forward_backward, prepare_global_batch, reduce_metrics
    from megarl.losses import fused_linear
    from megarl.trainer.setup import wrap_ddp

    calls = []  # proves which path ran: the fused function sees hidden states [s, b, h], never logits
    original = fused_linear.fused_logprob_entropy
    fused_linear.fused_logprob_entropy = lambda hidden, *a, **k: calls.append(hidden.shape[-1]) or original(hidden, *a,
                                                                                                              **k)
    ps, bridge, chunks = ranks.build(path, **layout)
    model = wrap_ddp(chunks, pg=bridge.pg)
    local = prepare_global_batch(batch, cfg.aggregation, cfg.norm_length, pg=bridge.pg)
    out = {}
    for fused in (False, True):
        for m in model:
            m.zero_grad_buffer()
        metrics = reduce_metrics(forward_backward(model, local, num_microbatches,
                                                  dataclasses.replace(cfg, fused_logprobs=fused), bridge.vocab_size,
                                                  pg=bridge.pg), bridge.pg)
        log_probs = compute_log_probs(model, batch, num_microbatches, bridge.vocab_size, temperature=cfg.temperature,
                                      entropy=True, fused=fused, pg=bridge.pg)
        out[fused] = {"metrics": metrics, "grads": dict(bridge.export_hf_weights(chunks, grads=True)),
                      "log_probs": log_probs, "fused_calls": calls[:]}
        calls.clear()
    return out


@pytest.mark.multirank
@pytest.mark.parametrize("kind,layout,world", [("untied", {}, 1), ("tied", {}, 1), ("tied", {"tp": 2}, 2),
                                               ("untied", {"tp": 2}, 2), ("tied", {"pp": 2}, 2)])
def test_model_fused_equals_logits_path(kind, layout, world):
    path, batch = _model(kind)
    results = run_ranks(world, _fused_vs_unfused, path, layout, batch, CFG, 2)
    grads = {False: {}, True: {}}
    for r in results:
        for fused in (False, True):
            grads[fused].update(r[fused]["grads"])
        plain, fused = r[False], r[True]
        last_stage = plain["log_probs"] is not None
        # 2 micro-batches trained + 2 forward-only, each from the model's hidden states (64 wide), on the last stage
        assert plain["fused_calls"] == [] and fused["fused_calls"] == ([64] * 4 if last_stage else [])
        for key in ("loss", "entropy", "kl"):
            assert abs(fused["metrics"][key] - plain["metrics"][key]) < 1e-6, key
        if last_stage:
            for a, b in zip(fused["log_probs"], plain["log_probs"]):
                assert _close(a, b, 1e-6)
    assert grads[False].keys() == grads[True].keys() and "model.embed_tokens.weight" in grads[True]
    for name, expected in grads[False].items():
        assert _close(grads[True][name], expected, 1e-6), name
    head = "model.embed_tokens.weight" if kind == "tied" else "lm_head.weight"
    assert grads[True][head].abs().max() > 1e-3  # the output layer's gradient is there (tied: in the embedding)
