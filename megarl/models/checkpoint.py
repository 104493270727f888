"""Sharded model checkpoints with megatron-core dist_checkpointing: save at one layout, load at any other.

Each virtual-pipeline chunk is stored under `model{i}`; the ShardedTensor keys inside are global (layer and expert
offsets), which is what lets a TP2/PP2 checkpoint load into TP1/PP1 or an EP layout change. Saves are atomic: ranks
write into `<dir>.tmp-<pid>`, and rank 0 renames it to `<dir>` only after every rank finished.
"""
from __future__ import annotations

import os
import shutil

import torch.distributed as dist


def _sharded_state(chunks: list) -> dict:
    return {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}


def save_model_checkpoint(chunks: list, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    ckpt_dir = os.path.abspath(ckpt_dir)
    tmp = [f"{ckpt_dir}.tmp-{os.getpid()}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(tmp, src=0)
    tmp_dir = tmp[0]
    if dist.get_rank() == 0:
        os.makedirs(tmp_dir)
    dist.barrier()
    dist_checkpointing.save(_sharded_state(chunks), tmp_dir)
    dist.barrier()
    if dist.get_rank() == 0:
        publish_dir(tmp_dir, ckpt_dir)
    dist.barrier()


def publish_dir(tmp_dir: str, final_dir: str) -> None:
    """fsync every file in tmp_dir, then move it to final_dir. An existing final_dir stays whole until the new one is
    complete: it is renamed aside, the new folder renamed in, and only then the old one removed."""
    for root, _, files in os.walk(tmp_dir):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
    if os.path.exists(final_dir):
        old = f"{final_dir}.old-{os.getpid()}"
        os.rename(final_dir, old)
        os.rename(tmp_dir, final_dir)
        shutil.rmtree(old)
    else:
        os.rename(tmp_dir, final_dir)


def load_model_checkpoint(chunks: list, ckpt_dir: str) -> None:
    from megatron.core import dist_checkpointing

    if not os.path.isdir(ckpt_dir):
        raise FileNotFoundError(f"checkpoint folder {ckpt_dir!r} does not exist")
    apply_model_state(chunks, dist_checkpointing.load(_sharded_state(chunks), ckpt_dir), ckpt_dir)


def apply_model_state(chunks: list, loaded: dict, where: str) -> None:
    """Copy the loaded `model{i}` states into the chunks; anything missing or unexpected is an error."""
    for i, chunk in enumerate(chunks):
        missing, unexpected = chunk.load_state_dict(loaded[f"model{i}"], strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {where} does not match the model: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
