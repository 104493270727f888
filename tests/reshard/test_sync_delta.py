"""Delta weight sync (reshard.mode=delta): the encoding against the trainer's shadow and the engine-side patching
(pure), and against a real bf16 SGLang CPU engine (tiny Qwen3-MoE) over several steps, at several trainer layouts
and both bucketed transports: after every delta
sync the engine's tensors are bit-identical to a full sync's (SGLang's checksums of every tensor on every engine TP
rank equal the trainer's engine-dtype tensors), a sync after another writer replaced the engine's weights (what a
restarted engine looks like) or in a new process (a resume) is full, and a corrupted delta is caught by the
verification, which then sends every tensor whole."""
import pytest
import torch

import ranks
from megarl.reshard.delta import DELTA, DeltaEncoder, apply_delta, changed_elements, sparse_payload
from megarl.testing import run_ranks, tiny_model_dir
from megarl.testing.fixtures import early_engine


# ------------------------------------------------------------------------------------------------------- pure
@pytest.mark.unit
def test_encoded_steps_rebuild_the_tensors_bit_for_bit():
    """Random steps of several sizes: the engine side's patched tensors equal the trainer's after each, in bits;
    few changes go sparse, many whole, none not at all."""
    g = torch.Generator().manual_seed(0)
    weights = {"a": torch.randn(64, 32, generator=g), "b": torch.randn(1000, generator=g), "c": torch.randn(7, 3)}
    encoder, engine = DeltaEncoder(), {}
    for step, scale in enumerate([0.0, 1e-4, 1e-2, 0.0, 1e-3]):
        for name, w in weights.items():
            w.add_(scale * torch.randn(w.shape, generator=g))
        sent = list(encoder.encode((n, w.to(torch.bfloat16)) for n, w in weights.items()))
        loaded = dict(apply_delta(engine, sent))
        for name, w in weights.items():
            assert torch.equal(engine[name].view(torch.int16), w.to(torch.bfloat16).view(torch.int16)), (step, name)
        stats = encoder.take_stats()
        names = [n for n, _ in sent]
        if step == 0:
            assert names == ["a", "b", "c"] and stats["dense"] == 3  # nothing sent yet: whole
        elif scale == 0.0:
            assert names == [] and loaded == {} and stats["unchanged"] == 3
        elif scale == 1e-4:  # a few bf16 values move: indices + values
            assert "a" + DELTA in names and 0 < stats["changed"] < 0.2 * stats["elements"]
        elif scale == 1e-2:  # most move: whole tensors are smaller
            assert "a" in names and "b" in names and stats["sparse"] == 0
    encoder.reset()
    assert [n for n, _ in encoder.encode((n, w.to(torch.bfloat16)) for n, w in weights.items())] == ["a", "b", "c"]


@pytest.mark.unit
def test_bits_not_values_decide_what_changed():
    new, old = torch.tensor([0.0, -0.0, 1.0, float("nan")]), torch.tensor([-0.0, -0.0, 1.0, float("nan")])
    assert changed_elements(new, old).tolist() == [0]  # -0.0 vs 0.0 differ in bits; the same NaN does not


@pytest.mark.unit
def test_a_delta_without_a_base_is_refused():
    with pytest.raises(KeyError, match="never sent whole"):
        apply_delta({}, [("w" + DELTA, sparse_payload(torch.tensor([0]), torch.tensor([1.0]), 4))])


@pytest.mark.unit
def test_delta_mode_config_rules(tmp_path):
    from megarl.config import ConfigError
    from megarl.trainer import load_train_config
    from megarl.trainer.config import fleet_spec
    from megarl.rollout.server import engine_server_config, server_command

    with pytest.raises(ConfigError, match="reshard.transport=disk makes the engine reload a whole folder"):
        load_train_config(None, [f"run_dir={tmp_path}", "model.path=x", "reshard.mode=delta", "reshard.transport=disk"])
    with pytest.raises(ConfigError, match="reshard.mode"):
        load_train_config(None, [f"run_dir={tmp_path}", "model.path=x", "reshard.mode=sparse"])
    cfg = load_train_config(None, [f"run_dir={tmp_path}", "model.path=x", "reshard.mode=delta"])
    cmd, _ = server_command(engine_server_config(fleet_spec(cfg), "x"), 1, on_gpu=True)
    assert cmd[cmd.index("--custom-weight-loader") + 1] == "megarl.compat.sglang.load_weight_delta"


# --------------------------------------------------------------------------------------------- real engine
def _bf16_server(_, log_dir):
    from megarl.rollout import ServerConfig

    return ServerConfig(model_path=tiny_model_dir("qwen3_moe"), log_dir=log_dir, dtype="bfloat16", delta_sync=True)


# a bf16 engine with megarl's delta loader, of the tiny Qwen3-MoE: attention and dense layers for the TP/PP layouts,
# routed experts (and the fp32 router) for EP
engine = early_engine(server=_bf16_server)


def delta_run(path, url, layout, steps, corrupt_at, transport="tensor"):
    """RL-like steps (every weight moves a little) with a delta sync after each, verified every time; then another
    writer replaces the engine's weights, and a new WeightSync (a resumed process) syncs."""
    import torch.distributed as dist

    from megarl.reshard import SyncConfig, WeightSync, resolve_transport
    from megarl.reshard.delta import DELTA
    from megarl.rollout import EngineClient

    _, bridge, chunks = ranks.build(path, **layout)
    client = EngineClient(url)
    kind, transport = transport, resolve_transport(transport)(client)
    push = transport.push
    corrupted = []

    def corrupting_push(bucket, version):  # flips an exponent bit of the first value of one delta at `corrupt_at`
        if sync.count == corrupt_at and not corrupted:
            deltas = [m for m in bucket.metadata if m.name.endswith(DELTA)]
            if deltas:
                payload = bucket.tensor(deltas[0].name).view(-1)  # count (int64), int32 indices, bf16 values
                high_byte = 8 + 4 * int(payload[:8].clone().view(torch.int64)) + 1
                payload[high_byte:high_byte + 1].bitwise_xor_(torch.tensor([64], dtype=torch.uint8))
                corrupted.append(deltas[0].name)
        push(bucket, version)

    transport.push = corrupting_push
    config = SyncConfig(bucket_bytes=256 << 10, engine_dtype=torch.bfloat16, mode="delta", full_every=0,
                        probe_atol=0.5)  # bf16 engine vs fp32 trainer log-probs; the checksums stay exact
    sync = WeightSync(bridge, chunks, transport, client if dist.get_rank() == 0 else None, config)
    g = torch.Generator().manual_seed(7)
    stats = []
    for step in range(steps):
        with torch.no_grad():
            for c in chunks:
                for p in c.parameters():
                    p.add_(2e-5 * torch.randn(p.shape, generator=g))
        stats.append(sync.sync(f"step-{step}", verify=True))
    if dist.get_rank() == 0:  # another writer: the engine now serves other weights under SGLang's default version
        client.call("/update_weights_from_disk", {"model_path": path, "weight_version": "default"})
    dist.barrier()
    stats.append(sync.sync("after-restart", verify=True))
    sync.close()
    resumed = WeightSync(bridge, chunks, resolve_transport(kind)(client), client if dist.get_rank() == 0 else None,
                         config)
    stats.append(resumed.sync("resumed", verify=True))
    resumed.close()
    return {"stats": stats, "corrupted": corrupted}


# layout -> (world, parallel sizes, transport)
# ep2: each rank owns half the experts, the engine all of them: the experts' deltas land in SGLang's fused expert
# tensors, checksummed expert by expert
LAYOUTS = {"tp1": (1, {}, "tensor"), "tp2": (2, {"tp": 2}, "tensor"), "pp2": (2, {"pp": 2}, "tensor"),
           "ep2": (2, {"ep": 2}, "tensor"), "tp2-distributed": (2, {"tp": 2}, "distributed")}


@pytest.mark.engine
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_delta_syncs_leave_the_engine_bit_identical_to_full_ones(engine, layout):
    world, parallel, transport = LAYOUTS[layout]
    check_delta_run(run_ranks(world, delta_run, tiny_model_dir("qwen3_moe"), engine.url, parallel, 4, 2, transport,
                              timeout=600))


def check_delta_run(results: list) -> None:
    """delta_run with the third sync (a delta) corrupted on its way: full, delta, (caught: full), delta, then the
    syncs after another writer and in a new process, full."""
    stats = results[0]["stats"]
    assert [s["full_sync"] for s in stats] == [1.0, 0.0, 1.0, 0.0, 1.0, 1.0], [s["full_sync"] for s in stats]
    # the sync after another writer found the engine not holding this process's last version: restored, verified
    assert [s["restored"] for s in stats] == [0.0, 0.0, 0.0, 0.0, 1.0, 0.0], [s["restored"] for s in stats]
    for s in stats:  # every sync verified: each engine tensor's checksum equals the trainer's engine-dtype tensor
        assert s["verified_tensors"] > 20 and s["probe_max_abs_diff"] < 0.5
    full_bytes = stats[0]["pushed_bytes"]
    for delta in (stats[1], stats[3]):
        assert 0 < delta["changed_frac"] < 0.2, delta["changed_frac"]
        assert delta["sparse_tensors"] > 0 and delta["pushed_bytes"] < 0.5 * full_bytes, (delta, full_bytes)
    assert any(r["corrupted"] for r in results)  # the corruption happened, was caught, and a full sync repaired it
    assert stats[2]["pushed_bytes"] >= 0.9 * full_bytes
    assert stats[0]["shadow_bytes"] == pytest.approx(full_bytes, rel=0.05)  # the shadow: the model in bf16


@pytest.mark.engine
def test_an_engine_without_the_delta_loader_is_one_line(tiny_qwen2_engine):
    """An engine not started with megarl's custom weight loader (e.g. one given by rollout.engine.urls) is refused
    before anything is sent to it: SGLang's scheduler would die on the unknown load format."""
    from megarl.rollout import EngineClient, EngineError

    with pytest.raises(EngineError, match="was not started with --custom-weight-loader "
                                          "megarl.compat.sglang.load_weight_delta. Fix: "):
        EngineClient(tiny_qwen2_engine.url).enable_delta_loads()
    assert EngineClient(tiny_qwen2_engine.url).health()
