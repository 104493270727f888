"""The algorithm zoo, part 2: FIPO, Clip-Cov, KL-Cov (policy losses), Lopti and high-entropy token selection (loss
phases), the global top-k selection behind them and the entropy dynamics metric — against naive per-element
references written here in plain Python (values and gradients), hand-worked numbers, a data-parallel split
(2 gloo ranks) and config errors. Layout invariance through Megatron is in tests/losses/test_rl_layouts.py."""
import math

import pytest
import torch
import torch.distributed as dist

from megarl.algorithms import AlgorithmConfig, AlgorithmConfigError, entropy_split, global_top_mask, loss_phases
from megarl.algorithms.policy_losses import POLICY_LOSSES, fipo_weights
from megarl.algorithms.token_selection import covariance, token_keys
from megarl.losses import TokenBatch, prepare_global_batch
from megarl.losses.rl import rl_objective
from megarl.testing import run_ranks


def _tokens(seed=0, b=8, s=9):
    """A batch with unequal responses: mask, current/old log-probs, per-sequence advantages, token ids."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, s)
    for i in range(b):
        start = int(torch.randint(0, 3, (1,), generator=g))
        mask[i, start:int(torch.randint(start + 2, s + 1, (1,), generator=g))] = 1
    old = -torch.rand(b, s, generator=g) * 2.5  # probabilities from 0.08 to 1: both sides of eta = 0.5
    log_prob = (old + 0.3 * torch.randn(b, s, generator=g)).requires_grad_(True)
    adv = torch.randn(b, generator=g)[:, None] * torch.ones(b, s) + 0.2 * torch.randn(b, s, generator=g)
    ids = torch.randint(3, 300, (b, s), generator=g)
    return mask, log_prob, old * mask, adv * mask, ids, g


def _positions(mask, i):
    return [t for t in range(mask.shape[1]) if mask[i, t] > 0]


def _seq_sum(x):
    return x.detach().float().sum(-1)


def _naive_ppo(lp, old, a, lo, hi):
    r = torch.exp(lp - old)
    clipped = r if lo <= r.item() <= hi else torch.tensor(min(max(r.item(), lo), hi))
    return -a * r if -a * r.item() >= -a * clipped.item() else -a * clipped


def _naive_top(values, mask, k):
    """The k largest masked values, by sorting the list of (value, position)."""
    items = sorted(((values[i, t].item(), (i, t)) for i in range(mask.shape[0]) for t in _positions(mask, i)),
                   reverse=True)
    return {pos for _, pos in items[:k]}


def _chosen(sel):
    return {(i, t) for i, t in sel.nonzero().tolist()}


# ----------------------------------------------------------------------------------------------- global selection
@pytest.mark.unit
def test_global_top_mask_matches_sorting():
    mask, _, old, _, _, g = _tokens()
    values = torch.randn(mask.shape, generator=g) * mask
    n = int(mask.sum())
    for k in (0, 1, 5, n // 3, n - 1, n, n + 3):
        assert _chosen(global_top_mask(values, mask, k)) == _naive_top(values, mask, k), k
    # ties are kept together (>= k); constant values: all of them
    ties = torch.ones_like(mask)
    assert _chosen(global_top_mask(ties, mask, 2)) == _chosen(mask)
    # values 1e-9 apart (within one coarse bin) are still separated by the fine level
    close = (1.0 + 1e-9 * torch.arange(mask.numel()).reshape(mask.shape).double()) * mask
    close[0, 0] = 50.0  # a wide range makes the coarse bins wide
    assert _chosen(global_top_mask(close, mask, 3)) == _naive_top(close, mask, 3)


@pytest.mark.unit
def test_token_keys_ignore_row_order_and_padding():
    _, _, _, _, ids, _ = _tokens()
    keys = token_keys(ids, seed=3)
    assert keys.min() >= 0 and keys.max() < 1 and abs(keys.mean().item() - 0.5) < 0.1
    perm = torch.tensor([3, 1, 7, 0, 2, 6, 5, 4])
    assert torch.equal(token_keys(ids[perm], 3), keys[perm])
    padded = torch.cat([ids, torch.zeros(ids.shape[0], 3, dtype=ids.dtype)], 1)
    assert torch.equal(token_keys(padded, 3)[:, :ids.shape[1]], keys)
    assert not torch.equal(token_keys(ids, 4), keys)  # another seed, another draw


# ------------------------------------------------------------------------------------------------------------ FIPO
@pytest.mark.unit
def test_fipo_weights_hand_worked():
    """gamma = 2^-1 (decay_rate 1), log-ratios [0.1, -0.4, 0.05, (masked out), 0.3]: FutureKL_4 = 0.3,
    FutureKL_2 = 0.05 + 0.25 * 0.3 = 0.125 (the masked position adds nothing but counts in the discount),
    FutureKL_1 = -0.4 + 0.5 * 0.125 = -0.3375, FutureKL_0 = 0.1 + 0.5 * -0.3375 = -0.06875."""
    delta = torch.tensor([[0.1, -0.4, 0.05, 9.0, 0.3]])
    mask = torch.tensor([[1.0, 1, 1, 0, 1]])
    both = AlgorithmConfig(fipo_decay_rate=1.0, fipo_clip_range=0.2, fipo_clip_high_only=False)
    w = fipo_weights(delta, mask, both)[0].tolist()
    expect = [math.exp(-0.06875), 0.8, math.exp(0.125), 1.0, 1.2]  # exp(-0.3375) = 0.71 and exp(0.3) = 1.35 clip
    assert all(abs(a - b) < 1e-6 for a, b in zip(w, expect)), w
    high = fipo_weights(delta, mask, AlgorithmConfig(fipo_decay_rate=1.0, fipo_clip_high_only=True))[0].tolist()
    assert all(abs(a - b) < 1e-6 for a, b in zip(high, [1.0, 1.0, math.exp(0.125), 1.0, 1.2])), high


@pytest.mark.unit
def test_fipo_matches_naive_forward_and_gradient():
    mask, log_prob, old, adv, _, g = _tokens(1)
    cfg = AlgorithmConfig(policy_loss="fipo", clip_eps_low=0.1, clip_eps_high=0.2, fipo_decay_rate=4.0,
                          fipo_clip_range=0.1, fipo_clip_high_only=False).validate()
    weights = torch.rand(mask.shape, generator=g) * mask
    loss, stats = POLICY_LOSSES["fipo"](log_prob, old, adv, mask, cfg, _seq_sum)
    (loss * weights).sum().backward()
    gamma = 2 ** (-1 / 4.0)
    reweighted = 0
    for i in range(mask.shape[0]):
        for t in _positions(mask, i):
            future = sum(gamma ** (k - t) * (log_prob[i, k].item() - old[i, k].item())
                         for k in _positions(mask, i) if k >= t)
            f = min(max(math.exp(future), 0.9), 1.1)
            reweighted += f != 1.0
            lp = torch.tensor(log_prob[i, t].item(), requires_grad=True)
            ref = _naive_ppo(lp, old[i, t].item(), adv[i, t].item() * f, 0.9, 1.2)
            dref = torch.autograd.grad(ref, lp)[0].item() if ref.requires_grad else 0.0
            assert abs(loss[i, t].item() - ref.item()) < 1e-5, (i, t)
            assert abs(log_prob.grad[i, t].item() - dref * weights[i, t].item()) < 1e-5, (i, t)
            assert abs(stats["fipo_weight"][i, t].item() - f) < 1e-6
    assert reweighted > 5


@pytest.mark.unit
def test_fipo_on_policy_is_ppo_clip():
    mask, log_prob, _, adv, _, _ = _tokens(2)
    cfg = AlgorithmConfig(policy_loss="fipo", fipo_clip_high_only=False)
    old = log_prob.detach().clone()
    fipo, stats = POLICY_LOSSES["fipo"](log_prob, old, adv, mask, cfg, _seq_sum)
    ppo, _ = POLICY_LOSSES["ppo_clip"](log_prob, old, adv, mask, cfg, _seq_sum)
    assert torch.equal(stats["fipo_weight"], torch.ones_like(mask)) and torch.allclose(fipo, ppo)


# -------------------------------------------------------------------------------------------- Clip-Cov, KL-Cov
def _naive_cov(old, adv, mask):
    cells = [(i, t) for i in range(mask.shape[0]) for t in _positions(mask, i)]
    mean_a = sum(adv[c].item() for c in cells) / len(cells)
    mean_l = sum(old[c].item() for c in cells) / len(cells)
    return {c: (adv[c].item() - mean_a) * (old[c].item() - mean_l) for c in cells}


def _batch(mask, log_prob, old, adv, ids):
    return TokenBatch(input_ids=ids, targets=ids, loss_mask=mask, advantages=adv, old_log_probs=old)


@pytest.mark.unit
def test_cov_matches_naive():
    mask, _, old, adv, _, _ = _tokens(3)
    cov = covariance(old, adv, mask)
    for c, value in _naive_cov(old, adv, mask).items():
        assert abs(cov[c].item() - value) < 1e-5
    assert cov[mask == 0].abs().max() == 0


@pytest.mark.unit
def test_kl_cov_matches_naive_forward_and_gradient():
    mask, log_prob, old, adv, ids, g = _tokens(4)
    cfg = AlgorithmConfig(policy_loss="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=0.7).validate()
    (phase,) = loss_phases(_batch(mask, log_prob, old, adv, ids), cfg)
    cov = _naive_cov(old, adv, mask)
    k = max(1, int(len(cov) * 0.1))
    top = {c for c, _ in sorted(cov.items(), key=lambda kv: -kv[1])[:k]}
    assert _chosen(phase.selected) == top and len(top) >= 3
    weights = torch.rand(mask.shape, generator=g) * mask
    loss, _ = POLICY_LOSSES["kl_cov"](log_prob, old, adv, mask, cfg, _seq_sum, selected=phase.selected)
    (loss * weights).sum().backward()
    for c in cov:
        lp = torch.tensor(log_prob[c].item(), requires_grad=True)
        ref = -adv[c].item() * torch.exp(lp - old[c].item())  # unclipped surrogate
        if c in top:
            ref = ref + 0.7 * (lp - old[c].item()).abs()
        assert abs(loss[c].item() - ref.item()) < 1e-5, c
        assert abs(log_prob.grad[c].item() - torch.autograd.grad(ref, lp)[0].item() * weights[c].item()) < 1e-5, c


@pytest.mark.unit
def test_clip_cov_detaches_a_random_draw_of_the_band():
    mask, log_prob, old, adv, ids, g = _tokens(5)
    cov = _naive_cov(old, adv, mask)
    lb, ub = sorted(cov.values())[len(cov) // 2], max(cov.values())  # the upper half of the band, open at ub
    band = {c for c, v in cov.items() if lb < v < ub}
    cfg = AlgorithmConfig(policy_loss="clip_cov", clip_cov_ratio=0.08, clip_cov_lb=lb, clip_cov_ub=ub,
                          clip_eps_low=0.1, clip_eps_high=0.2).validate()
    draws = [_chosen(loss_phases(_batch(mask, log_prob, old, adv, ids), cfg, seed=s)[0].selected) for s in range(6)]
    n = max(int(0.08 * len(cov)), 1)
    assert all(d <= band and len(d) == n for d in draws) and n >= 2
    assert draws[0] == _chosen(loss_phases(_batch(mask, log_prob, old, adv, ids), cfg, seed=0)[0].selected)
    assert len({frozenset(d) for d in draws}) > 1  # the seed changes the draw
    selected = loss_phases(_batch(mask, log_prob, old, adv, ids), cfg, seed=0)[0].selected
    weights = torch.rand(mask.shape, generator=g) * mask
    loss, stats = POLICY_LOSSES["clip_cov"](log_prob, old, adv, mask, cfg, _seq_sum, selected=selected)
    (loss * weights).sum().backward()
    for c in cov:
        lp = torch.tensor(log_prob[c].item(), requires_grad=True)
        ref = _naive_ppo(lp, old[c].item(), adv[c].item(), 0.9, 1.2) * (0.0 if c in draws[0] else 1.0)
        dref = torch.autograd.grad(ref, lp)[0].item() if ref.requires_grad else 0.0
        assert abs(loss[c].item() - ref.item()) < 1e-5 and abs(log_prob.grad[c].item() - dref * weights[c].item()) \
            < 1e-5, c
    assert stats["cov_selected_frac"].sum() == n


@pytest.mark.unit
def test_cov_losses_need_the_selection():
    mask, log_prob, old, adv, _, _ = _tokens()
    with pytest.raises(ValueError, match="needs the tokens chosen before the loss"):
        POLICY_LOSSES["kl_cov"](log_prob, old, adv, mask, AlgorithmConfig(), _seq_sum)


# ------------------------------------------------------------------------------------ Lopti, high-entropy tokens
@pytest.mark.unit
def test_lopti_first_step_trains_only_low_probability_tokens():
    """Each phase's gradient (through rl_objective with its own aggregation weights) comes only from its tokens: the
    first from p_old < eta, the second from the rest; each phase is normalised by its own token count."""
    mask, log_prob, old, adv, ids, _ = _tokens(6)
    cfg = AlgorithmConfig(lopti=True, lopti_eta=0.5).validate()
    phases = loss_phases(_batch(mask, log_prob, old, adv, ids), cfg)
    assert len(phases) == 2
    low = {(i, t) for i, t in mask.nonzero().tolist() if math.exp(old[i, t].item()) < 0.5}
    assert 0 < len(low) < mask.sum()
    for phase, expect in zip(phases, (low, _chosen(mask) - low)):
        prepared = prepare_global_batch(phase, "token-mean", seq_multiple=1)
        assert abs(prepared.loss_weight.sum().item() - 1) < 1e-6  # token-mean over the phase's own tokens
        lp = old.clone().requires_grad_(True)  # on-policy: no token is clipped, every one has a gradient
        loss, _ = rl_objective(lp, torch.zeros_like(lp), prepared, cfg)
        loss.backward()
        assert _chosen(lp.grad) == expect  # nonzero gradient exactly on the phase's tokens
    single = loss_phases(_batch(mask, log_prob, old, adv, ids), AlgorithmConfig())
    assert len(single) == 1 and torch.equal(single[0].loss_mask, mask)
    # a phase without tokens takes no step: every token below eta leaves only the low phase
    unlikely = loss_phases(_batch(mask, log_prob, torch.full_like(old, math.log(0.1)), adv, ids), cfg)
    assert len(unlikely) == 1 and torch.equal(unlikely[0].loss_mask, mask)


@pytest.mark.unit
def test_high_entropy_selection_and_entropy_split():
    mask, _, old, adv, ids, g = _tokens(7)
    entropy = torch.rand(mask.shape, generator=g) * 3
    cfg = AlgorithmConfig(high_entropy_only=True, high_entropy_rho=0.4, lopti=True).validate()
    phases = loss_phases(_batch(mask, None, old, adv, ids), cfg, entropy=entropy)
    n = int(mask.sum())
    top = _naive_top(entropy, mask, math.ceil(0.4 * n))
    assert len(phases) == 2 and phases[0].loss_mask.sum() > 0 and phases[1].loss_mask.sum() > 0
    assert _chosen(phases[0].loss_mask + phases[1].loss_mask) == top  # Lopti then splits the selected tokens
    with pytest.raises(ValueError, match="high_entropy_only needs"):
        loss_phases(_batch(mask, torch.zeros_like(mask), entropy, adv, ids), cfg)
    sums = entropy_split(entropy, mask, 0.2)
    top20 = _naive_top(entropy, mask, math.ceil(0.2 * n))
    values = [entropy[c].item() for c in top20]
    rest = [entropy[c].item() for c in _chosen(mask) - top20]
    assert sums[1] == len(values) and sums[3] == len(rest)
    assert abs(sums[0] / sums[1] - sum(values) / len(values)) < 1e-6 and sums[0] / sums[1] > sums[2] / sums[3]


def _dp_rank_phases(batch, entropy, cfgs, share):
    dist.init_process_group("gloo")
    rows = slice(0, share) if dist.get_rank() == 0 else slice(share, None)
    out = [[(p.loss_mask, p.selected) for p in loss_phases(batch.rows(rows), cfg, entropy=entropy[rows],
                                                           group=dist.group.WORLD, seed=11)] for cfg in cfgs]
    out.append(entropy_split(entropy[rows], batch.loss_mask[rows], 0.2, dist.group.WORLD))
    return out


@pytest.mark.multirank
def test_selections_do_not_depend_on_the_dp_split():
    mask, _, old, adv, ids, g = _tokens(8)
    entropy = torch.rand(mask.shape, generator=g) * 3
    entropy[:5] += 2  # rank 0's rows hold most of the global top: rank 1 alone would choose other tokens
    batch = _batch(mask, None, old, adv, ids)
    cfgs = [AlgorithmConfig(high_entropy_only=True, lopti=True), AlgorithmConfig(policy_loss="kl_cov",
                                                                                 kl_cov_ratio=0.1),
            AlgorithmConfig(policy_loss="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=-10.0, clip_cov_ub=10.0)]
    parts = run_ranks(2, _dp_rank_phases, batch, entropy, cfgs, 5)
    for c, cfg in enumerate(cfgs):
        whole = loss_phases(batch, cfg, entropy=entropy, seed=11)
        for p, phase in enumerate(whole):
            assert torch.equal(torch.cat([parts[0][c][p][0], parts[1][c][p][0]]), phase.loss_mask), (c, p)
            if phase.selected is not None:
                assert phase.selected.sum() > 0
                assert torch.equal(torch.cat([parts[0][c][p][1], parts[1][c][p][1]]), phase.selected), (c, p)
        local = loss_phases(batch.rows(slice(5, None)), cfg, entropy=entropy[5:], seed=11)
        differs = any(not torch.equal(a.loss_mask, b[0]) or (a.selected is not None and not torch.equal(a.selected,
                                                                                                       b[1]))
                      for a, b in zip(local, parts[1][c]))
        # the global reduction matters (clip_cov's draw from layout-free keys may coincide by chance: not checked)
        assert differs or cfg.policy_loss == "clip_cov", c
    assert torch.allclose(parts[0][-1] + parts[1][-1], entropy_split(entropy, mask, 0.2).double())


# --------------------------------------------------------------------------------------------------------- config
@pytest.mark.unit
@pytest.mark.parametrize("kwargs,needle", [
    (dict(lopti=True, lopti_eta=1.5), "algorithm.lopti_eta=1.5 must be in (0, 1)"),
    (dict(high_entropy_rho=0.0), "algorithm.high_entropy_rho=0.0 must be in (0, 1]"),
    (dict(policy_loss="fipo", fipo_decay_rate=0.0), "algorithm.fipo_decay_rate=0.0 must be > 0"),
    (dict(policy_loss="clip_cov", clip_cov_ratio=0.0), "algorithm.clip_cov_ratio=0.0 must be in (0, 1]"),
    (dict(policy_loss="clip_cov", clip_cov_lb=5.0, clip_cov_ub=1.0), "algorithm.clip_cov_lb=5.0 must be below"),
    (dict(policy_loss="kl_cov", kl_cov_coef=-1.0), "algorithm.kl_cov_coef=-1.0 must be >= 0"),
])
def test_bad_config_names_the_field(kwargs, needle):
    with pytest.raises(AlgorithmConfigError) as error:
        AlgorithmConfig(**kwargs).validate()
    assert needle in str(error.value) and "\n" not in str(error.value)


@pytest.mark.unit
def test_train_config_refuses_what_cannot_work():
    from megarl.config import ConfigError
    from megarl.trainer.config import TrainConfig

    for overrides, needle in [
        (dict(algorithm=AlgorithmConfig(high_entropy_only=True), old_log_probs="rollout"),
         "algorithm.high_entropy_only selects tokens by the old policy's entropy"),
        (dict(algorithm=AlgorithmConfig(policy_loss="fipo"), cp=2), "algorithm.policy_loss=fipo sums"),
    ]:
        cfg = TrainConfig()
        cfg.model.tiny = "qwen3"
        cfg.algorithm = overrides["algorithm"]
        cfg.rollout.old_log_probs = overrides.get("old_log_probs", "recompute")
        cfg.parallel.cp = overrides.get("cp", 1)
        with pytest.raises(ConfigError) as error:
            cfg.validate()
        assert needle in str(error.value) and "\n" not in str(error.value)
