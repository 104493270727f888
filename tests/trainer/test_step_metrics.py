"""The RL step's metrics (megarl.trainer.metrics) reduce over the group that holds the values: the same numbers at
TP 2, PP 2, DP 2, TP2 x PP2 and PP2 x DP2 as on one rank, on every rank (rank 0, which logs, is on the first stage)."""
import pytest
import torch

import ranks
from megarl.testing import run_ranks

pytestmark = pytest.mark.multirank

LAYOUTS = [("tp2", {"tp": 2}, 2), ("pp2", {"pp": 2}, 2), ("dp2", {}, 2),
           ("tp2pp2", {"tp": 2, "pp": 2}, 4), ("pp2dp2", {"pp": 2}, 4)]


def _batch():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(8, 12, generator=g) * 3
    rollout = old + torch.randn(8, 12, generator=g) * 0.05
    mask = (torch.rand(8, 12, generator=g) > 0.3).float()
    entropy = torch.rand(8, 12, generator=g) * 2
    return old * mask, rollout * mask, mask, entropy * mask


@pytest.fixture(scope="module")
def reference():
    (ref,) = run_ranks(1, ranks.step_metrics, {}, *_batch())
    diff = (_batch()[0] - _batch()[1]).abs()
    assert ref["mismatch/logprob_abs_diff_max"] == pytest.approx(diff.max().item())  # the naive value
    assert ref["mismatch/logprob_abs_diff"] == pytest.approx((diff.sum() / _batch()[2].sum()).item())
    return ref


@pytest.mark.parametrize("name,layout,world", LAYOUTS, ids=[l[0] for l in LAYOUTS])
def test_step_metrics_do_not_depend_on_layout(reference, name, layout, world):
    for result in run_ranks(world, ranks.step_metrics, layout, *_batch()):
        assert result.keys() == reference.keys()
        for key, value in reference.items():
            assert result[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
