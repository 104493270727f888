"""Rank functions shared by the multi-rank tests (each runs inside megarl.testing.run_ranks)."""
from __future__ import annotations

import torch

from megarl import parallel
from megarl.models import ModelBridge, forward_logits, open_model_folder
from megarl.trainer.setup import wrap_ddp

SEQ = 16


def input_batches(n: int = 2, batch: int = 2, seq: int = SEQ, vocab: int = 384, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(n)]


def build(path: str, tp=1, pp=1, vpp=None, ep=1, etp=None, load=True, **config_overrides):
    """ParallelConfig's pipeline split fields (num_layers_in_first_pipeline_stage, ...) in config_overrides go to the
    layout; the rest to the model's TransformerConfig. Returns (megatron's parallel_state module, for the tests'
    own checks; the bridge, built on megarl.parallel.groups().mcore: bridge.pg; its chunks)."""
    from megatron.core import parallel_state as ps

    split = {k: config_overrides.pop(k) for k in parallel.config.SPLIT_FIELDS if k in config_overrides}
    folder = open_model_folder(path)
    groups = parallel.initialize(parallel.ParallelConfig(tp=tp, pp=pp, vpp=vpp, ep=ep, etp=etp, **split),
                                 folder.shape())
    bridge = ModelBridge(folder, config_overrides=config_overrides, pg=groups.mcore)
    chunks = bridge.build()
    if load:
        bridge.load_hf_weights(chunks)
    return ps, bridge, chunks


def logits_and_export(path: str, layout: dict) -> dict:
    """Full logits (last stage only) and the HF tensors this rank owns after loading the HF folder."""
    ps, bridge, chunks = build(path, **layout)
    logits = forward_logits(chunks, input_batches(), vocab_size=bridge.vocab_size, pg=bridge.pg)
    return {"logits": logits, "weights": dict(bridge.export_hf_weights(chunks))}


def masked_vocab_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Mean token cross-entropy over vocab-parallel logits, ignoring the padded vocabulary columns."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    per_rank = logits.shape[-1]
    start = ps.get_tensor_model_parallel_rank() * per_rank
    padded = torch.arange(start, start + per_rank) >= vocab_size
    logits = logits.masked_fill(padded, -1e4)
    # megatron's vocab_parallel_cross_entropy takes [s, b, v] / [s, b]
    loss = vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(), labels.transpose(0, 1).contiguous())
    return loss.mean()


def train_grads(path: str, layout: dict, micro_batches: int = 4) -> dict:
    """HF-named gradients of the mean next-token loss over `micro_batches` micro-batches of one sequence."""
    ps, bridge, chunks = build(path, **layout)
    model = wrap_ddp(chunks, pg=bridge.pg)
    losses = forward_backward(bridge, model, micro_batches)
    grads = dict(bridge.export_hf_weights(chunks, grads=True))
    return {"grads": grads, "losses": losses}


def optimizer_step(path: str, layout: dict) -> dict:
    """One Adam step (distributed optimizer, grad clipping) on the next-token loss; HF weights before and after."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ps, bridge, chunks = build(path, **layout)
    before = dict(bridge.export_hf_weights(chunks))
    model = wrap_ddp(chunks, distributed_optimizer=True, pg=bridge.pg)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, clip_grad=1.0, use_distributed_optimizer=True,
                        params_dtype=torch.float32), model)
    optimizer.zero_grad()
    forward_backward(bridge, model, micro_batches=2)
    updated, grad_norm, _ = optimizer.step()
    return {"updated": updated, "grad_norm": grad_norm, "before": before,
            "after": dict(bridge.export_hf_weights(chunks))}


def forward_backward(bridge, model: list, micro_batches: int):
    """Megatron's forward-backward schedule over `micro_batches` one-sequence batches; per-micro-batch losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megarl.models import causal_inputs

    batches = input_batches(n=micro_batches, batch=1)

    def forward_step(data_iterator, m):
        ids = next(data_iterator)
        output = m(*causal_inputs(ids))
        labels = torch.roll(ids, -1, dims=1)

        def loss_func(logits):
            loss = masked_vocab_cross_entropy(logits, labels, bridge.vocab_size)
            return loss, {"loss": loss.detach().clone()}

        return output, loss_func

    for m in model:
        m.zero_grad_buffer()
    iterators = [iter(batches) for _ in model] if len(model) > 1 else iter(batches)
    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iterators, model=model if len(model) > 1 else model[0],
        num_microbatches=micro_batches, seq_length=SEQ, micro_batch_size=1, forward_only=False)
    return [x["loss"] for x in losses] if losses else None


def dp_share(global_batch):
    """This data-parallel rank's contiguous share of the global batch, and its (first, end) row range."""
    from megatron.core import parallel_state as ps

    per_rank = global_batch.input_ids.shape[0] // ps.get_data_parallel_world_size()
    first = ps.get_data_parallel_rank() * per_rank
    return global_batch.rows(slice(first, first + per_rank)), (first, first + per_rank)


def rl_grads(path: str, layout: dict, global_batch, cfg, num_microbatches: int, objective: str = "rl") -> dict:
    """HF-named gradients and global metrics of one RL batch through megarl's loss + Megatron's schedule."""
    from megarl.losses import forward_backward, prepare_global_batch, reduce_metrics

    ps, bridge, chunks = build(path, **layout)
    model = wrap_ddp(chunks, pg=bridge.pg)
    local, rows = dp_share(global_batch)
    local = prepare_global_batch(local, cfg.aggregation, cfg.norm_length, pg=bridge.pg)
    for m in model:
        m.zero_grad_buffer()
    metrics = reduce_metrics(forward_backward(model, local, num_microbatches, cfg if objective == "rl" else None,
                                              bridge.vocab_size, objective=objective, pg=bridge.pg), bridge.pg)
    return {"grads": dict(bridge.export_hf_weights(chunks, grads=True)), "metrics": metrics}


def rl_train_step(path: str, layout: dict, global_batch, cfg, num_microbatches: int) -> dict:
    """One megarl.losses.train_step (DDP, SGD, grad clipping): HF weights after, metrics. (SGD keeps the layout
    comparison tight; Adam's first step is ~lr*sign(g), which amplifies float noise in near-zero grads.)"""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from megarl.losses import compute_log_probs, prepare_global_batch, train_step

    ps, bridge, chunks = build(path, **layout)
    pg = bridge.pg
    model = wrap_ddp(chunks, pg=pg)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.5, sgd_momentum=0.0, clip_grad=0.05,
                        params_dtype=torch.float32), model)
    local, rows = dp_share(global_batch)
    log_probs = compute_log_probs(model, local, num_microbatches, bridge.vocab_size, temperature=cfg.temperature,
                                  pg=pg)
    local = prepare_global_batch(local, cfg.aggregation, cfg.norm_length, pg=pg)
    metrics = train_step(model, optimizer, local, num_microbatches, cfg, bridge.vocab_size, pg=pg)
    return {"weights": dict(bridge.export_hf_weights(chunks)), "metrics": metrics, "log_probs": log_probs,
            "rows": rows}


def perturb(chunks, seed: int, scale: float = 0.02) -> None:
    """Change the trainer's weights the same way on every rank (TP replicas stay identical)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for chunk in chunks:
            for p in chunk.parameters():
                p.add_(scale * torch.randn(p.shape, generator=g))


def trainer_log_probs(bridge, chunks, sequences):
    """log p(seq[t] | seq[:t]) under the trainer for equal-length sequences, on every rank."""
    import torch.distributed as dist

    from megarl.models import forward_logits

    ids = torch.tensor(sequences)
    logits = forward_logits(chunks, [ids], vocab_size=bridge.vocab_size, pg=bridge.pg)
    mine = None if logits is None else torch.log_softmax(logits[0], -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return next(x for x in everyone if x is not None)


class CountingTransport:
    """A user's transport, written against megarl.reshard.transports.WeightTransport only (reshard.transport=
    "ranks:CountingTransport"): it hands each bucket to the engine through the built-in tensor transport's push and
    counts what it pushed."""
    shared_memory = True

    def __init__(self, client, options):
        from megarl.reshard import TensorTransport

        self.inner, self.pushed = TensorTransport(client, options), []

    def setup(self, owners):
        self.inner.setup(owners)

    def send(self, source, version):
        from megarl.reshard import send_buckets

        return send_buckets(self, source, version)

    def push(self, bucket, version):
        self.inner.push(bucket, version)
        self.pushed.append(bucket.nbytes)

    def close(self):
        self.inner.close()


def sync_and_compare(path, url, layout, transport, seed, corrupt=None, engine_tp=1):
    """Perturb the trainer, sync into the engine, and return the engine's and trainer's log-probs of the engine's own
    sampled tokens, plus the engine's probe log-probs before and after the sync."""
    import torch.distributed as dist

    from megarl.reshard import SyncConfig, TransportOptions, WeightSync, resolve_transport
    from megarl.rollout import EngineClient

    ps, bridge, chunks = build(path, **layout)
    perturb(chunks, seed)
    client = EngineClient(url)
    fixed = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27]]
    before = client.prompt_log_probs(fixed) if dist.get_rank() == 0 else None
    transport = resolve_transport(transport)(client, TransportOptions(engine_tp=engine_tp, folder=f"{path}-disk-sync"))
    if corrupt is not None:
        transport = corrupt(transport)
    sync = WeightSync(bridge, chunks, transport, client if dist.get_rank() == 0 else None,
                      SyncConfig(bucket_bytes=256 << 10))
    try:
        stats = sync.sync()
    finally:
        sync.close()
    result = {"stats": stats, "user_transport_pushed": getattr(transport, "pushed", None)}
    if dist.get_rank() == 0:
        result["before"] = before
        result["after"] = client.prompt_log_probs(fixed)
        # ignore_eos: both completions are 6 tokens (a sampled end-of-sequence token would leave rows of two lengths)
        completions = client.generate([[5, 6, 7], [30, 31, 32]], {"max_new_tokens": 6, "temperature": 1.0,
                                                                   "ignore_eos": True})
        result["engine"] = [c.output_log_probs for c in completions]
        result["weight_versions"] = [c.weight_version for c in completions]
        result["sequences"] = [c.prompt_ids + c.output_ids for c in completions]
    sequences = [None]
    if dist.get_rank() == 0:
        sequences = [result["sequences"]]
    dist.broadcast_object_list(sequences, src=0)
    trainer = trainer_log_probs(bridge, chunks, sequences[0])
    result["trainer"] = [row[2:].tolist() for row in trainer]  # the 6 generated tokens (after a 3-token prompt)
    return result


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def sync_peak_memory(path, url, layout, bucket_bytes):
    """Extra resident memory (peak minus start) of a sync on each rank, after a first warm-up sync: the smallest of
    three syncs."""
    import gc

    import torch.distributed as dist

    from megarl.reshard import SyncConfig, TensorTransport, WeightSync
    from megarl.rollout import EngineClient

    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 << 10)  # M_MMAP_THRESHOLD fixed at 64 KiB: large blocks are mmapped and returned on free,
    libc.mallopt(-1, 0)  # M_TRIM_THRESHOLD 0: so the resident set follows what is really alive
    ps, bridge, chunks = build(path, **layout)
    client = EngineClient(url)
    sync = WeightSync(bridge, chunks, TensorTransport(client), client if dist.get_rank() == 0 else None,
                      SyncConfig(bucket_bytes=bucket_bytes))
    perturb(chunks, 1)
    sync.sync(verify=True)  # warm-up: imports, connections, the bucket buffer
    extras = []
    for attempt in range(3):  # a copy the sync makes shows in every sync; a stray allocation elsewhere in the
        perturb(chunks, 2 + attempt)  # process (a library thread's arena) does not: keep the smallest peak
        gc.collect()
        libc.malloc_trim(0)
        dist.barrier()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset this process's peak resident set (VmHWM)
        start_kb = _status_kb("VmRSS")
        stats = sync.sync(verify=False)
        extras.append((_status_kb("VmHWM") - start_kb) * 1024)
    extra = min(extras)
    probe = sync.verify()  # the measured syncs really moved the weights
    sync.close()
    buffer = sync.source.packer._buffer  # resident since the warm-up sync: counted on top of the measured peak
    return {"extra_bytes": extra, "buffer_bytes": 0 if buffer is None else buffer.numel(), "buckets": stats["buckets"],
            "probe_max_abs_diff": probe["probe_max_abs_diff"]}


def dispatched_rows(samples, layout: dict, routing_shape, max_tokens: int, mini_batches: int,
                    workers: str = "rank0") -> dict:
    """This rank's RL rows after megarl.trainer.dispatch, and what it received. workers="rank0": rank 0 holds the
    samples; "dp_leaders": each DP leader holds the groups g with g % dp == its DP rank (as rollout workers do)."""
    from megarl.trainer.batching import BatchPlan, PackedRollout
    from megarl.trainer.dispatch import dispatch

    groups = parallel.initialize(parallel.ParallelConfig(**layout))
    sources = (0,) if workers == "rank0" else groups.leaders
    packed = plan = None
    rank = torch.distributed.get_rank()
    if rank in sources:
        every = PackedRollout.from_samples(samples, routing=routing_shape is not None)
        plan = BatchPlan.make(every.seq_lens, every.group, groups.dp_size, groups.mcore.tp.size(),
                              max_tokens, row_multiple=mini_batches)
        mine = [i for i, s in enumerate(samples) if s.group % len(sources) == sources.index(rank)]
        packed = PackedRollout.from_samples([samples[i] for i in mine], routing=routing_shape is not None,
                                            group_size=len(samples) // len({s.group for s in samples}))
        assert packed.sample_index.tolist() == mine
    got = dispatch(packed, plan, groups, sources=sources)
    batch = got.share.token_batch(got.rows, got.seq_len, 0, routing_shape)
    return {"dp_rank": groups.dp_rank, "sample_index": got.share.sample_index.tolist(), "batch": batch,
            "score": got.share.score, "group": got.share.group, "num_microbatches": got.num_microbatches,
            "bytes_received": got.bytes_received, "step_bytes": every.nbytes if rank in sources else None}


def rollout_worker_failure(model_path: str, failing: int) -> str:
    """Two rollout workers collect a step; worker `failing`'s engine calls fail. Returns the error every rank ends
    with (megarl.errors.on_ranks, as RLTrainer.step_once runs collect)."""
    import torch.distributed as dist

    from megarl.data import ChatTokenizer, PromptRecord
    from megarl.errors import UserError, on_ranks
    from megarl.rollout.server import EngineError
    from megarl.rewards import RewardPool
    from megarl.rollout.client import Completion
    from megarl.trainer.config import load_train_config, rollout_inputs
    from megarl.trainer.rollout import PromptStream, Workers
    from megarl.trainer.workers import build_rollout

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = load_train_config(None, ['model.tiny={"family": "qwen2"}', "rollout.prompts_per_step=4",
                                   "rollout.n_samples=2", "rollout.dynamic_sampling=true"])

    class Router:  # an engine that answers on one worker and fails on the other
        def generate(self, prompts, params, return_routed_experts=False, resume_aborted=False):
            if rank == failing:
                raise EngineError(f"rollout.engine.urls[0]: the engine died on worker {rank}. Fix: restart it")
            return [Completion(list(p), [7, 8], [-0.1, -0.2], "stop", "step-0") for p in prompts]

    tok = ChatTokenizer.from_pretrained(model_path)
    records = [PromptRecord(i, [1, 2, 3 + i], str(i), f"{i}") for i in range(8)]
    rewards = RewardPool("exact_match", 1, 10.0)
    rollout = build_rollout(rollout_inputs(cfg), tok, Router(), rewards)
    workers = Workers(rank, 2, dist.new_group([0, 1]))
    try:
        on_ranks(lambda: rollout.collect(PromptStream(records, seed=1), 1, workers), here=True)
    except UserError as e:
        return str(e)
    finally:
        rollout.close()
        rewards.close()
    return "no error"


def routing_with_engine(path, url, layout, seed):
    """MoE routing against a real engine started with --enable-return-routed-experts: perturb the trainer (router and
    its expert bias included), sync it into the engine, sample from the engine with its routing, then run the
    trainer's old-log-prob forward on those tokens twice, as megarl's RL step does (megarl.models.moe.RoutingStats
    and replay_routing through megarl.losses.compute_log_probs): with its own routing, and replaying the engine's
    (R3). Returns both routing agreements with the engine (over each sample's routed positions) and the largest
    |trainer - engine| log-prob difference of the sampled tokens each way."""
    import torch.distributed as dist

    from megarl.losses import compute_log_probs
    from megarl.models import open_model_folder
    from megarl.models.moe import RoutingStats
    from megarl.reshard import TRANSPORTS, SyncConfig, TransportOptions, WeightSync
    from megarl.rollout import EngineClient
    from megarl.trainer.batching import Sample, token_batch

    ps, bridge, chunks = build(path, moe_enable_routing_replay=True, **layout)
    perturb(chunks, seed)
    client = EngineClient(url)
    sync = WeightSync(bridge, chunks, TRANSPORTS["tensor"](client, TransportOptions()),
                      client if dist.get_rank() == 0 else None, SyncConfig(bucket_bytes=256 << 10))
    try:
        stats = sync.sync()
    finally:
        sync.close()
    sampled = [None]
    if dist.get_rank() == 0:
        done = client.generate([[5, 6, 7], [30, 31, 32, 33, 34]], {"max_new_tokens": 8, "temperature": 1.0},
                               return_routed_experts=True)
        sampled = [[(c.prompt_ids, c.output_ids, c.output_log_probs, c.routed_experts.flatten().tolist())
                    for c in done]]
    dist.broadcast_object_list(sampled, src=0)
    hf = open_model_folder(path).config
    samples = [Sample(i, i, p, o, lp, "stop", routed_experts=r) for i, (p, o, lp, r) in enumerate(sampled[0])]
    seq_len = max(len(p) + len(o) for p, o, _, _ in sampled[0])
    batch = token_batch(samples, len(samples), seq_len, 0, (hf.num_hidden_layers, hf.num_experts_per_tok))
    engine_routing = batch.routed_experts
    lengths = torch.tensor([len(p) + len(o) for p, o, _, _ in sampled[0]])
    positions = (torch.arange(seq_len) < lengths[:, None] - 1).float()  # what the engine routed: all but the last
    engine_lp = torch.zeros_like(batch.loss_mask)
    for i, (p, o, lp, _) in enumerate(sampled[0]):
        engine_lp[i, len(p) - 1:len(p) - 1 + len(o)] = torch.tensor(lp)
    result = {"stats": stats, "tokens": int(positions.sum())}
    for name, replayed in (("own", None), ("replay", engine_routing)):
        batch.routed_experts = replayed
        routing = RoutingStats(chunks)
        log_probs = compute_log_probs(chunks, batch, 1, bridge.vocab_size, pack=False, pg=bridge.pg)
        routing.close()
        agreement = routing.agreement(engine_routing, positions, 1)
        dist.all_reduce(agreement)
        found = [None] * dist.get_world_size()
        dist.all_gather_object(found, None if log_probs is None else
                               float(((log_probs - engine_lp) * batch.loss_mask).abs().max()))
        result[name] = {"agreement": float(agreement[0] / agreement[1]),
                        "logprob_max_diff": next(x for x in found if x is not None)}
    return result


def step_metrics(layout: dict, old, rollout, mask, entropy) -> dict:
    """megarl.trainer.metrics on a [b, s] batch split over DP x CP by rows, held as the trainer holds it: the last
    pipeline stage has the log-probs (every TP rank a copy), the other stages zeros (a wrong reduction shows)."""
    from megarl.trainer import metrics

    parallel.initialize(parallel.ParallelConfig(**layout), None)
    pg = parallel.groups().mcore
    share = slice(pg.dp_cp.rank(), None, pg.dp_cp.size())
    last = pg.pp.rank() == pg.pp.size() - 1
    held = old[share] if last else torch.zeros_like(old[share])
    out = metrics.logprob_mismatch(held, rollout[share], mask[share], pg)
    out.update(metrics.entropy_dynamics(entropy[share], mask[share], pg))
    out.update(metrics.forgetting_kl(held if last else None, rollout[share], mask[share], pg))
    return out


def save_then_load(path, ckpt, save_layout, load_layout):
    """Save a checkpoint at one layout, load it at another over a different random init: logits before and after
    the load, the reference logits at the load layout from the HF folder, and the exported HF weights."""
    from megarl.models import load_model_checkpoint, save_model_checkpoint

    _, _, chunks = build(path, **save_layout)
    save_model_checkpoint(chunks, ckpt)
    # Reference at the load layout: the same weights straight from the HF folder.
    _, bridge, direct = build(path, **load_layout)
    expected = forward_logits(direct, input_batches(), vocab_size=bridge.vocab_size, pg=bridge.pg)
    torch.manual_seed(999)  # a different random init: the load must overwrite every weight
    _, bridge, chunks = build(path, load=False, **load_layout)
    before = forward_logits(chunks, input_batches(), vocab_size=bridge.vocab_size, pg=bridge.pg)
    load_model_checkpoint(chunks, ckpt)
    after = forward_logits(chunks, input_batches(), vocab_size=bridge.vocab_size, pg=bridge.pg)
    return {"expected": expected, "before": before, "after": after,
            "weights": dict(bridge.export_hf_weights(chunks))}


class ZeroSliceOf:
    """A transport wrapper that zeroes rows 0..7 of one tensor on the way to the engine."""

    def __init__(self, transport, name):
        self.inner, self.name = transport, name

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def send(self, source, version):
        from megarl.reshard import send_buckets

        return send_buckets(self, source, version)  # the buckets go through this wrapper's push

    def push(self, bucket, version):
        if self.name in bucket.names:
            bucket.tensor(self.name)[:8] = 0
        return self.inner.push(bucket, version)
