"""Orchestration cost: from "rollouts complete" on the source rank to every rank's first micro-batch, and the metrics
reduction, on CPU with gloo, 4 ranks (DP=4 and TP2xDP2), with synthetic rollouts (no engine, no model).

    .venv/bin/python benchmarks/orchestration.py --path baseline      # today's path -> the "baseline" key
    .venv/bin/python benchmarks/orchestration.py --path tensor        # megarl's path -> the "cases" key

Writes benchmarks/results/orchestration.json ({"cases": [...], "baseline": [...]}; rewriting one key keeps the other).
Every case runs in a fresh 4-rank gloo world (megarl.testing.run_ranks forks the ranks, megarl.parallel.initialize
sets up megatron's parallel_state with tp=1 or 2, no model).

Rollouts: `samples` x ~1k tokens: prompt 96..160 tokens (mean 128, shared by the 8 samples of a group, as GRPO
samples n per prompt), response 768..1024 (mean 896), ids uniform in a 151,936 vocabulary, fp32 log-probs, and the
`extra` dict today's rollout carries (weight version, turns, the decoded text: ~4 bytes per token). MoE cases add
the engine's routing for a 48-layer top-8 model with 128 experts (Qwen3-30B-A3B's shape) as today's `Sample` holds
it: a flat Python list of positions x 48 x 8 ints. Built on the source rank (rank 0) before the clock starts.

A path (PATHS) is a `Path(dispatch, metrics, loss_metrics=None, memory=None)`:
- dispatch(samples, spec) runs on every rank, gets the list of `Sample`s on rank 0 (None elsewhere, as in today's
  trainer) and returns `Dispatched(micro_batch, bytes_total)`: this rank's first micro-batch (a TokenBatch) and, on
  the source rank, the size of the whole rollout in the path's wire format (bytes_total; 0 elsewhere);
- metrics(per_microbatch) runs on every rank with per-micro-batch metric dicts as the loss function returns them
  and returns the global metrics. The harness makes them in today's form ("values/ratio": every trained token's
  ratio on this rank; "mean/..." [sum, count] pairs; a "max/..."); loss_metrics(one dict), if set, turns each into
  what this path's loss function returns instead, before the clock (the loss does that work, per micro-batch);
- memory(case) estimates the total resident bytes over all ranks; a case above MEMORY_LIMIT (16 GB: the machine has
  24 GB, shared with others) is not run and is recorded as skipped with the reason. None: no limit.
Adding a path is one line, e.g. PATHS["tensor"] = Path(tensor_dispatch, reduce_metrics, loss_metrics=to_histogram).

The baseline is today's trainer, frozen at commit 75427db (the code is copied below, since megarl replaces it):
step_once's megarl.errors.on_rank0 broadcasts the whole list with broadcast_object_list to every rank, and every
rank builds its DP share with that commit's megarl.trainer.batching.rank_batch; its metrics are that commit's
megarl.losses.rl.reduce_metrics (all_gather_object of every token's ratio over DP for the percentiles, plus
all_reduces of the means). The baseline's MoE routing as Python lists (every rank unpickles the whole step: ~3 MB
of list per sample; 16k x 1k x 384 ints would be ~50 GB per rank) runs at 256 samples; the larger MoE cases exceed
the 16 GB limit (baseline_memory) and are recorded as skipped. baseline_memory against the measured total (the
ranks' extra peaks + the source's lists): dense 16k, 8.5 GB estimated / ~8.4 GB measured; MoE 256, 7.6 / ~5.6 GB.

megarl's path ("tensor", the "cases" key; "tensor_rank0", the "cases" key of results/orchestration_rank0.json) is megarl.trainer.dispatch as the
trainer runs it. "tensor": the DP leaders are the rollout workers (rollout.workers=auto), so when the rollouts
complete each leader holds the groups it generated (g % dp == its DP rank) as megarl's rollout holds them (numpy
arrays made as each request chunk returns; the MoE routing as the int32 tensor the engine client decodes); the
leaders pack them as flat tensors, agree on the plan (one all-reduce of the samples' lengths) and send each DP leader
its rows point to point; leaders broadcast over their replica (TP) group. "tensor_rank0": rank 0 holds and sends
everything (rollout.workers=rank0). Its metrics: reduce_metrics with fixed-size log-ratio histograms.

Measured per rank, reported as the max over ranks (and bytes_total from the source(s)):
- bytes received: torch.distributed's point-to-point and collective calls are wrapped while dispatch runs
  (ByteCounter); a rank counts the bytes of the tensors it receives: broadcast (not on the source), scatter (its
  piece), recv/irecv, all_gather / all_gather_into_tensor / gather (the other ranks' pieces), all_to_all(_single)
  (the pieces from the other ranks), all_reduce and reduce_scatter_tensor (the tensor, once). Object collectives
  (broadcast_object_list, scatter_object_list, all_gather_object) go through these calls, so they count their pickled
  payload plus the int64 size header (8 bytes per object).
- peak RSS: VmHWM from /proc/self/status after resetting it (/proc/self/clear_refs "5") at the start of dispatch,
  minus VmRSS at that moment: the extra resident memory the dispatch needed on that rank (MB = 2**20 bytes).
- dispatch_s: from leaving a barrier after the source holds the rollouts ("rollouts complete") to this rank's first
  micro-batch ready (returned by dispatch).
- metrics_s: one metrics() call after a barrier. Each DP rank's trained tokens are the step's response tokens / dp
  (spread evenly: not the exact shard), in micro-batches of rl.max_tokens_per_microbatch's default token budget.
Seconds on this shared 2-core machine are noisy; compare paths within one machine, and ratios, not absolute values.
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Callable, NamedTuple, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from machine import machine  # noqa: E402  (benchmarks/machine.py: the machine, for the JSON)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
os.environ.setdefault("OMP_NUM_THREADS", "1")

import conftest  # noqa: E402,F401  (imports torch + megatron once, applies the CPU platform)
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megarl import parallel  # noqa: E402
from megarl.errors import on_rank0  # noqa: E402
from megarl.losses.rl import TokenBatch  # noqa: E402
from megarl.testing import run_ranks  # noqa: E402
from megarl.trainer.batching import Sample  # noqa: E402
from megarl.trainer.config import RLConfig  # noqa: E402

RESULTS = os.path.join(HERE, "results", "orchestration.json")
VOCAB = 151_936
GROUP = 8  # samples per prompt
TOKENS_PER_SAMPLE = 1024  # prompt 96..160 (mean 128) + response 768..1024 (mean 896): see lengths()
NUM_EXPERTS = 128
MAX_TOKENS_PER_MICROBATCH = RLConfig().max_tokens_per_microbatch  # the trainer's default token budget
PAD_ID = 0
MEMORY_LIMIT = 16e9
SIZES = (256, 1024, 4096, 16384)
MOE_SIZES = (256, 1024)
LAYOUTS = ((4, 1), (2, 2))  # (dp, tp) at world 4
WORLD = 4


@dataclass(frozen=True)
class Case:
    world: int
    dp: int
    tp: int
    samples: int
    tokens_per_sample: int = TOKENS_PER_SAMPLE
    moe_layers: int = 0
    topk: int = 0


@dataclass(frozen=True)
class Spec:
    """What a dispatch needs to know about this rank and the step (process groups explicit)."""
    dp_rank: int
    dp_size: int
    tp_rank: int
    tp_size: int
    dp_group: object
    tp_group: object
    pad_id: int
    seq_multiple: int  # the padded length is a multiple of this (TP, for sequence parallelism)
    max_tokens_per_microbatch: int
    routing_shape: Optional[tuple[int, int]]  # (layers, top-k) for MoE routing, None without
    sources: tuple[int, ...] = (0,)  # the ranks that hold the rollouts when they complete (see Path.holders)
    sources_group: object = None  # a process group over them (None: one source)
    samples: int = 0  # the step's samples (case.samples)

    @classmethod
    def current(cls, case: Case) -> "Spec":
        from megatron.core import parallel_state as ps

        return cls(dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                   tp_rank=ps.get_tensor_model_parallel_rank(), tp_size=ps.get_tensor_model_parallel_world_size(),
                   dp_group=ps.get_data_parallel_group(), tp_group=ps.get_tensor_model_parallel_group(),
                   pad_id=PAD_ID, seq_multiple=ps.get_tensor_model_parallel_world_size(),
                   max_tokens_per_microbatch=MAX_TOKENS_PER_MICROBATCH,
                   routing_shape=(case.moe_layers, case.topk) if case.moe_layers else None)


class Dispatched(NamedTuple):
    micro_batch: TokenBatch  # this rank's first micro-batch
    bytes_total: int  # on the source rank: the whole rollout in this path's wire format; 0 elsewhere


class Path(NamedTuple):
    dispatch: Callable[[Optional[list], Spec], Dispatched]
    metrics: Callable[[list], dict]
    loss_metrics: Optional[Callable[[dict], dict]] = None  # today's loss metrics -> this path's (not timed)
    memory: Optional[Callable[[Case], float]] = None  # estimated resident bytes over all ranks; None: no limit
    arrays: bool = False  # the rollout holds arrays (megarl's rollout and engine client now), not Python lists
    holders: str = "rank0"  # who holds the rollouts when they complete: rank 0, or each DP leader its share


# ----------------------------------------------------------------------------------------------- synthetic rollouts
def lengths(tokens_per_sample: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Uniform (inclusive) prompt and response length ranges whose means add up to tokens_per_sample:
    prompt 1/8 +- 1/32 of it, response 7/8 +- 1/8 (1024: prompt 96..160, response 768..1024)."""
    t = tokens_per_sample
    return (t // 8 - t // 32, t // 8 + t // 32), (t * 7 // 8 - t // 8, t * 7 // 8 + t // 8)


def synthetic_rollout(case: Case, seed: int = 0, arrays: bool = False, share: tuple[int, int] = (0, 1)
                      ) -> list[Sample]:
    """`case.samples` Samples as today's rollout builds them (Python lists; see the module docstring).
    arrays: the samples as megarl's rollout now holds them: ids / log-probs as numpy arrays (made as each chunk
    returns, while the rest generates) and the MoE routing as the flat int32 tensor its engine client returns.
    share=(i, w): only the groups g with g % w == i, as rollout worker i of w holds them (each group has its own
    random stream, so a share is exactly those groups of the whole rollout)."""
    samples: list[Sample] = []
    layers, k = case.moe_layers, case.topk
    prompt_range, response_range = lengths(case.tokens_per_sample)
    for group in range(share[0], math.ceil(case.samples / GROUP), share[1]):
        g = torch.Generator().manual_seed(seed * 1_000_003 + group)
        prompt = torch.randint(0, VOCAB, (int(torch.randint(prompt_range[0], prompt_range[1] + 1, (), generator=g)),),
                               generator=g).tolist()
        for _ in range(min(GROUP, case.samples - group * GROUP)):
            length = int(torch.randint(response_range[0], response_range[1] + 1, (), generator=g))
            response = torch.randint(0, VOCAB, (length,), generator=g).tolist()
            log_probs = (-torch.rand(length, generator=g) * 4).tolist()
            routed = None
            if layers:  # top-k distinct experts per position and layer: first + j * odd stride (mod 128), j < k
                rows = (len(prompt) + length - 1) * layers
                first = torch.randint(0, NUM_EXPERTS, (rows, 1), generator=g)
                stride = 2 * torch.randint(0, NUM_EXPERTS // 2, (rows, 1), generator=g) + 1
                routed = ((first + stride * torch.arange(k)) % NUM_EXPERTS).flatten()
                routed = routed.to(torch.int32) if arrays else routed.tolist()
            text = bytes(torch.randint(97, 123, (4 * length,), generator=g, dtype=torch.uint8).tolist()).decode()
            ids = (np.asarray(prompt, np.int32), np.asarray(response, np.int32), np.asarray(log_probs, np.float32)) \
                if arrays else (list(prompt), response, log_probs)
            samples.append(Sample(group=group, prompt_index=group, prompt_ids=ids[0], response_ids=ids[1],
                                  rollout_log_probs=ids[2], finish_reason="stop", reward=1.0, score=1.0,
                                  routed_experts=routed,
                                  extra={"weight_version": 0, "turns": 1, "final_text": text}))
    return samples


def metric_inputs(case: Case, spec: Spec, seed: int = 0) -> list[dict]:
    """Per-micro-batch metric dicts as megarl.losses.rl.rl_objective returns them, for this DP rank's share."""
    g = torch.Generator().manual_seed(seed * 1000 + spec.dp_rank)
    response = sum(lengths(case.tokens_per_sample)[1]) / 2
    response_tokens = int(case.samples * response)
    mine = response_tokens // spec.dp_size + (spec.dp_rank < response_tokens % spec.dp_size)
    per_mb = max(1, int(MAX_TOKENS_PER_MICROBATCH * response / case.tokens_per_sample))
    out = []
    for start in range(0, mine, per_mb):
        n = min(per_mb, mine - start)
        ratio = torch.exp(0.05 * torch.randn(n, generator=g))
        out.append({"mean/pg_loss": torch.stack([torch.randn((), generator=g) * n, torch.tensor(float(n))]),
                    "mean/entropy": torch.stack([torch.rand((), generator=g) * n, torch.tensor(float(n))]),
                    "mean/ppo_kl": torch.stack([torch.randn((), generator=g) * 1e-3 * n, torch.tensor(float(n))]),
                    "mean/clipfrac": torch.stack([torch.rand((), generator=g) * 0.1 * n, torch.tensor(float(n))]),
                    "max/logprob_abs_diff": torch.rand((), generator=g),
                    "values/ratio": ratio})
    return out


# ------------------------------------------------------------------------------------------------ byte counting
class ByteCounter:
    """Counts the bytes this rank receives (and, on a source, sends) through torch.distributed while active.

    Wraps the functions in both torch.distributed and torch.distributed.distributed_c10d (the object collectives call
    the module-level broadcast / all_gather / scatter there). Counting rules: see the module docstring."""

    NAMES = ("broadcast", "scatter", "send", "recv", "isend", "irecv", "all_gather", "all_gather_into_tensor",
             "gather", "all_to_all", "all_to_all_single", "all_reduce", "reduce_scatter_tensor")

    def __init__(self):
        self.received = 0
        self.sent = 0
        self._depth = 0  # calls of wrapped functions in progress
        self._saved: list[tuple[object, str, Callable]] = []

    def __enter__(self) -> "ByteCounter":
        from torch.distributed import distributed_c10d as c10d

        for name in self.NAMES:
            original = getattr(c10d, name)
            wrapped = self._wrap(name, original)
            for module in (dist, c10d):
                self._saved.append((module, name, getattr(module, name)))
                setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        counter = self

        def wrapped(*args, **kwargs):
            counter._depth += 1  # torch's send/recv call its isend/irecv: count the outermost call only
            try:
                result = original(*args, **kwargs)
            finally:
                counter._depth -= 1
            if counter._depth == 0:
                counter._count(name, args, kwargs)
            return result

        wrapped.__name__ = name
        return wrapped

    def _count(self, name: str, args: tuple, kwargs: dict) -> None:
        def arg(i: int, key: str, default=None):
            return args[i] if len(args) > i else kwargs.get(key, default)

        group = kwargs.get("group")
        me = dist.get_rank(group)

        def root(src_index: int, src_key: str) -> int:  # the source/destination as a rank of `group`
            group_root = kwargs.get(f"group_{src_key}")
            if group_root is not None:
                return group_root
            root_rank = arg(src_index, src_key, 0)
            return root_rank if group is None else dist.get_group_rank(group, root_rank)

        if name == "broadcast":
            tensor = arg(0, "tensor")
            if me == root(1, "src"):
                self.sent += tensor.nbytes
            else:
                self.received += tensor.nbytes
        elif name == "scatter":
            if me == root(2, "src"):
                pieces = arg(1, "scatter_list") or []
                self.sent += sum(t.nbytes for i, t in enumerate(pieces) if i != me)
            else:
                self.received += arg(0, "tensor").nbytes
        elif name in ("send", "isend"):
            self.sent += arg(0, "tensor").nbytes
        elif name in ("recv", "irecv"):
            self.received += arg(0, "tensor").nbytes
        elif name == "all_gather":
            self.received += sum(t.nbytes for i, t in enumerate(arg(0, "tensor_list")) if i != me)
        elif name == "all_gather_into_tensor":
            self.received += arg(0, "output_tensor").nbytes - arg(1, "input_tensor").nbytes
        elif name == "gather":
            if me == root(2, "dst"):
                self.received += sum(t.nbytes for i, t in enumerate(arg(1, "gather_list") or []) if i != me)
        elif name == "all_to_all":
            self.received += sum(t.nbytes for i, t in enumerate(arg(0, "output_tensor_list")) if i != me)
        elif name == "all_to_all_single":
            output, splits = arg(0, "output"), arg(2, "output_split_sizes")
            world = dist.get_world_size(group)
            row = output[0].nbytes if output.dim() and output.shape[0] else 0
            own = splits[me] * row if splits else output.nbytes // world
            self.received += output.nbytes - own
        else:  # all_reduce, reduce_scatter_tensor: the tensor, once
            self.received += arg(0, "tensor" if name == "all_reduce" else "output").nbytes


# ------------------------------------------------------------------------------ today's path, frozen at 75427db
# The trainer's data path at commit 75427db (megarl/trainer/batching.py and megarl/losses/rl.py there), copied verbatim
# but for names: megarl replaces it (PackedRollout + megarl.trainer.dispatch, histogram metrics), and the baseline must
# keep measuring what it measured. Only the container types (Sample, TokenBatch) and on_rank0 (unchanged) come from
# megarl.
def _shift_sequences(prompts: list[list[int]], responses: list[list[int]], pad_id: int, seq_len: int | None = None):
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    seq_len = seq_len or max(lengths)
    ids = torch.full((len(prompts), seq_len), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), seq_len)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not p:
            raise ValueError(f"sequence {i}: empty prompt (the first response token needs a token to predict it)")
        ids[i, : len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
        mask[i, len(p) - 1: len(p) + len(r) - 1] = 1
    targets = torch.cat([ids[:, 1:], torch.full((len(prompts), 1), pad_id, dtype=torch.long)], dim=1)
    return ids, targets, mask


def _place_response_values(values: list[list[float]], prompt_lengths: list[int], seq_len: int) -> torch.Tensor:
    out = torch.zeros(len(values), seq_len)
    for i, (v, p) in enumerate(zip(values, prompt_lengths)):
        out[i, p - 1: p - 1 + len(v)] = torch.as_tensor(v, dtype=torch.float32)
    return out


def _shard_groups(samples: list[Sample], dp_size: int) -> list[list[int]]:
    groups: dict[int, list[int]] = {}
    for i, s in enumerate(samples):
        groups.setdefault(s.group, []).append(i)
    tokens = {g: sum(len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in idx)
              for g, idx in groups.items()}
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for g in sorted(groups, key=lambda g: (-tokens[g], g)):
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        shares[rank].extend(groups[g])
        load[rank] += tokens[g]
    return [sorted(s) for s in shares]


def _routing_tensor(samples: list[Sample], rows: int, seq_len: int, shape: tuple[int, int]) -> torch.Tensor:
    layers, k = shape
    out = torch.arange(k).expand(rows, seq_len, layers, k).clone()
    for i, s in enumerate(samples):
        routed = torch.tensor(s.routed_experts, dtype=torch.int64)
        positions = len(s.prompt_ids) + len(s.response_ids) - 1
        if routed.numel() != positions * layers * k:
            raise ValueError(f"sample {i}: the engine's routing has {routed.numel()} entries, expected {positions} "
                             f"positions x {layers} layers x top-{k}")
        out[i, :positions] = routed.view(positions, layers, k)
    return out


def _token_batch(samples: list[Sample], rows: int, seq_len: int, pad_id: int,
                 routing_shape: tuple[int, int] | None = None) -> TokenBatch:
    prompts = [s.prompt_ids for s in samples]
    responses = [s.response_ids for s in samples]
    pad_rows = rows - len(samples)
    if pad_rows < 0:
        raise ValueError(f"{len(samples)} samples do not fit {rows} rows")
    prompts += [[pad_id]] * pad_rows
    responses += [[]] * pad_rows
    input_ids, targets, mask = _shift_sequences(prompts, responses, pad_id, seq_len)
    for i, s in enumerate(samples):
        if not s.trained:
            mask[i] = 0
        elif s.loss_mask is not None:
            start = len(s.prompt_ids) - 1
            mask[i, start:start + len(s.response_ids)] *= torch.tensor(s.loss_mask, dtype=mask.dtype)
    rollout = _place_response_values([s.rollout_log_probs for s in samples] + [[]] * pad_rows,
                                     [len(p) for p in prompts], seq_len)
    routed = _routing_tensor(samples, rows, seq_len, routing_shape) \
        if routing_shape and samples and samples[0].routed_experts is not None else None
    return TokenBatch(input_ids=input_ids, targets=targets, loss_mask=mask, rollout_log_probs=rollout * mask,
                      routed_experts=routed)


def _micro_batches_for(rows: int, seq_len: int, max_tokens: int) -> int:
    return max(1, min(rows, math.ceil(rows * seq_len / max_tokens)))


def _rank_batch(samples: list[Sample], dp_rank: int, dp_size: int, pad_id: int, seq_multiple: int,
                max_tokens_per_microbatch: int, row_multiple: int = 1,
                routing_shape: tuple[int, int] | None = None) -> tuple[TokenBatch, list[int], int]:
    """(batch, sample indices, num_microbatches): 75427db's RankBatch fields."""
    shares = _shard_groups(samples, dp_size)
    seq_len = int(math.ceil(max(len(s.prompt_ids) + len(s.response_ids) for s in samples) / seq_multiple)
                  * seq_multiple)
    rows = max(len(s) for s in shares)
    num_mb = _micro_batches_for(rows // row_multiple or 1, seq_len, max_tokens_per_microbatch) * row_multiple
    rows = int(math.ceil(rows / num_mb) * num_mb)
    mine = shares[dp_rank]
    return _token_batch([samples[i] for i in mine], rows, seq_len, pad_id, routing_shape), mine, num_mb


def baseline_reduce_metrics(per_microbatch: list[dict] | None) -> dict[str, float]:
    """75427db's megarl.losses.rl.reduce_metrics: every token's ratio gathered as objects for the percentiles."""
    from megatron.core import parallel_state as ps

    holder = None
    if per_microbatch:
        dp_cp = ps.get_data_parallel_group(with_context_parallel=True)
        keys = sorted(per_microbatch[0])
        means = [k for k in keys if k.startswith("mean/") or k == "loss"]
        maxes = [k for k in keys if k.startswith("max/")]
        sums = torch.stack([sum(m[k].double() for m in per_microbatch) for k in means]) if means else None
        mx = torch.stack([torch.stack([m[k].double() for m in per_microbatch]).max() for k in maxes]) if maxes \
            else None
        if sums is not None:
            dist.all_reduce(sums, group=dp_cp)
        if mx is not None:
            dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=dp_cp)
        ratio_parts = [m["values/ratio"].double() for m in per_microbatch if "values/ratio" in m]
        result = {}
        for k, (total, count) in zip(means, sums if sums is not None else []):
            name = k.split("/", 1)[-1]
            result[name] = float(total) if k == "loss" else float(total / count.clamp(min=1))
        for k, value in zip(maxes, mx if mx is not None else []):
            result[k.split("/", 1)[1] + "_max"] = float(value)
        if ratio_parts:
            gathered = [None] * dist.get_world_size(dp_cp)
            dist.all_gather_object(gathered, torch.cat(ratio_parts), group=dp_cp)
            ratios = torch.cat(gathered)
            if ratios.numel():
                for q in (0.05, 0.5, 0.95):
                    result[f"ratio_p{int(q * 100)}"] = float(torch.quantile(ratios, q))
        holder = result
    pp_group = ps.get_pipeline_model_parallel_group()
    last = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)
    box = [holder]
    dist.broadcast_object_list(box, src=last, group=pp_group)
    return box[0] or {}


# ----------------------------------------------------------------------------------------------------- paths
def baseline_dispatch(samples: Optional[list], spec: Spec) -> Dispatched:
    """Today's trainer (75427db step_once): the whole list to every rank (on_rank0: broadcast_object_list), then
    rank_batch on every rank."""
    with ByteCounter() as own:  # nested in the harness's counter: only to learn the payload the source sent
        samples = on_rank0(lambda: samples)
    batch, _, num_mb = _rank_batch(samples, spec.dp_rank, spec.dp_size, spec.pad_id, seq_multiple=spec.seq_multiple,
                                   max_tokens_per_microbatch=spec.max_tokens_per_microbatch,
                                   routing_shape=spec.routing_shape)
    return Dispatched(batch.rows(slice(0, batch.input_ids.shape[0] // num_mb)), own.sent)


def baseline_memory(case: Case) -> float:
    """Resident bytes over all ranks for today's path, from CPython's object sizes (an estimate, checked against the
    measured peaks in the module docstring): every rank holds the whole list (the source builds it, the others
    unpickle it) and, at the peak, the pickled payload three times (pickle's buffer, its bytes, the tensor made from
    them), plus its rows as tensors (the routing twice: the per-sample tensors and the batch)."""
    positions = case.tokens_per_sample - 1
    prompt_range, response_range = lengths(case.tokens_per_sample)
    response = sum(response_range) / 2
    lists = (case.tokens_per_sample * 8 + (response + case.tokens_per_sample / GROUP) * 32  # ids: pointers + ints
             + response * 32  # log-probs: pointers + floats
             + 4 * response + 1000  # the text, the Sample and its dicts
             + positions * case.moe_layers * case.topk * 8)  # routing: pointers to cached small ints
    pickled = case.tokens_per_sample * 4.2 + response * 9 + 4 * response + positions * case.moe_layers * case.topk * 2
    seq_len = case.tokens_per_sample + (prompt_range[1] - prompt_range[0] + response_range[1] - response_range[0]) / 2
    rows = case.samples / case.dp * seq_len * (8 + 8 + 4 + 4 + case.moe_layers * case.topk * 8 * 2)
    return case.world * (case.samples * (lists + 3 * pickled) + rows)


def tensor_dispatch(samples: Optional[list], spec: Spec) -> Dispatched:
    """megarl's path (megarl.trainer.dispatch) as the trainer runs it by default (rollout.workers=auto: the DP
    leaders): each leader holds the groups it generated (g % dp == its DP rank) and packs them as flat tensors; the
    leaders agree on the plan (one all-reduce of the samples' lengths) and send each DP leader the rows it trains,
    point to point; a leader broadcasts its rows in its replica. With spec.sources == (0,) (path "tensor_rank0"),
    rank 0 holds and sends everything (rollout.workers=rank0)."""
    from megarl.trainer.batching import BatchPlan, PackedRollout
    from megarl.trainer.dispatch import dispatch

    packed = plan = None
    if dist.get_rank() in spec.sources:
        packed = PackedRollout.from_samples(samples, routing=spec.routing_shape is not None, group_size=GROUP)

        def reduce(t):
            if spec.sources_group is not None:
                dist.all_reduce(t, group=spec.sources_group)
            return t

        plan = BatchPlan.from_workers(packed, spec.samples, GROUP, reduce, spec.dp_size, spec.seq_multiple,
                                      spec.max_tokens_per_microbatch)
    got = dispatch(packed, plan, parallel.groups(), sources=spec.sources)
    batch = got.share.token_batch(got.rows, got.seq_len, spec.pad_id, spec.routing_shape)
    return Dispatched(batch.rows(slice(0, got.rows // got.num_microbatches)), packed.nbytes if packed else 0)


def ratio_histogram(metrics: dict) -> dict:
    """What megarl's loss function now returns for the ratio percentiles: a fixed-size log-ratio histogram."""
    from megarl.losses.rl import log_histogram

    out = {k: v for k, v in metrics.items() if k != "values/ratio"}
    out["hist/log_ratio"] = log_histogram(torch.log(metrics["values/ratio"].double()))
    return out


def tensor_reduce_metrics(per_microbatch: list[dict] | None) -> dict[str, float]:
    from megarl.losses.rl import reduce_metrics

    return reduce_metrics(per_microbatch, parallel.groups().mcore)


PATHS: dict[str, Path] = {
    "baseline": Path(baseline_dispatch, baseline_reduce_metrics, memory=baseline_memory),
    "tensor": Path(tensor_dispatch, tensor_reduce_metrics, loss_metrics=ratio_histogram, arrays=True,
                   holders="dp_leaders"),
    "tensor_rank0": Path(tensor_dispatch, tensor_reduce_metrics, loss_metrics=ratio_histogram, arrays=True),
}
RESULT_KEY = {"baseline": "baseline"}  # every other path writes "cases"
# orchestration.json holds exactly {"cases", "baseline"} (the trainer's default path, and the path before it); the
# rank-0-only variant goes to a file of its own
RESULT_FILE = {"tensor_rank0": os.path.join(HERE, "results", "orchestration_rank0.json")}


# ----------------------------------------------------------------------------------------------------- harness
def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def _release_free_memory() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap back, so RSS at the start is what is alive


def run_case(case: Case, path: str, seed: int = 0, keep_batch: bool = False) -> dict:
    """On every rank of a fresh world: dispatch + metrics of `path`; this rank's measurements."""
    parallel.initialize(parallel.ParallelConfig(tp=case.tp))
    bench = PATHS[path]
    leaders = parallel.groups().leaders
    sources = tuple(leaders) if bench.holders == "dp_leaders" else (0,)
    sources_group = dist.new_group(list(sources)) if len(sources) > 1 else None
    spec = replace(Spec.current(case), sources=sources, sources_group=sources_group, samples=case.samples)
    rank = dist.get_rank()
    samples = synthetic_rollout(case, seed, bench.arrays, (sources.index(rank), len(sources))) \
        if rank in sources else None
    _release_free_memory()
    dist.barrier()  # rollouts complete on the source
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset this process's peak resident set (VmHWM) to the current RSS
    start_kb = _status_kb("VmRSS")
    with ByteCounter() as counter:
        start = time.perf_counter()
        out = bench.dispatch(samples, spec)
        dispatch_s = time.perf_counter() - start
    peak_bytes = (_status_kb("VmHWM") - start_kb) * 1024
    result = {"bytes_received": counter.received, "bytes_total": out.bytes_total, "peak_rss_bytes": peak_bytes,
              "dispatch_s": dispatch_s, "dp_rank": spec.dp_rank, "tp_rank": spec.tp_rank,
              "micro_batch_rows": out.micro_batch.input_ids.shape[0]}
    if keep_batch:
        result["micro_batch"] = out.micro_batch
    del samples, out
    per_microbatch = metric_inputs(case, spec, seed)
    if bench.loss_metrics is not None:  # what this path's loss function outputs instead (computed per micro-batch)
        per_microbatch = [bench.loss_metrics(m) for m in per_microbatch]
    _release_free_memory()
    dist.barrier()
    start = time.perf_counter()
    metrics = bench.metrics(per_microbatch)
    result["metrics_s"] = time.perf_counter() - start
    result["metrics"] = metrics
    return result


def measure(case: Case, path: str, seed: int = 0, timeout: float = 1200.0) -> dict:
    """One case in a fresh 4-rank world: the JSON row (or a skipped row with the reason)."""
    row = asdict(case)
    estimate = PATHS[path].memory(case) if PATHS[path].memory else None
    if estimate is not None and estimate > MEMORY_LIMIT:
        return {**row, "bytes_total": None, "bytes_max_rank": None, "peak_rss_mb_max_rank": None, "dispatch_s": None,
                "metrics_s": None, "skipped": f"estimated {estimate / 1e9:.0f} GB resident over {case.world} ranks "
                                              f"> the {MEMORY_LIMIT / 1e9:.0f} GB limit"}
    ranks = run_ranks(case.world, run_case, case, path, seed, timeout=timeout)
    return {**row, "bytes_total": sum(r["bytes_total"] for r in ranks),  # reported by the source(s), 0 elsewhere
            "bytes_max_rank": max(r["bytes_received"] for r in ranks),
            "peak_rss_mb_max_rank": round(max(r["peak_rss_bytes"] for r in ranks) / 2**20, 1),
            "dispatch_s": round(max(r["dispatch_s"] for r in ranks), 4),
            "metrics_s": round(max(r["metrics_s"] for r in ranks), 4)}


def all_cases(sizes=SIZES, moe_sizes=MOE_SIZES, layouts=LAYOUTS) -> list[Case]:
    dense = [Case(WORLD, dp, tp, n) for n in sizes for dp, tp in layouts]
    moe = [Case(WORLD, dp, tp, n, moe_layers=48, topk=8) for n in moe_sizes for dp, tp in layouts]
    return dense + moe


def table(rows: list[dict]) -> str:
    head = f"{'dp':>3} {'tp':>3} {'samples':>8} {'moe':>7} {'bytes_total':>14} {'bytes_max_rank':>15} " \
           f"{'peak_rss_mb':>12} {'dispatch_s':>11} {'metrics_s':>10}"
    lines = [head]
    for r in rows:
        moe = f"{r['moe_layers']}x{r['topk']}" if r["moe_layers"] else "-"
        if r.get("skipped"):
            lines.append(f"{r['dp']:>3} {r['tp']:>3} {r['samples']:>8} {moe:>7}  skipped: {r['skipped']}")
            continue
        lines.append(f"{r['dp']:>3} {r['tp']:>3} {r['samples']:>8} {moe:>7} {r['bytes_total']:>14,} "
                     f"{r['bytes_max_rank']:>15,} {r['peak_rss_mb_max_rank']:>12.1f} {r['dispatch_s']:>11.3f} "
                     f"{r['metrics_s']:>10.3f}")
    return "\n".join(lines)


def write_results(key: str, rows: list[dict], path: str = RESULTS) -> None:
    data = {}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data[key] = rows
    data["machine"] = machine()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump({k: data[k] for k in sorted(data)}, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--path", choices=sorted(PATHS), default="baseline")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="dense sample counts")
    parser.add_argument("--moe-sizes", type=int, nargs="*", default=list(MOE_SIZES), help="MoE sample counts")
    parser.add_argument("--out", default=None, help="default: results/orchestration.json (tensor_rank0: "
                        "results/orchestration_rank0.json)")
    args = parser.parse_args(argv)
    rows = []
    for case in all_cases(args.sizes, args.moe_sizes):
        start = time.perf_counter()
        rows.append(measure(case, args.path))
        print(table(rows[-1:]).splitlines()[-1], f"  ({time.perf_counter() - start:.0f} s)", flush=True)
    args.out = args.out or RESULT_FILE.get(args.path, RESULTS)
    write_results(RESULT_KEY.get(args.path, "cases"), rows, args.out)
    print(f"\n{args.path}:\n{table(rows)}\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
