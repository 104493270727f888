"""Per-request seeded sampling for SGLang's CPU engine (loaded only by megarl's CPU SGLang servers: this folder is on
their PYTHONPATH, and the patch applies only when MEGARL_SGLANG_SEEDED_SAMPLING=1).

Why: an RL run that is killed and resumed must draw the same rollouts as an uninterrupted one, so megarl gives every
request a `sampling_seed`. SGLang 0.5.23 honours per-request seeds only under --enable-deterministic-inference
(sglang/srt/sampling/sampling_batch_info.py:128, `enable_deterministic`), and that flag is refused with the
torch_native attention backend, the only one on CPU (sglang/srt/arg_groups/overrides.py:1119); it would also swap
aten::mm for Triton batch-invariant kernels, which do not exist on CPU. On GPU megarl uses the real flag.

What: after SGLang builds a batch's SamplingBatchInfo, when the requests carry `sampling_seed` and SGLang left the
seed tensor unset, set it (one int64 per request, 42 for a request without a seed, as SGLang does). SGLang's own
seeded sampler (`multinomial_with_seed`, a hash of seed and position) then draws each token; filtering and merging
of batches already carry the tensor along.
"""
import importlib.abc
import importlib.machinery
import os
import sys

_TARGET = "sglang.srt.sampling.sampling_batch_info"


def _patch(module) -> None:
    import torch

    cls = module.SamplingBatchInfo
    original = cls.from_schedule_batch.__func__

    def from_schedule_batch(klass, batch, vocab_size):
        info = original(klass, batch, vocab_size)
        seeds = [r.sampling_params.sampling_seed for r in batch.reqs]
        if info.sampling_seed is None and any(s is not None for s in seeds):
            info.sampling_seed = torch.tensor([42 if s is None else s for s in seeds], dtype=torch.int64,
                                              device=batch.device)
        return info

    cls.from_schedule_batch = classmethod(from_schedule_batch)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


if os.environ.get("MEGARL_SGLANG_SEEDED_SAMPLING") == "1":
    sys.meta_path.insert(0, _PatchOnImport())
