"""A LoRA RL run end to end (issue 30): `megarl train` with model.lora and a KL to the reference, on a real SGLang CPU
engine started with LoRA enabled. The pieces are tested against references elsewhere (tests/models/test_lora.py,
tests/reshard/test_lora_sync.py); this checks they are wired together: the adapters are what is synced, the reference
is the initial policy (the policy itself with its fresh adapters off), and the KL moves only once the adapters do."""
import json
import os
import subprocess
import sys

import pytest

from megarl.parallel.env import free_port
from megarl.testing import tiny_model_dir
from megarl.testing.fixtures import early_run_engine
from tiny_rl import TINY, write_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _config(folder, name: str) -> str:
    return write_config(folder, name, model={"lora": {"rank": 4, "alpha": 8.0, "target_modules": ALL}},
                        algorithm={"kl_coef": 0.1}, rl={"steps": 2, "mini_batches": 1, "forgetting_kl": True},
                        reshard={"verify_every": 1})


def _model(_=None) -> str:
    return tiny_model_dir(TINY["family"], tokenizer=TINY["tokenizer"], **TINY["overrides"])


# the engine the run would start itself (base weights, LoRA enabled at the run's rank and targets), launched ahead (a
# start costs ~25 s); the run loads its adapters into it
engine = early_run_engine(lambda folder, _: _config(folder, "engine"), _model)


@pytest.mark.e2e
def test_lora_rl_run_syncs_adapters_and_anchors_the_kl_to_the_initial_policy(tmp_path, engine):
    config = _config(tmp_path, "lora")
    log = tmp_path / "train.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "megarl.launch.torchrun", "--nproc_per_node", "1", "--master_port",
                             str(free_port()), "-m", "megarl.cli", "train", config,
                             f"rollout.engine.urls=[{engine.url}]"], cwd=ROOT, env=env, stdout=out,
                            stderr=subprocess.STDOUT, timeout=900).returncode
    assert rc == 0, log.read_text()[-4000:]
    steps: dict = {}
    for line in open(tmp_path / "lora" / "metrics.jsonl"):
        row = json.loads(line)
        steps.setdefault(row["step"], {}).update(row)
    # Step 1 trains the initial policy (fresh adapters: B = 0), which is the reference: its KL is zero up to the
    # rounding of two forward passes; step 2's policy has moved
    assert abs(steps[1]["kl"]) < 1e-7 and steps[2]["kl"] > 1e-6, (steps[1]["kl"], steps[2]["kl"])
    assert abs(steps[0]["eval/kl_to_initial"]) < 1e-7 and steps[2]["eval/kl_to_initial"] > 1e-6
    # The syncs pushed adapters (rank 4 x (in + out) per adapted layer), not the model: a small fraction of its bytes
    o = TINY["overrides"]
    h, ffn, layers = o["hidden_size"], o["intermediate_size"], o["num_hidden_layers"]
    model_bytes = 4 * (2 * o["vocab_size"] * h + layers * (4 * h * h + 3 * h * ffn))
    for step in (1, 2):
        assert 0 < steps[step]["reshard/pushed_bytes"] < model_bytes / 5, steps[step]["reshard/pushed_bytes"]
        assert steps[step]["reshard/probe_max_abs_diff"] < 1e-3  # the engine, through the adapter, equals the trainer
