"""Weight-sync throughput: gather + convert + bucket (no engine), and the full push into a real SGLang server per
transport, against this machine's memcpy bandwidth measured in the same run (the physical bound).

    .venv/bin/python benchmarks/reshard.py [--skip-large]

Models: the tiny test Qwen2 and a ~0.5B-parameter random Qwen2-shaped model (Qwen2.5-0.5B dimensions), fp32 on CPU.
gather+convert is the steady state (the bucket buffer is allocated once per WeightSync and reused by every sync); the
first pass, which also page-faults that buffer, is reported beside it. With TP > 1 on CPU the shards cross processes
over gloo/TCP, so the gloo gather bandwidth between the same ranks is measured too: that, not memcpy, bounds TP > 1 here.
Writes benchmarks/results/reshard.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from machine import machine  # noqa: E402  (benchmarks/machine.py: the machine, for the JSON)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import conftest  # noqa: E402,F401  (imports torch + megatron once, applies the CPU platform)
import ranks  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from megarl.models import write_tiny_model  # noqa: E402
from megarl.testing import run_ranks  # noqa: E402
from megarl.testing.engines import tiny_engine  # noqa: E402

QWEN2_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, max_position_embeddings=512, tie_word_embeddings=True)


def memcpy_gbps(nbytes: int = 1 << 30) -> float:
    src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    return nbytes / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gather_convert(path, layout, bucket_bytes):
    """Seconds and bytes to export + pack every bucket (what a push sends), on the slowest rank: the first pass (which
    also allocates and page-faults the bucket buffer) and the steady state (the buffer lives as long as WeightSync, so
    every later sync reuses it). Also the gloo gather bandwidth between these ranks, the bound for TP > 1 on CPU."""
    import torch.distributed as dist

    from megarl.reshard import BucketPacker

    _, bridge, chunks = ranks.build(path, **layout)
    packer = BucketPacker(bucket_bytes)
    passes = []
    for _ in range(2):
        dist.barrier()
        start, total = time.perf_counter(), 0
        for owner in bridge.owner_ranks(chunks):
            for bucket in packer.pack(bridge.export_hf_weights(chunks, owner=owner, copy=False)):
                total += bucket.nbytes
            dist.barrier()
        passes.append(time.perf_counter() - start)
    gather_gbps = None
    if dist.get_world_size() > 1:  # bytes that arrive at the owner per second, same accounting as above
        shard = torch.ones(min(bucket_bytes, 64 << 20) // 4)
        parts = [torch.empty_like(shard) for _ in range(dist.get_world_size())] if dist.get_rank() == 0 else None
        dist.gather(shard, parts, dst=0)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(3):
            dist.gather(shard, parts, dst=0)
        gather_gbps = 3 * dist.get_world_size() * shard.numel() * 4 / (time.perf_counter() - start) / 1e9
    return {"first_seconds": passes[0], "seconds": passes[1], "bytes": total, "gather_gbps": gather_gbps}


def push(path, url, layout, transport, bucket_bytes):
    import torch.distributed as dist

    from megarl.reshard import TRANSPORTS, SyncConfig, WeightSync
    from megarl.rollout import EngineClient

    _, bridge, chunks = ranks.build(path, **layout)
    client = EngineClient(url)
    sync = WeightSync(bridge, chunks, TRANSPORTS[transport](client), client if dist.get_rank() == 0 else None,
                      SyncConfig(bucket_bytes=bucket_bytes))
    first = sync.sync(verify=True)  # warm-up and correctness
    stats = sync.sync(verify=False)
    sync.close()
    return {"seconds": stats["sync_s"], "bytes": stats["pushed_bytes"], "probe": first["probe_max_abs_diff"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--skip-large", action="store_true", help="only the tiny model")
    args = parser.parse_args()
    bound = memcpy_gbps()
    print(f"memcpy bandwidth: {bound:.2f} GB/s")
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        models = [("tiny-qwen2", write_tiny_model(os.path.join(tmp, "tiny"), "qwen2"), [1 << 20, 16 << 20])]
        if not args.skip_large:
            models.append(("qwen2-0.5b-random", write_tiny_model(os.path.join(tmp, "q05"), "qwen2", **QWEN2_05B),
                           [16 << 20, 64 << 20, 256 << 20]))
        for label, path, buckets in models:
            params = sum(v.numel() for v in load_file(f"{path}/model.safetensors").values())
            for bucket in buckets:
                for layout_name, layout, world in [("tp1", {}, 1), ("tp2", {"tp": 2}, 2)]:
                    per_rank = run_ranks(world, gather_convert, path, layout, bucket, timeout=900)
                    total = sum(x["bytes"] for x in per_rank)
                    cases.append({"model": label, "params": params, "transport": "none", "layout": layout_name,
                                  "bucket_bytes": bucket,
                                  "gather_convert_gbps": total / max(x["seconds"] for x in per_rank) / 1e9,
                                  "first_pass_gbps": total / max(x["first_seconds"] for x in per_rank) / 1e9,
                                  "gloo_gather_gbps": per_rank[0]["gather_gbps"],
                                  "push_gbps": None, "peak_extra_bytes": None})
            with tiny_engine("qwen2", os.path.join(tmp, f"log-{label}"), **({} if label.startswith("tiny")
                                                                             else QWEN2_05B)) as server:
                for transport in ("tensor", "distributed"):
                    bucket = buckets[-1]
                    r = run_ranks(1, push, path, server.url, {}, transport, bucket, timeout=900)[0]
                    cases.append({"model": label, "params": params, "transport": transport, "layout": "tp1",
                                  "bucket_bytes": bucket, "gather_convert_gbps": None,
                                  "push_gbps": r["bytes"] / r["seconds"] / 1e9, "peak_extra_bytes": None,
                                  "probe_max_abs_diff": r["probe"]})
    print(f"\n{'model':20} {'params':>11} {'what':>14} {'layout':>6} {'bucket MiB':>10} {'GB/s':>7} "
          f"{'x memcpy':>8} {'1st pass':>8} {'x gloo':>6}")
    for c in cases:
        gbps = c["gather_convert_gbps"] if c["transport"] == "none" else c["push_gbps"]
        what = "gather+convert" if c["transport"] == "none" else f"push {c['transport']}"
        first = f"{c['first_pass_gbps']:.3f}" if c.get("first_pass_gbps") else "-"
        vs_gloo = f"{gbps / c['gloo_gather_gbps']:.2f}" if c.get("gloo_gather_gbps") else "-"
        print(f"{c['model']:20} {c['params']:>11,} {what:>14} {c['layout']:>6} {c['bucket_bytes'] / 2**20:>10.0f} "
              f"{gbps:>7.3f} {gbps / bound:>8.3f} {first:>8} {vs_gloo:>6}")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    out = os.path.join(HERE, "results", "reshard.json")
    with open(out, "w") as f:
        json.dump({"memcpy_gbps": bound, "cases": cases, "machine": machine()}, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
