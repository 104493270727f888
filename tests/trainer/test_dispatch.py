"""Rollout data moves as tensors to the DP rank that trains it: every rank's rows equal a naive per-sample build of
exactly the samples assigned to its DP rank (whole groups, same shapes everywhere), at DP=2 and TP2xDP2; a rank
receives about 1/DP of the step."""
import random

import pytest
import torch

import ranks
from megarl.testing import run_ranks
from megarl.trainer.batching import BatchPlan, PackedRollout, Sample

LAYERS, TOPK = 3, 2


def _samples(seed=0, groups=7, n=3, routing=True):
    rnd = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rnd.randrange(1, 150_000) for _ in range(rnd.randint(1, 6))]
        for j in range(n):
            length = rnd.randint(0, 9)
            mask = [rnd.randint(0, 1) for _ in range(length)] if g % 3 == 1 else None  # multi-turn samples
            s = Sample(group=g, prompt_index=100 + g, prompt_ids=prompt, response_ids=[rnd.randrange(150_000)
                                                                                       for _ in range(length)],
                       rollout_log_probs=[-rnd.random() for _ in range(length)], finish_reason="stop",
                       reward=float(j % 2), score=rnd.random(), trained=not (g == 2 and j == 0), loss_mask=mask)
            if routing:
                s.routed_experts = [rnd.randrange(200) for _ in range((len(prompt) + length - 1) * LAYERS * TOPK)]
            out.append(s)
    return out


def _naive_rows(samples, rows, seq_len, pad_id=0):
    """The reference: one row per sample, written position by position."""
    ids = torch.full((rows, seq_len), pad_id, dtype=torch.long)
    mask, logp = torch.zeros(rows, seq_len), torch.zeros(rows, seq_len)
    routing = torch.arange(TOPK).expand(rows, seq_len, LAYERS, TOPK).clone()
    for i, s in enumerate(samples):
        seq = s.prompt_ids + s.response_ids
        for t, token in enumerate(seq):
            ids[i, t] = token
        for j in range(len(s.response_ids)):
            trained = s.trained and (s.loss_mask is None or s.loss_mask[j])
            mask[i, len(s.prompt_ids) - 1 + j] = float(trained)
            logp[i, len(s.prompt_ids) - 1 + j] = s.rollout_log_probs[j] if trained else 0.0
        for t in range(len(seq) - 1):
            for layer in range(LAYERS):
                for k in range(TOPK):
                    routing[i, t, layer, k] = s.routed_experts[(t * LAYERS + layer) * TOPK + k]
    targets = torch.cat([ids[:, 1:], torch.full((rows, 1), pad_id, dtype=torch.long)], dim=1)
    return ids, targets, mask, logp, routing


@pytest.mark.multirank
@pytest.mark.parametrize("layout,workers", [({"tp": 1}, "rank0"), ({"tp": 2}, "rank0"), ({"tp": 2}, "dp_leaders")],
                         ids=["dp2", "tp2xdp2", "tp2xdp2-two-workers"])
def test_each_dp_rank_trains_exactly_its_samples(layout, workers):
    samples = _samples()
    world = 2 * layout["tp"]
    results = run_ranks(world, ranks.dispatched_rows, samples, layout, (LAYERS, TOPK), 40, 2, workers)
    by_dp = {}
    for r in results:
        by_dp.setdefault(r["dp_rank"], []).append(r)
    assert sorted(by_dp) == [0, 1]
    shapes = {tuple(r["batch"].input_ids.shape) for r in results}
    assert len(shapes) == 1  # one shape for every rank
    rows, seq_len = shapes.pop()
    assert seq_len % layout["tp"] == 0 and rows % results[0]["num_microbatches"] == 0
    assigned = sorted(i for dp in by_dp.values() for i in dp[0]["sample_index"])
    assert assigned == list(range(len(samples)))  # every sample trained once, by one DP rank
    for dp, replica in by_dp.items():
        mine = [samples[i] for i in replica[0]["sample_index"]]
        groups = {s.group for s in mine}
        assert sum(s.group in groups for s in samples) == len(mine)  # whole groups
        ids, targets, mask, logp, routing = _naive_rows(mine, rows, seq_len)
        for r in replica:  # every rank of the replica (TP peers) got the same rows
            b = r["batch"]
            assert r["sample_index"] == replica[0]["sample_index"]
            assert torch.equal(b.input_ids, ids) and torch.equal(b.targets, targets)
            assert torch.equal(b.loss_mask, mask) and torch.equal(b.rollout_log_probs, logp)
            assert torch.equal(b.routed_experts, routing)
            assert torch.equal(r["score"], torch.tensor([s.score for s in mine]))
            assert r["group"].tolist() == [s.group for s in mine]
    step_bytes = results[0]["step_bytes"]
    for rank, r in enumerate(results):
        if rank:  # every rank but rank 0 receives part of about half the step (plus 72-byte headers)
            assert 0 < r["bytes_received"] <= 1.25 * step_bytes / 2, (rank, r["bytes_received"], step_bytes)


@pytest.mark.unit
def test_packed_rollout_select_and_compact_types():
    samples = _samples(seed=3, groups=4)
    packed = PackedRollout.from_samples(samples)
    assert packed.tokens.dtype == torch.int32 and packed.routed_experts.dtype == torch.uint8
    assert packed.loss_mask.dtype == torch.uint8
    order = [5, 0, 7]
    part = packed.select(order)
    alone = PackedRollout.from_samples([samples[i] for i in order])
    for name, t in alone.tensors().items():
        if name != "sample_index":
            assert torch.equal(getattr(part, name), t), name
    assert part.sample_index.tolist() == order
    plan = BatchPlan.make(packed.seq_lens, packed.group, dp_size=3, seq_multiple=4, max_tokens_per_microbatch=30)
    assert sorted(i for s in plan.shares for i in s) == list(range(len(samples))) and plan.seq_len % 4 == 0


@pytest.mark.multirank
@pytest.mark.parametrize("failing", [0, 1])
def test_a_failing_rollout_worker_stops_every_rank_with_its_error(failing):
    """Worker `failing` hits an engine error in a round while the other waits for the round's sum: both stop, with
    the failing worker's one-line error (no hang, no second message)."""
    from megarl.testing import tiny_model_dir

    errors = run_ranks(2, ranks.rollout_worker_failure, tiny_model_dir("qwen2"), failing, timeout=120)
    assert errors == [f"rollout.engine.urls[0]: the engine died on worker {failing}. Fix: restart it"] * 2
