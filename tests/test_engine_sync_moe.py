"""Qwen3-MoE at EP=2 (and TP=2 x EP=2) -> SGLang on CPU: experts gathered under their global index, verified."""
import pytest
import torch

import ranks
from megarl.testing import run_ranks, tiny_model_dir
from megarl.testing.engines import tiny_engine


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    with tiny_engine("qwen3_moe", str(tmp_path_factory.mktemp("engine-moe"))) as server:
        yield server


@pytest.mark.parametrize("layout,world,transport", [({"ep": 2}, 2, "tensor"), ({"ep": 2}, 2, "distributed"),
                                                    ({"tp": 2, "ep": 2}, 4, "tensor")],
                         ids=["ep2-tensor", "ep2-distributed", "tp2ep2-tensor"])
def test_moe_sync_makes_engine_match_trainer(engine, layout, world, transport):
    seed = {"tensor": 11, "distributed": 12}[transport] + world
    r = run_ranks(world, ranks.sync_and_compare, tiny_model_dir("qwen3_moe"), engine.url, layout, transport, seed)[0]
    engine_lp, trainer_lp = torch.tensor(r["engine"]), torch.tensor(r["trainer"])
    assert (engine_lp - trainer_lp).abs().max() < 1e-3
    assert (torch.tensor(r["before"]) - torch.tensor(r["after"])).abs().max() > 1e-2
    assert r["stats"]["verified_tensors"] > 20 and r["stats"]["probe_max_abs_diff"] < 1e-3


def _corrupt_one_expert(transport):
    from test_engine_sync import _ZeroSliceOf

    return _ZeroSliceOf(transport, "model.layers.2.mlp.experts.3.up_proj.weight")  # expert 3 lives on EP rank 1


def test_corrupted_expert_slice_is_detected_and_named(engine):
    from megarl.testing import RankFailure

    with pytest.raises(RankFailure) as failure:
        run_ranks(2, ranks.sync_and_compare, tiny_model_dir("qwen3_moe"), engine.url, {"ep": 2}, "tensor", 17,
                  _corrupt_one_expert)
    message = str(failure.value)
    assert "WeightMismatchError" in message
    assert "engine tensor model.layers.2.mlp.experts.w13_weight differs" in message  # the fused tensor it went into
    assert "model.layers.2.mlp.experts.{0..3}.up_proj.weight" in message
