"""benchmarks/orchestration.py measures the real thing: at a tiny size (32 samples x 16 tokens, 4 ranks), the first
micro-batch its baseline path (today's trainer, frozen at 75427db) hands each rank is the one megarl's
rank_batch builds from the whole sample list for that DP rank, the bytes it counts are the pickled payload
broadcast_object_list sends, its byte counter counts tensor collectives by the rules it documents, and its metrics are
the global ones."""
import importlib.util
import math
import os
import pickle
import sys

import pytest
import torch
import torch.distributed as dist

from megarl.testing import run_ranks
from megarl.trainer.batching import rank_batch

pytestmark = pytest.mark.multirank

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("orchestration", os.path.join(ROOT, "benchmarks", "orchestration.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


@pytest.mark.parametrize("dp,tp,moe_layers,topk", [(4, 1, 0, 0), (2, 2, 2, 2)])
def test_baseline_path_gives_rank_batch_and_counts_the_pickled_payload(bench, dp, tp, moe_layers, topk):
    case = bench.Case(world=4, dp=dp, tp=tp, samples=32, tokens_per_sample=16, moe_layers=moe_layers, topk=topk)
    ranks = run_ranks(4, bench.run_case, case, "baseline", 0, keep_batch=True, timeout=120)
    samples = bench.synthetic_rollout(case, 0)
    assert len({s.group for s in samples}) == 4 and (samples[0].routed_experts is not None) == bool(moe_layers)

    payload = len(pickle.dumps(("ok", samples))) + 8  # what megarl.errors.on_rank0 pickles + the int64 size header
    assert ranks[0]["bytes_total"] == payload and ranks[0]["bytes_received"] == 0
    assert [r["bytes_received"] for r in ranks[1:]] == [payload] * 3  # every other rank gets the whole step

    firsts = {}
    for rank, r in enumerate(ranks):
        assert (r["dp_rank"], r["tp_rank"]) == (rank // tp, rank % tp)  # megarl's order tp-cp-ep-dp-pp
        rb = rank_batch(samples, r["dp_rank"], dp, bench.PAD_ID, seq_multiple=tp,
                        max_tokens_per_microbatch=bench.MAX_TOKENS_PER_MICROBATCH,
                        routing_shape=(moe_layers, topk) if moe_layers else None)
        expected = rb.batch.split(rb.num_microbatches)[0]
        got = r["micro_batch"]
        for name in ("input_ids", "targets", "loss_mask", "rollout_log_probs", "routed_experts"):
            want = getattr(expected, name)
            assert (getattr(got, name) is None) == (want is None), name
            if want is not None:
                assert torch.equal(getattr(got, name), want), (rank, name)
        assert got.loss_mask.sum() > 0  # real rows, not padding
        firsts.setdefault(r["dp_rank"], got.input_ids)
    assert len({tuple(ids.flatten().tolist()) for ids in firsts.values()}) == dp  # DP ranks differ

    # reduce_metrics' percentiles are those of every DP rank's ratios together
    ratios = torch.cat([m["values/ratio"].double() for d in range(dp)
                        for m in bench.metric_inputs(case, _spec(bench, d, dp))])
    for r in ranks:
        assert r["metrics"]["ratio_p50"] == pytest.approx(float(torch.quantile(ratios, 0.5)), rel=1e-12)
        assert r["metrics"]["ratio_p95"] == pytest.approx(float(torch.quantile(ratios, 0.95)), rel=1e-12)


def _spec(bench, dp_rank, dp_size):
    return bench.Spec(dp_rank=dp_rank, dp_size=dp_size, tp_rank=0, tp_size=1, dp_group=None, tp_group=None,
                      pad_id=bench.PAD_ID, seq_multiple=1, max_tokens_per_microbatch=bench.MAX_TOKENS_PER_MICROBATCH,
                      routing_shape=None)


def _tensor_collectives(bench):
    dist.init_process_group("gloo")
    me = dist.get_rank()
    pair = [dist.new_group([0, 1]), dist.new_group([2, 3])][me // 2]
    with bench.ByteCounter() as counter:
        piece = torch.empty(3, dtype=torch.int64)  # 24 bytes from rank 0 to each of the others
        dist.scatter(piece, [torch.full((3,), r) for r in range(4)] if me == 0 else None, src=0)
        dist.broadcast(torch.zeros(5, dtype=torch.float32), src=2 * (me // 2) + 1, group=pair)  # 20 bytes, in pairs
        out = [torch.empty(2, dtype=torch.float64) for _ in range(4)]  # 3 x 16 bytes from the others
        dist.all_gather(out, torch.ones(2, dtype=torch.float64))
        if me == 3:  # 7 bytes from rank 3 to rank 2 (torch's send/recv go through isend/irecv: counted once)
            dist.send(torch.zeros(7, dtype=torch.uint8), dst=2)
        elif me == 2:
            dist.recv(torch.empty(7, dtype=torch.uint8), src=3)
    return {"received": counter.received, "sent": counter.sent, "piece": piece.tolist()}


def test_byte_counter_counts_tensor_collectives(bench):
    results = run_ranks(4, _tensor_collectives, bench, timeout=60)
    assert [r["piece"] for r in results] == [[r] * 3 for r in range(4)]
    # rank 0: scatter source (sends 3 x 24), broadcast receiver in its pair; rank 1 broadcasts to rank 0; ...
    assert [r["received"] for r in results] == [20 + 48, 24 + 48, 24 + 20 + 48 + 7, 24 + 48]
    assert [r["sent"] for r in results] == [72, 20, 0, 20 + 7]


@pytest.mark.parametrize("path", ["tensor", "tensor_rank0"])
@pytest.mark.parametrize("dp,tp,moe_layers,topk", [(4, 1, 0, 0), (2, 2, 2, 2)])
def test_tensor_path_gives_the_same_batches_from_a_dp_share_of_the_bytes(bench, dp, tp, moe_layers, topk, path):
    """megarl's path, with the DP leaders as rollout workers ("tensor") or rank 0 alone ("tensor_rank0"): the same
    first micro-batch on every rank as the baseline's rank_batch on the whole rollout, each rank receiving at most
    1.25 x its DP share of the step's bytes, percentiles within one histogram bin."""
    from megarl.losses.rl import HISTOGRAM_BINS, HISTOGRAM_RANGE

    # 16 groups: enough that balancing whole groups by tokens gives every DP rank about its share
    case = bench.Case(world=4, dp=dp, tp=tp, samples=128, tokens_per_sample=16, moe_layers=moe_layers, topk=topk)
    ranks = run_ranks(4, bench.run_case, case, path, 0, keep_batch=True, timeout=120)
    samples = bench.synthetic_rollout(case, 0)
    shares = [bench.synthetic_rollout(case, 0, share=(i, dp)) for i in range(dp)]
    assert sorted((s.group, s.response_ids) for share in shares for s in share) == \
        sorted((s.group, s.response_ids) for s in samples)  # the workers' shares make up the whole rollout
    total = sum(r["bytes_total"] for r in ranks)
    assert total > 0 and (path == "tensor" or ranks[0]["bytes_received"] == 0)
    for rank, r in enumerate(ranks):
        rb = rank_batch(samples, r["dp_rank"], dp, bench.PAD_ID, seq_multiple=tp,
                        max_tokens_per_microbatch=bench.MAX_TOKENS_PER_MICROBATCH,
                        routing_shape=(moe_layers, topk) if moe_layers else None)
        expected = rb.batch.split(rb.num_microbatches)[0]
        for name in ("input_ids", "targets", "loss_mask", "rollout_log_probs", "routed_experts"):
            want, got = getattr(expected, name), getattr(r["micro_batch"], name)
            assert (got is None) == (want is None) and (want is None or torch.equal(got, want)), (rank, name)
        if rank or path == "tensor":
            assert 0 < r["bytes_received"] <= 1.25 * total / dp, (rank, r["bytes_received"], total)
    ratios = torch.cat([m["values/ratio"].double() for d in range(dp)
                        for m in bench.metric_inputs(case, _spec(bench, d, dp))])
    width = 2 * HISTOGRAM_RANGE / HISTOGRAM_BINS
    for r in ranks:
        for q in (0.5, 0.95):
            exact = float(torch.quantile(ratios, q))
            assert abs(math.log(r["metrics"][f"ratio_p{int(q * 100)}"]) - math.log(exact)) <= width
