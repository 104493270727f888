"""Weight-sync checksums on "odd" model shapes, against real SGLang CPU engines at engine TP 1 and TP 2.

SGLang's CPU engine zero-pads what its TP size does not divide (intermediate sizes to 32 x TP, the vocabulary to 64);
the trainer's expected per-rank tensors must follow, or a correct sync is reported as a mismatch. Here: a tied Qwen3
with GQA, head_dim != hidden/heads, intermediate 176 and vocabulary 300 at engine TP 2 (one module-scoped engine),
synced from a TP=2 trainer and checked tensor by tensor on every engine rank. Engine TP 1 with the other odd shapes
(untied, MHA, intermediate 176, vocabulary 300) is what every end-to-end `megarl train` test runs (tests/tiny_rl.py).
"""
import hashlib

import pytest
import torch

import ranks
from megarl.reshard.verify import EngineShapes, engine_shapes, rank_slice, tensor_checksum
from megarl.testing import RankFailure, run_ranks, tiny_model_dir
from megarl.testing.fixtures import early_engine

# Qwen3, tied, GQA, head_dim 32 != hidden/heads = 16, intermediate 176, vocabulary 300
ODD_QWEN3 = dict(intermediate_size=176, vocab_size=300)


class _Config:
    def __init__(self, **fields):
        self.__dict__.update(dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, vocab_size=384,
                                  intermediate_size=128), **fields)


@pytest.mark.unit
def test_engine_shapes_follow_sglang_cpu_padding():
    s = engine_shapes(_Config(intermediate_size=176, vocab_size=300), tp=2, cpu=True)
    assert (s.intermediate, s.vocab, s.heads, s.kv_heads, s.head_dim) == (192, 320, 4, 2, 16)
    assert engine_shapes(_Config(intermediate_size=176), tp=1, cpu=True).intermediate == 192  # 32 x 1
    assert engine_shapes(_Config(intermediate_size=192), tp=2, cpu=True).intermediate == 192  # aligned: untouched
    assert engine_shapes(_Config(intermediate_size=176), tp=2, cpu=False).intermediate == 176  # GPU: no padding
    s = engine_shapes(_Config(num_attention_heads=6, num_key_value_heads=3, head_dim=32), tp=2, cpu=True)
    assert (s.heads, s.kv_heads, s.head_dim) == (8, 4, 32)  # kv heads padded to 4, queries to 4 x 2
    assert engine_shapes(_Config(vocab_size=300), tp=3, cpu=False).vocab == 384  # 320 % 3 != 0: pad to 64 x 3
    s = engine_shapes(_Config(num_attention_heads=8, num_key_value_heads=2), tp=4, cpu=False)
    assert (s.heads, s.kv_heads) == (8, 2)  # GPU: kv heads replicated, not padded


@pytest.mark.unit
def test_rank_slices_rebuild_the_tensor_with_zero_padding():
    s = EngineShapes(tp=2, head_dim=16, heads=4, kv_heads=2, intermediate=192, moe_intermediate=None,
                     shared_expert_intermediate=None, vocab=320)
    gate, down = torch.randn(176, 64), torch.randn(64, 176)
    parts = [rank_slice(gate, "model.layers.0.mlp.gate_proj.weight", s, r) for r in range(2)]
    assert [p.shape for p in parts] == [(96, 64), (96, 64)]
    whole = torch.cat(parts)
    assert torch.equal(whole[:176], gate) and not whole[176:].any()
    cols = torch.cat([rank_slice(down, "model.layers.0.mlp.down_proj.weight", s, r) for r in range(2)], 1)
    assert torch.equal(cols[:, :176], down) and not cols[:, 176:].any()
    norm = torch.randn(64)
    assert rank_slice(norm, "model.layers.0.input_layernorm.weight", s, 1) is norm  # replicated
    replicated = EngineShapes(tp=4, head_dim=16, heads=8, kv_heads=2, intermediate=128, moe_intermediate=None,
                              shared_expert_intermediate=None, vocab=384)
    k = torch.randn(32, 64)
    assert [torch.equal(rank_slice(k, "model.layers.0.self_attn.k_proj.weight", replicated, r), k[16 * (r // 2):][:16])
            for r in range(4)] == [True] * 4


@pytest.mark.unit
def test_checksum_is_sglang_cpu_tensor_hash():
    t = torch.randn(7, 5)
    # sglang/srt/managers/mm_utils.py tensor_hash (CPU path), formatted as /weights_checker does: f"{int:016x}"
    expected = f"{int.from_bytes(hashlib.sha256(t.numpy().tobytes()).digest()[:8], 'big'):016x}"
    assert tensor_checksum(t) == expected


qwen3_tp2 = early_engine("qwen3", tp_size=2, **ODD_QWEN3)


def _check(result):
    stats = result["stats"]
    assert stats["probe_max_abs_diff"] < 1e-3
    assert (torch.tensor(result["engine"]) - torch.tensor(result["trainer"])).abs().max() < 1e-3
    assert (torch.tensor(result["before"]) - torch.tensor(result["after"])).abs().max() > 1e-2
    return stats["verified_tensors"]


@pytest.mark.engine
def test_tied_gqa_head_dim_odd_intermediate_and_vocab_at_engine_tp2(qwen3_tp2):
    # the tensor transport (megarl's default) into two engine ranks: one shared-memory handle per rank
    r = run_ranks(2, ranks.sync_and_compare, tiny_model_dir("qwen3", **ODD_QWEN3), qwen3_tp2.url, {"tp": 2},
                  "tensor", 32, engine_tp=2)[0]
    # 4 layers x (qkv, o, gate_up, down, 2 norms, q_norm, k_norm) + embed (tied: no lm_head) + final norm, x 2 ranks
    assert _check(r) == 2 * (4 * 8 + 2)


def _corrupt_gate_up(transport):

    return ranks.ZeroSliceOf(transport, "model.layers.1.mlp.up_proj.weight")


@pytest.mark.engine
def test_corrupted_padded_tensor_is_named_at_engine_tp2(qwen3_tp2):
    with pytest.raises(RankFailure) as failure:
        run_ranks(2, ranks.sync_and_compare, tiny_model_dir("qwen3", **ODD_QWEN3), qwen3_tp2.url, {"tp": 2},
                  "distributed", 33, _corrupt_gate_up, engine_tp=2)
    message = str(failure.value)
    assert "WeightMismatchError" in message
    assert "engine tensor model.layers.1.mlp.gate_up_proj.weight differs" in message
    assert "model.layers.1.mlp.up_proj.weight" in message
