"""LoRA against full fine-tuning (issue 30): trainer memory, weight-sync bytes and time, and learning.

    .venv/bin/python benchmarks/lora.py --part memory      # one training step per model and mode (minutes)
    .venv/bin/python benchmarks/lora.py --part sync        # adapter vs merged sync into real CPU engines (minutes)
    .venv/bin/python benchmarks/lora.py --part learning    # the quickstart task, LoRA vs full RL, seeds 0,1,2 (~1 h)
    .venv/bin/python benchmarks/lora.py --table            # runs nothing: the tables from the JSON

memory: for the quickstart's model and SmolLM2-135M-Instruct (fp32 on CPU), one rank builds the policy as the trainer
does (build_policy), runs one forward/backward over 4 sequences of 256 tokens and one Adam step, and reports what
it holds (parameters, DDP gradient buffers, Adam state: counted tensor by tensor) and the rise of its peak resident
memory from before build_policy to the end of the step (VmHWM, reset first: the model, its gradients and optimizer
state, activations and temporaries; the process's import footprint excluded).

sync: for the same two models with LoRA (rank 16, all seven projections, a non-zero B), the adapter-only sync
(reshard.lora_sync=adapter: megarl.reshard.AdapterTransport into an engine started with LoRA enabled) against the
merged full-weight sync (reshard.lora_sync=merged: the tensor transport into a plain engine), fp32 engines on CPU: bytes
pushed and the steady-state sync time (the median of SYNC_REPEATS syncs after a first, verified one; verification not
timed). The target (issue 30): adapter bytes = the adapters' exactly, and the adapter sync <= 0.2x the merged one's
time on SmolLM2 at rank 16.

learning: per seed, the quickstart's SFT cold start runs once (benchmarks/algorithms.py ensure_sft, the same
checkpoint the algorithm comparison uses); from it, full RL (configs/quickstart.yaml as is) and LoRA RL (the same plus
LORA below) run with the same seed, so both start from one policy with the same prompts and held-out evaluation.
The LoRA learning rate is not tuned here (no dev split is used for it): 10x the full fine-tuning one, the rule of
"LoRA Without Regret" (Schulman et al., Thinking Machines 2025), which found the best LoRA learning rate about 10x
FullFT's across model sizes.

benchmarks/results/lora.json: {"machine", "memory": [rows], "sync": [rows], "learning": {"settings", "runs": [{"mode",
"seed", "pass_at_1_before", "pass_at_1_after", "wall_s"}]}}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

from machine import machine  # noqa: E402

OUT = os.path.join(HERE, "results", "lora.json")
WORK = os.path.join(ROOT, "runs", "bench-lora")
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"rank": 16, "alpha": 32, "target_modules": ALL}
LR_FACTOR = 10.0  # LoRA lr = 10 x the full fine-tuning lr (see the docstring)
MEMORY_BATCH = (4, 256)  # sequences x tokens of the measured step
SYNC_REPEATS = 5


# ------------------------------------------------------------------------------------------------------- memory
def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory_step(path: str, lora: dict | None) -> dict:
    """On one rank (megarl.testing.run_ranks): build_policy, one forward/backward + Adam step; what it holds."""
    import torch

    from megarl import parallel
    from megarl.models import causal_inputs, open_model_folder
    from megarl.models.lora import LoraConfig
    from megarl.trainer.config import OptimConfig
    from megarl.trainer.setup import build_policy

    folder = open_model_folder(path)
    groups = parallel.initialize(parallel.ParallelConfig(), folder.shape())
    with open("/proc/self/clear_refs", "w") as f:  # "5": reset the peak RSS (VmHWM) to the current RSS
        f.write("5")
    before = _rss("VmRSS")
    policy = build_policy(folder, OptimConfig(lr=1e-5), 10, lora=LoraConfig(**lora) if lora else None,
                          pg=groups.mcore)
    rows, tokens = MEMORY_BATCH
    ids = torch.randint(0, policy.bridge.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(0))
    policy.optimizer.zero_grad()
    logits = policy.model[0](*causal_inputs(ids))
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                                             ids[:, 1:].reshape(-1))
    loss.backward()
    policy.model[0].finish_grad_sync()
    policy.optimizer.step()
    peak = _rss("VmHWM")
    opts = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    params = [p for c in policy.chunks for p in c.parameters()]
    return {"params": sum(p.numel() for p in params),
            "trainable": sum(p.numel() for p in params if p.requires_grad),
            "weight_bytes": sum(p.numel() * p.element_size() for p in params),
            "grad_bytes": sum(b.grad_data.numel() * b.grad_data.element_size() for m in policy.model
                              for b in m.buffers),
            "optimizer_state_bytes": sum(t.numel() * t.element_size() for o in opts
                                         for s in o.optimizer.state.values() for t in s.values() if torch.is_tensor(t)),
            "rss_start_gb": round(before / 1e9, 3), "peak_rss_gb": round(peak / 1e9, 3),
            "peak_over_start_gb": round((peak - before) / 1e9, 3)}


def quickstart_model(work: str) -> str:
    """The quickstart's model folder (configs/quickstart.yaml model.tiny), written with megarl's own tiny writer."""
    import yaml

    from megarl.models import write_tiny_model

    with open(os.path.join(ROOT, "configs", "quickstart.yaml")) as f:
        tiny = yaml.safe_load(f)["model"]["tiny"]
    return write_tiny_model(os.path.join(work, "quickstart-model"), tiny["family"], tokenizer=tiny["tokenizer"],
                            **tiny.get("overrides", {}))


def _cpu_platform() -> None:
    """As tests/conftest.py: megarl's CPU platform applied, and one intra-op thread, in this process before run_ranks
    forks its ranks (a fork of a process whose OpenMP pool has run can deadlock in the child)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    from megarl import platform

    torch.set_num_threads(1)
    platform.setup()


def model_folders(work: str, names: list[str]) -> list[tuple[str, str]]:
    """(label, HF folder) of the models named: quickstart (written here), smollm2 (models/, converted by
    launchers/smollm2.sh)."""
    out = []
    if "quickstart" in names:
        out.append(("quickstart", quickstart_model(work)))
    if "smollm2" in names:
        if not os.path.isdir(SMOLLM2):
            sys.exit(f"lora.py: error: {SMOLLM2} is missing. Fix: bash launchers/smollm2.sh rl.steps=0 (converts it), "
                     "or --models quickstart")
        out.append(("SmolLM2-135M-Instruct", SMOLLM2))
    return out


def measure_memory(work: str, names: list[str]) -> list[dict]:
    _cpu_platform()
    from megarl.testing import run_ranks

    models = model_folders(work, names)
    rows = []
    for name, path in models:
        for mode, lora in (("full", None), ("lora", LORA)):
            (out,) = run_ranks(1, memory_step, path, lora, timeout=1800)
            row = {"model": name, "mode": mode, "lora": lora, "batch": list(MEMORY_BATCH), "dtype": "float32",
                   **out}
            rows.append(row)
            print(f"[lora] memory {name} {mode}: trainable {out['trainable']:,} of {out['params']:,}; grads "
                  f"{out['grad_bytes'] / 1e6:.1f} MB, Adam {out['optimizer_state_bytes'] / 1e6:.1f} MB, peak memory "
                  f"+{out['peak_over_start_gb']:.2f} GB", flush=True)
    return rows


# --------------------------------------------------------------------------------------------------------- sync
def sync_times(path: str, url: str, mode: str) -> dict:
    """On one rank: a LoRA policy with a non-zero B synced into the engine at `url`, adapters only or merged; the
    first sync verified (probes through the adapter / checksums + probes), then SYNC_REPEATS timed ones."""
    import statistics

    import torch
    import torch.distributed as dist

    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import ranks

    from megarl.models.lora import ADAPTER, LoraConfig, adapted_layers, apply_lora
    from megarl.reshard import AdapterTransport, SyncConfig, TensorTransport, WeightSync
    from megarl.rollout import EngineClient

    _, bridge, chunks = ranks.build(path)
    cfg = LoraConfig(**LORA)
    apply_lora(chunks, cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, _, layer in adapted_layers(chunks):
            b = getattr(layer, ADAPTER).B
            b.copy_(0.01 * torch.randn(b.shape, generator=g))
    client = EngineClient(url)
    transport = AdapterTransport(client, cfg) if mode == "adapter" else TensorTransport(client)
    sync = WeightSync(bridge, chunks, transport, client if dist.get_rank() == 0 else None, SyncConfig())
    first = sync.sync("v0", verify=True)
    times, pushed = [], set()
    for i in range(SYNC_REPEATS):
        stats = sync.sync(f"v{i + 1}", verify=False)
        times.append(stats["sync_s"])
        pushed.add(int(stats["pushed_bytes"]))
    sync.close()
    adapter_bytes = sum(p.numel() * p.element_size() for _, _, layer in adapted_layers(chunks)
                        for p in getattr(layer, ADAPTER).parameters())
    return {"pushed_bytes": sorted(pushed), "sync_s_median": statistics.median(times), "sync_s": times,
            "probe_max_abs_diff": first["probe_max_abs_diff"], "verified_tensors": first["verified_tensors"],
            "adapter_param_bytes": adapter_bytes}


def measure_sync(work: str, names: list[str]) -> list[dict]:
    _cpu_platform()
    from megarl.rollout import ServerConfig, SGLangServer
    from megarl.testing import run_ranks

    models = model_folders(work, names)
    rows = []
    for name, path in models:
        by_mode = {}
        for mode in ("merged", "adapter"):
            lora_flags = {"lora_rank": LORA["rank"], "lora_target_modules": LORA["target_modules"]} \
                if mode == "adapter" else {}
            server = SGLangServer(ServerConfig(model_path=path, log_dir=os.path.join(work, f"engine-{name}-{mode}"),
                                               **lora_flags)).start()
            try:
                (out,) = run_ranks(1, sync_times, path, server.url, mode, timeout=1800)
            finally:
                server.stop()
            by_mode[mode] = out
            rows.append({"model": name, "mode": mode, "lora": LORA, "engine_dtype": "float32", **out})
            print(f"[lora] sync {name} {mode}: {out['pushed_bytes'][0] / 1e6:.2f} MB in "
                  f"{out['sync_s_median']:.3f} s (median of {SYNC_REPEATS})", flush=True)
        ratio = by_mode["adapter"]["sync_s_median"] / by_mode["merged"]["sync_s_median"]
        rows[-1]["time_vs_merged"] = round(ratio, 4)
        rows[-1]["bytes_vs_merged"] = round(by_mode["adapter"]["pushed_bytes"][0] / by_mode["merged"]["pushed_bytes"][0],
                                            5)
    return rows


# ----------------------------------------------------------------------------------------------------- learning
def learning(seeds: list[int], work: str, out: str) -> None:
    import algorithms
    from real_model import save

    full_lr = float(_quickstart("optim")["lr"])
    # model.load (the shared SFT checkpoint) holds base weights the engine (started from model.path) lacks: the
    # adapter-only sync refuses that, so these runs push merged weights (the learning does not depend on it)
    lora_set = [f"model.lora={json.dumps(LORA)}", f"optim.lr={full_lr * LR_FACTOR}", "reshard.lora_sync=merged"]
    modes = {"full": [], "lora": lora_set}
    settings = {"rl_steps": algorithms._quickstart_steps("rl"), "sft_steps": algorithms._quickstart_steps("sft"),
                "set": [], "lora": LORA, "lora_lr": full_lr * LR_FACTOR, "full_lr": full_lr}
    done = {(r["mode"], r["seed"]) for r in _load(out).get("learning", {}).get("runs", [])}
    for seed in seeds:
        ckpt = algorithms.ensure_sft(work, seed, settings)
        for mode, extra in modes.items():
            if (mode, seed) in done:
                continue
            seed_dir = os.path.join(work, f"seed{seed}")
            run_dir = os.path.join(seed_dir, mode)
            shutil.rmtree(run_dir, ignore_errors=True)
            overrides = [f"run_dir={run_dir}", f"seed={seed}", "model.tiny=null",
                         f"model.path={os.path.join(seed_dir, 'base-model')}", f"model.load={ckpt}", "sft.steps=0",
                         *algorithms._overrides(algorithms.SHARED), *extra]
            wall = algorithms._megarl("train", overrides, os.path.join(seed_dir, f"{mode}.log"))
            with open(os.path.join(run_dir, "rl_summary.json")) as f:
                summary = json.load(f)
            run = {"mode": mode, "seed": seed, "pass_at_1_before": summary["pass_at_1_before"],
                   "pass_at_1_after": summary["pass_at_1_after"], "wall_s": round(wall, 1), "overrides": extra}

            def update(r, run=run):
                section = r.setdefault("learning", {"runs": []})
                section["settings"] = settings
                section["runs"] = [x for x in section["runs"] if (x["mode"], x["seed"]) != (run["mode"], run["seed"])]
                section["runs"].append(run)
                r["machine"] = machine()

            save(out, update)
            print(f"[lora] {mode} seed {seed}: {run['pass_at_1_before']:.1f}% -> {run['pass_at_1_after']:.1f}% in "
                  f"{wall:.0f} s", flush=True)


def _merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """The rows of `new`, and those of `old` for the (model, mode) pairs `new` did not measure (a --models subset)."""
    measured = {(r["model"], r["mode"]) for r in new}
    return [r for r in old if (r["model"], r["mode"]) not in measured] + new


def _quickstart(section: str) -> dict:
    import yaml

    with open(os.path.join(ROOT, "configs", "quickstart.yaml")) as f:
        return yaml.safe_load(f)[section]


def _load(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


# -------------------------------------------------------------------------------------------------------- table
def table(results: dict) -> str:
    lines = []
    if results.get("memory"):
        lines += ["| model | mode | trainable params | gradients | Adam state | peak memory (build + step) |", "|---|---|---|---|---|---|"]
        for r in results["memory"]:
            lines.append(f"| {r['model']} | {r['mode']} | {r['trainable']:,} of {r['params']:,} | "
                         f"{r['grad_bytes'] / 1e6:.1f} MB | {r['optimizer_state_bytes'] / 1e6:.1f} MB | "
                         f"+{r['peak_over_start_gb']:.2f} GB |")
    if results.get("sync"):
        lines += ["", "| model | sync | bytes pushed | sync time (median) | vs merged |", "|---|---|---|---|---|"]
        for r in results["sync"]:
            vs = f"{r['bytes_vs_merged']:.4f}x bytes, {r['time_vs_merged']:.3f}x time" if "time_vs_merged" in r \
                else "-"
            lines.append(f"| {r['model']} | {r['mode']} | {r['pushed_bytes'][0] / 1e6:.2f} MB | "
                         f"{r['sync_s_median']:.3f} s | {vs} |")
    runs = results.get("learning", {}).get("runs", [])
    if runs:
        lines += ["", "| seed | full: before -> after (gain) | LoRA: before -> after (gain) |", "|---|---|---|"]
        by = {(r["mode"], r["seed"]): r for r in runs}
        for seed in sorted({r["seed"] for r in runs}):
            cells = []
            for mode in ("full", "lora"):
                r = by.get((mode, seed))
                cells.append("-" if r is None else f"{r['pass_at_1_before']:.1f}% -> {r['pass_at_1_after']:.1f}% "
                             f"({r['pass_at_1_after'] - r['pass_at_1_before']:+.1f})")
            lines.append(f"| {seed} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) or "no results yet"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", choices=["memory", "sync", "learning"], action="append")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--models", default="quickstart,smollm2", help="memory and sync: quickstart, smollm2")
    p.add_argument("--table", action="store_true")
    p.add_argument("--out", default=OUT)
    p.add_argument("--work", default=WORK)
    args = p.parse_args(argv)
    parts = [] if args.table else (args.part or ["memory", "sync", "learning"])
    if "memory" in parts:
        from real_model import save

        rows = measure_memory(args.work, args.models.split(","))
        save(args.out, lambda r: r.update(memory=_merge_rows(r.get("memory", []), rows), machine=machine()))
    if "sync" in parts:
        from real_model import save

        rows = measure_sync(args.work, args.models.split(","))
        save(args.out, lambda r: r.update(sync=_merge_rows(r.get("sync", []), rows), machine=machine()))
    if "learning" in parts:
        learning([int(s) for s in args.seeds.split(",")], args.work, args.out)
    print(table(_load(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
