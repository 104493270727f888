"""Vocab-parallel chunked log-prob + entropy vs the naive full-vocabulary computation (log_softmax + gather +
entropy), forward + backward, fp32 on CPU, V=151,936, 4,096 tokens; TP=1 and TP=2 (numbers per rank).

    .venv/bin/python benchmarks/logprob_entropy.py [--tokens 4096] [--vocab 151936] [--repeats 2]

Each measurement runs in a fresh process with one thread. Peak memory is the process's peak resident memory minus
its resident memory once the input logits exist (so the input is not counted; the gradient w.r.t. the logits, which
both paths must produce, is). Writes benchmarks/results/logprob_entropy.json; ratios are megarl / naive, per rank.
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


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def worker(impl: str, tokens: int, vocab: int, tp: int, rank: int, port: int, repeats: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if tp > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    from megarl.losses import vocab_parallel_logprob_entropy

    g = torch.Generator().manual_seed(0)
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    per_rank = vocab // tp
    logits = torch.randn(tokens, per_rank, generator=g)  # this rank's slice
    baseline = _rss_kb()
    best = float("inf")
    for _ in range(repeats):
        x = logits.detach().requires_grad_(True)
        start = time.perf_counter()
        if impl == "megarl":
            log_prob, entropy = vocab_parallel_logprob_entropy(
                x, targets, vocab_size=vocab, group=dist.group.WORLD if tp > 1 else None)
        else:  # naive: log_softmax over the full vocabulary (TP=1 only)
            logp = torch.log_softmax(x, dim=-1)
            log_prob = logp.gather(-1, targets[:, None])[:, 0]
            entropy = -(logp.exp() * logp).sum(-1)
        (log_prob.sum() + entropy.sum()).backward()
        best = min(best, time.perf_counter() - start)
        del x, log_prob, entropy
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"time_s": best, "peak_extra_mb": (peak_kb - baseline) / 1024}))
    if tp > 1:
        dist.destroy_process_group()


def run(impl, tokens, vocab, tp, repeats):
    port = 29600 + (hash((impl, tp)) % 300)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", impl, str(tokens), str(vocab), str(tp), str(r),
                               str(port), str(repeats)], stdout=subprocess.PIPE, env=env, text=True)
             for r in range(tp)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    return {"time_s": max(o["time_s"] for o in outs), "peak_extra_mb": max(o["peak_extra_mb"] for o in outs)}


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        impl, tokens, vocab, tp, rank, port, repeats = sys.argv[2], *map(int, sys.argv[3:])
        return worker(impl, tokens, vocab, tp, rank, port, repeats)
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cases = []
    naive = run("naive", args.tokens, args.vocab, 1, args.repeats)  # the reference: full vocabulary, one rank
    print(f"{'tp':>3} {'impl':>7} {'time s':>8} {'peak MB':>9} {'time ratio':>11} {'mem ratio':>10}")
    print(f"{1:>3} {'naive':>7} {naive['time_s']:8.2f} {naive['peak_extra_mb']:9.0f}")
    for tp in (1, 2):
        ours = run("megarl", args.tokens, args.vocab, tp, args.repeats)
        case = {"tp": tp, "vocab": args.vocab, "tokens": args.tokens,
                "peak_mem_ratio": ours["peak_extra_mb"] / naive["peak_extra_mb"],
                "time_ratio": ours["time_s"] / naive["time_s"], "megarl": ours, "naive": naive}
        cases.append(case)
        print(f"{tp:>3} {'megarl':>7} {ours['time_s']:8.2f} {ours['peak_extra_mb']:9.0f} {case['time_ratio']:11.2f} "
              f"{case['peak_mem_ratio']:10.3f}")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    path = os.path.join(HERE, "results", "logprob_entropy.json")
    with open(path, "w") as f:
        json.dump({"cases": cases, "note": "ratios are megarl (per rank) / naive on the full vocabulary on one rank "
                   "(a naive TP=2 run would all-gather the vocabulary on each rank: the same work and ~2x the "
                   "memory of naive TP=1 per rank, which two ranks cannot fit in this machine's 24 GiB)"},
                  f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
