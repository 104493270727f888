"""Faults without loss (issue 33): a non-finite loss or gradient skips the optimizer step on every rank and a run of
such steps stops with one line; a checkpoint that cannot be written leaves the previous one intact and says so in one
line; old checkpoints are pruned by checkpoint.keep. The references are the states before the fault: weights and
optimizer state compared bit for bit, the checkpoint saved before the failed one loaded back."""
import copy
import errno
import os
import types

import pytest
import torch

import ranks
from megarl.algorithms import AlgorithmConfig
from megarl.testing import run_ranks, tiny_model_dir
from rl_batch import TEMPERATURE, rl_token_batch

pytestmark = pytest.mark.multirank

CFG = AlgorithmConfig(policy_loss="ppo_clip", kl_coef=0.02, temperature=TEMPERATURE).validate()


def _weights(chunks) -> list:
    return [p.detach().clone() for chunk in chunks for p in chunk.parameters()]


def _same(a, b) -> bool:
    """Bit-exact equality of nested tensors (weights, optimizer state dicts)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _poisoned(batch, rows):
    """The batch with NaN advantages in `rows`: what a NaN reward gives the loss."""
    bad = copy.copy(batch)
    bad.advantages = batch.advantages.clone()
    bad.advantages[rows] = float("nan")
    return bad


# ------------------------------------------------------------------------------------------------- numerics guard
def _nan_steps(path, batch):
    """TP 2. A poisoned batch (every rank's loss is NaN), then a NaN put into one TP-sharded gradient of rank 1 alone
    (rank 0's loss and gradients stay finite: only the guard's reduction can stop rank 0 from stepping)."""
    import torch.distributed as dist

    from megarl.errors import UserError
    from megarl.losses import prepare_global_batch, train_step
    from megarl.trainer import step as phases
    from megarl.trainer.numerics import SkippedSteps
    from megarl.trainer.setup import make_optimizer, wrap_ddp

    _, bridge, chunks = ranks.build(path, tp=2)
    pg = bridge.pg
    model = wrap_ddp(chunks, pg=pg)
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, "constant", 10, pg=pg)
    def step(b):
        return train_step(model, optimizer, prepare_global_batch(b, CFG.aggregation, CFG.norm_length, pg=pg), 2, CFG,
                          bridge.vocab_size, pg=pg)

    state = lambda: (_weights(chunks), copy.deepcopy(optimizer.state_dict()))  # noqa: E731
    out, skips = {"skipped": [], "unchanged": [], "error": None}, SkippedSteps(2)

    def counted(b):
        metrics = step(b)
        out["skipped"].append(metrics["skipped_updates"])
        skips.count(metrics, f"call {len(out['skipped'])}")
        return metrics

    step(batch)  # Adam's moments exist
    before = state()
    out["nan_loss"] = counted(_poisoned(batch, 0))["loss"]
    out["unchanged"].append(_same(before, state()))
    counted(batch)  # a finite step trains again, and ends the run of skips
    out["trained"] = not _same(before[0], _weights(chunks)) and all(torch.isfinite(w).all() for w in _weights(chunks))
    before = state()
    weight = next(p for p in chunks[0].parameters() if getattr(p, "tensor_model_parallel", False))
    hook = weight.register_hook(lambda g: torch.full_like(g, float("nan"))) if dist.get_rank() == 1 else None
    counted(batch)
    out["local_grads_finite"] = all(bool(torch.isfinite(b.grad_data).all()) for b in model[0].buffers)
    out["unchanged"].append(_same(before, state()))
    try:
        counted(batch)  # the second skip in a row: the run stops
    except UserError as e:
        out["error"] = (type(e).__name__, str(e))
    out["unchanged"].append(_same(before, state()))
    if hook is not None:
        hook.remove()

    # an RL step's updates (rl.mini_batches=2), its second mini-batch poisoned: one of its two updates is skipped,
    # the step's metrics count it, and a limit of 1 stops at it, naming the step and the mini-batch
    rl = types.SimpleNamespace(ppo_epochs=1, mini_batches=2, log_update_sparsity=False)
    policy = types.SimpleNamespace(chunks=chunks, model=model, optimizer=optimizer, scheduler=scheduler)
    rank_batch = types.SimpleNamespace(batch=_poisoned(batch, slice(4, 8)), num_microbatches=2)
    update = lambda limit: phases.update(policy, None, rank_batch, CFG, rl, bridge.vocab_size, pg, seed=0,  # noqa: E731
                                         old_entropy=None, skips=SkippedSteps(limit), step=7)
    before = _weights(chunks)
    out["rl_skipped"] = update(2)["skipped_updates"]
    out["rl_trained"] = not _same(before, _weights(chunks)) and all(torch.isfinite(w).all() for w in _weights(chunks))
    try:
        update(1)
    except UserError as e:
        out["rl_error"] = str(e)
    return out


def test_a_non_finite_step_is_skipped_on_every_rank_and_a_run_of_them_stops():
    path = tiny_model_dir("llama")
    results = run_ranks(2, _nan_steps, path, rl_token_batch(path))
    for rank, out in enumerate(results):
        assert out["skipped"] == [1.0, 0.0, 1.0, 1.0], rank
        assert out["unchanged"] == [True, True, True], rank  # weights and Adam state bit-exact after each skip
        assert out["trained"] and out["nan_loss"] != out["nan_loss"], rank  # finite steps train; the NaN is logged
        assert out["rl_skipped"] == 1.0 and out["rl_trained"], rank
        assert "RL step 7, epoch 1, mini-batch 2" in out["rl_error"], rank
    # rank 0 saw nothing wrong itself: it skipped because rank 1's gradient was NaN
    assert [out["local_grads_finite"] for out in results] == [True, False]
    (kind0, message), (kind1, message1) = (out["error"] for out in results)
    assert (kind0, kind1) == ("NonFiniteTraining", "RemoteUserError") and message1 == message  # rank 0 says it
    assert "\n" not in message and message.startswith("rl.max_skipped_steps=2: 2 optimizer steps in a row")
    assert "call 4" in message and "Fix:" in message


# ------------------------------------------------------------------------------------------------------------ disk
def _trained(layout: dict):
    from megarl.trainer.setup import make_optimizer, wrap_ddp

    _, bridge, chunks = ranks.build(tiny_model_dir("qwen2"), **layout)
    model = wrap_ddp(chunks, pg=bridge.pg)
    optimizer, scheduler = make_optimizer(model, 1e-3, 0.0, 0, "constant", 10, pg=bridge.pg)
    optimizer.zero_grad()
    ranks.forward_backward(bridge, model, micro_batches=1)
    optimizer.step()  # Adam state exists, as in any real checkpoint
    return chunks, optimizer, scheduler


def _disk_full(ckpt_root):
    """TP 2: step 1 is saved; while step 2 is written, rank 1's disk is full (its fsync fails, as a full disk's
    does); then a disk known to be too small; then the previous checkpoint is loaded back and saving works again."""
    import shutil

    import torch.distributed as dist

    from megarl.errors import UserError
    from megarl.trainer import checkpoint as ck

    chunks, optimizer, scheduler = _trained({"tp": 2})
    save = lambda step: ck.save_checkpoint(ckpt_root, step, chunks, optimizer, scheduler,  # noqa: E731
                                           {"data": {"position": step}})
    save(1)
    saved = _weights(chunks)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.add_(1.0)
    out = {}
    fsync, usage = os.fsync, shutil.disk_usage

    def full(fd):
        if ".tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fsync(fd)

    if dist.get_rank() == 1:
        os.fsync = full
    try:
        save(2)
    except UserError as e:
        out["full"] = (type(e).__name__, str(e))
    finally:
        os.fsync = fsync
    dist.barrier()  # rank 0 removes the temporary folder after every rank raised
    out["after_full"] = sorted(os.listdir(ckpt_root))
    shutil.disk_usage = lambda path: usage(path)._replace(free=1024)
    try:
        save(2)
    except UserError as e:
        out["small"] = (type(e).__name__, str(e))
    finally:
        shutil.disk_usage = usage
    dist.barrier()
    out["after_small"] = sorted(os.listdir(ckpt_root))
    out["state"] = ck.load_checkpoint(ck.latest_checkpoint(ckpt_root), chunks, optimizer, scheduler)
    out["restored"] = _same(saved, _weights(chunks))
    out["again"] = os.path.basename(save(2))
    return out


def test_a_checkpoint_that_cannot_be_written_leaves_the_previous_one_and_says_so_in_one_line(tmp_path):
    root = str(tmp_path / "ckpt")
    results = run_ranks(2, _disk_full, root)
    previous = os.path.join(root, "step_000001")
    for case in ("full", "small"):
        (kind0, message), (kind1, message1) = (out[case] for out in results)
        assert (kind0, kind1) == ("CheckpointWriteError", "RemoteUserError") and message1 == message, case
        assert "\n" not in message and message.startswith(f"checkpoint: cannot write {root}/step_000002"), case
        assert "needs about" in message and f"the previous checkpoint {previous} is intact" in message, case
    assert "No space left on device" in results[0]["small"][1] and "are free on that disk" in results[0]["small"][1]
    for out in results:  # the half-written folder is gone, `latest` still names step 1, which loads
        assert out["after_full"] == out["after_small"] == ["latest", "step_000001"]
        assert out["state"]["step"] == 1 and out["state"]["data"] == {"position": 1} and out["restored"]
        assert out["again"] == "step_000002"
    assert (tmp_path / "ckpt" / "latest").read_text() == "step_000002"


def _prune_flow(folder, cases):
    """Each case (steps saved in order, keep) in its own checkpoint folder: the listing after each save."""
    from megarl.trainer import checkpoint as ck

    chunks, optimizer, scheduler = _trained({})
    listings = []
    for i, (steps, keep) in enumerate(cases):
        root = os.path.join(folder, str(i))
        for step in steps:
            ck.save_checkpoint(root, step, chunks, optimizer, scheduler, {}, keep=keep)
            listings.append(sorted(os.listdir(root)))
    return listings


def test_old_checkpoints_are_pruned_by_keep_in_step_order(tmp_path):
    """Steps past 999999 have 7 digits: the order is the step's, not the name's (step_1000000 sorts before
    step_999998 as text)."""
    listings = run_ranks(1, _prune_flow, str(tmp_path), [([1, 2, 3, 4], 2), ([999998, 999999, 1000000], 2),
                                                         ([1, 2, 3], 0)])[0]
    assert listings[1] == ["latest", "step_000001", "step_000002"]
    assert listings[3] == ["latest", "step_000003", "step_000004"]
    assert listings[6] == ["latest", "step_1000000", "step_999999"]
    assert listings[9] == ["latest", "step_000001", "step_000002", "step_000003"]  # keep 0: every one
