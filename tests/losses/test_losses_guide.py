"""docs/losses.md's loop runs as written: at TP=2 on 2 ranks (sequence parallelism on, a sequence length that is not
a multiple of TP) the loss goes down, the TP replicas of every replicated parameter stay bit-identical, and the
losses and weights equal a TP=1 run of the same code.

The code is the guide's own python blocks (after the `losses-guide` marker, up to the next level-2 heading), executed
in each forked rank with sys.argv = [script, model folder], as `torchrun ... rl_loop.py MODEL` would run it.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from megarl.testing import run_ranks, tiny_model_dir

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "losses.md"
MARKER = "<!-- losses-guide:"
STEPS = 6  # optimizer steps the guide runs (4 hand-written + 2 train_step)


def guide_code(text: str) -> str:
    """The python blocks after the marker up to the next "## " heading, at their own line numbers (tracebacks
    point into docs/losses.md)."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(MARKER)), None)
    if start is None:
        raise AssertionError(f"{GUIDE} has no {MARKER!r} marker before its runnable code")
    code, inside = [""] * len(lines), False
    for i in range(start + 1, len(lines)):
        line = lines[i]
        if not inside and line.startswith("## "):
            break
        if line.strip() == "```python":
            inside = True
        elif inside and line.strip() == "```":
            inside = False
        elif inside:
            code[i] = line
    return "\n".join(code)


def run_guide(code: str, model_path: str, reduce_tp_grads: bool = True) -> dict:
    """One rank: exec the guide; its losses, replicated parameters and HF-named weights afterwards.

    reduce_tp_grads=False removes finalize_model_grads' TP all-reduce of the sequence-parallel / replicated grads
    (what a loop without Megatron DDP + finalize_model_grads gets), to show the replica check can fail."""
    import importlib

    from megatron.core import parallel_state as ps

    if not reduce_tp_grads:  # this forked rank only (the package re-exports the function under the module's name)
        finalize = importlib.import_module("megatron.core.distributed.finalize_model_grads")
        finalize._allreduce_non_tensor_model_parallel_grads = lambda *args, **kwargs: None
    sys.argv = ["rl_loop.py", model_path]
    namespace = {"__name__": "__main__"}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    chunks, bridge = namespace["chunks"], namespace["bridge"]
    replicated = {name: p.detach().clone() for i, chunk in enumerate(chunks)
                  for name, p in chunk.named_parameters() if not getattr(p, "tensor_model_parallel", False)}
    return {"losses": [m["loss"] for m in namespace["history"]], "first": namespace["history"][0],
            "replicated": replicated,
            "sequence_parallel": bool(chunks[0].config.sequence_parallel), "seq": namespace["batch"].input_ids.shape[1],
            "tp_rank": ps.get_tensor_model_parallel_rank(), "weights": dict(bridge.export_hf_weights(chunks))}


@functools.cache
def _runs(world: int, reduce_tp_grads: bool = True):
    return run_ranks(world, run_guide, guide_code(GUIDE.read_text()), tiny_model_dir("qwen3"), reduce_tp_grads)


def _replica_mismatches(results) -> list[str]:
    first, second = (r["replicated"] for r in results)
    assert first.keys() == second.keys()
    return [name for name in first if not torch.equal(first[name], second[name])]


@pytest.mark.multirank
def test_guide_runs_at_tp2_replicas_stay_identical_and_loss_decreases():
    results = _runs(2)
    assert [r["tp_rank"] for r in results] == [0, 1]
    assert all(r["sequence_parallel"] for r in results)  # what megarl turns on at TP > 1
    assert results[0]["seq"] == 14  # the stand-in rollouts are 13 tokens long: padded to a multiple of TP
    names = results[0]["replicated"]
    assert any("layernorm" in n for n in names) and any("q_layernorm" in n for n in names), sorted(names)
    assert _replica_mismatches(results) == []
    losses = results[0]["losses"]
    assert len(losses) == STEPS and results[1]["losses"] == losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert losses[-1] < losses[0] - 0.1, losses
    # The old log-probs (compute_log_probs on the unpadded 13-token batch) are the first training forward's (padded
    # to 14) before any update: ratio 1 everywhere.
    first = results[0]["first"]
    assert abs(first["ppo_kl"]) < 1e-6 and abs(first["ratio_p5"] - 1) < 1e-5 and abs(first["ratio_p95"] - 1) < 1e-5


@pytest.mark.multirank
def test_guide_at_tp2_equals_tp1():
    (single,) = _runs(1)
    assert not single["sequence_parallel"] and single["seq"] == 13
    tp2 = _runs(2)
    for a, b in zip(single["losses"], tp2[0]["losses"]):
        assert abs(a - b) < 1e-6, (single["losses"], tp2[0]["losses"])
    from safetensors.torch import load_file

    before = load_file(f"{tiny_model_dir('qwen3')}/model.safetensors")
    weights = {k: v for r in tp2 for k, v in r["weights"].items()}
    assert weights.keys() == single["weights"].keys() == before.keys()
    for name, expected in single["weights"].items():
        update = (expected - before[name]).norm()
        assert update > 0, f"{name} did not train"
        # Adam's early steps are ~lr * sign(grad): float noise in near-zero gradients moves single entries by up to
        # ~2 lr, so the TP=2 update is compared with the TP=1 update as a whole (measured: within 2e-4 of it).
        assert (weights[name] - expected).norm() < 1e-3 * update, name


@pytest.mark.multirank
def test_replica_check_catches_missing_tp_grad_reduction():
    """The same loop without finalize_model_grads' TP reduction: the norms' replicas drift apart."""
    results = _runs(2, reduce_tp_grads=False)
    assert set(_replica_mismatches(results)) == set(results[0]["replicated"])


@pytest.mark.unit
def test_token_batch_checks_shapes_and_pads_inertly():
    import pytest

    from megarl.losses import TokenBatch

    ids = torch.arange(15).reshape(3, 5)
    with pytest.raises(ValueError, match=r"TokenBatch.advantages has shape \[3, 4\].*\[3, 5\]"):
        TokenBatch(ids, ids, torch.ones(3, 5), advantages=torch.ones(3, 4))
    routed = torch.randint(0, 8, (3, 5, 2, 2))
    batch = TokenBatch(ids, ids + 1, torch.ones(3, 5), advantages=torch.full((3, 5), 2.0), routed_experts=routed)
    assert batch.pad_to_multiple(5) is batch
    padded = batch.pad_to_multiple(4)
    assert padded.input_ids.shape == (3, 8) and padded.routed_experts.shape == (3, 8, 2, 2)
    assert torch.equal(padded.input_ids[:, :5], ids) and torch.equal(padded.targets[:, :5], ids + 1)
    assert padded.loss_mask[:, 5:].abs().sum() == 0 and padded.advantages[:, 5:].abs().sum() == 0
    assert torch.equal(padded.routed_experts[:, :5], routed)
    assert torch.equal(padded.routed_experts[:, 5:], routed[:, 4:5].expand(3, 3, 2, 2))  # a valid routing


def _train_step_on_bare_chunks(path: str) -> str:
    import ranks
    from megarl.algorithms import AlgorithmConfig
    from megarl.losses import TokenBatch, prepare_global_batch, train_step

    _, bridge, chunks = ranks.build(path)
    ids = torch.randint(3, 300, (2, 6))
    batch = prepare_global_batch(TokenBatch(ids, ids.roll(-1, 1), torch.ones(2, 6), advantages=torch.ones(2, 6),
                                            old_log_probs=torch.zeros(2, 6)))
    try:
        train_step(chunks, None, batch, 1, AlgorithmConfig(), bridge.vocab_size, pg=bridge.pg)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.multirank
def test_train_step_refuses_a_model_without_megatron_ddp():
    (message,) = run_ranks(1, _train_step_on_bare_chunks, tiny_model_dir("qwen3"))
    assert "finalize_model_grads_func" in message and "wrap_ddp" in message, message
