"""Trainer building blocks: DP sharding and token batches, packed-row forward, checkpoint atomicity, prompt stream,
the seeded-sampling hash of the CPU SGLang stand-in."""
import os
import struct

import pytest
import torch

import ranks
from megarl.testing import run_ranks, tiny_model_dir
from megarl.trainer.batching import Sample, rank_batch, shard_groups, token_batch


def _samples(lengths_per_group):
    out = []
    for g, lengths in enumerate(lengths_per_group):
        for j, n in enumerate(lengths):
            out.append(Sample(group=g, prompt_index=g, prompt_ids=[1, 2, 3 + g], response_ids=list(range(10, 10 + n)),
                              rollout_log_probs=[-0.5 - j] * n, finish_reason="stop", reward=float(j % 2)))
    return out


@pytest.mark.unit
def test_shard_groups_whole_and_balanced():
    samples = _samples([[9, 9], [1, 1], [5, 5], [4, 4], [2, 2]])
    shares = shard_groups(torch.tensor([len(s.prompt_ids) + len(s.response_ids) for s in samples]),
                          torch.tensor([s.group for s in samples]), 2)
    assert sorted(i for s in shares for i in s) == list(range(len(samples)))
    for share in shares:  # a group never straddles ranks
        groups = {samples[i].group for i in share}
        assert all(samples[i].group in groups for i in share)
        assert sum(s.group in groups for s in samples) == len(share)
    tokens = [sum(len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in s) for s in shares]
    assert abs(tokens[0] - tokens[1]) <= 6


@pytest.mark.unit
def test_token_batch_uses_engine_ids_verbatim():
    samples = _samples([[3, 5]])
    samples[1].trained = False
    batch = token_batch(samples, rows=3, seq_len=10, pad_id=0)
    for row, s in enumerate(samples):
        n = len(s.prompt_ids) + len(s.response_ids)
        assert batch.input_ids[row, :n].tolist() == s.prompt_ids + s.response_ids
        assert batch.targets[row, :n - 1].tolist() == (s.prompt_ids + s.response_ids)[1:]
    # the response's tokens are trained at the positions that predict them; rollout log-probs sit there too
    assert batch.loss_mask[0].tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0]
    assert torch.allclose(batch.rollout_log_probs[0, 2:5], torch.full((3,), -0.5))
    assert batch.loss_mask[1].sum() == 0 and batch.loss_mask[2].sum() == 0  # untrained sample, padding row


@pytest.mark.unit
def test_rank_batch_rows_and_microbatches():
    samples = _samples([[6] * 4, [2] * 4, [3] * 4])
    rb = [rank_batch(samples, r, 2, 0, seq_multiple=2, max_tokens_per_microbatch=20, row_multiple=2)
          for r in range(2)]
    assert rb[0].batch.input_ids.shape == rb[1].batch.input_ids.shape
    rows, seq = rb[0].batch.input_ids.shape
    assert seq % 2 == 0 and rows % (rb[0].num_microbatches) == 0 and rb[0].num_microbatches % 2 == 0
    assert sorted(rb[0].sample_index + rb[1].sample_index) == list(range(12))


def _packed_vs_alone(path, layout):
    from megarl.models import causal_inputs

    _, bridge, chunks = ranks.build(path, **layout)
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(3, 300, (1, 6), generator=g), torch.randint(3, 300, (1, 8), generator=g)
    packed = torch.cat([a, b], dim=1)
    segments = torch.tensor([[1] * 6 + [2] * 8])
    with torch.no_grad():
        for c in chunks:
            c.eval()
        full = chunks[0](*causal_inputs(packed, segments))
        alone_a = chunks[0](*causal_inputs(torch.cat([a, torch.zeros(1, 2, dtype=torch.long)], 1)))
        alone_b = chunks[0](*causal_inputs(b))
    return full[:, :6], alone_a[:, :6], full[:, 6:], alone_b


@pytest.mark.multirank
@pytest.mark.parametrize("layout,world", [({}, 1), ({"tp": 2}, 2)], ids=["tp1", "tp2"])
def test_packed_rows_equal_separate_samples(layout, world):
    out = run_ranks(world, _packed_vs_alone, tiny_model_dir("qwen2"), layout)[0]
    assert (out[0] - out[1]).abs().max() < 1e-5
    assert (out[2] - out[3]).abs().max() < 1e-5


def _checkpoint_flow(ckpt_root):
    from megarl.trainer import checkpoint as ck
    from megarl.trainer.setup import make_optimizer, wrap_ddp

    _, bridge, chunks = ranks.build(tiny_model_dir("qwen2"))
    model = wrap_ddp(chunks, pg=bridge.pg)
    opt, sched = make_optimizer(model, 1e-3, 0.0, 0, "constant", 10, pg=bridge.pg)
    opt.zero_grad()
    ranks.forward_backward(bridge, model, micro_batches=1)
    opt.step()  # Adam state exists, as in any real checkpoint
    ck.save_checkpoint(ckpt_root, 1, chunks, opt, sched, {"data": {"epoch": 0, "position": 4}})
    weight = next(chunks[0].parameters())
    saved = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1.0)
    original = ck.publish_dir

    def crash(tmp, final):  # the process dies after writing everything, before the rename
        raise KeyboardInterrupt("killed")

    ck.publish_dir = crash
    try:
        ck.save_checkpoint(ckpt_root, 2, chunks, opt, sched, {})
    except KeyboardInterrupt:
        pass
    finally:
        ck.publish_dir = original
    latest = ck.latest_checkpoint(ckpt_root)
    state = ck.load_checkpoint(latest, chunks, opt, sched)
    return {"latest": os.path.basename(latest), "state": state, "listing": sorted(os.listdir(ckpt_root)),
            "restored": bool((weight.detach() == saved).all())}


@pytest.mark.multirank
def test_half_written_checkpoint_is_never_picked_up(tmp_path):
    out = run_ranks(1, _checkpoint_flow, str(tmp_path / "ckpt"))[0]
    assert out["latest"] == "step_000001" and out["state"]["step"] == 1
    assert out["state"]["data"] == {"epoch": 0, "position": 4} and out["restored"]
    assert any(name.startswith("step_000002.tmp-") for name in out["listing"])  # the crash's leftovers ...
    assert "step_000002" not in out["listing"]  # ... never become a checkpoint
    (tmp_path / "ckpt" / "latest").write_text("step_000002.tmp-1")
    from megarl.trainer.checkpoint import latest_checkpoint

    with pytest.raises(RuntimeError, match="not a complete checkpoint"):
        latest_checkpoint(str(tmp_path / "ckpt"))


@pytest.mark.unit
def test_prompt_stream_resumes_in_place():
    from megarl.data import PromptRecord
    from megarl.trainer.rollout import PromptStream

    records = [PromptRecord(i, [i], None, str(i)) for i in range(7)]
    a = PromptStream(records, seed=3)
    first = [r.index for r in a.take(10)]
    b = PromptStream(records, seed=3)
    b.take(4)
    c = PromptStream(records, seed=3)
    c.load(b.state())
    assert [r.index for r in c.take(6)] == first[4:]
    assert sorted(first[:7]) == list(range(7))  # an epoch is a permutation


def _murmur_reference(seed, pos, col):
    h = 0
    for k in struct.unpack("<IIII", struct.pack("<qII", seed, pos, col)):
        k = (k * 0xCC9E2D51) & 0xFFFFFFFF
        k = ((k << 15) | (k >> 17)) & 0xFFFFFFFF
        k = (k * 0x1B873593) & 0xFFFFFFFF
        h ^= k
        h = ((h << 13) | (h >> 19)) & 0xFFFFFFFF
        h = (h * 5 + 0xE6546B64) & 0xFFFFFFFF
    h ^= 16
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


@pytest.mark.unit
def test_cpu_seeded_sampling_hash_is_murmur3():
    import importlib.util

    from megarl.rollout.server import CPU_STANDINS

    spec = importlib.util.spec_from_file_location("sgl_kernel_standin", os.path.join(CPU_STANDINS, "sgl_kernel",
                                                                                      "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seeds = torch.tensor([5, -3, 2**62 + 11]).to(torch.uint64)
    hashed = module.murmur_hash32_cpu(seeds, torch.tensor([0, 7, 123]), torch.arange(5))
    for r, (seed, pos) in enumerate([(5, 0), (-3, 7), (2**62 + 11, 123)]):
        assert hashed[r].tolist() == [_murmur_reference(seed, pos, c) for c in range(5)]


def _critic_values(path, layout, head, steps):
    """Critic values at a layout with the value head set to `head`; then the value loss over `steps` critic updates
    towards fixed returns."""
    from megarl.algorithms import AlgorithmConfig
    from megarl.losses import TokenBatch, compute_values, prepare_global_batch, train_step
    from megarl.trainer.config import OptimConfig
    from megarl.trainer.setup import build_critic, wrap_ddp

    _, bridge, chunks = ranks.build(path, **layout)
    critic = build_critic(bridge, chunks, OptimConfig(), lr=1e-3, total_steps=steps)
    if critic.chunks[-1].post_process:
        with torch.no_grad():
            critic.chunks[-1].output_layer.weight.copy_(head[None])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 300, (4, 12), generator=g)
    mask = torch.zeros(4, 12)
    mask[:, 5:11] = 1
    batch = TokenBatch(input_ids=ids, targets=torch.roll(ids, -1, 1), loss_mask=mask)
    values = compute_values(critic.model, batch, 2, pg=bridge.pg)
    batch.old_values = values.detach().clone() if values is not None else torch.zeros_like(mask)
    batch.returns = torch.linspace(-1, 1, 12).expand(4, 12) * mask
    batch = prepare_global_batch(batch, seq_multiple=bridge.pg.tp.size())
    losses = [train_step(critic.model, critic.optimizer, batch, 2, AlgorithmConfig(value_clip=None), 1,
                         objective="value", pg=bridge.pg)["value_loss"] for _ in range(steps)]
    return {"values": values, "losses": losses}


@pytest.mark.multirank
@pytest.mark.parametrize("layout,world", [({"tp": 2}, 2), ({"pp": 2}, 2), ({"tp": 2, "pp": 2}, 4)],
                         ids=["tp2", "pp2", "tp2pp2"])
def test_critic_values_and_training_match_single_rank(layout, world):
    path = tiny_model_dir("qwen2")
    head = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 0.1
    tp1 = run_ranks(1, _critic_values, path, {}, head, 8)[0]
    tp2 = [r for r in run_ranks(world, _critic_values, path, layout, head, 8) if r["values"] is not None]
    assert tp1["values"].abs().max() > 1e-3 and tp2  # a real, non-zero value head
    for r in tp2:  # same values and the same training trajectory at every layout
        assert (r["values"] - tp1["values"]).abs().max() < 1e-5
        assert abs(r["losses"][-1] - tp1["losses"][-1]) < 1e-4 * max(1.0, abs(tp1["losses"][-1]))
    assert tp1["losses"][-1] < 0.5 * tp1["losses"][0]


def _stop_requests(run_dir):
    """Rank 1 alone is signalled; then rank 0 alone sees a STOP file: every rank must agree both times."""
    import signal

    import torch.distributed as dist

    from megarl.trainer.preemption import StopRequest

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stop = StopRequest(run_dir, rank)
    seen = [stop.requested()]  # nothing yet
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    seen.append(stop.requested())
    stop.signalled = None
    if rank == 0:
        open(os.path.join(run_dir, "STOP"), "w").close()
    dist.barrier()
    seen.append(stop.requested())
    stop.acknowledge(7)
    return seen


@pytest.mark.multirank
def test_stop_request_is_agreed_by_every_rank_and_leaves_a_marker(tmp_path):
    import json

    (tmp_path / "preempted.json").write_text("{}")  # a previous run's marker is cleared at start
    results = run_ranks(2, _stop_requests, str(tmp_path), timeout=60)
    assert results == [[False, True, True], [False, True, True]]
    marker = json.loads((tmp_path / "preempted.json").read_text())
    assert marker["step"] == 7 and marker["stop_file"] is True  # the last stop came from the file ...
    assert not (tmp_path / "STOP").exists()  # ... which is consumed
    assert not (tmp_path / "STOP").exists()


@pytest.mark.unit
@pytest.mark.parametrize("every", [0, 1, 3])
def test_verification_schedule_does_not_depend_on_where_the_run_resumed(every):
    from megarl.reshard.sync import SyncConfig, WeightSync

    def verified_steps(resume_step: int, last: int = 10) -> list:
        sync = WeightSync.__new__(WeightSync)  # the schedule only: no bridge, engine or transport
        sync.cfg, sync.count, out = SyncConfig(verify_every=every), 0, []
        for step in range(resume_step, last + 1):  # the process's first sync pushes the resumed step's weights
            if sync.due(step):
                out.append(step)
            sync.count += 1
        return out

    full = verified_steps(0)
    assert full[0] == 0 and len(full) == {0: 1, 1: 11, 3: 4}[every]
    for resume in range(1, 10):  # every resumed run verifies its first sync, then exactly the uninterrupted steps
        assert verified_steps(resume) == [resume] + [s for s in full if s > resume] if every else [resume]
