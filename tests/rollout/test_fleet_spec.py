"""megarl.trainer.config.fleet_spec: the one mapping of a run's sections onto its SGLang servers (FleetSpec), and the
server command every policy engine then gets (megarl.rollout.server.engine_server_config)."""
import os

import pytest

from megarl.rollout.server import engine_server_config
from megarl.trainer import load_train_config
from megarl.trainer.config import fleet_spec

pytestmark = pytest.mark.unit


def _spec(*overrides):
    return fleet_spec(load_train_config(None, ["model.tiny.family=qwen2", *overrides]))


def test_the_sections_reach_each_engine(tmp_path):
    spec = _spec(f"run_dir={tmp_path}", "seed=7", "rollout.deterministic=true", "rollout.engine.tp_size=2",
                 "rollout.engine.dtype=bfloat16", "rollout.engine.extra_args=[--foo]", "rollout.engine.startup_retries=3")
    c = engine_server_config(spec, "/m", index=2)
    assert (c.model_path, c.random_seed, c.seeded_sampling, c.tp_size, c.dtype, c.startup_retries) == \
        ("/m", 9, True, 2, "bfloat16", 3)
    assert c.log_dir == os.path.join(str(tmp_path), "engine") and c.extra_args == ["--foo"]
    assert spec.teacher is None and spec.pools == {}


@pytest.mark.parametrize("overrides,flag", [
    (["rollout.return_routed_experts=true"], "--enable-return-routed-experts"),
    (["rollout.routing_replay=true"], "--enable-return-routed-experts"),
    (["rl.max_staleness=1", "rl.partial_rollouts=true"], "--disable-overlap-schedule"),
])
def test_flags_other_sections_decide(overrides, flag):
    assert flag not in engine_server_config(_spec(), "/m").extra_args
    assert flag in engine_server_config(_spec(*overrides), "/m").extra_args


def test_teacher_only_when_enabled():
    assert _spec("algorithm.advantage_estimator=opd", "teacher.urls=[http://t:1]").teacher.urls == ["http://t:1"]
    assert _spec().teacher is None
