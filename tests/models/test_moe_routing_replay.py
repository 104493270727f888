"""MoE RL: a tiny DeepSeek-V3 through the full RL step at EP=2 with the real SGLang engine (bf16 engine, fp32 trainer),
with and without rollout routing replay (R3); the routing tensor layout; the MoE config options."""
import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

import ranks
from megarl.config import ConfigError
from megarl.testing import run_ranks, tiny_model_dir
from megarl.testing.fixtures import early_run_engine
from megarl.trainer.batching import Sample, token_batch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/<package>/ -> repo
# family -> tiny model overrides (char tokenizer). The flagship, DeepSeek-V3 (MLA, sigmoid router with bias); the
# trainer's routing bookkeeping is the same for every family (tests/reshard/test_sync_moe.py checks each one's routing
# and R3 against a real engine).
TINY_MOE = {"deepseek_v3": {}}


def _config(tmp, name: str, r3: bool, model: str) -> str:
    cfg = {"run_dir": str(tmp / name), "seed": 3, "model": {"path": model, "moe_aux_loss_coeff": 0.0},
           "parallel": {"ep": 2},
           "data": {"train": "synthetic", "synthetic": {"max_operand": 9, "num_train": 60, "num_eval": 4},
                    "max_prompt_tokens": 64},
           "sft": {"steps": 0},
           # a bf16 engine serving an fp32 trainer: near-tied router scores pick different experts sometimes
           "rollout": {"prompts_per_step": 8, "n_samples": 4, "max_new_tokens": 16, "request_size": 4,
                       "return_routed_experts": True, "routing_replay": r3,
                       "engine": {"max_total_tokens": 4096, "dtype": "bfloat16"}},
           "reward": {"name": "reward_fns:digit_fraction", "workers": 1},
           "optim": {"lr": 2e-3},
           "rl": {"steps": 1, "eval_samples": 1},
           "reshard": {"bucket_mb": 1, "probe_atol": 0.5},  # checksums stay exact; bf16 probes differ by ~0.05
           "checkpoint": {"export_hf": False},
           "logging": {"wandb": "disabled", "progress": False}}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _train(config: str, log: str, url: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    with open(log, "w") as out:
        rc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--standalone",
                             "-m", "megarl.cli", "train", config, f"rollout.engine.urls=[{url}]"], cwd=ROOT, env=env,
                            stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
    assert rc == 0, f"megarl train failed ({rc}); log tail:\n" + open(log).read()[-4000:]
    rows = [json.loads(line) for line in open(os.path.join(os.path.dirname(config), log_name(config), "metrics.jsonl"))]
    return next(r for r in rows if r["step"] == 1 and "grad_norm" in r)


def log_name(config: str) -> str:
    return os.path.basename(config)[:-len(".yaml")]


def _model(family: str) -> str:
    return tiny_model_dir(family, tokenizer="char", **TINY_MOE[family])


# per family, the engine a run would start itself (bf16, returns routed experts), launched ahead: both runs use it
engine = early_run_engine(lambda folder, family: _config(folder, "engine", False, _model(family)), _model,
                          params=sorted(TINY_MOE))


@pytest.mark.e2e
def test_routing_replay_makes_training_route_like_the_engine(tmp_path, engine, request):
    """Step 1 draws the same rollouts either way (same seeds, same weights), so the two runs compare the trainer's
    log-probs of identical tokens: with R3 the trainer uses exactly the engine's experts and its log-probs move
    closer to the engine's. Both runs use one engine (rollout.engine.urls; a start costs ~25 s), the one a run would
    start itself: each run first pushes its initial weights into it (verified), so step 1 samples from the same
    weights."""
    model = _model(request.node.callspec.params["engine"])  # the family
    configs = {r3: _config(tmp_path, f"r3_{'on' if r3 else 'off'}", r3, model) for r3 in (False, True)}
    off = _train(configs[False], str(tmp_path / "off.log"), engine.url)
    on = _train(configs[True], str(tmp_path / "on.log"), engine.url)
    assert off["rollout/samples"] == on["rollout/samples"] == 32 and on["grad_norm"] > 0
    for key in ("reward/mean", "response_len/mean", "rollout/tokens"):  # the same rollouts (R3 changes no sampling)
        assert on[key] == off[key], key
    # the trainer's own routing mostly matches the engine's (so the token/layer bookkeeping is right: a wrong
    # order would agree ~25% of the time with top-2 of 8), but not always in bf16 vs fp32
    assert 0.95 < off["moe/routing_agreement"] < 1.0
    assert on["moe/routing_agreement"] == 1.0
    assert on["mismatch/logprob_abs_diff"] < off["mismatch/logprob_abs_diff"]
    assert on["mismatch/logprob_abs_diff_max"] < off["mismatch/logprob_abs_diff_max"]
    for m in (on, off):
        assert m["moe/dropped_token_frac"] == 0.0  # no capacity factor: no token is dropped
        assert m["moe/expert_load_max_over_mean"] >= 1.0 and m["moe/expert_load_cv"] >= 0.0


@pytest.mark.unit
def test_routing_tensor_places_each_samples_positions():
    layers, k = 2, 2
    a = Sample(0, 0, [1, 2], [3, 4], [0.0, 0.0], "stop", routed_experts=list(range(3 * layers * k)))
    b = Sample(1, 1, [5], [6], [0.0], "stop", routed_experts=[7, 6, 5, 4])
    t = token_batch([a, b], rows=3, seq_len=5, pad_id=0, routing_shape=(layers, k)).routed_experts
    assert t.shape == (3, 5, layers, k)
    assert t[0, :3].flatten().tolist() == list(range(12)) and t[1, 0].flatten().tolist() == [7, 6, 5, 4]
    assert (t[0, 3:] == torch.arange(k)).all() and (t[2] == torch.arange(k)).all()  # last token / padding
    with pytest.raises(ValueError, match="expected 1 positions x 2 layers x top-2"):
        token_batch([Sample(0, 0, [1], [2], [0.0], "stop", routed_experts=[1, 2, 3])], 1, 2, 0, (layers, k))


def _moe_options(path):
    from megarl.models.moe import routers

    _, _, chunks = ranks.build(path, load=False, moe_enable_routing_replay=True, moe_aux_loss_coeff=0.0,
                               moe_router_bias_update_rate=0.0)
    config = chunks[0].config
    found = routers(chunks)
    return {"replay": all(r.router_replay is not None for r in found), "layers": [r.layer_number for r in found],
            "aux": config.moe_aux_loss_coeff, "bias_rate": config.moe_router_bias_update_rate}


@pytest.mark.multirank
def test_moe_options_reach_the_megatron_config(tmp_path):
    from megarl.models import open_model_folder
    from megarl.trainer.config import load_train_config
    from megarl.trainer.setup import moe_config_overrides

    path = tiny_model_dir("qwen3_moe")
    base = [f"run_dir={tmp_path}", 'model.tiny={"family": "qwen3_moe"}']
    cfg = load_train_config(None, base + ["rollout.routing_replay=true", "model.moe_aux_loss_coeff=0.0",
                                          "model.freeze_router_bias=true"])
    overrides = moe_config_overrides(cfg, open_model_folder(path))
    assert overrides == {"moe_enable_routing_replay": True, "moe_aux_loss_coeff": 0.0,
                         "moe_router_bias_update_rate": 0.0}
    built = run_ranks(1, _moe_options, path)[0]
    assert built == {"replay": True, "layers": [1, 2, 3, 4], "aux": 0.0, "bias_rate": 0.0}
    with pytest.raises(ConfigError, match="rollout.routing_replay, model.moe_aux_loss_coeff, model.freeze_router_bias "
                                          "apply to MoE models; .* is dense"):
        moe_config_overrides(cfg, open_model_folder(tiny_model_dir("qwen2")))


@pytest.mark.unit
def test_expert_load_and_assignments_count_only_the_samples_routed_tokens():
    """moe/expert_load_* and moe/dropped_token_frac count the positions routing agreement counts (each sample's tokens
    but its last): padding, and under R3 the placeholder experts of positions the engine never routed, do not."""
    from types import SimpleNamespace

    from megarl.models.moe import RoutingStats

    router = SimpleNamespace(layer_number=1, topk=1, config=SimpleNamespace(sequence_parallel=False))
    stats = RoutingStats.__new__(RoutingStats)
    stats.routers = [router]
    # one micro-batch of 2 rows x 3 positions, tokens in [s, b] order: (s0,b0) (s0,b1) (s1,b0) (s1,b1) (s2,b0) (s2,b1)
    experts = torch.tensor([2, 1, 2, 0, 0, 0])  # row 1 is padding after its first token; position 2 is a last token
    stats.maps = {1: [torch.nn.functional.one_hot(experts, 3).bool()]}
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]]).float()
    assert stats.load(1, 3, mask, 1).tolist() == [[0.0, 1.0, 2.0]]  # tokens (s0,b0) (s0,b1) (s1,b0) only
    assert stats.load(1, 3).tolist() == [[3.0, 1.0, 2.0]]  # every position
    assert stats.assignments(mask, 1).tolist() == [3.0, 3.0]
    routed = torch.tensor([2, 0, 1, 0, 0, 0]).view(3, 2).t().reshape(2, 3, 1, 1)  # engine: (s0,b1) and (s1,b0) differ
    assert stats.agreement(routed, mask, 1).tolist() == [1.0, 3.0]
