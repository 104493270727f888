"""The prepared GPU check: one script, one H200, under 9 minutes -> benchmarks/results/gpu_check.json.

    bash launchers/install.sh && .venv/bin/python benchmarks/gpu_check.py          # on a machine with a GPU
    .venv/bin/python benchmarks/gpu_check.py --plan                                # anywhere: configs + checks only

What it runs (each step is recorded with its numbers, or with the error that stopped it; one failing step does not
stop the others):
1. `logits`: the model bridge on the TransformerEngine spec (what megarl builds on GPU) against Hugging Face
   transformers on a random Qwen2.5-0.5B-shaped model (`megarl smoke`: logits, and the HF -> Megatron -> HF round
   trip bit-exact). Megatron runs the fp32 weights with TE kernels that may use TF32: tolerance 5e-2 on the logits.
2. `memory`: a GPU SGLang engine on the same model: GPU memory in use (nvidia-smi) after start, after
   /release_memory_occupation and after /resume_memory_occupation (the colocated trainer's phases).
3. `rl_tensor`: `megarl train` for 3 GRPO steps in bf16, the engine colocated and weights pushed over the `tensor`
   transport (CUDA IPC), verified by checksums + probe log-probs: step time, tokens/s, train MFU, reshard time,
   trainer-vs-engine log-prob mismatch.
4. `rl_distributed`: the same for 2 steps over the `distributed` transport (NCCL broadcast into the engine).
5. `packing`: packed sequences (algorithm.pack_sequences) on the TransformerEngine path, i.e. megatron-core's THD
   PackedSeqParams, against the padded forward of the same long-tailed RL batch (`benchmarks/packing.py`, a 4-layer
   model and the Qwen2.5-0.5B shape, bf16): log-prob and gradient differences, tokens computed, time both ways.
6. `deepseek_v3`: a tiny DeepSeek-V3 (MLA with YaRN, shared experts, sigmoid router with bias, group-limited
   routing) through 2 GRPO steps with routing replay (R3), the engine colocated: weight sync verified by checksums +
   probe log-probs every step, trainer-vs-engine log-prob mismatch and routing agreement: MLA through SGLang's GPU
   attention backends and the TransformerEngine spec (on CPU the suite runs the engine path on torch_native).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
# Qwen2.5-0.5B's dimensions (random weights: parity and speed do not need trained ones); the char tokenizer's ids
# are a small subset of the vocabulary.
MODEL = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, vocab_size=151936, max_position_embeddings=1024, tie_word_embeddings=True)
H200_BF16_DENSE_FLOPS = 989e12  # NVIDIA's H200 SXM dense BF16 Tensor Core peak
LOGITS_ATOL = 5e-2


def params_of(m: dict) -> int:
    """Parameters of a Qwen2-shaped model (q/k/v biases included, embeddings counted once when tied)."""
    h, f, layers, heads, kv = (m["hidden_size"], m["intermediate_size"], m["num_hidden_layers"],
                               m["num_attention_heads"], m["num_key_value_heads"])
    head_dim = h // heads
    attn = h * h + 2 * h * kv * head_dim + (h + 2 * kv * head_dim) + h * h  # q, k, v (+ biases), o
    per_layer = attn + 3 * h * f + 2 * h
    embed = m["vocab_size"] * h * (1 if m.get("tie_word_embeddings") else 2)
    return layers * per_layer + embed + h


def train_mfu(tokens: float, train_s: float, n_params: int, peak_flops: float = H200_BF16_DENSE_FLOPS) -> float:
    """6 * N FLOPs per trained token (forward + backward), over the train phase's wall time, against the peak."""
    return 6.0 * n_params * tokens / max(train_s, 1e-9) / peak_flops


def rl_config(run_dir: str, transport: str, steps: int, family: str = "qwen2") -> dict:
    """The RL run of a step: the Qwen2.5-0.5B shape, or (family deepseek_v3) the tiny DeepSeek-V3 with R3."""
    moe = family != "qwen2"
    return {
        "run_dir": run_dir, "seed": 0,
        "model": {"tiny": {"family": family, "tokenizer": "char", "overrides": {} if moe else MODEL}},
        "data": {"train": "synthetic", "synthetic": {"digits": 2, "num_train": 2000, "num_eval": 32},
                 "max_prompt_tokens": 128},
        "sft": {"steps": 0},
        "rollout": {"prompts_per_step": 64, "n_samples": 8, "max_new_tokens": 64, "request_size": 64,
                    "routing_replay": moe, "engine": {"mem_fraction_static": 0.4, "max_total_tokens": None}},
        "reward": {"name": "exact_match", "workers": 4},
        "optim": {"lr": 1e-6},
        "rl": {"steps": steps, "eval_samples": 1, "max_tokens_per_microbatch": 16384},
        "reshard": {"transport": transport, "verify_every": 1},
        "checkpoint": {"export_hf": False, "save_every": 0},
        "logging": {"wandb": "disabled", "progress": False},
    }


def _write_yaml(path: str, cfg: dict) -> str:
    import yaml

    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def plan(work: str) -> dict:
    """The configs the RL steps run, loaded and pre-flight checked exactly as `megarl train` would (no GPU needed)."""
    from megarl.launch.preflight import preflight
    from megarl.trainer.config import load_train_config

    checked = {}
    for transport, steps, family in (("tensor", 3, "qwen2"), ("distributed", 2, "qwen2"),
                                     ("tensor", 2, "deepseek_v3")):
        name = transport if family == "qwen2" else family
        path = _write_yaml(os.path.join(work, f"rl_{name}.yaml"),
                           rl_config(os.path.join(work, f"rl_{name}"), transport, steps, family))
        cfg = load_train_config(path)
        checked[name] = preflight(cfg, "train", world_size=1)
    return {"configs": checked, "params": params_of(MODEL)}


def _gpu_memory_mb() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[0])


def _model(work: str) -> str:
    """The random Qwen2.5-0.5B-shaped HF folder (fp32 safetensors), written once."""
    from megarl.models import write_tiny_model

    model = os.path.join(work, "model")
    if not os.path.isfile(os.path.join(model, "config.json")):
        write_tiny_model(model, "qwen2", tokenizer="char", **MODEL)
    return model


def step_logits(work: str) -> dict:
    out = os.path.join(work, "smoke")
    proc = subprocess.run([sys.executable, "-m", "megarl.launch.torchrun", "--nproc_per_node", "1", "-m", "megarl.cli",
                           "smoke", "--model", _model(work), "--tp", "1", "--out", out], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    summary_path = os.path.join(out, "summary.json")
    if not os.path.isfile(summary_path):
        raise RuntimeError(f"smoke failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    with open(summary_path) as f:
        s = json.load(f)
    diff = s["logits_max_abs_diff_vs_transformers"]
    return {"max_abs_diff": diff, "atol": LOGITS_ATOL, "ok": diff < LOGITS_ATOL and not s["roundtrip_mismatched_tensors"],
            "roundtrip_mismatched": s["roundtrip_mismatched_tensors"], "timings_s": s["timings_s"]}


def step_memory(work: str) -> dict:
    from megarl.rollout import EngineClient, ServerConfig, SGLangServer

    model = _model(work)
    idle = _gpu_memory_mb()
    server = SGLangServer(ServerConfig(model_path=model, dtype="bfloat16", mem_fraction_static=0.4,
                                       log_dir=os.path.join(work, "engine-memory"))).start()
    try:
        client = EngineClient(server=server)
        started = _gpu_memory_mb()
        client.release_memory()
        released = _gpu_memory_mb()
        client.resume_memory()
        resumed = _gpu_memory_mb()
        out = client.generate([[5, 6, 7]], {"max_new_tokens": 4, "temperature": 0.0})
    finally:
        server.stop()
    return {"idle_mb": idle, "started_mb": started, "released_mb": released, "resumed_mb": resumed,
            "freed_mb": started - released, "generates_after_resume": len(out[0].output_ids) == 4,
            "ok": released < started - 0.5 * (started - idle) and len(out[0].output_ids) == 4}


def step_rl(work: str, transport: str, steps: int, family: str = "qwen2") -> dict:
    name = f"rl_{transport}" + ("" if family == "qwen2" else f"_{family}")
    run_dir = os.path.join(work, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    path = _write_yaml(os.path.join(work, f"{name}.yaml"), rl_config(run_dir, transport, steps, family))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megarl.launch.torchrun", "--nproc_per_node", "1", "-m",
                           "megarl.cli", "train", path], cwd=ROOT, capture_output=True, text=True, timeout=420)
    wall = time.perf_counter() - start
    metrics_path = os.path.join(run_dir, "metrics.jsonl")
    if proc.returncode != 0 or not os.path.isfile(metrics_path):
        raise RuntimeError(f"megarl train failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps_rows = [r for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r]
    last = steps_rows[-1]
    n = params_of(MODEL)
    tokens = last["perf/tokens_per_s"] * last["time/step_s"]
    return {"wall_s": round(wall, 1), "steps": len(steps_rows),
            "step_s": [round(r["time/step_s"], 2) for r in steps_rows],
            "tokens_per_s": round(last["perf/tokens_per_s"], 1),
            "train_s": round(last.get("time/train_s", 0.0), 2), "reshard_s": round(last.get("time/reshard_s", 0.0), 2),
            "train_mfu": round(train_mfu(tokens, last.get("time/train_s", 0.0), n), 4),
            "mismatch_logprob_abs_diff": last.get("mismatch/logprob_abs_diff"),
            "probe_max_abs_diff": last.get("reshard/probe_max_abs_diff"),
            "routing_agreement": last.get("moe/routing_agreement"),
            "ok": len(steps_rows) == steps}


PACKING_LOGPROB_MEAN_ATOL = 2e-2  # bf16: THD and padded attention run different kernels
PACKING_GRAD_RTOL = 5e-2


def step_packing(work: str) -> dict:
    out = os.path.join(work, "packing.json")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "packing.py"), "--case", "long_tail", "--case",
                           "long_tail_0p5b", "--repeats", "2", "--out", out], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0 or not os.path.isfile(out):
        raise RuntimeError(f"packing.py failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    with open(out) as f:
        cases = json.load(f)["cases"]
    ok = all(c["log_probs_mean_abs_diff"] < PACKING_LOGPROB_MEAN_ATOL and c["grad_rel_diff"] < PACKING_GRAD_RTOL
             for c in cases.values())
    return {"cases": cases, "ok": ok}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", action="store_true", help="write and check the configs, print them; no GPU needed")
    parser.add_argument("--work", default=os.path.join(ROOT, "runs", "gpu_check"))
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpu_check.json"))
    args = parser.parse_args(argv)
    os.makedirs(args.work, exist_ok=True)
    if args.plan:
        print(json.dumps(plan(args.work), indent=1))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; run it on a GPU machine (or --plan)", file=sys.stderr)
        return 2
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "params": params_of(MODEL),
              "steps": {}}
    started = time.perf_counter()
    for name, fn in (("logits", lambda: step_logits(args.work)), ("memory", lambda: step_memory(args.work)),
                     ("packing", lambda: step_packing(args.work)),
                     ("rl_tensor", lambda: step_rl(args.work, "tensor", 3)),
                     ("rl_distributed", lambda: step_rl(args.work, "distributed", 2)),
                     ("deepseek_v3", lambda: step_rl(args.work, "tensor", 2, "deepseek_v3"))):
        t = time.perf_counter()
        try:
            result["steps"][name] = fn()
        except Exception as e:  # record and go on: one GPU session should tell as much as it can
            result["steps"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[-4000:]}
        result["steps"][name]["seconds"] = round(time.perf_counter() - t, 1)
        print(f"gpu_check {name}: {json.dumps(result['steps'][name])[:400]}", flush=True)
        with open(args.out, "w") as f:  # after every step: a time-out still leaves what was measured
            json.dump(result, f, indent=1)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["ok"] = all(s.get("ok") for s in result["steps"].values())
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"gpu_check: {'all ok' if result['ok'] else 'FAILED steps: ' + str([k for k, v in result['steps'].items() if not v.get('ok')])}"
          f" ({result['wall_s']} s) -> {args.out}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
