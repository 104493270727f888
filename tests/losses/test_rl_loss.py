"""The RL/SFT objectives on logits: against a naive full-vocabulary computation (value and gradient), under simulated
context parallelism (tokens of every sequence split over 2 ranks), on-policy invariants, and the SFT shift."""
import pytest
import torch

from megarl.algorithms import AGGREGATIONS, AlgorithmConfig, MismatchConfig
from megarl.losses import (TokenBatch, prepare_global_batch, rl_objective, sft_objective, shift_sequences,
                           vocab_parallel_logprob_entropy)
from megarl.testing import run_ranks

V, PADDED, T = 40, 48, 0.9


def _batch(seed=0, b=4, s=8):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (int(torch.randint(1, 3, (1,), generator=g)),), generator=g).tolist()
               for _ in range(b)]
    responses = [torch.randint(0, V, (int(torch.randint(1, s - 2, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(b)]
    ids, targets, mask = shift_sequences(prompts, responses, pad_id=0, seq_len=s)
    logits = 2 * torch.randn(b, s, PADDED, generator=g)
    with torch.no_grad():
        lp = torch.log_softmax(logits[..., :V] / T, -1).gather(-1, targets[..., None])[..., 0]
    noise = lambda: 0.2 * torch.randn(b, s, generator=g)  # noqa: E731
    batch = TokenBatch(input_ids=ids, targets=targets, loss_mask=mask, advantages=torch.randn(b, s, generator=g),
                       old_log_probs=lp + noise(), ref_log_probs=lp + noise(), rollout_log_probs=lp + noise())
    return logits, batch


def _naive_rl(logits, batch, cfg):
    """Full-vocabulary log_softmax, PPO-clip with dual clip, token TIS, k3 KL in the loss, entropy bonus."""
    logits = logits.clone().requires_grad_(True)
    logp_all = torch.log_softmax(logits[..., :V] / T, -1)
    lp = logp_all.gather(-1, batch.targets[..., None])[..., 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    ratio = torch.exp(lp - batch.old_log_probs)
    a = batch.advantages
    pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high))
    pg = torch.where(a < 0, torch.minimum(pg, -a * cfg.dual_clip), pg)
    is_w = torch.exp(batch.old_log_probs - batch.rollout_log_probs).clamp(max=cfg.mismatch.cap)
    d = batch.ref_log_probs - lp
    k3 = torch.exp(d) - d - 1
    per_token = pg * is_w + cfg.kl_coef * k3 - cfg.entropy_coef * entropy
    loss = (per_token * batch.loss_mask * batch.loss_weight).sum()
    loss.backward()
    return loss.detach(), logits.grad


def _ours(logits, batch, cfg, objective=rl_objective, cp_group=None):
    logits = logits.clone().requires_grad_(True)
    lp, ent = vocab_parallel_logprob_entropy(logits, batch.targets, vocab_size=V, temperature=T, chunk_size=5)
    loss, metrics = objective(lp, ent, batch, cfg, cp_group=cp_group)
    loss.backward()
    return loss.detach(), logits.grad, metrics


def _cfg(**kw):
    base = dict(clip_eps_low=0.1, clip_eps_high=0.15, dual_clip=2.5, kl_coef=0.1, entropy_coef=0.02, temperature=T,
                norm_length=8, mismatch=MismatchConfig(mode="tis", cap=1.3))
    return AlgorithmConfig(**{**base, **kw}).validate()


@pytest.mark.unit
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_rl_objective_matches_naive_full_vocab(aggregation):
    logits, batch = _batch()
    cfg = _cfg(aggregation=aggregation)
    batch = prepare_global_batch(batch, aggregation, cfg.norm_length)
    ref_loss, ref_grad = _naive_rl(logits, batch, cfg)
    loss, grad, metrics = _ours(logits, batch, cfg)
    assert abs(loss.item() - ref_loss.item()) < 1e-6
    assert torch.allclose(grad, ref_grad, atol=1e-6) and ref_grad.abs().max() > 1e-3
    assert torch.all(grad[..., V:] == 0)


@pytest.mark.unit
def test_on_policy_metrics():
    logits, batch = _batch()
    with torch.no_grad():
        lp, _ = vocab_parallel_logprob_entropy(logits, batch.targets, vocab_size=V, temperature=T)
    batch.old_log_probs = batch.rollout_log_probs = lp * batch.loss_mask
    batch = prepare_global_batch(batch)
    _, _, m = _ours(logits, batch, _cfg(kl_coef=0.0, dual_clip=None))
    mean = lambda k: (m[k][0] / m[k][1]).item()  # noqa: E731
    assert abs(mean("mean/ratio") - 1) < 1e-6 and abs(mean("mean/ppo_kl")) < 1e-7
    assert mean("mean/clip_frac_low") == 0 and mean("mean/clip_frac_high") == 0
    assert mean("mean/logprob_abs_diff") < 1e-6 and abs(mean("mean/k3_kl_rollout_train")) < 1e-6
    batch.ref_log_probs = lp * batch.loss_mask
    _, _, m = _ours(logits, batch, _cfg(kl_coef=0.0, dual_clip=None))
    assert abs((m["mean/kl"][0]).item()) < 1e-6


# CP=2 the way Megatron balances it: the sequence is cut into 4 chunks; rank 0 holds chunks 0 and 3, rank 1 holds 1, 2.
def _cp_columns(rank, s=8):
    chunk = s // 4
    order = [0, 3] if rank == 0 else [1, 2]
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in order])


def _cp_shard(logits, batch, rank):
    cols = _cp_columns(rank)
    sharded = TokenBatch(**{k: (v[:, cols] if torch.is_tensor(v) else v) for k, v in vars(batch).items()})
    return logits[:, cols], sharded


def _cp_rank(logits, batch, cfg):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    shard_logits, shard = _cp_shard(logits, batch, dist.get_rank())
    loss, grad, _ = _ours(shard_logits, shard, cfg, cp_group=dist.group.WORLD)
    return loss, grad


CP_CASES = [dict(policy_loss="ppo_clip"), dict(policy_loss="gspo", dual_clip=None),
            dict(policy_loss="cispo", dual_clip=None), dict(mismatch=MismatchConfig(mode="seq_tis", cap=1.5)),
            dict(mismatch=MismatchConfig(mode="mis", low=0.9, high=1.1))]


@pytest.mark.multirank
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("overrides", CP_CASES, ids=["ppo_clip", "gspo", "cispo", "seq_tis", "mis"])
def test_simulated_context_parallel_gives_the_same_loss_and_gradient(aggregation, overrides):
    logits, batch = _batch(seed=3)
    cfg = _cfg(aggregation=aggregation, **overrides)
    batch = prepare_global_batch(batch, aggregation, cfg.norm_length)  # weights from whole sequences
    full_loss, full_grad, _ = _ours(logits, batch, cfg)
    results = run_ranks(2, _cp_rank, logits, batch, cfg)
    assert abs(sum(r[0].item() for r in results) - full_loss.item()) < 1e-6
    for rank, (_, grad) in enumerate(results):
        assert torch.allclose(grad, full_grad[:, _cp_columns(rank)], atol=1e-6)


@pytest.mark.unit
def test_sft_objective_is_shifted_cross_entropy():
    g = torch.Generator().manual_seed(0)
    prompts, responses = [[5, 6, 7], [8]], [[9, 10], [11, 12, 13, 14]]
    ids, targets, mask = shift_sequences(prompts, responses, pad_id=0)
    batch = prepare_global_batch(TokenBatch(input_ids=ids, targets=targets, loss_mask=mask))
    logits = torch.randn(2, ids.shape[1], PADDED, generator=g)
    loss, grad, _ = _ours(logits, batch, None, objective=sft_objective)
    # Independent: position t of the logits predicts token t + 1; only response tokens count.
    ref = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        for k, token in enumerate(r):
            ref.append(torch.nn.functional.cross_entropy(logits[i, len(p) - 1 + k, :V] / T, torch.tensor(token)))
    assert abs(loss.item() - torch.stack(ref).mean().item()) < 1e-6
    assert mask.sum() == 6 and grad[..., V:].abs().max() == 0


@pytest.mark.unit
def test_ratio_percentiles_from_a_mergeable_histogram():
    """Ratio percentiles come from fixed-size log-ratio histograms summed over ranks (no per-token gather): within
    one bin (2e-3 in log-ratio) of the exact quantile, exact for a single value, and the same whether the tokens
    are split over ranks or not."""
    from megarl.losses.rl import HISTOGRAM_BINS, HISTOGRAM_RANGE, histogram_quantile, log_histogram

    g = torch.Generator().manual_seed(0)
    values = torch.randn(10_000, generator=g, dtype=torch.float64) * 0.2
    whole = log_histogram(values)
    parts = sum(log_histogram(p) for p in values.split([1, 4_000, 5_999]))
    assert whole.shape == (2, HISTOGRAM_BINS) and torch.allclose(whole, parts)
    width = 2 * HISTOGRAM_RANGE / HISTOGRAM_BINS
    for q in (0.05, 0.5, 0.95):
        assert abs(float(histogram_quantile(whole, q) - torch.quantile(values, q))) <= width
    assert float(histogram_quantile(log_histogram(torch.zeros(7, dtype=torch.float64)), 0.05)) == 0.0
    tails = log_histogram(torch.tensor([-50.0, 50.0], dtype=torch.float64))  # beyond the range: the edge bins
    assert tails[0, 0] == 1 and tails[0, -1] == 1 and float(histogram_quantile(tails, 0.95)) == 50.0
