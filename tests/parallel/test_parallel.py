"""ParallelConfig validation, launch-environment parsing, and the parallel_state groups megarl creates."""
import pytest

from megarl import parallel
from megarl.parallel import DistributedEnv, LaunchEnvError, ModelShape, ParallelConfig, ParallelConfigError
from megarl.testing import run_ranks

DENSE = ModelShape(num_layers=4, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128)
MOE = ModelShape(num_layers=4, num_attention_heads=4, num_key_value_heads=2, ffn_hidden_size=128, num_experts=4,
                 moe_ffn_hidden_size=32)


@pytest.mark.unit
@pytest.mark.parametrize("config,world,model,needle", [
    (ParallelConfig(tp=2, pp=2), 6, None, "world size 6 is not divisible by tp*pp*cp = 2*2*1 = 4"),
    (ParallelConfig(tp=3), 3, DENSE, "num_attention_heads=4 is not divisible by parallel.tp=3"),
    (ParallelConfig(tp=4), 4, ModelShape(4, 8, 2, 128), "num_key_value_heads=2 is not divisible by parallel.tp=4"),
    (ParallelConfig(ep=3), 3, MOE, "num_experts=4 is not divisible by parallel.ep=3"),
    (ParallelConfig(ep=2), 2, DENSE, "parallel.ep=2 but the model has no experts"),
    (ParallelConfig(pp=3, num_layers_in_first_pipeline_stage=3), 3, DENSE,
     "parallel.num_layers_in_first_pipeline_stage=3 cannot place num_hidden_layers=4 on pp=3"),
    (ParallelConfig(pp=2, vpp=4), 2, DENSE, "num_hidden_layers=4 cannot be split over parallel.pp=2 x parallel.vpp=4"),
    (ParallelConfig(vpp=2), 1, None, "parallel.vpp=2 needs parallel.pp > 1"),
    (ParallelConfig(tp=0), 1, None, "parallel.tp must be a positive integer"),
    (ParallelConfig(tp="2"), 2, None, "parallel.tp must be a positive integer"),
    (ParallelConfig(ep=2, etp=2), 2, MOE, "not divisible by etp*ep*pp = 2*2*1"),
    (ParallelConfig(cp=2), 2, None, "parallel.cp > 1 needs TransformerEngine"),
])
def test_invalid_layouts_name_the_field_and_fix(config, world, model, needle):
    with pytest.raises(ParallelConfigError) as error:
        config.validate(world, model, on_gpu=False)
    assert needle in str(error.value)
    assert "Fix" in str(error.value) or "must be" in str(error.value)


@pytest.mark.unit
def test_valid_layouts_and_derived_dp():
    ParallelConfig(tp=2, pp=2, vpp=2).validate(8, DENSE, on_gpu=False)
    ParallelConfig(tp=2, ep=2).validate(4, MOE, on_gpu=False)
    ParallelConfig(cp=2).validate(2, DENSE, on_gpu=True)
    assert ParallelConfig(tp=2, pp=2).dp(8) == 2
    assert ParallelConfig(tp=2, ep=2, etp=1).expert_tp == 1 and ParallelConfig(tp=2).expert_tp == 2


@pytest.mark.multirank
def test_env_from_torchrun_variables():
    env = DistributedEnv.from_environ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node7",
                                       "MASTER_PORT": "29400", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.launcher) == \
        (3, 8, 1, "node7", 29400, "torchrun")


@pytest.mark.unit
def test_env_from_slurm_variables():
    env = DistributedEnv.from_environ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                                       "SLURM_JOB_NODELIST": "gpu[003-004,010],cpu1", "SLURM_JOB_ID": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.launcher) == (5, 8, 1, "gpu003", "slurm")
    assert env.master_port == 20000 + 1234
    assert DistributedEnv.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "n1",
                                        "MASTER_PORT": "1234"}).master_addr == "n1"


@pytest.mark.unit
@pytest.mark.parametrize("nodelist,first", [("n1", "n1"), ("n[1-4]", "n1"), ("gpu[007,009-010]", "gpu007"),
                                            ("a-b-[01-02],c", "a-b-01"), ("host1,host2", "host1")])
def test_first_slurm_host(nodelist, first):
    assert parallel.first_slurm_host(nodelist) == first


@pytest.mark.unit
def test_env_errors_name_the_variable():
    with pytest.raises(LaunchEnvError, match="RANK='x' is not an integer"):
        DistributedEnv.from_environ({"RANK": "x", "WORLD_SIZE": "2"})
    with pytest.raises(LaunchEnvError, match="SLURM_JOB_NODELIST"):
        DistributedEnv.from_environ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    single = DistributedEnv.from_environ({})
    assert (single.rank, single.world_size, single.launcher) == (0, 1, "single")


def _groups(config):
    import torch.distributed as dist

    pg = parallel.initialize(config).mcore
    ranks = lambda group: dist.get_process_group_ranks(group)  # noqa: E731
    return {"tp": ranks(pg.tp), "pp": ranks(pg.pp), "dp": ranks(pg.dp), "ep": ranks(pg.ep),
            "backend": dist.get_backend()}


@pytest.mark.multirank
def test_groups_follow_tp_cp_ep_dp_pp_order():
    # 8 ranks, tp=2, pp=2 -> dp=2. tp varies fastest, then dp, then pp (cp=ep=1).
    results = run_ranks(8, _groups, ParallelConfig(tp=2, pp=2))
    assert results[0] == {"tp": [0, 1], "pp": [0, 4], "dp": [0, 2], "ep": [0], "backend": "gloo"}
    assert results[5] == {"tp": [4, 5], "pp": [1, 5], "dp": [5, 7], "ep": [5], "backend": "gloo"}


@pytest.mark.multirank
def test_groups_with_expert_parallel():
    results = run_ranks(4, _groups, ParallelConfig(tp=1, ep=2))
    assert [r["ep"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert results[0]["dp"] == [0, 1, 2, 3]


def _relayout_then_teardown():
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel.initialize(ParallelConfig(tp=2))
    pp_groups = _groups(ParallelConfig(pp=2))  # a second initialize re-lays the groups out
    parallel.teardown()
    parallel.teardown()  # idempotent
    return pp_groups["pp"], pp_groups["tp"], dist.is_initialized(), parallel_state.model_parallel_is_initialized()


@pytest.mark.multirank
def test_relayout_and_teardown():
    assert run_ranks(2, _relayout_then_teardown) == [([0, 1], [0], False, False), ([0, 1], [1], False, False)]


def _bad_world():
    parallel.initialize(ParallelConfig(tp=2, pp=2))


@pytest.mark.multirank
def test_initialize_rejects_bad_world_size_on_every_rank():
    from megarl.testing import RankFailure

    with pytest.raises(RankFailure) as failure:
        run_ranks(2, _bad_world)
    assert str(failure.value).count("world size 2 is not divisible by tp*pp*cp") == 2


def _initialize_twice():
    from megatron.core import parallel_state

    parallel.initialize(ParallelConfig(tp=2))
    first = parallel_state.get_tensor_model_parallel_group()
    parallel.initialize(ParallelConfig(tp=2))  # `megarl run`: SFT, then RL, same layout
    kept = parallel_state.get_tensor_model_parallel_group() is first
    parallel.initialize(ParallelConfig(pp=2))  # another layout: rebuilt
    rebuilt = parallel_state.get_pipeline_model_parallel_world_size() == 2
    parallel.teardown()
    return kept, rebuilt


@pytest.mark.multirank
def test_groups_are_built_once_per_layout():
    assert run_ranks(2, _initialize_twice) == [(True, True), (True, True)]
