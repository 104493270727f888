"""Advantage estimators, policy losses, KL, aggregation and mismatch correction against naive per-element references
(plain Python loops), hand-worked numbers, on-policy invariants and config errors."""
import math
import statistics

import pytest
import torch

from megarl.algorithms import (AlgorithmConfig, AlgorithmConfigError, MismatchConfig, compute_advantages,
                               kl_estimate, loss_weights, mismatch_weights, value_loss)
from megarl.algorithms.policy_losses import POLICY_LOSSES

pytestmark = pytest.mark.unit

torch.set_default_dtype(torch.float32)


def _data(seed=0, b=6, s=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, s)
    for i in range(b):
        start = int(torch.randint(0, 3, (1,), generator=g))
        end = int(torch.randint(start + 1, s + 1, (1,), generator=g))
        mask[i, start:end] = 1
    return {"mask": mask, "scores": torch.randn(b, generator=g), "group_ids": torch.tensor([0, 0, 0, 1, 1, 1]),
            "values": torch.randn(b, s, generator=g), "kl": torch.rand(b, s, generator=g) * mask,
            "multi": torch.randn(b, 2, generator=g), "g": g}


def _positions(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t] > 0]


def _whiten_naive(values_by_seq, eps):
    flat = [v for seq in values_by_seq for v in seq]
    mean = sum(flat) / len(flat)
    var = statistics.variance(flat)
    return [[(v - mean) / math.sqrt(var + eps) for v in seq] for seq in values_by_seq]


def _to_tensor(per_seq, mask):
    out = torch.zeros_like(mask)
    for i, seq in enumerate(per_seq):
        for t, v in zip(_positions(mask, i), seq):
            out[i, t] = v
    return out


def _group_naive(scores, groups):
    by = {}
    for s, gid in zip(scores, groups):
        by.setdefault(gid, []).append(s)
    return by


# ------------------------------------------------------------------------------------------- advantage estimators
def test_grpo_dr_grpo_rloo_match_naive():
    d = _data()
    scores, groups, mask = d["scores"].tolist(), d["group_ids"].tolist(), d["mask"]
    by = _group_naive(scores, groups)
    expect = {
        "grpo": [(s - statistics.mean(by[g])) / (statistics.stdev(by[g]) + 1e-6) for s, g in zip(scores, groups)],
        "dr_grpo": [s - statistics.mean(by[g]) for s, g in zip(scores, groups)],
        "rloo": [s - (sum(by[g]) - s) / (len(by[g]) - 1) for s, g in zip(scores, groups)],
    }
    for name, per_seq in expect.items():
        adv, returns = compute_advantages(name, scores=d["scores"], group_ids=d["group_ids"], mask=mask)
        assert torch.allclose(adv, torch.tensor(per_seq)[:, None] * mask, atol=1e-6), name
        assert torch.allclose(returns, d["scores"][:, None] * mask, atol=1e-6)


def test_gae_matches_naive():
    d = _data()
    mask, values = d["mask"], d["values"]
    rewards = torch.randn(mask.shape, generator=d["g"]) * mask
    gamma, lam = 0.9, 0.8
    adv, ret = compute_advantages("gae", token_rewards=rewards, values=values, mask=mask, gamma=gamma, lam=lam)
    for i in range(mask.shape[0]):
        pos = _positions(mask, i)
        running = 0.0
        for k in reversed(range(len(pos))):
            t = pos[k]
            next_v = values[i, pos[k + 1]].item() if k + 1 < len(pos) else 0.0
            delta = rewards[i, t].item() + gamma * next_v - values[i, t].item()
            running = delta + gamma * lam * running
            assert abs(adv[i, t].item() - running) < 1e-5
            assert abs(ret[i, t].item() - (running + values[i, t].item())) < 1e-5


def _reinforce_pp_naive(scores, mask, kl, beta, gamma):
    returns = []
    for i in range(mask.shape[0]):
        pos = _positions(mask, i)
        rewards = [-beta * kl[i, t].item() for t in pos]
        rewards[-1] += scores[i]
        g, seq = 0.0, []
        for r in reversed(rewards):
            g = r + gamma * g
            seq.append(g)
        returns.append(seq[::-1])
    return _whiten_naive(returns, 1e-8), returns


def test_reinforce_plus_plus_and_baseline_match_naive():
    d = _data()
    mask, kl = d["mask"], d["kl"]
    scores = d["scores"].tolist()
    adv_naive, ret_naive = _reinforce_pp_naive(scores, mask, kl, 0.1, 0.95)
    adv, ret = compute_advantages("reinforce_plus_plus", scores=d["scores"], mask=mask, kl=kl, kl_coef=0.1,
                                  gamma=0.95)
    assert torch.allclose(adv, _to_tensor(adv_naive, mask), atol=1e-5)
    assert torch.allclose(ret, _to_tensor(ret_naive, mask), atol=1e-6)
    by = _group_naive(scores, d["group_ids"].tolist())
    centred = [s - statistics.mean(by[g]) for s, g in zip(scores, d["group_ids"].tolist())]
    adv_naive, _ = _reinforce_pp_naive(centred, mask, kl, 0.1, 0.95)
    adv, _ = compute_advantages("reinforce_plus_plus_baseline", scores=d["scores"], group_ids=d["group_ids"],
                                mask=mask, kl=kl, kl_coef=0.1, gamma=0.95)
    assert torch.allclose(adv, _to_tensor(adv_naive, mask), atol=1e-5)


def test_gdpo_matches_naive():
    d = _data()
    mask, multi, groups = d["mask"], d["multi"], d["group_ids"].tolist()
    weights = [1.0, 0.5]
    combined = []
    for i in range(mask.shape[0]):
        total = 0.0
        for k in range(2):
            col = multi[:, k].tolist()
            by = _group_naive(col, groups)
            total += weights[k] * (col[i] - statistics.mean(by[groups[i]])) / (statistics.stdev(by[groups[i]]) + 1e-6)
        combined.append([total] * len(_positions(mask, i)))
    adv, _ = compute_advantages("gdpo", scores=multi, group_ids=d["group_ids"], mask=mask, reward_weights=weights)
    assert torch.allclose(adv, _to_tensor(_whiten_naive(combined, 1e-8), mask), atol=1e-5)


def test_hand_worked_advantages():
    mask = torch.ones(4, 1)
    adv, _ = compute_advantages("grpo", scores=torch.tensor([1.0, 0.0, 1.0, 0.0]), group_ids=torch.zeros(4), mask=mask)
    assert torch.allclose(adv[:, 0], torch.tensor([0.866025, -0.866025, 0.866025, -0.866025]), atol=1e-5)
    adv, _ = compute_advantages("rloo", scores=torch.tensor([1.0, 0.0, 0.0]), group_ids=torch.zeros(3),
                                mask=torch.ones(3, 1))
    assert torch.allclose(adv[:, 0], torch.tensor([1.0, -0.5, -0.5]))
    adv, ret = compute_advantages("gae", token_rewards=torch.tensor([[0.0, 0.0, 1.0]]),
                                  values=torch.tensor([[0.5, 0.6, 0.7]]), mask=torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.4, 0.3]])) and torch.allclose(ret, torch.ones(1, 3))


def test_rloo_needs_two_samples():
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        compute_advantages("rloo", scores=torch.ones(2), group_ids=torch.tensor([0, 1]), mask=torch.ones(2, 1))


# -------------------------------------------------------------------------------------------------- policy losses
def _naive_token_loss(name, lp, old, a, cfg, seq_ratio=None):
    """One token's loss from Python scalars (lp is a 0-d tensor so autograd gives the reference gradient)."""
    lo, hi = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high
    if name == "reinforce":
        return -a * lp
    if name == "cispo":
        r = math.exp(lp.item() - old)
        return -min(max(r, lo), hi) * a * lp
    ratio = torch.exp(lp - old) if name == "ppo_clip" else seq_ratio * torch.exp(lp - lp.detach())
    r = ratio.item()
    clipped = ratio if lo <= r <= hi else torch.tensor(min(max(r, lo), hi))  # a clipped ratio has no gradient
    surrogate, clipped_surrogate = -a * ratio, -a * clipped
    loss = surrogate if surrogate.item() >= clipped_surrogate.item() else clipped_surrogate
    if name == "ppo_clip" and cfg.dual_clip is not None and a < 0 and loss.item() > -a * cfg.dual_clip:
        return torch.tensor(-a * cfg.dual_clip)
    return loss


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo", "reinforce"])
def test_policy_losses_match_naive_forward_and_gradient(name):
    d = _data(seed=1)
    mask = d["mask"]
    log_prob = (torch.randn(mask.shape, generator=d["g"]) - 2).requires_grad_(True)
    old = log_prob.detach() + 0.3 * torch.randn(mask.shape, generator=d["g"])
    adv = torch.randn(mask.shape, generator=d["g"])
    cfg = AlgorithmConfig(clip_eps_low=0.1, clip_eps_high=0.2, dual_clip=2.0 if name == "ppo_clip" else None)
    loss, _ = POLICY_LOSSES[name](log_prob, old, adv, mask, cfg, lambda x: x.detach().sum(-1))
    weights = torch.randn(mask.shape, generator=d["g"]) * mask
    (loss * weights).sum().backward()
    ours_grad = log_prob.grad.clone()
    ref_grad = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        pos = _positions(mask, i)
        seq_ratio = math.exp(sum(log_prob[i, t].item() - old[i, t].item() for t in pos) / len(pos))
        for t in pos:
            lp = log_prob[i, t].detach().clone().requires_grad_(True)
            ref = _naive_token_loss(name, lp, old[i, t].item(), adv[i, t].item(), cfg, seq_ratio)
            assert abs(ref.item() - loss[i, t].item()) < 1e-6, (i, t)
            if ref.requires_grad:
                (ref * weights[i, t]).backward()
                ref_grad[i, t] = lp.grad
    assert torch.allclose(ours_grad * mask, ref_grad, atol=1e-6)
    assert ref_grad.abs().max() > 0


def test_hand_worked_ppo_clip_and_dual_clip():
    cfg = AlgorithmConfig(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0)
    lp = torch.log(torch.tensor([[1.5, 0.5, 5.0]]))
    loss, stats = POLICY_LOSSES["ppo_clip"](lp, torch.zeros(1, 3), torch.tensor([[1.0, -1.0, -1.0]]),
                                            torch.ones(1, 3), cfg, None)
    assert torch.allclose(loss, torch.tensor([[-1.2, 0.8, 3.0]]))
    assert stats["clip_frac_high"].tolist() == [[1.0, 0.0, 0.0]] and stats["dual_clip_frac"].tolist() == [[0, 0, 1]]


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
def test_on_policy_ratio_is_one_and_nothing_clips(name):
    d = _data()
    lp = torch.randn(d["mask"].shape)
    loss, stats = POLICY_LOSSES[name](lp, lp.clone(), torch.randn(lp.shape), d["mask"],
                                      AlgorithmConfig(clip_eps_low=0.01, clip_eps_high=0.01),
                                      lambda x: x.detach().sum(-1))
    assert torch.allclose(stats["ratio"], torch.ones_like(lp))
    assert stats["clip_frac_low"].sum() == 0 and stats["clip_frac_high"].sum() == 0


# ----------------------------------------------------------------------------------------------- KL, aggregation
def test_kl_estimators():
    lp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert torch.allclose(kl_estimate(lp, ref, "k1"), torch.tensor([math.log(2)]))
    assert torch.allclose(kl_estimate(lp, ref, "k2"), torch.tensor([0.5 * math.log(2) ** 2]))
    assert torch.allclose(kl_estimate(lp, ref, "k3"), torch.tensor([0.5 + math.log(0.5) * -1 - 1]))
    x = torch.randn(20)
    for kind in ("k1", "k2", "k3"):
        assert torch.all(kl_estimate(x, x.clone(), kind) == 0)
    assert torch.isfinite(kl_estimate(torch.tensor([0.0]), torch.tensor([-1000.0]), "k3")).all()  # clamped
    # k3 is an unbiased estimate of KL(p || q) from samples of p
    p, q = torch.tensor([0.7, 0.2, 0.1]), torch.tensor([0.3, 0.3, 0.4])
    exact = (p * (p / q).log()).sum()
    k3_mean = (p * kl_estimate(p.log(), q.log(), "k3")).sum()
    assert torch.allclose(k3_mean, exact, atol=1e-6)


def test_aggregation_weights_hand_worked():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert torch.allclose(loss_weights(mask, "token-mean", 5, 2), mask / 5)
    assert torch.allclose(loss_weights(mask, "seq-mean-token-sum", 5, 2), mask / 2)
    assert torch.allclose(loss_weights(mask, "seq-mean-token-mean", 5, 2),
                          torch.tensor([[0.25, 0.25, 0], [1 / 6, 1 / 6, 1 / 6]]))
    assert torch.allclose(loss_weights(mask, "seq-mean-token-sum-norm", 5, 2, norm_length=4), mask / 8)


def test_mismatch_corrections():
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    old = torch.log(torch.tensor([[1.0, 3.0, 1.0], [1.0, 1.0, 1.0]]))
    rollout = torch.zeros(2, 3)
    seq_sum = lambda x: x.sum(-1)  # noqa: E731
    w, keep = mismatch_weights(old, rollout, mask, "tis", seq_sum, cap=2.0)
    assert torch.allclose(w * mask, torch.tensor([[1.0, 2.0, 1.0], [1.0, 1.0, 0.0]]))
    w, _ = mismatch_weights(old, rollout, mask, "seq_tis", seq_sum, cap=10.0)
    assert torch.allclose(w[:, 0], torch.tensor([3.0, 1.0]))
    _, keep = mismatch_weights(old, rollout, mask, "mis", seq_sum, low=0.5, high=1.3)  # seq 0: 3^(1/3)=1.44
    assert keep.tolist() == [[0, 0, 0], [1, 1, 0]]
    _, keep = mismatch_weights(old, rollout, mask, "icepop", seq_sum, low=0.5, high=2.0)
    assert keep.tolist() == [[1, 0, 1], [1, 1, 0]]


def test_gae_with_kl_in_reward_equals_explicit_token_rewards():
    d = _data()
    mask, kl, values = d["mask"], d["kl"], d["values"]
    rewards = torch.zeros_like(mask)
    for i in range(mask.shape[0]):
        pos = _positions(mask, i)
        for t in pos:
            rewards[i, t] = -0.2 * kl[i, t]
        rewards[i, pos[-1]] += d["scores"][i]
    explicit = compute_advantages("gae", token_rewards=rewards, values=values, mask=mask, gamma=0.9, lam=0.8)
    implicit = compute_advantages("gae", scores=d["scores"], kl=kl, kl_coef=0.2, values=values, mask=mask,
                                  gamma=0.9, lam=0.8)
    assert torch.allclose(explicit[0], implicit[0], atol=1e-6) and explicit[0].abs().max() > 0


def test_value_loss_matches_naive_forward_and_gradient():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(20, generator=g).requires_grad_(True)
    old, returns = torch.randn(20, generator=g), torch.randn(20, generator=g)
    loss, _ = value_loss(values, old, returns, clip=0.3)
    loss.sum().backward()
    for i in range(20):
        v = values[i].detach().clone().requires_grad_(True)
        clipped = old[i] + torch.clamp(v - old[i], -0.3, 0.3)
        a, b = (v - returns[i]) ** 2, (clipped - returns[i]) ** 2
        ref = 0.5 * (a if a.item() >= b.item() else b)
        ref.backward()
        assert abs(ref.item() - loss[i].item()) < 1e-6 and abs(v.grad.item() - values.grad[i].item()) < 1e-6


def test_value_loss_clipped():
    v, old, ret = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), torch.tensor([0.0, 1.0])
    loss, stats = value_loss(v, old, ret, clip=0.2)
    # token 0: unclipped (1-0)^2=1, clipped (0.2-0)^2=0.04 -> 0.5; token 1: both 1 -> 0.5
    assert torch.allclose(loss, torch.tensor([0.5, 0.5])) and stats["vf_clip_frac"].tolist() == [0.0, 0.0]


# ------------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs,needle", [
    (dict(policy_loss="ppo2"), "algorithm.policy_loss='ppo2' is unknown"),
    (dict(advantage_estimator="magic"), "algorithm.advantage_estimator='magic' is unknown"),
    (dict(aggregation="mean"), "algorithm.aggregation='mean' is unknown"),
    (dict(kl_estimator="k4"), "algorithm.kl_estimator='k4' is unknown"),
    (dict(clip_eps_low=1.2), "algorithm.clip_eps_low=1.2 must be in [0, 1)"),
    (dict(clip_eps_high=-0.1), "bounds would be inverted"),
    (dict(dual_clip=0.5), "algorithm.dual_clip=0.5 must be > 1"),
    (dict(advantage_estimator="gae"), "gae needs a critic"),
    (dict(use_critic=True), "does not use values"),
    (dict(kl_in_reward=True, kl_coef=0.1), "kl_in_reward=true needs token-level returns"),
    (dict(advantage_estimator="reinforce_plus_plus", kl_in_reward=True), "kl_coef=0 adds nothing"),
    (dict(aggregation="seq-mean-token-sum-norm"), "needs algorithm.norm_length"),
    (dict(advantage_estimator="dr_grpo", aggregation="seq-mean-token-mean"), "puts it back"),
    (dict(mismatch=MismatchConfig(mode="tis", low=2.0, high=1.0)), "algorithm.mismatch.low=2.0"),
    (dict(mismatch=MismatchConfig(mode="xis")), "algorithm.mismatch.mode='xis' is unknown"),
    (dict(temperature=0), "algorithm.temperature=0 must be > 0"),
])
def test_bad_config_names_the_field(kwargs, needle):
    with pytest.raises(AlgorithmConfigError) as error:
        AlgorithmConfig(**kwargs).validate()
    assert needle in str(error.value)


def test_custom_policy_loss_can_be_registered():
    from megarl.algorithms import register_policy_loss

    from megarl.algorithms import POLICY_LOSSES

    @register_policy_loss("test_only_sign")
    def sign_loss(log_prob, old_log_prob, advantages, mask, cfg, seq_sum):
        return -torch.sign(advantages) * log_prob, {}

    try:
        AlgorithmConfig(policy_loss="test_only_sign").validate()
    finally:  # the registry is process-wide: leave it as the other tests (the docs check) expect it
        POLICY_LOSSES.pop("test_only_sign")
