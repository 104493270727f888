"""Packed sequences (algorithm.pack_sequences) vs rows padded to the longest: tokens the model computes and time of the
RL train forward+backward and the forward-only log-probs, fp32 on CPU, one rank.

    .venv/bin/python benchmarks/packing.py [--repeats 2] [--case quickstart|long_tail ...]

Cases (lengths drawn with a fixed seed; micro-batches by the trainer's token budget, rl.max_tokens_per_microbatch
8192, as megarl.trainer.batching.micro_batches_for splits them):
- `quickstart`: the quickstart's shape (Qwen2, 4 layers, hidden 128, 300-token vocabulary), 256 samples of a 9-14
  token prompt and a 1-8 token response (2-digit addition in chat format).
- `long_tail`: a reasoning-like RL batch (Qwen2, 4 layers, hidden 256, 8,192-token vocabulary), 64 samples of a
  32-128 token prompt and a log-normal response length (median 150, capped at 896): most rows are far shorter than
  the longest.
Per mode: tokens the model computes (padded: rows x padded length per micro-batch; packed: the packed length of each
micro-batch, which is one length for the whole call), the real tokens, and the best time of --repeats alternating
runs. The packed forward runs the local (CPU) attention with a dense [total, total] block-causal mask: its attention
cost grows with the square of the packed length, while everything else (projections, MLP, the fused output layer)
scales with the tokens. Writes benchmarks/results/packing.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from machine import machine  # noqa: E402  (benchmarks/machine.py: the machine, for the JSON)
sys.path.insert(0, os.path.dirname(HERE))

BUDGET = 8192
CASES = {
    "quickstart": dict(model=dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=4, vocab_size=300), samples=256, prompt=(9, 14),
                       response=("uniform", 1, 8)),
    "long_tail": dict(model=dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=8192), samples=64, prompt=(32, 128),
                      response=("lognormal", 150, 896)),
    # GPU only (benchmarks/gpu_check.py): the same lengths on the check's Qwen2.5-0.5B shape
    "long_tail_0p5b": dict(model=dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                      num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                      tie_word_embeddings=True), samples=64, prompt=(32, 128),
                           response=("lognormal", 150, 896)),
}
CPU_CASES = ["quickstart", "long_tail"]


def lengths_of(case: dict, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    n = case["samples"]
    prompts = torch.randint(case["prompt"][0], case["prompt"][1] + 1, (n,), generator=g)
    kind, a, b = case["response"]
    if kind == "uniform":
        responses = torch.randint(a, b + 1, (n,), generator=g)
    else:  # log-normal around the median a, sigma 0.8, capped at b
        responses = (a * torch.exp(0.8 * torch.randn(n, generator=g))).round().clamp(1, b).long()
    return prompts.tolist(), responses.tolist()


def token_batch(case: dict, vocab: int):
    import torch

    from megarl.losses import TokenBatch, shift_sequences

    prompt_lens, response_lens = lengths_of(case)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p in prompt_lens]
    responses = [torch.randint(3, vocab, (r,), generator=g).tolist() for r in response_lens]
    ids, targets, mask = shift_sequences(prompts, responses, pad_id=0)
    noise = 0.1 * torch.randn(mask.shape, generator=g)
    return TokenBatch(input_ids=ids, targets=targets, loss_mask=mask, advantages=torch.randn(len(ids), 1) * mask,
                      old_log_probs=(noise - 5) * mask, rollout_log_probs=(noise - 5) * mask)


def worker(path: str, name: str, repeats: int) -> dict:
    """One case on one rank, in this process (its own: `--worker`); on a GPU the model is built with the
    TransformerEngine spec and the packed forward runs THD PackedSeqParams."""
    from dataclasses import fields, replace

    import torch

    from megarl import parallel, platform
    from megarl.algorithms import AlgorithmConfig
    from megarl.losses import compute_log_probs, forward_backward, prepare_global_batch
    from megarl.losses.step import schedule_layouts
    from megarl.models import ModelBridge, open_model_folder
    from megarl.trainer.batching import micro_batches_for
    from megarl.trainer.setup import wrap_ddp

    platform.setup()
    folder = open_model_folder(path)
    pg = parallel.initialize(parallel.ParallelConfig(), folder.shape()).mcore
    bridge = ModelBridge(folder, pg=pg)
    chunks = bridge.build()
    model = wrap_ddp(chunks, pg=pg)
    device = torch.cuda.current_device() if platform.on_gpu() else "cpu"
    batch = token_batch(CASES[name], bridge.vocab_size)
    batch = replace(batch, **{f.name: getattr(batch, f.name).to(device) for f in fields(batch)
                              if getattr(batch, f.name) is not None})
    rows, seq = batch.input_ids.shape
    num_mb = micro_batches_for(rows, seq, BUDGET)
    while rows % num_mb:
        num_mb += 1
    cfg = AlgorithmConfig()
    prepared = prepare_global_batch(batch, cfg.aggregation, pg=pg)
    layouts = schedule_layouts(model, batch.split(num_mb), True, pg=pg)
    out = {"samples": rows, "padded_len": seq, "micro_batches": num_mb, "device": str(device),
           "tokens": {"real": int(sum(l.tokens for l in layouts)), "padded": rows * seq,
                      "packed": int(sum(l.total for l in layouts))},
           "packed_shapes": [[l.out_rows, l.length] for l in layouts]}
    times, grads, log_probs = {}, {}, {}
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]

    def synced():
        if platform.on_gpu():
            torch.cuda.synchronize()
        return time.perf_counter()

    for _ in range(repeats):
        for pack in (False, True):
            for m in model:
                m.zero_grad_buffer()
            t = synced()
            forward_backward(model, prepared, num_mb, cfg, bridge.vocab_size, pack=pack, pg=pg)
            train = synced() - t
            grads[pack] = torch.cat([p.main_grad.float().flatten() for p in params])
            t = synced()
            log_probs[pack] = compute_log_probs(model, batch, num_mb, bridge.vocab_size, pack=pack, pg=pg).float()
            forward = synced() - t
            best = times.setdefault(pack, {"train_s": train, "log_probs_s": forward})
            best["train_s"], best["log_probs_s"] = min(best["train_s"], train), min(best["log_probs_s"], forward)
    out["padded"], out["packed"] = times[False], times[True]
    diff = (log_probs[True] - log_probs[False]).abs()
    out["log_probs_max_abs_diff"] = float(diff.max())
    out["log_probs_mean_abs_diff"] = float(diff.sum() / batch.loss_mask.sum())
    out["grad_rel_diff"] = float((grads[True] - grads[False]).norm() / grads[False].norm())
    return out


def _run_case(name: str, path: str, repeats: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 500))
    proc = subprocess.run([sys.executable, __file__, "--worker", name, path, str(repeats)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"case {name} failed: {proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        import torch

        torch.set_num_threads(1)
        print(json.dumps(worker(argv[2], argv[1], int(argv[3]))), flush=True)
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--case", action="append", choices=list(CASES),
                        help=f"repeatable; default: {', '.join(CPU_CASES)}")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "packing.json"))
    args = parser.parse_args(argv)
    from megarl.models import write_tiny_model

    results = {}
    with tempfile.TemporaryDirectory(prefix="megarl-packing-") as tmp:
        for name in args.case or CPU_CASES:
            case = CASES[name]
            path = write_tiny_model(os.path.join(tmp, name), "qwen2", tokenizer="char", max_position_embeddings=4096,
                                    **case["model"])
            r = _run_case(name, path, args.repeats)
            r["train_time_ratio"] = r["packed"]["train_s"] / r["padded"]["train_s"]
            r["log_probs_time_ratio"] = r["packed"]["log_probs_s"] / r["padded"]["log_probs_s"]
            r["token_ratio"] = r["tokens"]["packed"] / r["tokens"]["padded"]
            r["model"] = case["model"]
            results[name] = r
            print(f"{name}: tokens padded {r['tokens']['padded']} -> packed {r['tokens']['packed']} "
                  f"(real {r['tokens']['real']}); train {r['padded']['train_s']:.2f} -> {r['packed']['train_s']:.2f} s "
                  f"({r['train_time_ratio']:.2f}x); log-probs {r['padded']['log_probs_s']:.2f} -> "
                  f"{r['packed']['log_probs_s']:.2f} s ({r['log_probs_time_ratio']:.2f}x); log-prob max diff "
                  f"{r['log_probs_max_abs_diff']:.1e}, grad rel diff {r['grad_rel_diff']:.1e}", flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"cases": results, "machine": machine(), "budget_tokens_per_microbatch": BUDGET, "threads": 1,
                   "note": "one rank; CPU: fp32, local attention with a dense block-causal mask over each packed "
                           "row; GPU: bf16, TransformerEngine THD. Best of the alternating repeats; ratios packed / "
                           "padded"}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
