"""Foundation benchmarks: the fork-based multi-rank runner vs torchrun, and the HF <-> Megatron bridge.

    .venv/bin/python benchmarks/foundation.py [--repeats 3]

Prints a table and writes benchmarks/results/foundation.json. All numbers come from one run on this machine; compare
the ratios, not the seconds (shared CPUs are noisy).
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
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import conftest  # noqa: E402,F401  (imports torch + megatron once, applies the CPU platform)
import ranks  # noqa: E402
import torch  # noqa: E402

from megarl.models import write_tiny_model  # noqa: E402
from megarl.testing import run_ranks  # noqa: E402

TORCHRUN_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
import conftest, ranks
import torch.distributed as dist
ranks.train_grads({path!r}, {{"tp": 2, "pp": 2}}, micro_batches=4)
dist.destroy_process_group()
"""


def timed(fn, repeats):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def bridge_timings(path, layout):
    from megarl.models import forward_logits

    start = time.perf_counter()
    _, bridge, chunks = ranks.build(path, load=False, **layout)
    built = time.perf_counter()
    bridge.load_hf_weights(chunks)
    loaded = time.perf_counter()
    n = sum(1 for _ in bridge.export_hf_weights(chunks))
    exported = time.perf_counter()
    forward_logits(chunks, [torch.randint(0, 32768, (4, 128))], vocab_size=bridge.vocab_size, pg=bridge.pg)
    forwarded = time.perf_counter()
    return {"build_s": built - start, "load_hf_s": loaded - built, "export_hf_s": exported - loaded,
            "forward_4x128_s": forwarded - exported, "tensors_exported_here": n}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        small = write_tiny_model(os.path.join(tmp, "qwen3"), "qwen3")
        # A larger (~42M parameter) model for the bridge numbers.
        big = write_tiny_model(os.path.join(tmp, "qwen3-big"), "qwen3", hidden_size=512, intermediate_size=1536,
                               num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_hidden_layers=8,
                               vocab_size=32768)

        fork = timed(lambda: run_ranks(4, ranks.train_grads, small, {"tp": 2, "pp": 2}), args.repeats)
        script = os.path.join(tmp, "step.py")
        with open(script, "w") as f:
            f.write(TORCHRUN_SCRIPT.format(tests=os.path.join(ROOT, "tests"), path=small))
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        env = dict(os.environ, PYTHONWARNINGS="ignore")
        tr = timed(lambda: subprocess.run([torchrun, "--nproc_per_node", "4", "--master_port", "29571", script],
                                          check=True, capture_output=True, env=env), 1)
        rows.append(("4-rank TP2xPP2 fwd+bwd, fork runner (run_ranks)", fork, ""))
        rows.append(("4-rank TP2xPP2 fwd+bwd, torchrun (fresh interpreters)", tr, f"{tr / fork:.1f}x slower"))

        bridge = {}
        for name, layout, world in [("tp1", {}, 1), ("tp2", {"tp": 2}, 2), ("pp2", {"pp": 2}, 2)]:
            per_rank = run_ranks(world, bridge_timings, big, layout)
            bridge[name] = {k: max(r[k] for r in per_rank) for k in per_rank[0] if k.endswith("_s")}
            for key, value in bridge[name].items():
                rows.append((f"bridge {name} {key[:-2]} (qwen3 42M, fp32)", value, ""))

    width = max(len(r[0]) for r in rows)
    print(f"\n{'measurement'.ljust(width)}  seconds  note")
    for label, seconds, note in rows:
        print(f"{label.ljust(width)}  {seconds:7.3f}  {note}")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    result = {"machine": {**machine(), "torch": torch.__version__},
              "fork_runner_s": fork, "torchrun_s": tr, "torchrun_over_fork": tr / fork, "bridge": bridge}
    with open(os.path.join(HERE, "results", "foundation.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(f"\nwrote {os.path.join(HERE, 'results', 'foundation.json')}")


if __name__ == "__main__":
    main()
