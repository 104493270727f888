"""Packed sequences (algorithm.pack_sequences): each micro-batch's rows run through the model as ONE row of their real
tokens (per-sample attention and positions), and the per-token outputs are unpacked to [b, s] before the objective.
The packed forward must give what the padded one gives: RL gradients and metrics, old/ref log-probs, SFT on
loader-packed rows, MoE with routing replay, at TP1, TP2 (sequence parallel) and PP2 (micro-batches of different
packed lengths padded to one length for the pipeline)."""
import functools
from dataclasses import replace

import pytest
import torch

import ranks
from megarl.algorithms import AlgorithmConfig, MismatchConfig
from megarl.data.chat import SFTSample, rows_to_tensors
from megarl.losses import TokenBatch
from megarl.models.forward import causal_inputs, packed_layouts
from megarl.testing import run_ranks, tiny_model_dir
from rl_batch import TEMPERATURE, rl_token_batch

FAMILY = "qwen3"  # tied embeddings split across stages at PP=2, qk-norm


def _config(**kwargs):
    return AlgorithmConfig(policy_loss="ppo_clip", clip_eps_low=0.1, clip_eps_high=0.15, aggregation=
                           "seq-mean-token-mean", kl_coef=0.05, entropy_coef=0.01, temperature=TEMPERATURE,
                           mismatch=MismatchConfig(mode="seq_tis", cap=1.5), **kwargs).validate()


@functools.cache
def _batch():
    return rl_token_batch(tiny_model_dir(FAMILY))


@functools.cache
def _sft_batches():
    """(one sample per row, the same samples loader-packed two or three per row with segment_ids), seq 32."""
    g = torch.Generator().manual_seed(3)
    samples = []
    for _ in range(12):
        n = int(torch.randint(3, 11, (1,), generator=g))
        ids = torch.randint(3, 384, (n,), generator=g).tolist()
        prompt = int(torch.randint(1, n - 1, (1,), generator=g))
        samples.append(SFTSample(ids, [0] * prompt + [1] * (n - prompt)))
    alone = TokenBatch(*rows_to_tensors([[s] for s in samples], 0, 32)[:3])
    packed_rows = [samples[0:3], samples[3:5], samples[5:9], samples[9:12]]
    ids, targets, mask, segments = rows_to_tensors(packed_rows, 0, 40)
    return alone, TokenBatch(ids, targets, mask, segment_ids=segments)


# ------------------------------------------------------------------------------------------------ the layout
@pytest.mark.unit
def test_layout_packs_real_tokens_and_unpacks_them_back():
    mask = torch.tensor([[0, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0.]])
    other = torch.tensor([[1, 1, 0, 0, 0, 0.]] * 3)
    first, second = packed_layouts([mask, other], [None, None], multiple=4)
    assert [l.total for l in packed_layouts([mask, other], [None, None], 4, equal_shapes=False)] == [8, 8]
    assert [l.total for l in packed_layouts([mask, other], [None, None], 1, equal_shapes=False)] == [8, 6]
    assert first.total == second.total == 8  # the longest micro-batch (3 + 5 tokens), rounded up to 4
    assert first.index.tolist() == [0, 1, 2, 12, 13, 14, 15, 16]  # row 0 up to its last trained position + 1
    assert first.segment_ids.tolist() == [[1, 1, 1, 2, 2, 2, 2, 2]]
    assert first.cu_seqlens.tolist() == [0, 3, 8] and first.max_seqlen == 5
    assert second.segment_ids.tolist() == [[1, 1, 2, 2, 3, 3, 0, 0]]  # the padding tail is its own segment
    assert second.cu_seqlens.tolist() == [0, 2, 4, 6, 8]
    x = torch.arange(18.).view(3, 6)
    assert first.pack(x).tolist() == [[0, 1, 2, 12, 13, 14, 15, 16]]
    assert second.pack(x, repeat_last=True).tolist() == [[0, 1, 6, 7, 12, 13, 13, 13]]
    y = second.pack(x).requires_grad_()
    back = second.unpack(y)
    assert torch.equal(back, x * other)
    back.sum().backward()  # differentiable: each packed token gets its own gradient, the tail none
    assert y.grad.tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]
    _, positions, blocked = causal_inputs(second.pack(x).long(), second.segment_ids)
    assert positions.tolist() == [[0, 1, 0, 1, 0, 1, 0, 1]]
    assert blocked[0, 0, 2, :2].all() and not blocked[0, 0, 3, 2]  # no attention across samples


@pytest.mark.unit
def test_layout_bins_rows_of_at_most_the_padded_length():
    """The local attention's layout (CPU): first-fit-decreasing into packed rows of row_length positions."""
    lengths = [5, 2, 7, 0, 3, 4]
    mask = torch.zeros(6, 8)
    for r, n in enumerate(lengths):
        mask[r, max(0, n - 1)] = float(n > 0)  # kept up to the last trained position + 1
    (layout,) = packed_layouts([mask], [None], multiple=2, row_length=8)
    assert (layout.out_rows, layout.length) == (3, 8)  # 7 | 5 + 3 | 4 + 2 (21 tokens in 24 positions)
    assert layout.tokens == 21 and layout.segment_ids.tolist() == [[1] * 7 + [0], [1] * 5 + [2] * 3,
                                                                   [1] * 4 + [2] * 2 + [0] * 2]
    assert layout.cu_seqlens.tolist() == [0, 7, 8, 13, 16, 20, 22, 24]
    x = torch.arange(48.).view(6, 8)
    kept = (torch.arange(8)[None] < torch.tensor(lengths)[:, None]).float()
    assert torch.equal(layout.unpack(layout.pack(x)), x * kept)
    assert layout.pack(x)[0].tolist() == [16, 17, 18, 19, 20, 21, 22, 0]  # row 2, the longest, first
    with pytest.raises(ValueError, match="one packed row"):
        layout.model_inputs(layout.pack(x).long(), thd=True)
    # with pipeline stages one shape for every micro-batch: the most packed rows
    small = torch.zeros(2, 8)
    small[:, 1] = 1
    shapes = [(l.out_rows, l.length) for l in packed_layouts([mask, small], [None, None], 2, row_length=8)]
    assert shapes == [(3, 8), (3, 8)]
    shapes = [(l.out_rows, l.length) for l in packed_layouts([mask, small], [None, None], 2, False, row_length=8)]
    assert shapes == [(3, 8), (1, 8)]


@pytest.mark.unit
def test_layout_keeps_the_samples_of_loader_packed_rows_apart():
    _, rows = _sft_batches()
    (layout,) = packed_layouts([rows.loss_mask], [rows.segment_ids])
    assert layout.total == layout.tokens  # multiple 1: no tail
    # every sample its own segment, whole, except the last of each row, which ends at its last target (the final
    # token of a row predicts nothing trained)
    expected = []
    for row in rows.segment_ids:
        lengths = torch.bincount(row[row > 0]).tolist()[1:]
        expected += lengths[:-1] + [lengths[-1] - 1]
    assert torch.diff(layout.cu_seqlens).tolist() == expected and len(expected) == 12
    assert layout.segment_ids.max() == 12


@pytest.mark.unit
def test_transformer_engine_branch_is_megatron_thd_packed_seq_params():
    from megatron.core.packed_seq_params import PackedSeqParams

    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 0.]])
    (layout,) = packed_layouts([mask], [None], multiple=2)
    ids = layout.pack(torch.arange(8).view(2, 4))
    args, kwargs = layout.model_inputs(ids, thd=True)
    params = kwargs["packed_seq_params"]
    assert isinstance(params, PackedSeqParams) and params.qkv_format == "thd"
    assert args[2] is None  # attention_mask: the boundaries are in cu_seqlens
    assert params.cu_seqlens_q.tolist() == params.cu_seqlens_kv.tolist() == [0, 3, 6]
    assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == params.max_seqlen_kv == 3
    assert args[1].tolist() == [[0, 1, 2, 0, 1, 2]]


# ------------------------------------------------------------------------------------------ through Megatron
def _packed_vs_padded(path, layout, batch, sft, cfgs, num_microbatches):
    """On one model build, for pack False then True: RL gradients + metrics per config, log-probs + entropy, SFT
    gradients on loader-packed rows and on one sample per row."""
    from megarl.losses import compute_log_probs, forward_backward, prepare_global_batch, reduce_metrics
    from megarl.losses.step import schedule_layouts

    ps, bridge, chunks = ranks.build(path, **layout)
    model, pg = ranks.wrap_ddp(chunks, pg=bridge.pg), bridge.pg
    local, rows = ranks.dp_share(batch)

    def grads_of(prepared, cfg, objective, pack):
        for m in model:
            m.zero_grad_buffer()
        metrics = reduce_metrics(forward_backward(model, prepared, num_microbatches, cfg, bridge.vocab_size,
                                                  objective, pack=pack, pg=pg), pg)
        return {"grads": dict(bridge.export_hf_weights(chunks, grads=True)), "metrics": metrics}

    out = {"shapes": [(l.rows, l.out_rows, l.tokens, l.length)
                      for l in schedule_layouts(model, local.split(num_microbatches), True, pg=pg)]}
    if ps.get_tensor_model_parallel_world_size() == ps.get_pipeline_model_parallel_world_size() == 1:
        out["one_row"] = _one_row_logits_diff(chunks[0], local, bridge.vocab_size)
    for pack in (False, True):
        res = {"rl": [grads_of(prepare_global_batch(local, c.aggregation, pg=pg), c, "rl", pack)
                      for c in cfgs],
               "log_probs": compute_log_probs(model, local, num_microbatches, bridge.vocab_size,
                                              temperature=TEMPERATURE, entropy=True, pack=pack, pg=pg), "rows": rows}
        for name, b in zip(("sft_alone", "sft_rows"), sft):
            mine, _ = ranks.dp_share(b)
            res[name] = grads_of(prepare_global_batch(mine, "token-mean", pg=pg), None, "sft", pack)
        out[pack] = res
    return out


@torch.no_grad()
def _one_row_logits_diff(model, batch, vocab_size):
    """The THD layout (all the rows in one packed row, what TransformerEngine gets) through the local attention: its
    unpacked logits against the padded forward's, at the kept positions (max abs difference, kept positions)."""
    (layout,) = packed_layouts([batch.loss_mask], [None])
    padded = model(*causal_inputs(batch.input_ids))[..., :vocab_size]
    args, kwargs = layout.model_inputs(layout.pack(batch.input_ids), thd=False)
    packed = layout.unpack(model(*args, **kwargs)[..., :vocab_size])
    kept = layout.unpack(torch.ones(1, layout.total, 1)).bool()
    return float(((packed - padded) * kept).abs().max()), int(kept.sum()), layout.out_rows


def _same_grads(results, expected_per_rank, tol=1e-5):
    got, ref = {}, {}
    for r, e in zip(results, expected_per_rank):
        got.update(r["grads"])
        ref.update(e["grads"])
    assert sorted(got) == sorted(ref)
    for key, expected in ref.items():
        scale = expected.abs().max().item()
        assert scale > 0, key
        assert (got[key] - expected).abs().max().item() <= tol * scale + 1e-8, key


RL_KEYS = ("loss", "pg_loss", "kl", "entropy", "ppo_kl", "clip_frac_low", "clip_frac_high", "logprob_abs_diff",
           "logprob_abs_diff_max", "is_weight", "ratio_p50", "ratio_p95")


@pytest.mark.multirank
@pytest.mark.parametrize("name,layout,world,micro_batches", [
    ("tp1", {}, 1, 2), ("tp2", {"tp": 2}, 2, 2), ("pp2", {"pp": 2}, 2, 2), ("pp2mb4", {"pp": 2}, 2, 4)],
    ids=["tp1", "tp2", "pp2", "pp2mb4"])
def test_packed_forward_equals_padded(name, layout, world, micro_batches):
    cfgs = [_config()] + ([_config(fused_logprobs=False)] if name == "tp1" else [])  # logits path too, once
    results = run_ranks(world, _packed_vs_padded, tiny_model_dir(FAMILY), layout, _batch(), _sft_batches(), cfgs,
                        micro_batches)
    # samples really share packed rows (with pipeline stages the shapes are equalised: then a row stays empty)
    assert any(out_rows < rows or out_rows * length - tokens >= length
               for rows, out_rows, tokens, length in results[0]["shapes"])
    if name == "tp1":
        diff, kept, out_rows = results[0]["one_row"]
        assert diff < 1e-4 and kept > 40 and out_rows == 1
    padded, packed = [r[False] for r in results], [r[True] for r in results]
    for index in range(len(cfgs)):
        _same_grads([r["rl"][index] for r in packed], [r["rl"][index] for r in padded])
        for p, q in zip(packed, padded):  # every rank, every stage: the same global metrics
            for key in RL_KEYS:
                a, b = p["rl"][index]["metrics"][key], q["rl"][index]["metrics"][key]
                assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), key
    ref = padded[0]["rl"][0]["metrics"]
    assert 0 < ref["clip_frac_low"] + ref["clip_frac_high"] and ref["kl"] > 0 and ref["is_weight"] != 1
    holders = [(p, q) for p, q in zip(packed, padded) if q["log_probs"] is not None]
    assert holders
    for p, q in holders:
        for a, b in zip(p["log_probs"], q["log_probs"]):  # log-probs, entropies
            assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5)
        assert q["log_probs"][0].abs().sum() > 0
    # SFT: loader-packed rows, padded or packed forward, equal one sample per row (an independent reference)
    _same_grads([r["sft_rows"] for r in packed], [r["sft_alone"] for r in padded])
    _same_grads([r["sft_rows"] for r in padded], [r["sft_alone"] for r in padded])
    _same_grads([r["sft_alone"] for r in packed], [r["sft_alone"] for r in padded])
    nll = padded[-1]["sft_alone"]["metrics"]["nll"]
    assert nll > 1 and abs(packed[-1]["sft_rows"]["metrics"]["nll"] - nll) < 1e-5


@pytest.mark.multirank
def test_packed_tp2_equals_padded_tp1():
    """Across layouts too: the packed TP2 step (sequence parallel) against the padded single rank."""
    cfgs = [_config()]
    (one,) = run_ranks(1, _packed_vs_padded, tiny_model_dir(FAMILY), {}, _batch(), _sft_batches(), cfgs, 1)
    two = run_ranks(2, _packed_vs_padded, tiny_model_dir(FAMILY), {"tp": 2}, _batch(), _sft_batches(), cfgs, 2)
    _same_grads([two[0][True]["rl"][0], two[1][True]["rl"][0]], [one[False]["rl"][0]])
    assert abs(two[0][True]["rl"][0]["metrics"]["loss"] - one[False]["rl"][0]["metrics"]["loss"]) < 1e-6


# ------------------------------------------------------------------------------------------------ MoE, R3
def _moe_packed_vs_padded(path, batch, routed):
    """Qwen3-MoE at one rank: gradients with routing replay of `routed` (R3), and the routing agreement of a
    forward without replay (RoutingStats, packed order mapped back by schedule_layouts), pack False then True."""
    from megarl.losses import compute_log_probs, forward_backward, prepare_global_batch, reduce_metrics
    from megarl.losses.step import schedule_layouts
    from megarl.models.moe import RoutingStats

    ps, bridge, chunks = ranks.build(path, moe_enable_routing_replay=True, moe_aux_loss_coeff=0.0)
    model, pg = ranks.wrap_ddp(chunks, pg=bridge.pg), bridge.pg
    cfg = _config()
    out = {}
    for pack in (False, True):
        stats = RoutingStats(chunks)
        compute_log_probs(model, batch, 2, bridge.vocab_size, pack=pack, pg=pg)
        stats.close()
        layouts = schedule_layouts(model, batch.split(2), pack, pg=pg)
        agreement = stats.agreement(routed, batch.loss_mask, 2, layouts)
        prepared = prepare_global_batch(replace(batch, routed_experts=routed), cfg.aggregation, pg=pg)
        for m in model:
            m.zero_grad_buffer()
        metrics = reduce_metrics(forward_backward(model, prepared, 2, cfg, bridge.vocab_size, pack=pack, pg=pg), pg)
        out[pack] = {"grads": dict(bridge.export_hf_weights(chunks, grads=True)), "metrics": metrics,
                     "agreement": agreement}
    return out


@pytest.mark.multirank
def test_moe_routing_replay_packed_equals_padded():
    path = tiny_model_dir("qwen3_moe")
    batch = rl_token_batch(path)
    g = torch.Generator().manual_seed(5)
    b, s = batch.input_ids.shape
    layers, experts, k = 4, 4, 2
    routed = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(b * s * layers)])
    routed = routed.view(b, s, layers, k).to(torch.uint8)
    (result,) = run_ranks(1, _moe_packed_vs_padded, path, batch, routed)
    _same_grads([result[True]], [result[False]])
    assert abs(result[True]["metrics"]["loss"] - result[False]["metrics"]["loss"]) < 1e-6
    padded, packed = result[False]["agreement"], result[True]["agreement"]
    assert torch.equal(padded, packed) and 0 < padded[0] < padded[1]  # the same tokens counted, same decisions


# --------------------------------------------------------------------------------------------------- critic
def _critic_packed_vs_padded(path, layout, batch):
    """The critic (value head, replicated on every TP rank) at a layout: values and value-loss gradients, pack False
    then True."""
    from megarl.losses import compute_values, forward_backward, prepare_global_batch
    from megarl.trainer.config import OptimConfig
    from megarl.trainer.setup import build_critic

    _, bridge, chunks = ranks.build(path, **layout)
    critic = build_critic(bridge, chunks, OptimConfig(), lr=1e-3, total_steps=1)
    if critic.chunks[-1].post_process:
        with torch.no_grad():
            critic.chunks[-1].output_layer.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(4)
    batch = replace(batch, old_values=torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask,
                    returns=torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask)
    cfg = AlgorithmConfig(value_clip=0.2)
    out = {}
    for pack in (False, True):
        values = compute_values(critic.model, batch, 2, pack=pack, pg=bridge.pg)
        for m in critic.model:
            m.zero_grad_buffer()
        forward_backward(critic.model, prepare_global_batch(batch, seq_multiple=bridge.pg.tp.size()), 2, cfg, 1,
                         objective="value", pack=pack, pg=bridge.pg)
        grads = {name: p.main_grad.clone() for chunk in critic.chunks for name, p in chunk.named_parameters()}
        out[pack] = {"values": values, "grads": grads}
    return out


@pytest.mark.multirank
def test_critic_packed_equals_padded_tp2():
    results = run_ranks(2, _critic_packed_vs_padded, tiny_model_dir(FAMILY), {"tp": 2}, _batch())
    for r in results:
        assert torch.allclose(r[True]["values"], r[False]["values"], atol=1e-5)
        assert r[False]["values"].abs().sum() > 0
        _same_grads([{"grads": r[True]["grads"]}], [{"grads": r[False]["grads"]}])


@pytest.mark.unit
def test_config_refuses_packing_with_context_parallelism():
    from megarl.config import ConfigError
    from megarl.trainer.config import load_train_config

    # unset, the config keeps it unset (no value is changed by the validation): packed unless the groups have context
    # parallelism, decided where the schedule runs (megarl.losses.step.schedule_layouts, with the groups at hand)
    assert load_train_config(None, ["model.path=x", "parallel.cp=2"]).algorithm.pack_sequences is None
    with pytest.raises(ConfigError, match=r"algorithm.pack_sequences=true .* parallel.cp=2.*Fix: "
                                          r"algorithm.pack_sequences: false"):
        load_train_config(None, ["model.path=x", "parallel.cp=2", "algorithm.pack_sequences=true"])
