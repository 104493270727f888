"""Each megatron-core CPU shim is needed: the scenario it covers passes with it and fails once it is reverted."""
import multiprocessing
import os
import re

import pytest
import torch

import ranks
from megarl import platform
from megarl.models import forward_logits, save_model_checkpoint
from megarl.platform import cpu_shims
from megarl.testing import RankFailure, run_ranks, tiny_model_dir


def forward(path, layout, _tmp):
    _, bridge, chunks = ranks.build(path, **layout)
    return forward_logits(chunks, ranks.input_batches(n=1), vocab_size=bridge.vocab_size)


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
}


def _without(shim, scenario, *args):
    cpu_shims.revert(shim)  # only in this forked rank
    return scenario(*args)


def test_every_shim_has_a_test():
    assert sorted(CASES) == sorted(cpu_shims.SHIMS)
    assert not platform.on_gpu() and cpu_shims.applied() == sorted(cpu_shims.SHIMS)
    for shim in cpu_shims.SHIMS.values():
        assert ".py:" in shim.works_around, f"{shim.name} must name the megatron-core file:line it works around"


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
