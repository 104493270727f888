"""Vocab-parallel log-prob/entropy against a naive full-vocabulary PyTorch computation, at TP=1 and TP=2, with one
target per position or K (the teacher's top-k of on-policy distillation; repeated ids included)."""
import pytest
import torch

from megarl.losses import vocab_parallel_logprob_entropy
from megarl.testing import run_ranks

VOCAB, PADDED = 50, 64  # 14 padded columns, as Megatron's vocabulary padding leaves


def _inputs(seed=0, k=None):
    """k None: one target per position ([2, 7]); k: [2, 7, k] targets, the last column repeating the first."""
    g = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(2, 7, PADDED, generator=g, dtype=torch.float32)
    logits[..., VOCAB:] = 5.0  # padded columns must not count, whatever they hold
    shape = (2, 7) if k is None else (2, 7, k)
    targets = torch.randint(0, VOCAB, shape, generator=g)
    if k is not None:
        targets[..., -1] = targets[..., 0]  # a repeated id: its gradients must add up
    w_lp = torch.randn(shape, generator=g, dtype=torch.float32)
    w_h = torch.randn(2, 7, generator=g, dtype=torch.float32)
    return logits, targets, w_lp, w_h


def _naive(logits, targets, temperature, w_lp, w_h):
    logits = logits.clone().requires_grad_(True)
    logp_all = torch.log_softmax(logits[..., :VOCAB] / temperature, dim=-1)
    log_prob = logp_all.gather(-1, targets.reshape(*logits.shape[:-1], -1)).reshape(targets.shape)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ((w_lp * log_prob).sum() + (w_h * entropy).sum()).backward()
    return log_prob.detach(), entropy.detach(), logits.grad


def _ours(logits, targets, temperature, w_lp, w_h, group=None, chunk_size=3):
    logits = logits.clone().requires_grad_(True)
    log_prob, entropy = vocab_parallel_logprob_entropy(logits, targets, vocab_size=VOCAB, temperature=temperature,
                                                       group=group, chunk_size=chunk_size)
    ((w_lp * log_prob).sum() + (w_h * entropy).sum()).backward()
    return log_prob.detach(), entropy.detach(), logits.grad


@pytest.mark.unit
@pytest.mark.parametrize("k", [None, 3])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [3, 4096])
def test_single_rank_matches_naive(temperature, chunk_size, k):
    logits, targets, w_lp, w_h = _inputs(k=k)
    ref = _naive(logits, targets, temperature, w_lp, w_h)
    ours = _ours(logits, targets, temperature, w_lp, w_h, chunk_size=chunk_size)
    for a, b in zip(ours[:2], ref[:2]):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=0)
    assert torch.allclose(ours[2][..., :VOCAB], ref[2][..., :VOCAB], atol=1e-5, rtol=0)
    assert torch.all(ours[2][..., VOCAB:] == 0)
    assert ref[1].mean() > 0.1 and ref[2].abs().max() > 0.1  # non-trivial values


def _tp2(temperature, k):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    logits, targets, w_lp, w_h = _inputs(k=k)
    shard = logits[..., rank * PADDED // 2:(rank + 1) * PADDED // 2]
    log_prob, entropy, grad = _ours(shard, targets, temperature, w_lp, w_h, group=dist.group.WORLD)
    return log_prob, entropy, grad


@pytest.mark.multirank
@pytest.mark.parametrize("temperature,k", [(1.0, None), (0.7, None), (0.7, 3)])
def test_tp2_matches_naive_without_gathering_the_vocabulary(temperature, k):
    logits, targets, w_lp, w_h = _inputs(k=k)
    ref_lp, ref_h, ref_grad = _naive(logits, targets, temperature, w_lp, w_h)
    results = run_ranks(2, _tp2, temperature, k)
    for log_prob, entropy, grad in results:
        assert log_prob.shape == ref_lp.shape and torch.allclose(log_prob, ref_lp, atol=1e-5, rtol=0)
        assert torch.allclose(entropy, ref_h, atol=1e-5, rtol=0)
    full_grad = torch.cat([results[0][2], results[1][2]], dim=-1)
    assert full_grad.shape[-1] == PADDED
    assert torch.allclose(full_grad[..., :VOCAB], ref_grad[..., :VOCAB], atol=1e-5, rtol=0)
    assert torch.all(full_grad[..., VOCAB:] == 0)


@pytest.mark.unit
def test_targets_must_match_the_positions():
    logits, _, _, _ = _inputs()
    with pytest.raises(ValueError, match=r"targets \[2, 6\] do not match the positions \[2, 7\]"):
        vocab_parallel_logprob_entropy(logits, torch.zeros(2, 6, dtype=torch.long), vocab_size=VOCAB)


@pytest.mark.unit
def test_bad_temperature():
    logits, targets, _, _ = _inputs()
    with pytest.raises(ValueError, match="temperature must be > 0"):
        vocab_parallel_logprob_entropy(logits, targets, vocab_size=VOCAB, temperature=0.0)
