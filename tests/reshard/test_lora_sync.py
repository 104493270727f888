"""Adapter-only weight sync (reshard.lora_sync=adapter, megarl.reshard.adapter): a LoRA trainer's adapters loaded into
a real SGLang CPU engine serving LoRA, against the trainer's log-probs and transformers + peft; the config refusals,
the server flags and the CPU shim SGLang's LoRA serving needs (megarl/compat/sglang_cpu/sitecustomize.py, patch 5)."""
import os
import subprocess
import sys
import zlib

import pytest
import torch

import ranks
from megarl.testing import run_ranks, tiny_model_dir
from megarl.testing.fixtures import early_engine

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(rank=4, alpha=8.0, target_modules=TARGETS)
FIXED = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]
# intermediate_size 176: SGLang's CPU engine zero-pads it to 192 (a multiple of 32), and so sizes its LoRA buffers of
# gate/up (B's rows) and down (A's columns); an adapter sent unpadded kills the engine's scheduler
SHAPE = {"intermediate_size": 176}


def _model() -> str:
    return tiny_model_dir("qwen2", **SHAPE)


# ------------------------------------------------------------------------------------------------- engine tests
# The tiny Qwen2 (intermediate 176) served with LoRA enabled as an adapter-sync run starts it (ServerConfig.lora_rank /
# lora_target_modules)
lora_engine = early_engine("qwen2", lora_rank=4, lora_target_modules=tuple(TARGETS), **SHAPE)


def _set_b(chunks, bridge, seed: int, scale: float = 0.1) -> None:
    """A non-zero B, drawn whole per layer (seeded by its canonical name) and sharded like the layer's weight, so TP
    replicas of a row-parallel B agree."""
    from megarl.compat import mbridge as mbridge_compat
    from megarl.models.lora import ADAPTER, adapted_layers

    tp, tp_rank = bridge.pg.tp.size(), bridge.pg.tp.rank()
    with torch.no_grad():
        for chunk, path, layer in adapted_layers(chunks):
            adapter = getattr(layer, ADAPTER)
            canonical = bridge.canonical_name(chunk, f"{path}.weight")
            g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{canonical}".encode()))
            full = scale * torch.randn(layer.output_size, adapter.B.shape[1], generator=g)
            if adapter.column:
                full = mbridge_compat.split_across_tp(bridge.mb, canonical, full, layer.weight, tp)[tp_rank]
            adapter.B.copy_(full)


def adapter_sync_and_compare(path: str, url: str, layout: dict, seed: int, folder: str) -> dict:
    """Two adapter syncs (two different B's) into the engine; after each, the engine's log-probs of its own samples
    and of FIXED through the adapter, the trainer's of the same tokens, and what the engine holds. The second adapter
    is exported as PEFT into `folder` (the transformers + peft reference)."""
    import torch.distributed as dist

    from megarl.models.lora import LoraConfig, apply_lora, export_peft
    from megarl.reshard import AdapterTransport, SyncConfig, WeightSync
    from megarl.rollout import EngineClient

    _, bridge, chunks = ranks.build(path, **layout)
    cfg = LoraConfig(**LORA)
    apply_lora(chunks, cfg)
    client = EngineClient(url)
    transport = AdapterTransport(client, cfg)
    sync = WeightSync(bridge, chunks, transport, client if dist.get_rank() == 0 else None, SyncConfig())
    full = torch.zeros(1, dtype=torch.float64)
    for _, tensor in bridge.export_hf_weights(chunks):  # what a merged (full) sync would push, fp32
        full += tensor.numel() * 4
    dist.all_reduce(full)
    out = {"full_bytes": int(full)}
    for i, version in enumerate((f"adapter-{seed}-1", f"adapter-{seed}-2")):
        _set_b(chunks, bridge, seed + i)
        stats = sync.sync(version, verify=True)
        result = {"stats": stats, "client_adapter": client.adapter}
        sequences = [None]
        if dist.get_rank() == 0:
            completions = client.generate([[5, 6, 7], [30, 31, 32]], {"max_new_tokens": 6, "temperature": 1.0,
                                                                       "ignore_eos": True})
            result["engine"] = [c.output_log_probs for c in completions]
            result["weight_versions"] = [c.weight_version for c in completions]
            result["fixed"] = client.prompt_log_probs(FIXED)
            result["base"] = EngineClient(url).prompt_log_probs(FIXED)  # a client naming no adapter: the base model
            result["loaded"] = transport.loaded()
            sequences = [[c.prompt_ids + c.output_ids for c in completions]]
        dist.broadcast_object_list(sequences, src=0)
        trainer = ranks.trainer_log_probs(bridge, chunks, sequences[0])
        result["trainer"] = [row[2:].tolist() for row in trainer]  # the 6 sampled tokens after a 3-token prompt
        result["trainer_fixed"] = ranks.trainer_log_probs(bridge, chunks, FIXED).tolist()
        out[i] = result
    export_peft(chunks, bridge, cfg, folder)
    sync.close()
    out["dist_rank"] = dist.get_rank()
    return out


def _peft_log_probs(path: str, folder: str) -> torch.Tensor:
    """transformers + peft: log p(FIXED[t] | FIXED[:t]) under the base model with the PEFT adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), folder).eval()
    ids = torch.tensor(FIXED)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits, -1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def _adapter_bytes(path: str) -> int:
    """rank x (in + out) fp32 numbers per adapted projection and layer, from the HF config, with intermediate_size
    as the CPU engine pads it (to a multiple of 32 at engine TP 1)."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    h, inter, r = c["hidden_size"], -(-c["intermediate_size"] // 32) * 32, LORA["rank"]
    head_dim = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, inter),
              "up_proj": (h, inter), "down_proj": (inter, h)}
    return 4 * c["num_hidden_layers"] * sum(r * (i + o) for i, o in shapes.values())


@pytest.mark.engine
@pytest.mark.parametrize("layout", [{}, {"tp": 2}], ids=["tp1", "tp2"])
def test_adapter_sync_gives_the_engine_the_trainers_log_probs(lora_engine, layout, tmp_path):
    """A trainer (TP1, TP2) with non-zero adapters on all seven projections syncs them into the LoRA engine twice:
    each time the engine's log-probs through the adapter equal the trainer's (on its own samples and on fixed
    sequences), the built-in probe verification passes, the pushed bytes are exactly the adapters' in the engine's
    padded layout, and the engine holds only the newest adapter. The engine equals transformers + peft on the
    exported adapter, and its base model (a request naming no adapter) is still the HF folder's."""
    path = _model()
    seed = 7 + len(layout)
    world = layout.get("tp", 1)
    folder = str(tmp_path / "peft")
    r = next(x for x in run_ranks(world, adapter_sync_and_compare, path, lora_engine.url, layout, seed, folder)
             if x["dist_rank"] == 0)
    expected_bytes = _adapter_bytes(path)
    for i in (0, 1):
        result, version = r[i], f"adapter-{seed}-{i + 1}"
        stats = result["stats"]
        assert stats["version"] == version and result["client_adapter"] == version
        assert stats["pushed_bytes"] == expected_bytes and stats["buckets"] == 1
        assert stats["verified_tensors"] == 0 and stats["probe_max_abs_diff"] < 1e-4
        assert result["loaded"] == [version]  # the previous adapter was unloaded
        assert result["weight_versions"] == [version] * 2  # completions say which adapter sampled them
        engine, trainer = torch.tensor(result["engine"]), torch.tensor(result["trainer"])
        assert engine.shape == trainer.shape == (2, 6)
        assert (engine - trainer).abs().max() < 1e-4
        fixed, trainer_fixed = torch.tensor(result["fixed"]), torch.tensor(result["trainer_fixed"])
        assert (fixed - trainer_fixed).abs().max() < 1e-4
        assert (fixed - torch.tensor(result["base"])).abs().max() > 1e-2  # the adapter changes the outputs
    assert (torch.tensor(r[0]["fixed"]) - torch.tensor(r[1]["fixed"])).abs().max() > 1e-2  # the 2nd sync changed it
    assert (torch.tensor(r[1]["fixed"]) - _peft_log_probs(path, folder)).abs().max() < 1e-4
    base = _hf_base_log_probs(path)
    assert (torch.tensor(r[1]["base"]) - base).abs().max() < 1e-4
    assert expected_bytes < r["full_bytes"] / 10, (expected_bytes, r["full_bytes"])
    print(f"adapter sync pushed {expected_bytes} B; a merged sync pushes {r['full_bytes']} B")


def _hf_base_log_probs(path: str) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(FIXED)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits, -1)
    return logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


# --------------------------------------------------------------------------------------------------- the CPU shim
_PIN = """
import torch
unpatched_pin = torch.Tensor.pin_memory
from sglang.srt.lora import layers  # through sitecustomize.py's import hook (first on PYTHONPATH)
from sglang.srt.lora.backend import torch_backend
# the two forms SGLang's LoRA code pins in (sglang/srt/lora/layers.py:145, backend/torch_backend.py:225), as the
# patched modules make them, then as they are without the patch
for module in (layers, torch_backend):
    module.torch.tensor([0, 64], dtype=torch.int32, device="cpu", pin_memory=True)
    module.torch.zeros(3, dtype=torch.int32).pin_memory()
print("pinned with the patch")
for call in (lambda: torch.tensor([0, 64], dtype=torch.int32, device="cpu", pin_memory=True),
             lambda: unpatched_pin(torch.zeros(3, dtype=torch.int32))):
    try:
        call()
        print("pinned without the patch")
    except RuntimeError as e:
        print("refused without the patch:", e)
"""


@pytest.mark.unit
def test_lora_modules_pin_memory_only_with_the_cpu_patch():
    """SGLang's LoRA modules pin host memory, which a CPU-only torch refuses: in the CPU server's environment (the
    stand-ins and sitecustomize.py first on PYTHONPATH) their pinning calls work with patch 5, and the same calls
    raise without it (the server would die building its LoRA layers; the LoRA engine test above is the run that
    needs it)."""
    from megarl.rollout.server import ServerConfig, server_command

    _, env = server_command(ServerConfig(model_path="/nowhere"), 1234, on_gpu=False)
    done = subprocess.run([sys.executable, "-c", _PIN], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "pinned with the patch"
    assert lines[1] == ("refused without the patch: pin_memory=True requires a CUDA or other accelerator backend; no "
                        "pinned memory allocator is available on this system.")
    assert lines[2] == "refused without the patch: Cannot access accelerator device when none is available."


# ------------------------------------------------------------------------------------------ server and config units
@pytest.mark.unit
def test_an_adapter_sync_run_starts_its_engines_with_lora_and_pools_without():
    from megarl.models.lora import LoraConfig
    from megarl.rollout.pools import pool_server_config
    from megarl.rollout.server import engine_server_config, server_command
    from megarl.trainer.config import PoolConfig, TrainConfig, fleet_spec

    cfg = TrainConfig(pools={"judge": PoolConfig(model="/judge")})
    cfg.model.lora = LoraConfig(rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    spec = fleet_spec(cfg)
    server = engine_server_config(spec, "/model")
    cmd, _ = server_command(server, 1234, on_gpu=False)
    at = cmd.index("--lora-target-modules")
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "8"
    assert cmd[at + 1:at + 5] == ["q_proj", "k_proj", "v_proj", "o_proj"] and cmd[at + 5].startswith("--")
    assert cmd[cmd.index("--lora-backend") + 1] == "torch_native"
    gpu, _ = server_command(server, 1234, on_gpu=True)
    assert "--enable-lora" in gpu and "--lora-backend" not in gpu  # SGLang's default (CUDA) backend on a GPU
    pool = pool_server_config(spec, "judge", cfg.pools["judge"])
    assert "--enable-lora" not in server_command(pool, 1234, on_gpu=False)[0]
    cfg.reshard.lora_sync = "merged"
    assert "--enable-lora" not in server_command(engine_server_config(fleet_spec(cfg), "/model"), 1, on_gpu=False)[0]
    cfg.model.lora = None
    assert "--enable-lora" not in server_command(engine_server_config(fleet_spec(cfg), "/model"), 1, on_gpu=False)[0]


def _config(**sections):
    from megarl.config import build
    from megarl.trainer.config import TrainConfig

    return build(TrainConfig, {"model": {"tiny": {}}, **sections}).validate()


LORA_SECTION = {"tiny": {}, "lora": {"rank": 4}}


MOE_LORA_SECTION = {"tiny": {"family": "qwen3_moe"},
                    "lora": {"rank": 4, "target_modules": ["q_proj", "k_proj", "v_proj", "experts.gate_up_proj",
                                                           "experts.down_proj"]}}
DISAGGREGATED = {"rollout": {"placement": "disaggregated", "engine": {"nodes": 1}},
                 "reshard": {"transport": "distributed"}}


@pytest.mark.unit
def test_lora_sync_defaults_to_adapter_for_a_lora_run_it_can_serve():
    from megarl.trainer.config import adapter_sync

    assert adapter_sync(_config(model=LORA_SECTION)).rank == 4
    assert adapter_sync(_config(model=LORA_SECTION, reshard={"lora_sync": "adapter"})).rank == 4
    assert adapter_sync(_config(model=LORA_SECTION, reshard={"lora_sync": "merged"})) is None
    assert adapter_sync(_config()) is None
    # unset, where the adapter sync cannot serve the run (an SFT checkpoint as model.load, expert adapters, engines on
    # other nodes): the merged sync, without a word from the user
    assert adapter_sync(_config(model={**LORA_SECTION, "load": "/ckpt"})) is None
    assert adapter_sync(_config(model=MOE_LORA_SECTION)) is None
    assert adapter_sync(_config(model=LORA_SECTION, **DISAGGREGATED)) is None


@pytest.mark.unit
@pytest.mark.parametrize("sections,message", [
    ({"reshard": {"lora_sync": "adapters"}}, "reshard.lora_sync"),
    ({"reshard": {"lora_sync": "merged"}}, "reshard.lora_sync=merged is set but model.lora is not"),
    ({"model": LORA_SECTION, **DISAGGREGATED, "reshard": {"transport": "distributed", "lora_sync": "adapter"}},
     "Fix: reshard.lora_sync=merged"),
    ({"model": {**LORA_SECTION, "load": "/ckpt"}, "reshard": {"lora_sync": "adapter"}}, "model.load=/ckpt"),
    ({"model": MOE_LORA_SECTION, "reshard": {"lora_sync": "adapter"}}, "adapt MoE experts"),
], ids=["bad-value", "without-lora", "disaggregated", "model-load", "experts"])
def test_lora_sync_refusals_are_one_line(sections, message):
    from megarl.config import ConfigError

    with pytest.raises(ConfigError) as info:
        _config(**sections)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.unit
def test_merged_lora_sync_and_disaggregated_engines_are_accepted():
    _config(model=LORA_SECTION, rollout=DISAGGREGATED["rollout"],
            reshard={"transport": "distributed", "lora_sync": "merged"})


@pytest.mark.unit
def test_adapters_are_zero_padded_like_the_engines_base_layers():
    """The CPU engine at TP 3 pads 4 query / 2 kv heads to 6 / 3 and intermediate 176 to 192 (engine_shapes): B's
    rows of q/k/v/gate/up and A's columns of o/down grow by zeros at the end; A of q and B of o are unchanged."""
    from types import SimpleNamespace

    from megarl.reshard.adapter import engine_layout
    from megarl.reshard.verify import engine_shapes

    hf = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, intermediate_size=176,
                         vocab_size=300)
    shapes = engine_shapes(hf, 3, cpu=True)
    prefix = "base_model.model.model.layers.1."
    cases = {"self_attn.q_proj.lora_B": ((64, 4), (96, 4)), "self_attn.k_proj.lora_B": ((32, 4), (48, 4)),
             "self_attn.q_proj.lora_A": ((4, 64), (4, 64)), "self_attn.o_proj.lora_A": ((4, 64), (4, 96)),
             "self_attn.o_proj.lora_B": ((64, 4), (64, 4)), "mlp.up_proj.lora_B": ((176, 4), (192, 4)),
             "mlp.down_proj.lora_A": ((4, 176), (4, 192)), "mlp.down_proj.lora_B": ((64, 4), (64, 4))}
    for name, (shape, padded) in cases.items():
        tensor = torch.randn(shape)
        out = engine_layout(f"{prefix}{name}.weight", tensor, shapes)
        assert tuple(out.shape) == padded, name
        assert torch.equal(out[:shape[0], :shape[1]], tensor), name
        assert not out[shape[0]:].any() and not out[:, shape[1]:].any(), name  # the padding is zeros


@pytest.mark.unit
def test_the_adapter_is_serialised_as_one_shared_storage():
    """one_buffer: every tensor keeps its value, shape and dtype as a view of one storage, so torch's multiprocessing
    pickler shares one file for the whole adapter (the engine rebuilds each tensor as a view of it)."""
    import pickle
    from multiprocessing.reduction import ForkingPickler

    from megarl.reshard.adapter import one_buffer

    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7, dtype=torch.float64), "c": torch.randn(2, 9).bfloat16()}
    out = one_buffer(tensors)
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
    assert len({t.untyped_storage().data_ptr() for t in out.values()}) == 1
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        back = pickle.loads(ForkingPickler.dumps(out))
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)
    assert len({t.untyped_storage().data_ptr() for t in back.values()}) == 1
    assert all(torch.equal(back[name], t) for name, t in tensors.items())
