"""Each megatron-core CPU shim is needed: the scenario it covers passes with it and fails once it is reverted."""
import multiprocessing
import os
import re

import pytest
import torch

import ranks
from megarl import platform
from megarl.models import forward_logits, save_model_checkpoint
from megarl.compat import megatron as cpu_shims
from megarl.testing import RankFailure, run_ranks, tiny_model_dir


def forward(path, layout, _tmp):
    _, bridge, chunks = ranks.build(path, **layout)
    return forward_logits(chunks, ranks.input_batches(n=1), vocab_size=bridge.vocab_size, pg=bridge.pg)


def train(path, layout, _tmp):
    return ranks.train_grads(path, layout, micro_batches=2)["losses"]


def optimizer(path, layout, _tmp):
    result = ranks.optimizer_step(path, layout)
    assert result["updated"] and torch.isfinite(torch.tensor(result["grad_norm"]))
    if torch.distributed.get_rank() == 0:  # the rank that owns (exports) the HF tensors
        assert result["after"] and all(not torch.equal(result["before"][k], v) for k, v in result["after"].items())


def save(path, layout, tmp):
    _, _, chunks = ranks.build(path, **layout)
    save_model_checkpoint(chunks, f"{tmp}/ckpt")
    children = multiprocessing.active_children()
    assert not children, f"the synchronous checkpoint save started helper processes: {children}"


def grads_match_transformers(path, layout, _tmp):
    """The Megatron gradients of ranks.train_grads' loss (mean token cross-entropy, averaged over 2 micro-batches)
    equal the same loss's gradients in Hugging Face transformers."""
    from transformers import AutoModelForCausalLM

    ours = ranks.train_grads(path, layout, micro_batches=2)["grads"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for ids in ranks.input_batches(n=2, batch=1):
        logits = model(ids).logits
        labels = torch.roll(ids, -1, dims=1)
        (torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()) / 2).backward()
    reference = dict(model.named_parameters())
    if torch.distributed.get_rank() != 0:  # the rank that owns (exports) the HF tensors
        return
    # transformers 5 keeps the routed experts fused (gate_up_proj): the attention and dense tensors are compared
    compared = sorted(set(ours) & set(reference))
    assert any("kv_a_proj_with_mqa" in name for name in compared), compared
    for name in compared:
        error = (ours[name] - reference[name].grad).abs().max().item()
        assert error < 1e-5, f"the gradient of {name} differs from transformers' by {error:.2e}"


# shim -> (family, layout, world size, scenario, text expected in the failure once the shim is reverted)
CASES = {
    "current_device": ("llama", {}, 1, forward, "Torch not compiled with CUDA enabled"),
    "rng": ("llama", {}, 1, forward, "Torch not compiled with CUDA enabled"),
    "synchronize": ("llama", {"pp": 2}, 2, forward, "Torch not compiled with CUDA enabled"),
    "streams": ("qwen3_moe", {"ep": 2}, 2, forward, "torch.cuda.Stream requires CUDA support"),
    "hardcoded_cuda": ("llama", {}, 1, forward, "Torch not compiled with CUDA enabled"),
    "tensor_cuda": ("qwen3", {"pp": 2}, 2, forward, "Torch not compiled with CUDA enabled"),
    "moe_split_sizes": ("qwen3_moe", {"ep": 2}, 2, forward, "all_to_all_single"),
    "sequence_parallel_torch_norm": ("llama", {"tp": 2}, 2, forward, "sequence parallel not supported"),
    "uneven_collectives": ("qwen3_moe", {"tp": 2, "ep": 2}, 4, train, "invalid tensor size"),
    "cuda_type_names": ("llama", {}, 2, optimizer, "torch.cuda.FloatTensor"),
    "checkpoint_results_queue": ("llama", {}, 1, save, "started helper processes"),
    "mla_rope_key_grad": ("deepseek_v3", {"tp": 2}, 2, grads_match_transformers, "differs from transformers"),
}


def _without(shim, scenario, *args):
    cpu_shims.revert(shim)  # only in this forked rank
    return scenario(*args)


@pytest.mark.unit
def test_every_shim_has_a_test():
    assert sorted(CASES) == sorted(cpu_shims.SHIMS)
    assert not platform.on_gpu() and cpu_shims.applied() == sorted(cpu_shims.SHIMS)
    for shim in cpu_shims.SHIMS.values():
        assert ".py:" in shim.works_around, f"{shim.name} must name the megatron-core file:line it works around"


@pytest.mark.multirank
@pytest.mark.parametrize("shim", sorted(CASES))
def test_scenario_passes_with_shim_and_fails_without(shim, tmp_path):
    family, layout, world, scenario, expected = CASES[shim]
    path = tiny_model_dir(family)
    run_ranks(world, scenario, path, layout, str(tmp_path / "with"))
    with pytest.raises(RankFailure) as failure:
        run_ranks(world, _without, shim, scenario, path, layout, str(tmp_path / "without"), timeout=60)
    message = str(failure.value)
    assert expected in message, message[-3000:]
    frames = re.findall(r'File "[^"]*/megatron/core/([^"]+)", line (\d+)', message)
    if frames:  # the failure is at the megatron-core line the shim documents
        path, line = frames[-1]
        works_around = cpu_shims.SHIMS[shim].works_around
        assert os.path.basename(path) in works_around and line in works_around, (path, line, works_around)
