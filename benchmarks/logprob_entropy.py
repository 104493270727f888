"""Log-prob + entropy of the sampled tokens, forward + backward, fp32 on CPU, V=151,936, 4,096 tokens; TP=1 and TP=2
(numbers per rank). Two comparisons:

- impl "megarl": the vocab-parallel chunked computation on given logits vs "naive" (full-vocabulary log_softmax +
  gather + entropy on the same logits).
- impl "fused": log-probs straight from the hidden states [4096, 896] and the output weight [151936/TP, 896] (Qwen2.5-
  0.5B's LM head; megarl.losses.fused_linear, the logits never exist) vs "naive-matmul": the LM-head matmul, then the
  naive path. Both put the weight's gradient where a Megatron trainer does, into a `main_grad` buffer allocated (and
  touched) before the measurement, so that buffer is not counted on either side.
- impl "topk" (on-policy distillation's `opd_top_k`): the fused path's log-probs of the sampled token and the
  teacher's top-k tokens (--top-k, default 8) in one pass over the vocabulary (targets [tokens, 1 + k]) vs "topk-loop":
  1 + k passes, one per target column (what the loss did before). Run it with fewer tokens (--tokens 512).

    .venv/bin/python benchmarks/logprob_entropy.py [--tokens 4096] [--vocab 151936] [--hidden 896] [--repeats 2]
                                                   [--impl megarl|fused|topk] [--top-k 8]
                                                   (one comparison; the JSON keeps the others)

Each measurement runs in a fresh process with one thread; the --repeats runs of an impl alternate with those of its
naive reference, and each side keeps its best time. Peak memory is the process's peak resident memory minus
its resident memory once the inputs exist (logits, or hidden + weight + main_grad; so the inputs are not counted; the
gradient w.r.t. the logits or the hidden states, which the paths must produce, is). Writes
benchmarks/results/logprob_entropy.json; ratios are megarl or fused (per rank) / its naive counterpart at TP=1.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from machine import machine  # noqa: E402  (benchmarks/machine.py: the machine, for the JSON)


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def _linear_into_main_grad():
    """hidden @ weight.T whose backward adds the weight's gradient into weight.main_grad in place, as Megatron's
    linear layers do with gradient_accumulation_fusion (the naive side's LM head)."""
    import torch

    class Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight):
            ctx.save_for_backward(hidden, weight)
            return hidden @ weight.t()

        @staticmethod
        def backward(ctx, grad_logits):
            hidden, weight = ctx.saved_tensors
            weight.main_grad.addmm_(grad_logits.t(), hidden)
            return grad_logits @ weight, None

    return Linear.apply


def worker(impl: str, tokens: int, vocab: int, hidden_size: int, tp: int, rank: int, port: int, repeats: int,
           top_k: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if tp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    from megarl.losses import vocab_parallel_logprob_entropy
    from megarl.losses.fused_linear import fused_logprob_entropy
    if impl != "megarl" and tp > 1:  # imported before the baseline, like the rest of the code
        import megatron.core.tensor_parallel.mappings  # noqa: F401  (its TP all-reduce of grad_hidden)

    group = dist.group.WORLD if tp > 1 else None
    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, vocab, (tokens,) if impl not in ("topk", "topk-loop") else (tokens, 1 + top_k),
                            generator=g)
    per_rank = vocab // tp
    if impl in ("naive", "megarl"):
        logits = torch.randn(tokens, per_rank, generator=g)  # this rank's slice
    else:
        hidden = torch.randn(tokens, hidden_size, generator=g)
        weight = torch.randn(per_rank, hidden_size, generator=g) / hidden_size ** 0.5  # this rank's slice
        weight.main_grad = torch.zeros_like(weight)  # the parameter's gradient buffer: allocated and touched
        linear = _linear_into_main_grad()
    baseline = _rss_kb()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        if impl in ("naive", "naive-matmul"):  # log_softmax over the full vocabulary (TP=1 only)
            if impl == "naive":
                x = logits.detach().requires_grad_(True)
                full = x
            else:
                x = hidden.detach().requires_grad_(True)
                full = linear(x, weight)
            logp = torch.log_softmax(full, dim=-1)
            del full
            log_prob = logp.gather(-1, targets[:, None])[:, 0]
            entropy = -(logp.exp() * logp).sum(-1)
            del logp
        elif impl == "megarl":
            x = logits.detach().requires_grad_(True)
            log_prob, entropy = vocab_parallel_logprob_entropy(x, targets, vocab_size=vocab, group=group)
        else:  # fused, topk, topk-loop
            x = hidden.detach().requires_grad_(True)
            w = weight.detach().requires_grad_(True)
            w.main_grad = weight.main_grad
            if impl == "topk-loop":  # one pass per target column; entropy from the first, as the loss used it
                passes = [fused_logprob_entropy(x, w, targets[:, j].contiguous(), vocab_size=vocab, group=group)
                          for j in range(targets.shape[1])]
                log_prob, entropy = torch.stack([lp for lp, _ in passes], -1), passes[0][1]
                del passes
            else:
                log_prob, entropy = fused_logprob_entropy(x, w, targets, vocab_size=vocab, group=group)
        (log_prob.sum() + entropy.sum()).backward()
        best = min(best, time.perf_counter() - start)
        del x, log_prob, entropy
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"time_s": best, "peak_extra_mb": (peak_kb - baseline) / 1024}))
    if tp > 1:
        dist.destroy_process_group()


def run(impl, tokens, vocab, hidden, tp, repeats, top_k):
    port = 29600 + (hash((impl, tp)) % 300)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", impl, str(tokens), str(vocab), str(hidden),
                               str(tp), str(r), str(port), str(repeats), str(top_k)], stdout=subprocess.PIPE, env=env,
                              text=True)
             for r in range(tp)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    return {"time_s": max(o["time_s"] for o in outs), "peak_extra_mb": max(o["peak_extra_mb"] for o in outs)}


# impl -> the reference its ratios are taken against
COMPARISONS = {"megarl": "naive", "fused": "naive-matmul", "topk": "topk-loop"}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        impl, tokens, vocab, hidden, tp, rank, port, repeats, top_k = sys.argv[2], *map(int, sys.argv[3:])
        return worker(impl, tokens, vocab, hidden, tp, rank, port, repeats, top_k)
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--top-k", type=int, default=8, help="impl topk: the teacher's top-k per position")
    parser.add_argument("--impl", action="append", choices=list(COMPARISONS),
                        help="measure only this comparison (repeatable; default: all); the JSON keeps the other rows")
    args = parser.parse_args()
    impls = args.impl or list(COMPARISONS)
    path = os.path.join(HERE, "results", "logprob_entropy.json")
    kept = []
    if args.impl and os.path.exists(path):
        with open(path) as f:
            kept = [c for c in json.load(f)["cases"] if c.get("impl") not in impls]
    cases = []
    print(f"{'tp':>3} {'impl':>12} {'time s':>8} {'peak MB':>9} {'time ratio':>11} {'mem ratio':>10}")
    for impl in impls:
        naive_impl, extra = COMPARISONS[impl], {"hidden": args.hidden} if impl != "megarl" else {}
        if impl == "topk":
            extra["top_k"] = args.top_k
        # Repeats alternate between the naive reference and the impl (best time, highest peak of each), so a change
        # in the load of this shared machine hits both sides alike.
        measured = {}
        for _ in range(args.repeats):
            for key, (name, tp) in {"naive": (naive_impl, 1), 1: (impl, 1), 2: (impl, 2)}.items():
                new = run(name, args.tokens, args.vocab, args.hidden, tp, 1, args.top_k)
                old = measured.get(key, new)
                measured[key] = {"time_s": min(old["time_s"], new["time_s"]),
                                 "peak_extra_mb": max(old["peak_extra_mb"], new["peak_extra_mb"])}
        naive = measured["naive"]
        print(f"{1:>3} {naive_impl:>12} {naive['time_s']:8.2f} {naive['peak_extra_mb']:9.0f}")
        for tp in (1, 2):
            ours = measured[tp]
            case = {"impl": impl, "tp": tp, "vocab": args.vocab, "tokens": args.tokens, **extra,
                    "peak_mem_ratio": ours["peak_extra_mb"] / naive["peak_extra_mb"],
                    "time_ratio": ours["time_s"] / naive["time_s"], impl: ours, "naive": naive,
                    "naive_impl": naive_impl}
            cases.append(case)
            print(f"{tp:>3} {impl:>12} {ours['time_s']:8.2f} {ours['peak_extra_mb']:9.0f} {case['time_ratio']:11.2f} "
                  f"{case['peak_mem_ratio']:10.3f}")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    cases = sorted(kept + cases, key=lambda c: (list(COMPARISONS).index(c["impl"]), c["tp"]))
    with open(path, "w") as f:
        json.dump({"cases": cases, "machine": machine(), "note": "ratios are megarl or fused (per rank) / its naive counterpart on the full "
                   "vocabulary on one rank: naive (log_softmax + gather + entropy on given logits) for impl megarl, "
                   "naive-matmul (the LM-head matmul hidden @ weight.T, then the same) for impl fused, topk-loop "
                   "(the fused path once per target column, 1 + top_k passes) for impl topk. The weight's gradient "
                   "goes into a preallocated main_grad on both sides and is not counted. (A naive TP=2 run "
                   "would all-gather the vocabulary on each rank: the same work and ~2x the memory of naive TP=1 per "
                   "rank, which two ranks cannot fit in this machine's 24 GiB.)"}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
