"""The algorithm zoo (MaxRL, OPO, GPG, GRPO pass@k, std-free GRPO/GDPO, whitened GAE; GMPO, SAPO, ASPO, Advantage
Reweighting; abs and straight-through KL, the verl k3 clamp; token-sum aggregation) against naive per-element
references written here in plain Python (values and gradients), hand-worked numbers, on-policy invariants, the
data-parallel split of batch statistics (2 gloo ranks) and config errors."""
import math
import statistics

import pytest
import torch
import torch.distributed as dist

from megarl.algorithms import AlgorithmConfig, AlgorithmConfigError, compute_advantages, kl_estimate, loss_weights
from megarl.algorithms.advantages import ADVANTAGE_ESTIMATORS, estimator, last_token_rewards, register_advantage
from megarl.algorithms.policy_losses import POLICY_LOSSES
from megarl.testing import run_ranks

GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])


def _mask(seed=0, b=12, s=7):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, s)
    for i in range(b):
        start = int(torch.randint(0, 3, (1,), generator=g))
        mask[i, start:int(torch.randint(start + 1, s + 1, (1,), generator=g))] = 1
    return mask, g


def _positions(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t] > 0]


def _by_group(values, groups):
    out = {}
    for v, gid in zip(values, groups):
        out.setdefault(gid, []).append(v)
    return out


def _assert_broadcast(adv, per_seq, mask, atol=1e-6):
    assert torch.allclose(adv, torch.tensor(per_seq, dtype=torch.float32)[:, None] * mask, atol=atol)


BINARY = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0])  # group 0: 2/4 right, group 1: none, group 2: 3/4


# ------------------------------------------------------------------------------------------- advantage estimators
@pytest.mark.unit
def test_maxrl_matches_naive_and_hand_worked():
    mask, g = _mask()
    scores = torch.rand(12, generator=g).round()  # binary, some groups may be all 0
    for s in (scores, BINARY):
        by = _by_group(s.tolist(), GROUPS.tolist())
        expect = []
        for r, gid in zip(s.tolist(), GROUPS.tolist()):
            k, n = sum(by[gid]), len(by[gid])
            expect.append(n * r / k - 1 if k > 0 else 0.0)  # N r_i / K - 1: normalised by the successes
        adv, ret = compute_advantages("maxrl", scores=s, group_ids=GROUPS, mask=mask)
        _assert_broadcast(adv, expect, mask)
        assert torch.allclose(ret, s[:, None] * mask)
    adv, _ = compute_advantages("maxrl", scores=torch.tensor([1.0, 0, 0, 0]), group_ids=torch.zeros(4),
                                mask=torch.ones(4, 1))
    assert adv[:, 0].tolist() == [3.0, -1.0, -1.0, -1.0]  # GRPO would give [1.5, -0.5, -0.5, -0.5]


@pytest.mark.unit
def test_opo_matches_naive_and_hand_worked():
    mask, g = _mask(1)
    scores = torch.randn(12, generator=g)
    lengths = mask.sum(-1).tolist()
    by_r, by_len = _by_group(scores.tolist(), GROUPS.tolist()), _by_group(lengths, GROUPS.tolist())
    expect = [r - sum(l * x for l, x in zip(by_len[gid], by_r[gid])) / sum(by_len[gid])
              for r, gid in zip(scores.tolist(), GROUPS.tolist())]
    adv, _ = compute_advantages("opo", scores=scores, group_ids=GROUPS, mask=mask)
    _assert_broadcast(adv, expect, mask, atol=1e-5)
    # lengths 2 and 6, rewards 1 and 0: b = (2*1 + 6*0) / 8 = 0.25
    mask = torch.tensor([[1.0, 1, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    adv, _ = compute_advantages("opo", scores=torch.tensor([1.0, 0.0]), group_ids=torch.zeros(2), mask=mask)
    assert torch.allclose(adv, torch.tensor([[0.75] * 2 + [0] * 4, [-0.25] * 6]))


@pytest.mark.unit
def test_gpg_matches_naive_and_hand_worked():
    mask, _ = _mask(2)
    by = _by_group(BINARY.tolist(), GROUPS.tolist())
    invalid = sum(len(v) for v in by.values() if len(set(v)) == 1)
    alpha = 12 / (12 - invalid)
    expect = [alpha * (r - statistics.mean(by[gid])) for r, gid in zip(BINARY.tolist(), GROUPS.tolist())]
    adv, _ = compute_advantages("gpg", scores=BINARY, group_ids=GROUPS, mask=mask)
    _assert_broadcast(adv, expect, mask)
    # one mixed group and one all-correct group: B = 8, M = 4, alpha = 2
    adv, _ = compute_advantages("gpg", scores=torch.tensor([1.0, 0, 1, 0, 1, 1, 1, 1]),
                                group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), mask=torch.ones(8, 1))
    assert adv[:, 0].tolist() == [1.0, -1.0, 1.0, -1.0, 0, 0, 0, 0]


@pytest.mark.unit
def test_grpo_passk_matches_naive_and_hand_worked():
    mask, g = _mask(3)
    scores = torch.randn(12, generator=g)
    for std_normalize in (True, False):
        expect = [0.0] * 12
        for gid in set(GROUPS.tolist()):
            members = [i for i in range(12) if GROUPS[i] == gid]
            ranked = sorted(members, key=lambda i: -scores[i].item())
            gap = scores[ranked[0]].item() - scores[ranked[1]].item()
            std = statistics.stdev([scores[i].item() for i in members])
            expect[ranked[0]] = gap / (std + 1e-6) if std_normalize else gap
        adv, _ = compute_advantages("grpo_passk", scores=scores, group_ids=GROUPS, mask=mask,
                                    std_normalize=std_normalize)
        _assert_broadcast(adv, expect, mask, atol=1e-5)
    adv, _ = compute_advantages("grpo_passk", scores=torch.tensor([0.2, 1.0, 0.5]), group_ids=torch.zeros(3),
                                mask=torch.ones(3, 1), std_normalize=False)
    assert torch.allclose(adv[:, 0], torch.tensor([0.0, 0.5, 0.0]))
    adv, _ = compute_advantages("grpo_passk", scores=torch.tensor([1.0, 1.0, 0.0]), group_ids=torch.zeros(3),
                                mask=torch.ones(3, 1))
    assert adv.abs().sum() == 0  # a tie at the top: nobody is strictly best
    with pytest.raises(ValueError, match="at least 2 samples per prompt"):
        compute_advantages("grpo_passk", scores=torch.ones(2), group_ids=torch.tensor([0, 1]), mask=torch.ones(2, 1))


@pytest.mark.unit
def test_std_normalize_false_centres_only():
    mask, g = _mask(4)
    scores = torch.randn(12, generator=g)
    grpo, _ = compute_advantages("grpo", scores=scores, group_ids=GROUPS, mask=mask, std_normalize=False)
    dr_grpo, _ = compute_advantages("dr_grpo", scores=scores, group_ids=GROUPS, mask=mask)
    assert torch.equal(grpo, dr_grpo)
    multi, weights = torch.randn(12, 2, generator=g), [1.0, 0.5]
    combined = []
    for i in range(12):
        total = 0.0
        for k in range(2):
            by = _by_group(multi[:, k].tolist(), GROUPS.tolist())
            total += weights[k] * (multi[i, k].item() - statistics.mean(by[GROUPS[i].item()]))
        combined.append([total] * len(_positions(mask, i)))
    flat = [v for seq in combined for v in seq]
    mean, std = statistics.mean(flat), statistics.stdev(flat)
    adv, _ = compute_advantages("gdpo", scores=multi, group_ids=GROUPS, mask=mask, reward_weights=weights,
                                std_normalize=False)
    _assert_broadcast(adv, [(seq[0] - mean) / std for seq in combined], mask, atol=1e-5)
    with_std, _ = compute_advantages("gdpo", scores=multi, group_ids=GROUPS, mask=mask, reward_weights=weights)
    assert not torch.allclose(adv, with_std, atol=1e-3)


@pytest.mark.unit
def test_gae_whiten_advantages():
    mask, g = _mask(5)
    values, rewards = torch.randn(mask.shape, generator=g), torch.randn(mask.shape, generator=g) * mask
    plain, plain_ret = compute_advantages("gae", token_rewards=rewards, values=values, mask=mask, gamma=0.9, lam=0.8)
    white, white_ret = compute_advantages("gae", token_rewards=rewards, values=values, mask=mask, gamma=0.9, lam=0.8,
                                          whiten_advantages=True)
    flat = [plain[i, t].item() for i in range(12) for t in _positions(mask, i)]
    mean, var = statistics.mean(flat), statistics.variance(flat)
    expect = torch.zeros_like(mask)
    for i in range(12):
        for t in _positions(mask, i):
            expect[i, t] = (plain[i, t].item() - mean) / math.sqrt(var + 1e-8)
    assert torch.allclose(white, expect, atol=1e-5)
    assert torch.equal(white_ret, plain_ret)  # the critic's targets are not whitened


@pytest.mark.unit
@pytest.mark.parametrize("name", ["reinforce_plus_plus", "gae"])
def test_whitening_is_exact_when_values_are_large_next_to_their_spread(name):
    """E[x^2] - E[x]^2 in float32 cancels catastrophically here (equal scores: a negative variance, NaN); the
    whitening must match a centred float64 reference, and equal values must whiten to exactly 0."""
    mask = torch.ones(64, 512)
    g = torch.Generator().manual_seed(0)
    for spread in (0.0, 0.05):
        scores = 7.3 + spread * torch.randn(64, generator=g)
        if name == "gae":  # the same whitening, over token values
            values = torch.zeros_like(mask)
            inputs = dict(token_rewards=last_token_rewards(scores, mask), values=values, gamma=1.0, lam=1.0,
                          whiten_advantages=True)
            raw = last_token_rewards(scores, mask).flip(-1).cumsum(-1).flip(-1).double()
        else:
            inputs = dict(scores=scores)
            raw = scores.double()[:, None].expand(mask.shape)
        adv, _ = compute_advantages(name, mask=mask, **inputs)
        expect = (raw - raw.mean()) / torch.sqrt(raw.var() + 1e-8)
        assert torch.isfinite(adv).all() and torch.allclose(adv.double(), expect, atol=1e-5, rtol=0), (spread,)
        if spread == 0.0:
            assert torch.all(adv == 0)


@pytest.mark.unit
@pytest.mark.parametrize("value", [0.1, 2.7, 1 / 3])
def test_a_group_of_equal_rewards_gets_exactly_zero_advantage(value):
    """Group statistics in float32 leave a ~1e-8 std for non-dyadic rewards, which / (std + 1e-6) becomes a visible
    advantage (GRPO: -0.3 for 16 x 2.7) and makes GPG count the group as valid."""
    scores = torch.tensor([value] * 16 + [1.0, 0, 0, 0, 1, 0, 0, 0])
    group_ids = torch.tensor([0] * 16 + [1] * 8)
    mask = torch.ones(24, 1)
    for name in ("grpo", "grpo_passk", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "maxrl", "gpg"):
        adv, _ = compute_advantages(name, scores=scores, group_ids=group_ids, mask=mask)
        assert torch.all(adv[:16] == 0), name
    adv, _ = compute_advantages("gpg", scores=scores, group_ids=group_ids, mask=mask)
    assert adv[16:, 0].tolist() == [2.25, -0.75, -0.75, -0.75, 2.25, -0.75, -0.75, -0.75]  # alpha = 24 / 8


@pytest.mark.unit
def test_extreme_ratios_stay_finite():
    """A log-ratio far beyond exp's range (a token the update made 1e40 times likelier) must not turn into inf or a
    0 * inf = NaN gradient: the ratio-based losses clamp it as verl does."""
    old = torch.tensor([[-100.0, -100.0, -0.1]])
    mask, adv = torch.ones(1, 3), torch.tensor([[0.0, -1.0, -1.0]])
    for name in ("ppo_clip", "gspo", "sapo", "aspo", "adv_reweight", "fipo"):
        log_prob = torch.tensor([[-0.05, -0.05, -0.1]], requires_grad=True)
        cfg = AlgorithmConfig(policy_loss=name, dual_clip=3.0)
        loss, _ = POLICY_LOSSES[name](log_prob, old, adv, mask, cfg, _seq_sum)
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(log_prob.grad).all(), name


@pytest.mark.unit
def test_verl_kl_names_are_aliases():
    g = torch.Generator().manual_seed(0)
    log_prob, ref = torch.randn(4, 6, generator=g), torch.randn(4, 6, generator=g)
    for alias, name in (("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("kl+", "k1+"), ("low_var_kl+", "k3+")):
        assert torch.equal(kl_estimate(log_prob, ref, alias), kl_estimate(log_prob, ref, name))
    AlgorithmConfig(kl_estimator="low_var_kl").validate()


def _dp_rank_advantages(name, inputs, share):
    """On 2 gloo ranks: this rank's half of the batch (whole prompt groups) through compute_advantages over the DP
    group (the world)."""
    dist.init_process_group("gloo")
    rows = slice(0, share) if dist.get_rank() == 0 else slice(share, None)
    mine = {k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == 12 else v)
            for k, v in inputs.items()}
    return compute_advantages(name, group=dist.group.WORLD, **mine)[0]


@pytest.mark.multirank
def test_batch_statistics_do_not_depend_on_the_dp_split():
    """GPG's alpha and whitened GAE need global sums: two DP ranks (8 + 4 rows) give the one-rank advantages."""
    mask, g = _mask(6)
    cases = {"gpg": dict(scores=BINARY, group_ids=GROUPS, mask=mask),
             "gae": dict(token_rewards=torch.randn(mask.shape, generator=g) * mask,
                         values=torch.randn(mask.shape, generator=g), mask=mask, whiten_advantages=True)}
    for name, inputs in cases.items():
        whole = compute_advantages(name, **inputs)[0]
        parts = run_ranks(2, _dp_rank_advantages, name, inputs, 8)
        split = torch.cat(parts)
        assert torch.allclose(split, whole, atol=1e-6), name
        local = compute_advantages(name, **{k: (v[8:] if isinstance(v, torch.Tensor) and v.dim() >= 1 else v)
                                            for k, v in inputs.items()})[0]
        assert not torch.allclose(local, whole[8:], atol=1e-3), name  # the reduction matters


@pytest.mark.unit
def test_group_estimators_need_groups():
    assert all(estimator(name).needs_groups for name in ("grpo", "rloo", "maxrl", "opo", "gpg", "grpo_passk"))
    assert not any(estimator(name).needs_groups for name in ("reinforce_plus_plus", "remax", "opd", "gae"))


@pytest.mark.unit
def test_estimator_inputs_are_typed():
    """compute_advantages refuses an input no estimator reads (a typo is not silently dropped); an estimator gets
    only the fields it declares; a plug-in declares its inputs and capabilities at registration."""
    mask, scores, groups = torch.ones(4, 3), torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1])
    with pytest.raises(TypeError, match="group_idz"):
        compute_advantages("grpo", scores=scores, group_idz=groups, mask=mask)
    assert estimator("grpo").reads == {"scores", "group_ids", "mask", "eps", "std_normalize"}
    with pytest.raises(TypeError, match=r"\['rewardz'\] are not keyword-only AdvantageInputs fields"):
        register_advantage("typo")(lambda *, rewardz, mask: None)
    assert "typo" not in ADVANTAGE_ESTIMATORS
    try:
        @register_advantage("centred_plugin", needs_groups=True)
        def centred(*, scores, group_ids, mask):
            mean = torch.stack([scores[group_ids == g].mean() for g in group_ids])
            return (scores - mean)[:, None] * mask, scores[:, None] * mask

        adv, _ = compute_advantages("centred_plugin", scores=scores, group_ids=groups, mask=mask, kl_coef=0.1)
        assert adv[:, 0].tolist() == [0.5, -0.5, 0.0, 0.0] and estimator("centred_plugin").needs_groups
        AlgorithmConfig(advantage_estimator="centred_plugin").validate()  # known to the config check
        with pytest.raises(AlgorithmConfigError, match="std_normalize=false has no effect"):
            AlgorithmConfig(advantage_estimator="centred_plugin", std_normalize=False).validate()
    finally:
        ADVANTAGE_ESTIMATORS.pop("centred_plugin", None)


# -------------------------------------------------------------------------------------------------- policy losses
def _batch(seed=1, b=6, s=7, spread=0.3):
    mask, g = _mask(seed, b, s)
    log_prob = (torch.randn(mask.shape, generator=g) - 1).requires_grad_(True)
    old = log_prob.detach() + spread * torch.randn(mask.shape, generator=g)
    adv = torch.randn(b, generator=g)[:, None] * torch.ones(b, s)  # one advantage per sequence (outcome reward)
    return mask, log_prob, old, adv, g


def _seq_sum(x):
    return x.detach().float().sum(-1)


def _ours(name, cfg, mask, log_prob, old, adv, weights):
    loss, stats = POLICY_LOSSES[name](log_prob, old, adv, mask, cfg, _seq_sum)
    log_prob.grad = None
    (loss * weights).sum().backward()
    return loss.detach(), log_prob.grad.clone(), stats


def _naive_ppo(lp, old, a, lo, hi, dual):
    """PPO clip on one token (lp a 0-d tensor with grad): max(-a r, -a clip(r)), dual clip for a < 0."""
    r = torch.exp(lp - old)
    clipped = r if lo <= r.item() <= hi else torch.tensor(min(max(r.item(), lo), hi))
    loss = -a * r if -a * r.item() >= -a * clipped.item() else -a * clipped
    if dual is not None and a < 0 and loss.item() > -a * dual:
        return torch.tensor(-a * dual)
    return loss


@pytest.mark.unit
@pytest.mark.parametrize("name", ["sapo", "aspo", "adv_reweight"])
def test_token_losses_match_naive_forward_and_gradient(name):
    mask, log_prob, old, adv, g = _batch(spread=0.5)
    cfg = AlgorithmConfig(clip_eps_low=0.1, clip_eps_high=0.2, dual_clip=1.5, sapo_tau_pos=1.0, sapo_tau_neg=1.05,
                          adv_reweight_alpha=0.3)
    weights = torch.randn(mask.shape, generator=g) * mask
    loss, grad, stats = _ours(name, cfg, mask, log_prob, old, adv, weights)
    lo, hi, c = 1 - cfg.clip_eps_low, 1 + cfg.clip_eps_high, cfg.dual_clip
    branches = set()
    for i in range(mask.shape[0]):
        for t in _positions(mask, i):
            lp_value, o, a = log_prob[i, t].item(), old[i, t].item(), adv[i, t].item()
            r = math.exp(lp_value - o)
            if name == "sapo":  # value by autograd of the formula, gradient by hand: -a * 4 s (1 - s) * r
                tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
                sig = 1 / (1 + math.exp(-tau * (r - 1)))
                value, dvalue = -a * sig * 4 / tau, -a * 4 * sig * (1 - sig) * r
            elif name == "aspo":  # value and d/d(log pi) written out per branch
                if a < 0:
                    if max(r, lo) > c:
                        value, dvalue, branch = -a * c, -a * c, "neg_dual"
                    elif r < lo:
                        value, dvalue, branch = -a * lo, 0.0, "neg_clip"
                    else:
                        value, dvalue, branch = -a * r, -a * r, "neg"
                else:
                    if 1 / min(r, hi) > c:
                        value, dvalue, branch = -a * c, -a * c, "pos_dual"
                    elif r > hi:
                        value, dvalue, branch = -a / hi, 0.0, "pos_clip"
                    else:
                        value, dvalue, branch = -a / r, -a / r, "pos_flipped"
                branches.add(branch)
            else:
                lp = torch.tensor(lp_value, requires_grad=True)
                ref = _naive_ppo(lp, o, a * (0.3 * math.exp(o) + 0.7), lo, hi, c)  # weighted by pi_old
                value = ref.item()
                dvalue = torch.autograd.grad(ref, lp)[0].item() if ref.requires_grad else 0.0
            assert abs(loss[i, t].item() - value) < 1e-5 * max(1, abs(value)), (name, i, t)
            assert abs(grad[i, t].item() - dvalue * weights[i, t].item()) < 1e-5 * max(1, abs(dvalue)), (name, i, t)
    assert (grad * mask).abs().max() > 0
    if name == "aspo":  # the batch reaches every branch, so each is checked above
        assert branches == {"neg_dual", "neg_clip", "neg", "pos_dual", "pos_clip", "pos_flipped"}, branches
        assert stats["dual_clip_frac"].sum() > 0


@pytest.mark.unit
def test_gmpo_matches_the_geometric_mean_objective():
    """Value per token is -A R_i; with seq-mean-token-mean weights the gradient is that of the paper's objective
    -mean_i A_i exp(mean_t clip~(log r_t)), built here by autograd from a per-sequence Python loop."""
    mask, log_prob, old, adv, g = _batch(spread=0.4)
    cfg = AlgorithmConfig(clip_eps_low=0.3, clip_eps_high=0.25)
    lengths = mask.sum(-1)
    weights = mask / lengths[:, None] / mask.shape[0]
    loss, grad, stats = _ours("gmpo", cfg, mask, log_prob, old, adv, weights)
    lp_ref = log_prob.detach().clone().requires_grad_(True)
    objective, clipped = 0.0, 0
    for i in range(mask.shape[0]):
        a, terms = adv[i, 0].item(), []
        for t in _positions(mask, i):
            x = lp_ref[i, t] - old[i, t]
            if a > 0 and x.item() > cfg.clip_eps_high:
                x, clipped = torch.tensor(cfg.clip_eps_high), clipped + 1
            elif a < 0 and x.item() < -cfg.clip_eps_low:
                x, clipped = torch.tensor(-cfg.clip_eps_low), clipped + 1
            terms.append(x)
        ratio = torch.exp(sum(terms) / len(terms))
        for t in _positions(mask, i):
            assert abs(loss[i, t].item() + a * ratio.item()) < 1e-5
        objective = objective - a * ratio / mask.shape[0]
    objective.backward()
    assert clipped > 0 and ((stats["clip_frac_high"] + stats["clip_frac_low"]) * mask).sum() == clipped
    assert torch.allclose(grad * mask, lp_ref.grad, atol=1e-6) and lp_ref.grad.abs().max() > 0


@pytest.mark.unit
@pytest.mark.parametrize("name", ["gmpo", "sapo", "aspo", "adv_reweight"])
def test_on_policy_gradient_is_the_policy_gradient(name):
    """At pi = pi_old every new loss gives the REINFORCE gradient -A grad log pi (adv_reweight: with A reweighted);
    nothing clips."""
    mask, log_prob, _, adv, g = _batch()
    cfg = AlgorithmConfig(clip_eps_low=0.01, clip_eps_high=0.01, dual_clip=3.0)
    weights = torch.rand(mask.shape, generator=g) * mask
    _, grad, stats = _ours(name, cfg, mask, log_prob, log_prob.detach().clone(), adv, weights)
    factor = (0.3 * torch.exp(log_prob.detach()) + 0.7) if name == "adv_reweight" else 1.0
    assert torch.allclose(grad, -adv * factor * weights, atol=1e-6)
    assert torch.allclose(stats["ratio"], torch.ones_like(mask))
    assert sum(float(stats[k].sum()) for k in stats if "frac" in k) == 0


@pytest.mark.unit
def test_sapo_hand_worked():
    # r = 1: gate 2 / tau (A = 1, tau 1: -2; A = -1, tau 2: +1); r = e, tau 1: 4 sigmoid(e - 1) = 3.3916...
    loss, _ = POLICY_LOSSES["sapo"](torch.tensor([[0.0, 1.0, 0.0]]), torch.zeros(1, 3),
                                    torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3),
                                    AlgorithmConfig(sapo_tau_pos=1.0, sapo_tau_neg=2.0), None)
    assert torch.allclose(loss, torch.tensor([[-2.0, -3.39164, 1.0]]), atol=1e-5)


# ------------------------------------------------------------------------------------------- KL and aggregation
@pytest.mark.unit
def test_abs_and_straight_through_kl():
    lp = torch.log(torch.tensor([0.5, 0.1, 0.3])).requires_grad_(True)
    ref = torch.log(torch.tensor([0.25, 0.4, 0.3]))
    x = (lp - ref).detach()
    assert torch.allclose(kl_estimate(lp, ref, "abs"), x.abs())
    assert abs(kl_estimate(lp, ref, "abs")[0].item() - math.log(2)) < 1e-6
    for base in ("k1", "k3", "abs"):
        value = kl_estimate(lp, ref, base + "+")
        assert torch.allclose(value, kl_estimate(lp, ref, base))  # the value of the named estimator
        (grad,) = torch.autograd.grad(value.sum(), lp)
        assert torch.allclose(grad, x)  # the gradient of k2 = x^2 / 2
    (grad,) = torch.autograd.grad(kl_estimate(lp, ref, "abs").sum(), lp)
    assert grad.tolist() == [1.0, -1.0, 0.0]


@pytest.mark.unit
def test_k3_clamps_the_estimate_like_verl():
    lp = torch.tensor([0.0, 0.0, 0.0], requires_grad=True)
    ref = torch.tensor([-2.0, 5.0, 30.0])  # k3 = e^x - x - 1 for x = ref - lp: 0.135..+1, 143.4 -> 10, e^20.. -> 10
    value = kl_estimate(lp, ref, "k3")
    assert abs(value[0].item() - (math.exp(-2) + 2 - 1)) < 1e-6 and value[1:].tolist() == [10.0, 10.0]
    (grad,) = torch.autograd.grad(value.sum(), lp)
    assert abs(grad[0].item() - (1 - math.exp(-2))) < 1e-6 and grad[1:].tolist() == [0.0, 0.0]


@pytest.mark.unit
def test_token_sum_aggregation():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    assert torch.equal(loss_weights(mask, "token-sum", 5, 2), mask)


# ------------------------------------------------------------------------------------------------------- config
@pytest.mark.unit
@pytest.mark.parametrize("kwargs,needle", [
    (dict(std_normalize=False, advantage_estimator="rloo"), "algorithm.std_normalize=false has no effect"),
    (dict(whiten_advantages=True), "algorithm.whiten_advantages=true is only used by advantage_estimator=gae"),
    (dict(policy_loss="aspo"), "algorithm.policy_loss=aspo needs algorithm.dual_clip"),
    (dict(sapo_tau_neg=0.0), "must be > 0 (gate temperatures)"),
    (dict(adv_reweight_alpha=1.5), "algorithm.adv_reweight_alpha=1.5 must be in [0, 1]"),
    (dict(kl_estimator="k3-"), "algorithm.kl_estimator='k3-' is unknown"),
])
def test_bad_zoo_config_names_the_field(kwargs, needle):
    with pytest.raises(AlgorithmConfigError) as error:
        AlgorithmConfig(**kwargs).validate()
    assert needle in str(error.value) and "\n" not in str(error.value)


@pytest.mark.unit
@pytest.mark.parametrize("kwargs", [
    dict(advantage_estimator="maxrl"), dict(advantage_estimator="opo"), dict(advantage_estimator="gpg",
                                                                          policy_loss="reinforce"),
    dict(advantage_estimator="grpo_passk", std_normalize=False), dict(advantage_estimator="gdpo", std_normalize=False),
    dict(advantage_estimator="gae", use_critic=True, whiten_advantages=True), dict(policy_loss="gmpo"),
    dict(policy_loss="sapo"), dict(policy_loss="aspo", dual_clip=3.0), dict(policy_loss="adv_reweight"),
    dict(kl_estimator="abs"), dict(kl_estimator="k3+"), dict(aggregation="token-sum"),
])
def test_zoo_configs_validate(kwargs):
    AlgorithmConfig(**kwargs).validate()
