"""LoRA adapters (megarl.models.lora): TP/PP/EP layouts against TP1 (MoE: routed-expert adapters too), frozen base,
no-op init, adapters_disabled, PEFT export read by transformers + peft (MoE experts: target_parameters), load_peft,
and the one-line refusals."""
import functools
import math
import types
import zlib

import pytest
import torch

import ranks
from megarl.testing import run_ranks, tiny_model_dir

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(rank=4, alpha=8.0, target_modules=ALL)


def _set_nonzero_b(chunks, bridge, scale=0.1):
    """B drawn whole per layer (seeded by its canonical name, so every layout draws the same matrix) and sharded like
    the layer's weight: the adapter then changes the outputs."""
    from megarl.compat import mbridge as mbridge_compat
    from megarl.models.lora import ADAPTER, adapted_layers

    with torch.no_grad():
        for chunk, path, layer in adapted_layers(chunks):
            adapter = getattr(layer, ADAPTER)
            tp, tp_rank = adapter.group.size(), adapter.group.rank()  # an expert's: expert TP
            canonical = bridge.canonical_name(chunk, f"{path}.weight")
            g = torch.Generator().manual_seed(zlib.crc32(canonical.encode()))
            full = scale * torch.randn(layer.output_size, adapter.B.shape[1], generator=g)
            if adapter.column:
                full = mbridge_compat.split_across_tp(bridge.mb, canonical, full, layer.weight, tp)[tp_rank]
            adapter.B.copy_(full)


def _logits(bridge, chunks):
    from megarl.models import forward_logits

    return forward_logits(chunks, ranks.input_batches(), vocab_size=bridge.vocab_size, pg=bridge.pg)


def lora_layout(path: str, layout: dict, lora: dict = LORA) -> dict:
    """Base logits, LoRA logits at init (B = 0), with a non-zero B, under adapters_disabled; full adapter gradients of
    the next-token loss; which parameters an Adam step changed."""
    from megarl.models.lora import LoraConfig, adapted_layers, adapters_disabled, apply_lora, full_adapters
    from megarl.trainer.setup import make_optimizer, wrap_ddp

    _, bridge, chunks = ranks.build(path, **layout)
    out = {"base": _logits(bridge, chunks)}
    apply_lora(chunks, LoraConfig(**lora))
    out["init"] = _logits(bridge, chunks)
    _set_nonzero_b(chunks, bridge)
    out["lora"] = _logits(bridge, chunks)
    with adapters_disabled(chunks):
        out["disabled"] = _logits(bridge, chunks)
    out["after_disabled"] = _logits(bridge, chunks)
    try:
        with adapters_disabled(chunks):
            raise KeyError("inside the block")
    except KeyError:
        pass
    out["after_error"] = _logits(bridge, chunks)
    # chunk index + local name: with VPP two chunks of a rank share local names
    named = [(f"{i}:{n}", p) for i, c in enumerate(chunks) for n, p in c.named_parameters()]
    out["trainable"] = sorted(n for n, p in named if p.requires_grad)
    # megatron-core's expert-parallel mark, adapter vs its layer's weight (DDP reduces allreduce=False over expert DP)
    out["allreduce"] = {n: (getattr(p, "allreduce", True), getattr(layer.weight, "allreduce", True))
                        for i, c in enumerate(chunks) for _, path, layer in adapted_layers([c])
                        for n, p in ((f"{i}:{path}.A", layer.lora_adapter.A), (f"{i}:{path}.B", layer.lora_adapter.B))}
    model = wrap_ddp(chunks, pg=bridge.pg)
    optimizer, _ = make_optimizer(model, 1e-2, 0.0, 0, "constant", 10, pg=bridge.pg)
    optimizer.zero_grad()
    # 4 micro-batches: at pp2 x vpp2, 2 hang in the interleaved schedule (with or without adapters)
    out["losses"] = ranks.forward_backward(bridge, model, micro_batches=4)
    out["grads"] = {f"{c}.{x}": g for c, _, a, b in full_adapters(chunks, bridge, grads=True)
                    for x, g in (("A", a), ("B", b))}
    before = {n: p.detach().clone() for n, p in named}
    updated, _, _ = optimizer.step()
    assert updated
    out["changed"] = sorted(n for n, p in named if not torch.equal(p, before[n]))
    out["all_params"] = sorted(before)
    return out


# tp2: sequence parallelism on (mbridge's default at tp > 1); tp2nosp: the replicated-activation path
LAYOUTS = {"tp1": ({}, 1), "tp2": ({"tp": 2}, 2), "tp2nosp": ({"tp": 2, "sequence_parallel": False}, 2),
           "pp2": ({"pp": 2}, 2), "pp2vpp2": ({"pp": 2, "vpp": 2}, 2), "tp2pp2": ({"tp": 2, "pp": 2}, 4)}


ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]  # every routed expert's linear_fc1 / linear_fc2
MOE_LORA = dict(LORA, target_modules=ATTENTION + EXPERTS)
# tp2: expert TP 2 (etp defaults to tp); ep2: expert parallel with expert TP 1; tp2ep2: both (4 ranks, dp 2)
MOE_LAYOUTS = {"tp1": ({}, 1), "tp2": ({"tp": 2}, 2), "ep2": ({"ep": 2}, 2), "pp2": ({"pp": 2}, 2),
               "tp2ep2": ({"tp": 2, "ep": 2}, 4)}


@functools.cache
def _run(family, name):
    layout, world = (MOE_LAYOUTS if family == "qwen3_moe" else LAYOUTS)[name]
    return run_ranks(world, lora_layout, tiny_model_dir(family), layout,
                     MOE_LORA if family == "qwen3_moe" else LORA)


def _last_stage(results, key):
    values = [r[key] for r in results if r[key] is not None]
    assert values
    return values[0]


def _max_diff(a, b):
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@pytest.mark.multirank
@pytest.mark.parametrize("family,name", [(f, n) for f in ("qwen2", "qwen3") for n in LAYOUTS]
                         + [("qwen3_moe", n) for n in MOE_LAYOUTS])  # MoE: attention + routed-expert adapters
def test_lora_layout(family, name):
    results = _run(family, name)
    if family == "qwen3_moe":  # an adapter on each of the 4 experts' fc1 and fc2 in each of the 4 layers
        experts = {k for r in results for k in r["grads"] if ".mlp.experts." in k}
        assert len(experts) == 4 * 4 * 2 * 2, sorted(experts)
        for r in results:
            marks = r["allreduce"]
            assert all(adapter == weight for adapter, weight in marks.values())
            expert_marks = {mark for n, (mark, _) in marks.items() if ".local_experts." in n}
            assert expert_marks == ({False} if "ep2" in name else {True})  # EP: reduced over expert DP
            assert {mark for n, (mark, _) in marks.items() if ".local_experts." not in n} == {True}
    base, init, lora = (_last_stage(results, k) for k in ("base", "init", "lora"))
    # B = 0 at init: the adapted model is the base model, exactly
    assert _max_diff(init, base) == 0.0
    # a non-zero B matters, adapters_disabled gives the base back and re-enables on exit
    assert _max_diff(lora, base) > 1e-2
    assert _max_diff(_last_stage(results, "disabled"), base) == 0.0
    assert _max_diff(_last_stage(results, "after_disabled"), lora) == 0.0
    assert _max_diff(_last_stage(results, "after_error"), lora) == 0.0  # re-enabled when the block raises
    # only adapter parameters train, and the optimizer step changes exactly those
    for r in results:
        adapters = sorted(n for n in r["all_params"] if ".lora_adapter." in n)
        assert adapters and r["trainable"] == adapters
        assert r["changed"] == adapters
    if name == "tp1":
        return
    (reference,) = _run(family, "tp1")
    assert _max_diff(lora, reference["lora"]) < 1e-5
    grads = {k: v for r in results for k, v in r["grads"].items()}
    assert sorted(grads) == sorted(reference["grads"])
    for key, ref in reference["grads"].items():
        assert ref.abs().max() > 0, f"reference grad of {key} is zero: the check would be vacuous"
        assert (grads[key] - ref).abs().max().item() < 1e-5, key
    losses = next(r["losses"] for r in results if r["losses"])
    assert torch.allclose(torch.stack(losses), torch.stack(reference["losses"]), atol=1e-5)


def lora_export(path: str, layout: dict, folder: str, lora: dict = LORA) -> dict:
    """Export a trained-looking adapter as PEFT, read it back into fresh adapters (load_peft); logits of both, and
    the merged HF weights export_hf_weights gives (what the rollout engine receives)."""
    from megarl.models.lora import LoraConfig, apply_lora, export_peft, load_peft, read_peft_config

    cfg = LoraConfig(**lora)
    _, bridge, chunks = ranks.build(path, **layout)
    apply_lora(chunks, cfg)
    _set_nonzero_b(chunks, bridge)
    with torch.no_grad():  # A away from its init too, so load_peft must really copy it
        for c in chunks:
            for n, p in c.named_parameters():
                if n.endswith(".lora_adapter.A"):
                    p.mul_(1.5)
    export_peft(chunks, bridge, cfg, folder)
    out = {"logits": _logits(bridge, chunks), "merged": dict(bridge.export_hf_weights(chunks))}
    fresh = bridge.build()
    bridge.load_hf_weights(fresh)
    apply_lora(fresh, read_peft_config(folder))
    load_peft(folder, fresh, bridge, cfg)
    out["reloaded"] = _logits(bridge, fresh)
    return out


@functools.cache
def _hf_peft(path, folder):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()
    with torch.no_grad():
        logits = [model(batch).logits for batch in ranks.input_batches()]
    merged = {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}
    return logits, merged


@pytest.mark.multirank
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_peft_export_matches_transformers_peft(family, tmp_path):
    from safetensors.torch import load_file

    path, folder = tiny_model_dir(family), str(tmp_path / "adapter")
    results = run_ranks(2, lora_export, path, {"tp": 2}, folder)
    keys = sorted(load_file(f"{folder}/adapter_model.safetensors"))
    # unfused: one lora_A / lora_B per HF projection and layer (4 layers x 7 projections)
    assert len(keys) == 4 * 7 * 2 and "base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight" in keys
    ref_logits, ref_merged = _hf_peft(path, folder)
    ours = results[0]["logits"]
    assert ref_logits[0].abs().max() > 1.0
    assert _max_diff(ours, ref_logits) < 1e-4
    assert _max_diff(results[0]["reloaded"], ours) == 0.0  # load_peft restores the exported adapter exactly
    merged = {k: v for r in results for k, v in r["merged"].items()}
    base = load_file(f"{path}/model.safetensors")
    assert sorted(merged) == sorted(base)  # no adapter tensor leaks into the HF export
    assert (merged["model.layers.0.self_attn.k_proj.weight"] - base["model.layers.0.self_attn.k_proj.weight"]
            ).abs().max() > 1e-3  # the export is merged
    for key, tensor in merged.items():  # the merged weights the engine gets are PEFT's merge_and_unload
        assert (tensor - ref_merged[key]).abs().max().item() < 1e-5, key


def _experts_per_expert(hf: dict) -> dict:
    """transformers' fused expert tensors (mlp.experts.gate_up_proj [experts, 2 * ffn, hidden], down_proj) under the
    per-expert HF checkpoint names the bridge exports."""
    out = {}
    for key, t in hf.items():
        if key.endswith(".mlp.experts.gate_up_proj"):
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2)
                out[f"{key[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate
                out[f"{key[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up
        elif key.endswith(".mlp.experts.down_proj"):
            for e in range(t.shape[0]):
                out[f"{key[:-len('down_proj')]}{e}.down_proj.weight"] = t[e]
        else:
            out[key] = t
    return out


@pytest.mark.multirank
def test_moe_expert_peft_export_matches_transformers_peft(tmp_path):
    """Routed-expert adapters exported at TP2xEP2 (expert TP 2) in PEFT's target_parameters format: transformers + peft
    compute the same logits and merge the same weights, and load_peft reads the folder back exactly."""
    import json

    from safetensors.torch import load_file

    path, folder = tiny_model_dir("qwen3_moe"), str(tmp_path / "adapter")
    results = run_ranks(4, lora_export, path, {"tp": 2, "ep": 2}, folder, MOE_LORA)
    with open(f"{folder}/adapter_config.json") as f:
        config = json.load(f)
    assert sorted(config["target_modules"]) == sorted(ATTENTION) and sorted(config["target_parameters"]) == sorted(
        EXPERTS)
    tensors = load_file(f"{folder}/adapter_model.safetensors")
    # attention: lora_A / lora_B per projection; experts: one pair per expert tensor holding all 4 experts
    assert len(tensors) == 4 * (4 + 2) * 2
    prefix = "base_model.model.model.layers.0.mlp.experts"
    assert tensors[f"{prefix}.base_layer.lora_A.weight"].shape == (4 * 4, 64)  # gate_up_proj: [rank*experts, hidden]
    assert tensors[f"{prefix}.base_layer.lora_B.weight"].shape == (2 * 32, 4 * 4)
    assert tensors[f"{prefix}.lora_A.weight"].shape == (4 * 4, 32)  # down_proj (the outer wrapper)
    ref_logits, ref_merged = _hf_peft(path, folder)
    ours = next(r["logits"] for r in results if r["logits"] is not None)
    assert ref_logits[0].abs().max() > 1.0
    assert _max_diff(ours, ref_logits) < 1e-4
    assert _max_diff(next(r["reloaded"] for r in results if r["reloaded"] is not None), ours) == 0.0
    merged = {k: v for r in results for k, v in r["merged"].items()}
    base, ref_merged = load_file(f"{path}/model.safetensors"), _experts_per_expert(ref_merged)
    assert sorted(merged) == sorted(base)
    key = "model.layers.0.mlp.experts.3.up_proj.weight"
    assert (merged[key] - base[key]).abs().max() > 1e-3  # the expert export is merged
    for key, tensor in merged.items():
        assert (tensor - ref_merged[key]).abs().max().item() < 1e-5, key


def policy_from_peft(path: str, folder: str) -> dict:
    """build_policy with model.lora.load = a PEFT folder; then the same folder with k_proj's lora_A changed."""
    from safetensors.torch import load_file, save_file

    from megarl.models.lora import LoraConfig, LoraConfigError

    policy = _policy(path, {}, LoraConfig(**LORA, load=folder))
    out = {"logits": _logits(policy.bridge, policy.chunks)}
    tensors = load_file(f"{folder}/adapter_model.safetensors")
    tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"] += 1.0
    save_file(tensors, f"{folder}/adapter_model.safetensors")
    from megarl.compat.megatron import destroy_model_parallel

    destroy_model_parallel()
    try:
        _policy(path, {}, LoraConfig(**LORA, load=folder))
    except LoraConfigError as e:
        out["refusal"] = str(e)
    return out


@pytest.mark.multirank
def test_build_policy_starts_from_a_peft_folder(tmp_path):
    path, folder = tiny_model_dir("qwen2"), str(tmp_path / "adapter")
    exported = run_ranks(2, lora_export, path, {"tp": 2}, folder)[0]["logits"]
    (out,) = run_ranks(1, policy_from_peft, path, folder)
    assert _max_diff(out["logits"], exported) < 1e-5  # TP2's adapter, exported, then loaded at TP1
    assert out["refusal"] == (f"{folder}: base_model.model.model.layers.1.self_attn.q_proj, "
                              "base_model.model.model.layers.1.self_attn.k_proj, "
                              "base_model.model.model.layers.1.self_attn.v_proj have different lora_A; megarl's fused "
                              "linear_qkv adapter shares one A across them")


@pytest.mark.unit
def test_load_peft_refuses_a_different_adapter_shape(tmp_path):
    import peft

    from megarl.models.lora import LoraConfig, LoraConfigError, load_peft

    peft.LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"]).save_pretrained(str(tmp_path))
    with pytest.raises(LoraConfigError) as e:
        load_peft(str(tmp_path), [], None, LoraConfig(**LORA))
    assert str(e.value) == (f"model.lora.load={tmp_path}: adapter does not match model.lora (rank: folder 8 vs "
                            "model.lora 4; target_modules: folder ['k_proj', 'q_proj', 'v_proj'] vs model.lora "
                            "['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj'])")


@pytest.mark.unit
def test_expert_adapter_peft_config(tmp_path):
    """Routed-expert targets go to PEFT's target_parameters and come back as megarl targets; PEFT's expert wrapper
    has no dropout, so such an adapter with dropout is refused in one line before anything is written."""
    import peft

    from megarl.models.lora import LoraConfig, LoraConfigError, export_peft, read_peft_config

    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                    target_parameters=["experts.gate_up_proj", "mlp.experts.down_proj"]
                    ).save_pretrained(str(tmp_path / "ok"))
    read = read_peft_config(str(tmp_path / "ok"))  # (PEFT writes target_modules in set order)
    assert (read.rank, read.alpha, sorted(read.target_modules)) == (
        4, 8, sorted(["q_proj", "k_proj", "v_proj", "experts.gate_up_proj", "experts.down_proj"]))
    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],  # one layer's experts only
                    target_parameters=["model.layers.0.mlp.experts.gate_up_proj"]
                    ).save_pretrained(str(tmp_path / "bad"))
    with pytest.raises(LoraConfigError, match=r"PEFT adapter settings megarl cannot load: \{'target_parameters': "):
        read_peft_config(str(tmp_path / "bad"))
    with pytest.raises(LoraConfigError) as e:
        export_peft([], None, LoraConfig(**dict(MOE_LORA, dropout=0.1)), str(tmp_path / "dropout"))
    assert str(e.value) == ("model.lora.dropout=0.1: PEFT's LoRA on routed experts (target_parameters) has no dropout, "
                            "so this adapter has no PEFT form. Fix: set model.lora.dropout: 0.0")
    assert not (tmp_path / "dropout").exists()


def _config(moe=False, mla=False, gated=True):
    return types.SimpleNamespace(num_moe_experts=4 if moe else None, multi_latent_attention=mla,
                                 gated_linear_unit=gated)


@pytest.mark.unit
def test_bad_target_name_is_one_line_listing_valid_names():
    from megarl.models.lora import LoraConfig, LoraConfigError, megatron_targets

    with pytest.raises(LoraConfigError) as e:
        megatron_targets(LoraConfig(target_modules=["q_proj", "k_proj", "v_proj", "qkv"]), _config())
    assert str(e.value) == ("model.lora.target_modules: qkv not a LoRA target of this model; valid names: q_proj, "
                            "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj")
    with pytest.raises(LoraConfigError) as e:  # an MoE model: the experts are named as PEFT's target_parameters
        megatron_targets(LoraConfig(target_modules=["gate_proj", "up_proj", "gate"]), _config(moe=True))
    assert str(e.value) == ("model.lora.target_modules: gate_proj, up_proj, gate not a LoRA target of this model; "
                            "valid names: q_proj, k_proj, v_proj, o_proj, experts.gate_up_proj, experts.down_proj")
    assert megatron_targets(LoraConfig(target_modules=["experts.down_proj", "experts.gate_up_proj"]),
                            _config(moe=True)) == ["mlp.experts.linear_fc2", "mlp.experts.linear_fc1"]


@pytest.mark.unit
def test_fused_targets_come_as_a_group():
    from megarl.models.lora import LoraConfig, LoraConfigError, megatron_targets

    assert megatron_targets(LoraConfig(target_modules=ALL), _config()) == [
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"]
    with pytest.raises(LoraConfigError, match=r"^model.lora.target_modules: q_proj, k_proj, v_proj share Megatron's "
                                              r"fused self_attention.linear_qkv \(one adapter\): name all of them or "
                                              r"none \(missing k_proj, v_proj\)$"):
        megatron_targets(LoraConfig(target_modules=["q_proj"]), _config())


@pytest.mark.unit
def test_model_config_lora():
    from megarl.config import ConfigError, load_config
    from megarl.models.lora import LoraConfig
    from megarl.trainer.config import ModelConfig, TrainConfig

    assert ModelConfig().lora is None
    assert ModelConfig(lora={"rank": 4, "target_modules": ["o_proj"]}).lora == LoraConfig(rank=4,
                                                                                        target_modules=["o_proj"])
    cfg = load_config(TrainConfig, None, ["model.lora.rank=16", "model.lora.target_modules=[q_proj,k_proj,v_proj]"])
    assert cfg.model.lora.rank == 16 and cfg.model.lora.scale == 1.0
    with pytest.raises(ConfigError, match="model.lora.rank must be an integer >= 1"):
        load_config(TrainConfig, None, ["model.lora.rank=0"])


def _policy(path: str, layout: dict, lora, load=None, optim=True):
    """build_policy (the trainer's own path) on a fresh layout; lora None: full fine-tuning."""
    from megarl import parallel
    from megarl.models import open_model_folder
    from megarl.trainer.config import OptimConfig
    from megarl.trainer.setup import build_policy

    folder = open_model_folder(path)
    groups = parallel.initialize(parallel.ParallelConfig(**layout), folder.shape())
    return build_policy(folder, OptimConfig(lr=1e-2) if optim else None, 10, load=load, lora=lora, pg=groups.mcore)


def _memory(policy) -> dict:
    """Measured after one step: trainable parameters, the optimizer's state tensors and DDP's gradient buffers."""
    opts = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    state = sum(t.numel() * t.element_size() for o in opts for s in o.optimizer.state.values()
                for t in s.values() if torch.is_tensor(t))
    in_optimizer = sum(p.numel() for o in opts for g in o.optimizer.param_groups for p in g["params"])
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for m in policy.model for b in m.buffers)
    return {"total_params": sum(p.numel() for c in policy.chunks for p in c.parameters()),
            "trainable": sum(p.numel() for c in policy.chunks for p in c.parameters() if p.requires_grad),
            "optimizer_params": in_optimizer, "optimizer_state_bytes": state, "grad_buffer_bytes": grads}


def memory_with_and_without_lora(path: str) -> dict:
    from megarl.models.lora import LoraConfig

    out = {}
    for name, lora in (("full", None), ("lora", LoraConfig(**LORA))):
        policy = _policy(path, {}, lora)
        policy.optimizer.zero_grad()
        ranks.forward_backward(policy.bridge, policy.model, micro_batches=1)
        policy.optimizer.step()
        out[name] = _memory(policy)
        from megarl.compat.megatron import destroy_model_parallel

        destroy_model_parallel()
    return out


@pytest.mark.multirank
def test_optimizer_holds_adapters_only():
    (out,) = run_ranks(1, memory_with_and_without_lora, tiny_model_dir("qwen2"))
    full, lora = out["full"], out["lora"]
    print(f"\nLoRA memory (tiny qwen2, rank {LORA['rank']}, all 7 projections): {out}")
    assert lora["total_params"] == full["total_params"] + lora["trainable"]
    assert full["optimizer_params"] == full["trainable"] == full["total_params"]
    assert lora["optimizer_params"] == lora["trainable"] < full["trainable"] / 10
    # Adam: exp_avg + exp_avg_sq in fp32 per trainable parameter (plus one step counter per tensor)
    assert 8 * lora["trainable"] <= lora["optimizer_state_bytes"] < 8 * lora["trainable"] + 4096
    assert lora["grad_buffer_bytes"] == 4 * lora["trainable"]


def checkpoint_save(path: str, layout: dict, ckpt_root: str, lora: dict = LORA) -> dict:
    """One LoRA step through build_policy, then a run checkpoint; the full adapters that were saved."""
    from megarl.models.lora import LoraConfig, full_adapters
    from megarl.trainer import checkpoint as ck

    policy = _policy(path, layout, LoraConfig(**lora))
    _set_nonzero_b(policy.chunks, policy.bridge)
    policy.optimizer.zero_grad()
    ranks.forward_backward(policy.bridge, policy.model, micro_batches=1)
    policy.optimizer.step()
    ck.save_checkpoint(ckpt_root, 1, policy.chunks, policy.optimizer, policy.scheduler, {})
    return {c: (a, b) for c, _, a, b in full_adapters(policy.chunks, policy.bridge)}


def checkpoint_load(path: str, layout: dict, ckpt_root: str, lora: dict = LORA) -> dict:
    from megarl.models.lora import LoraConfig, full_adapters
    from megarl.trainer import checkpoint as ck

    policy = _policy(path, layout, LoraConfig(**lora))
    ck.load_checkpoint(ck.latest_checkpoint(ckpt_root), policy.chunks, policy.optimizer, policy.scheduler)
    return {c: (a, b) for c, _, a, b in full_adapters(policy.chunks, policy.bridge)}


def checkpoint_model_load(path: str, ckpt_root: str, lora: dict) -> dict:
    from megarl.models.lora import LoraConfig, full_adapters

    policy = _policy(path, {}, LoraConfig(**lora), load=ckpt_root, optim=False)
    return {c: (a, b) for c, _, a, b in full_adapters(policy.chunks, policy.bridge)}


def checkpoint_as_model_load(path: str, ckpt_root: str) -> dict:
    """What `megarl eval` does with a run's checkpoint (build_policy(load=...), no optimizer): with model.lora it reads
    the adapters; without, it refuses (it would evaluate the base model)."""
    from megarl.compat.megatron import destroy_model_parallel
    from megarl.config import ConfigError
    from megarl.models.lora import LoraConfig, full_adapters

    policy = _policy(path, {}, LoraConfig(**LORA), load=ckpt_root, optim=False)
    out = {"adapters": {c: (a, b) for c, _, a, b in full_adapters(policy.chunks, policy.bridge)}}
    destroy_model_parallel()
    try:
        _policy(path, {}, None, load=ckpt_root, optim=False)
    except ConfigError as e:
        out["refusal"] = str(e)
    return out


@pytest.mark.multirank
def test_checkpoint_reshards_adapters_tp2_to_tp1(tmp_path):
    """Adapters are saved with their own TP split (B by rows / A by columns), so a TP1 run resumes them whole."""
    path, root = tiny_model_dir("qwen2"), str(tmp_path / "ckpt")
    saved = {k: v for r in run_ranks(2, checkpoint_save, path, {"tp": 2}, root) for k, v in r.items()}
    (loaded,) = run_ranks(1, checkpoint_load, path, {}, root)
    assert sorted(loaded) == sorted(saved) and len(saved) == 16
    for key, (a, b) in saved.items():
        assert torch.equal(loaded[key][0], a) and torch.equal(loaded[key][1], b), key
        assert b.abs().max() > 0
    (as_load,) = run_ranks(1, checkpoint_as_model_load, path, root)
    for key, (a, b) in saved.items():
        assert torch.equal(as_load["adapters"][key][0], a) and torch.equal(as_load["adapters"][key][1], b), key
    assert as_load["refusal"].startswith("model checkpoint ") and as_load["refusal"].endswith(
        "holds LoRA adapters. Fix: set model.lora as in the run that wrote it")


@pytest.mark.multirank
def test_checkpoint_reshards_expert_adapters_tp2ep2_to_tp1(tmp_path):
    """Expert adapters go through SequentialMLP's expert sharding (global expert index, expert-DP replicas): a TP2xEP2
    run checkpoint, read as model.load (no optimizer: EP2's expert optimizer is a second chained optimizer that TP1
    does not have), gives the same adapters at TP1."""
    path, root = tiny_model_dir("qwen3_moe"), str(tmp_path / "ckpt")
    saved = {k: v for r in run_ranks(4, checkpoint_save, path, {"tp": 2, "ep": 2}, root, MOE_LORA)
             for k, v in r.items()}
    (loaded,) = run_ranks(1, checkpoint_model_load, path, root, MOE_LORA)
    assert sorted(loaded) == sorted(saved) and len(saved) == 4 * (2 + 4 * 2)
    for key, (a, b) in saved.items():
        assert torch.equal(loaded[key][0], a) and torch.equal(loaded[key][1], b), key
        assert b.abs().max() > 0


def plain_checkpoint_then_lora(path: str, ckpt_root: str) -> dict:
    """A full fine-tuning checkpoint (an SFT cold start) as model.load of a LoRA run: its weights load, then fresh
    adapters (B = 0) go on top, so the LoRA policy starts at exactly the checkpoint's outputs."""
    from megarl.compat.megatron import destroy_model_parallel
    from megarl.models.lora import LoraConfig
    from megarl.trainer import checkpoint as ck

    policy = _policy(path, {}, None)
    ranks.perturb(policy.chunks, seed=3)
    ck.save_checkpoint(ckpt_root, 1, policy.chunks, policy.optimizer, policy.scheduler, {})
    full = _logits(policy.bridge, policy.chunks)
    destroy_model_parallel()
    lora = _policy(path, {}, LoraConfig(**LORA), load=ckpt_root)
    return {"full": full, "lora": _logits(lora.bridge, lora.chunks),
            "trainable": sorted(n for c in lora.chunks for n, p in c.named_parameters() if p.requires_grad)}


@pytest.mark.multirank
def test_plain_checkpoint_gets_fresh_adapters(tmp_path):
    (out,) = run_ranks(1, plain_checkpoint_then_lora, tiny_model_dir("qwen2"), str(tmp_path / "ckpt"))
    assert _max_diff(out["lora"], out["full"]) == 0.0
    assert out["trainable"] and all(".lora_adapter." in n for n in out["trainable"])


def lora_reference(path: str, trained_start: bool) -> dict:
    """build_reference of a LoRA policy, then its adapters change (as training changes them): the reference still
    computes the policy as it was at build time - the base model when the adapters were fresh, the adapted policy
    when they started trained (non-zero B) - and the policy outside the reference's context is the changed one."""
    from megarl.models.lora import LoraConfig, adapters_disabled
    from megarl.trainer.setup import build_reference

    policy = _policy(path, {}, LoraConfig(**LORA))
    if trained_start:
        _set_nonzero_b(policy.chunks, policy.bridge)
    with adapters_disabled(policy.chunks):
        base = _logits(policy.bridge, policy.chunks)
    initial = _logits(policy.bridge, policy.chunks)
    ref = build_reference(policy)
    _set_nonzero_b(policy.chunks, policy.bridge, scale=0.3)  # "training" moved the adapters
    with ref.active():
        ref_logits = _logits(policy.bridge, ref.model)
    return {"base": base, "initial": initial, "ref": ref_logits, "policy": _logits(policy.bridge, policy.chunks),
            "shared": ref.model is policy.model}


@pytest.mark.multirank
@pytest.mark.parametrize("trained_start", [False, True], ids=["fresh", "trained"])
def test_lora_reference_is_the_initial_policy_without_a_second_model(trained_start):
    (out,) = run_ranks(1, lora_reference, tiny_model_dir("qwen2"), trained_start)
    assert out["shared"]  # the policy's own model: no copy
    assert _max_diff(out["ref"], out["initial"]) == 0.0
    assert _max_diff(out["policy"], out["initial"]) > 1e-2  # the adapters did change
    assert (_max_diff(out["initial"], out["base"]) == 0.0) != trained_start


def grads_in_peft_names(path: str, layout: dict, folder: str) -> dict:
    """Adapter gradients of ranks.forward_backward's loss (2 one-sequence micro-batches), named as PEFT's tensors:
    a fused layer's A gradient under its group's first projection, its B gradient split into the projections' rows."""
    from megarl.models.lora import LoraConfig, _peft_prefix, _rows_to_hf, apply_lora, export_peft, full_adapters
    from megarl.trainer.setup import wrap_ddp

    cfg = LoraConfig(**LORA)
    _, bridge, chunks = ranks.build(path, **layout)
    apply_lora(chunks, cfg)
    _set_nonzero_b(chunks, bridge)
    export_peft(chunks, bridge, cfg, folder)
    model = wrap_ddp(chunks, pg=bridge.pg)
    ranks.forward_backward(bridge, model, micro_batches=2)
    out = {}
    for canonical, column, a, b in full_adapters(chunks, bridge, grads=True):
        names, bs = _rows_to_hf(bridge, canonical, b) if column else ([bridge.hf_names(canonical)[0]], [b])
        out[f"{_peft_prefix(names[0])}.lora_A.weight"] = a
        out.update({f"{_peft_prefix(n)}.lora_B.weight": g for n, g in zip(names, bs)})
    return out


@pytest.mark.multirank
def test_adapter_grads_match_transformers_peft(tmp_path):
    """An independent reference: PEFT's autograd on transformers. PEFT gives each of q/k/v its own lora_A; megarl's
    shared A gets the sum of their gradients."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    path, folder = tiny_model_dir("qwen2"), str(tmp_path / "adapter")
    ours = {k: v for r in run_ranks(2, grads_in_peft_names, path, {"tp": 2}, folder) for k, v in r.items()}
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), folder,
                                      is_trainable=True)
    batches = ranks.input_batches(n=2, batch=1)
    for ids in batches:  # Megatron's schedule: the mean of the micro-batches' mean token losses
        logits = model(ids).logits[0]
        loss = torch.nn.functional.cross_entropy(logits, torch.roll(ids, -1, dims=1)[0]) / len(batches)
        loss.backward()
    theirs = {}
    for name, p in model.named_parameters():
        if "lora_" in name:
            key = name.replace(".default", "")
            group = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}
            proj = key.split(".")[-3]
            if "lora_A" in key and proj in group:  # a fused group's A gradients add up on its first projection
                key = key.replace(f".{proj}.", f".{group[proj]}.")
            theirs[key] = theirs.get(key, 0) + p.grad
    assert sorted(ours) == sorted(theirs)
    for key, grad in theirs.items():
        assert grad.abs().max() > 0, key
        assert (ours[key] - grad).abs().max().item() < 1e-5, key


def lora_rl_grads(path: str, layout: dict, global_batch, cfg, num_microbatches: int) -> dict:
    """Full adapter gradients and global metrics of one RL batch through megarl's loss (fused output-layer log-probs,
    frozen output layer) and Megatron's schedule."""
    from megarl.losses import forward_backward, prepare_global_batch, reduce_metrics
    from megarl.models.lora import LoraConfig, apply_lora, full_adapters
    from megarl.trainer.setup import wrap_ddp

    _, bridge, chunks = ranks.build(path, **layout)
    apply_lora(chunks, LoraConfig(**LORA))
    _set_nonzero_b(chunks, bridge)
    model = wrap_ddp(chunks, pg=bridge.pg)
    local, _ = ranks.dp_share(global_batch)
    local = prepare_global_batch(local, cfg.aggregation, cfg.norm_length, pg=bridge.pg)
    for m in model:
        m.zero_grad_buffer()
    metrics = reduce_metrics(forward_backward(model, local, num_microbatches, cfg, bridge.vocab_size, pg=bridge.pg),
                             bridge.pg)
    grads = {f"{c}.{x}": g for c, _, a, b in full_adapters(chunks, bridge, grads=True) for x, g in (("A", a), ("B", b))}
    return {"grads": grads, "metrics": metrics}


@pytest.mark.multirank
@pytest.mark.parametrize("name,layout,world,micro_batches", [("tp2", {"tp": 2}, 2, 2), ("dp2", {}, 2, 2),
                                                              ("pp2", {"pp": 2}, 2, 4)])
def test_rl_loss_adapter_grads_match_single_rank(name, layout, world, micro_batches):
    from megarl.algorithms import AlgorithmConfig, MismatchConfig
    from rl_batch import TEMPERATURE, rl_token_batch

    path = tiny_model_dir("qwen3")
    cfg = AlgorithmConfig(policy_loss="ppo_clip", clip_eps_low=0.1, clip_eps_high=0.15, aggregation="token-mean",
                          kl_coef=0.05, entropy_coef=0.01, temperature=TEMPERATURE,
                          mismatch=MismatchConfig(mode="tis", cap=1.5)).validate()
    batch = rl_token_batch(path)
    (ref,) = run_ranks(1, lora_rl_grads, path, {}, batch, cfg, 1)
    results = run_ranks(world, lora_rl_grads, path, layout, batch, cfg, micro_batches)
    grads = {k: v for r in results for k, v in r["grads"].items()}
    assert sorted(grads) == sorted(ref["grads"])
    for key, expected in ref["grads"].items():
        scale = expected.abs().max().item()
        assert scale > 0, key
        assert (grads[key] - expected).abs().max().item() <= 1e-5 * scale + 1e-8, key
    assert math.isclose(results[0]["metrics"]["loss"], ref["metrics"]["loss"], rel_tol=1e-5, abs_tol=1e-7)


def resume_step(path: str, layout: dict, ckpt_root: str, resume: bool) -> dict:
    """Step 1, checkpoint, step 2 (resume=False); or load the checkpoint, step 2 (resume=True): adapters after step 2."""
    from megarl.models.lora import LoraConfig, full_adapters
    from megarl.trainer import checkpoint as ck

    policy = _policy(path, layout, LoraConfig(**LORA))
    _set_nonzero_b(policy.chunks, policy.bridge)

    def step():
        policy.optimizer.zero_grad()
        ranks.forward_backward(policy.bridge, policy.model, micro_batches=1)
        policy.optimizer.step()
        policy.scheduler.step(1)

    if resume:
        ck.load_checkpoint(ck.latest_checkpoint(ckpt_root), policy.chunks, policy.optimizer, policy.scheduler)
    else:
        step()
        ck.save_checkpoint(ckpt_root, 1, policy.chunks, policy.optimizer, policy.scheduler, {})
    step()
    return {c: (a, b) for c, _, a, b in full_adapters(policy.chunks, policy.bridge)}


@pytest.mark.multirank
def test_resume_restores_adapter_optimizer_state(tmp_path):
    """Adam's second step depends on its moments: a resumed run repeats it bit for bit only if they were restored."""
    path, root = tiny_model_dir("qwen2"), str(tmp_path / "ckpt")
    straight = {k: v for r in run_ranks(2, resume_step, path, {"tp": 2}, root, False) for k, v in r.items()}
    resumed = {k: v for r in run_ranks(2, resume_step, path, {"tp": 2}, root, True) for k, v in r.items()}
    assert sorted(resumed) == sorted(straight)
    for key, (a, b) in straight.items():
        assert torch.equal(resumed[key][0], a) and torch.equal(resumed[key][1], b), key


def adapter_count(path: str, layout: dict, lora: dict) -> dict:
    from megarl.models.lora import LoraConfig, is_adapter_param

    policy = _policy(path, layout, LoraConfig(**lora))
    named = [(n, p) for c in policy.chunks for n, p in c.named_parameters()]
    return {"adapters": sum(p.numel() for n, p in named if is_adapter_param(n)),
            "trainable": sum(p.numel() for _, p in named if p.requires_grad)}


@pytest.mark.multirank
@pytest.mark.parametrize("family, layout, lora", [
    ("qwen2", {"tp": 2}, LORA),
    ("qwen3_moe", {"tp": 2, "ep": 2}, MOE_LORA),  # 4 ranks: expert adapters over ep x etp (etp = tp)
], ids=["dense-tp2", "moe-tp2-ep2"])
def test_dry_run_adapter_estimate_equals_the_built_model(family, layout, lora):
    """The dry run's LoRA numbers (megarl.launch.memory) against the adapters build_policy really makes on each rank:
    parameter count, and gradients + Adam state for those alone."""
    import json
    import os

    from megarl.launch import memory
    from megarl.models.hf import model_shape
    from megarl.models.lora import LoraConfig

    path = tiny_model_dir(family)
    world = layout["tp"] * layout.get("ep", 1) if family == "qwen3_moe" else layout["tp"]
    built = run_ranks(world, adapter_count, path, layout, lora)
    with open(os.path.join(path, "config.json")) as f:
        shape = model_shape(json.load(f))
    sizes = {"tp": layout["tp"], "pp": 1, "cp": 1, "ep": layout.get("ep", 1), "etp": layout.get("etp", layout["tp"]),
             "dp": world // layout["tp"], "expert-dp": 1}
    (st,) = memory.trainer_memory(shape, [[range(shape.num_layers)]], sizes, False, "float32", LoraConfig(**lora))
    (full,) = memory.trainer_memory(shape, [[range(shape.num_layers)]], sizes, False, "float32")
    for rank in built:
        assert rank["adapters"] == rank["trainable"] == st.adapter_params > 0
    assert st.gradients == 4 * st.adapter_params and st.optimizer == 8 * st.adapter_params
    assert st.weights == full.weights + 4 * st.adapter_params and st.total < full.total


@pytest.mark.unit
def test_dry_run_shows_lora_adapters():
    from megarl.launch import dry_run

    def run(*overrides):  # a preset whose model.shape is in the file: no model folder needed
        return dry_run("train", "configs/qwen3_30b_a3b.yaml", list(overrides), nnodes=1, gpus_per_node=8, environ={},
                       gpu_memory_gb=80)

    text, plain = run("model.lora={rank: 16}"), run()
    assert "LoRA adapter params (trainable)" in text and "LoRA" not in plain
