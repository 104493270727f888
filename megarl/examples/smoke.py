"""`megarl smoke`: the model-bridge smoke run. Writes a tiny random HF model (or uses --model PATH), loads it into a
TP/PP/EP-sharded Megatron GPTModel, compares the logits with Hugging Face transformers, exports the sharded model back
to an HF folder, checks that every tensor is bit-identical, and writes a summary JSON.

    torchrun --nproc_per_node 2 -m megarl.cli smoke [--family qwen3] [--tp 2] [--pp 1] [--ep 1] [--out runs/smoke]
"""
from __future__ import annotations

import json
import os
import time


def smoke(args) -> int:
    import torch
    import torch.distributed as dist

    from megarl import parallel
    from megarl.models import ModelBridge, forward_logits, open_model_folder, write_tiny_model

    timings = {}
    start = time.perf_counter()
    layout = parallel.ParallelConfig(tp=args.tp, pp=args.pp, ep=args.ep)
    parallel.init_distributed(parallel=layout)
    rank, world = dist.get_rank(), dist.get_world_size()
    model_path = args.model or os.path.join(args.out, f"tiny-{args.family}")
    if args.model is None and rank == 0:
        write_tiny_model(model_path, args.family)
    dist.barrier()
    folder = open_model_folder(model_path)
    groups = parallel.initialize(layout, folder.shape())  # validates the layout against the model's shapes
    timings["setup_s"] = time.perf_counter() - start

    t = time.perf_counter()
    bridge = ModelBridge(folder, pg=groups.mcore)
    chunks = bridge.build()
    bridge.load_hf_weights(chunks)
    timings["build_and_load_s"] = time.perf_counter() - t

    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, bridge.vocab_size, (2, 32), generator=generator)
    t = time.perf_counter()
    logits = forward_logits(chunks, [batch], vocab_size=bridge.vocab_size, pg=bridge.pg)
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
