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
