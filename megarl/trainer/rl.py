"""The RL trainer. `RLTrainer.step_once()` is one RL step, top to bottom:

    rollout (rank 0 -> SGLang, rewards in parallel) -> this DP rank's token batch -> reference log-probs ->
    old log-probs -> advantages -> ppo_epochs x mini-batches through Megatron's pipeline schedule -> reshard the new
    weights into the engine -> metrics

Everything else here is set-up (model, engines, data, resume) and bookkeeping (checkpoints, evaluation, summary).
Run it under torchrun: `megarl train CONFIG [key=value ...]`.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time

import torch
import torch.distributed as dist

from .. import parallel, platform
from ..algorithms import compute_advantages, entropy_split, kl_estimate, loss_phases
from ..algorithms.advantages import RETURNS_TEACHER_LOG_RATIO
from ..algorithms.dynamics import UpdateSparsity, kl_sums
from ..config import ConfigError, to_dict
from ..errors import about, on_rank0, on_ranks
from ..data import PROCEDURAL, ChatTokenizer, load_prompts
from ..losses import TokenBatch, compute_log_probs, compute_values, prepare_global_batch, train_step
from ..losses.rl import place_response_values, shift_sequences
from ..losses.step import holds_results, schedule_layouts
from ..models.moe import RoutingStats, load_balance_metrics
from ..reshard import TRANSPORTS, SyncConfig, TransportOptions, WeightSync
from ..rewards import RewardPool
from ..rollout import EngineClient, EngineRouter, SGLangServer
from ..rollout.pools import EnginePools, pool_server_config
from ..rollout.server import engine_server_config
from ..rollout.teacher import Teacher, check_same_tokenizer
from .async_rollout import RolloutBatch, RolloutProducer, lag_stats, sample_version_stats, version_name
from .batching import BatchPlan, PackedRollout, RankBatch
from .dispatch import dispatch
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .logging import MetricsLog, PhaseTimer
from .preemption import StopRequest
from .rollout import PromptStream, Rollout, Workers, rollout_metrics
from .setup import (build_critic, build_policy, build_reference, init_parallel, moe_config_overrides,
                    prepare_model_folder, prompt_tools, resolve_load)

logger = logging.getLogger("megarl")


def _on_every_stage(per_token: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """Forward-only results exist on the last pipeline stage; the other stages, which compute no loss, get zeros."""
    return per_token if per_token is not None else torch.zeros_like(like)


def _listed(values):
    """JSON-ready: arrays (what the rollout holds) as lists; None stays None."""
    return values.tolist() if hasattr(values, "tolist") else values


def dumped_samples(run_dir: str, step: int) -> list[dict]:
    """The engine samples of one step that rl.dump_rollouts wrote (one file per rollout worker), in step-wide sample
    order: record i is sample i, the one `"sample": i` names in the DP ranks' step_N.dpR.train.jsonl rows."""
    import glob

    pattern = os.path.join(run_dir, "rollouts", f"step_{step:06d}.worker*.jsonl")
    records = [json.loads(line) for path in glob.glob(pattern) for line in open(path)]
    return sorted(records, key=lambda r: r["sample"])


class RLTrainer:
    def __init__(self, cfg, metrics_log: bool = True):
        self.cfg, self.started = cfg, time.perf_counter()
        if cfg.rl.max_staleness and platform.on_gpu() and cfg.rollout.placement == "colocated" and \
                not cfg.rollout.engine.urls:
            raise ConfigError("rl.max_staleness > 0 needs engines that generate while Megatron trains, but colocated "
                              "engines give their GPU memory to training: set rollout.placement: disaggregated (or "
                              "rollout.engine.urls), or rl.max_staleness: 0")
        parallel.init_distributed(parallel=cfg.parallel)  # the groups: once the model shape is known
        self.rank = dist.get_rank()
        self.model_path = prepare_model_folder(cfg)
        if cfg.teacher.model:  # before any engine starts: a teacher with another tokenizer is refused in seconds
            on_rank0(lambda: check_same_tokenizer(self.model_path, cfg.teacher.model))
        self.servers = self._launch_engines()
        self.teacher_server = self._launch_teacher()
        self.pools = EnginePools(cfg, self.rank).launch()  # pools.<name> (judges, verifiers): never weight-synced
        try:
            self._build(cfg, metrics_log)
        except BaseException:  # the engines launched above do not outlive a failed set-up
            for server in self.servers + [self.teacher_server]:
                if server is not None:
                    server.stop()
            self.pools.stop()
            raise

    def _build(self, cfg, metrics_log: bool) -> None:
        folder = init_parallel(cfg, self.model_path)
        self.groups = parallel.groups()
        self.pg = self.groups.mcore  # megatron-core's ProcessGroupCollection: passed to every collective below
        self.dp_rank, self.dp_size = self.groups.dp_rank, self.groups.dp_size
        self._batch: RolloutBatch | None = None  # a rollout worker: its share of the step's rollout (see _collect)
        self.producer: RolloutProducer | None = None  # rl.max_staleness > 0: the rollouts of the next steps
        self._queued: list[RolloutBatch] = []  # asynchronous rollouts restored from a checkpoint
        self.tok = ChatTokenizer.from_pretrained(self.model_path)
        updates = cfg.rl.steps * cfg.rl.ppo_epochs * cfg.rl.mini_batches
        self.policy = build_policy(folder, cfg.optim, updates, load=resolve_load(cfg),
                                   config_overrides=moe_config_overrides(cfg, folder), pg=self.pg)
        self.bridge = self.policy.bridge
        hf = folder.config  # the engine's routing per position: [layers, top-k] (MoE, rollout.return_routed_experts)
        self.routing_shape = (hf.num_hidden_layers, hf.num_experts_per_tok) if folder.is_moe else None
        use_ref = cfg.rl.ref_model if cfg.rl.ref_model is not None else cfg.algorithm.kl_coef > 0 or \
            cfg.rl.forgetting_kl  # the reference is the initial model: the forgetting KL's anchor
        self.ref = build_reference(self.bridge, self.policy.chunks) if use_ref else None
        self._offload_ref = self.ref is not None and cfg.rl.offload_ref and platform.on_gpu()
        self._place_ref("cpu")
        self.critic = build_critic(self.bridge, self.policy.chunks, cfg.optim, cfg.rl.critic_lr, updates) \
            if cfg.algorithm.use_critic else None
        self.ckpt_root = os.path.join(cfg.run_dir, "checkpoints")
        self.step, self.state = 0, {}
        self._start_rollout_side()
        self._resume()
        self.log = MetricsLog(cfg.run_dir, to_dict(cfg), cfg.logging.wandb, cfg.logging.project,
                              progress_total=cfg.rl.steps, progress=cfg.logging.progress) \
            if self.rank == 0 and metrics_log else None
        if self.log is not None:
            self.log.truncate_after(self.step)
            if self.log.bar is not None:
                self.log.bar.update(self.step)

    # ------------------------------------------------------------------------------------------------ set-up
    def _start_rollout_side(self) -> None:
        cfg = self.cfg
        # each rollout worker reads the training prompts and starts its own reward pool (a bad data file fails in
        # seconds, before anything waits for an engine); then rank 0 reads the held-out data and waits for its
        # engines. A failure on one rank reaches every rank.
        self.workers, self.worker_ranks = self._rollout_workers()
        on_ranks(self._start_worker, here=self.rank in self.worker_ranks)
        urls = on_rank0(self._start_rank0)
        teacher_urls = on_rank0(self._start_teacher) if cfg.teacher.enabled else []
        pool_urls = on_rank0(self.pools.wait_ready) if cfg.pools else {}
        self.clients = [EngineClient(server=s) for s in self.servers] if self.servers else \
            [EngineClient(url) for url in urls]
        if self.rank in self.worker_ranks:
            self.router = EngineRouter(self.clients, cfg.rollout.engine.router_policy)
            # opd: the teacher's engines are asked for log-probs only; they are not in self.clients, so no weight
            # sync ever reaches them
            teacher = Teacher([EngineClient(server=self.teacher_server) if self.teacher_server else EngineClient(u)
                               for u in teacher_urls]) if teacher_urls else None
            # the other pools (a judge's): their own routers, also never in self.clients (no weight sync)
            self.rollout = Rollout(cfg, self.tok, self.router, self.rewards, tools=self._tools, teacher=teacher,
                                   pools=self.pools.routers(pool_urls), eval_rewards=self.eval_rewards)
        e = cfg.rollout.engine
        self.syncs = []
        for i, client in enumerate(self.clients):
            t = TRANSPORTS[cfg.reshard.transport](client, TransportOptions(
                engine_tp=e.tp_size, folder=os.path.join(cfg.run_dir, "engine", f"weights-{i}"),
                # engines on other hosts join the group at rank 0's host name
                master_address=cfg.reshard.master_address or ("127.0.0.1" if self.servers else socket.gethostname())))
            self.syncs.append(WeightSync(self.bridge, self.policy.chunks, t, client if self.rank == 0 else None,
                                         SyncConfig(bucket_bytes=cfg.reshard.bucket_mb << 20,
                                                    verify_every=cfg.reshard.verify_every,
                                                    verify_checksums=cfg.reshard.verify_checksums,
                                                    probe_atol=cfg.reshard.probe_atol,
                                                    engine_dtype=getattr(torch, e.dtype) if e.dtype else None)))

    def _rollout_workers(self) -> tuple[Workers, list[int]]:
        """The ranks that run rollouts (rollout.workers), and this rank's place among them. A collective."""
        mode, leaders = self.cfg.rollout.workers, list(self.groups.leaders)
        if mode == "rank0":
            ranks = [0]
        elif mode == "dp_leaders" or self.cfg.rollout.engine.urls:
            ranks = leaders
        else:  # auto with engines this job started on rank 0's node, reachable at 127.0.0.1 from that node only
            hosts = [None] * dist.get_world_size()
            dist.all_gather_object(hosts, socket.gethostname())
            ranks = [r for r in leaders if hosts[r] == hosts[0]]
        group = dist.new_group(ranks) if len(ranks) > 1 else None  # every rank creates it (torch.distributed)
        here = ranks.index(self.rank) if self.rank in ranks else 0
        return Workers(here, len(ranks), group), ranks

    def _start_worker(self) -> None:
        cfg = self.cfg
        self._tools = prompt_tools(cfg)
        with about(f"data.train={cfg.data.train}"):
            self.train_records = load_prompts(cfg.data.train, self.tok, cfg.data, "train", self._tools)
        self.stream = PromptStream(self.train_records, cfg.seed, cfg.data.shuffle)
        self.rewards = RewardPool(cfg.reward.name, cfg.reward.workers, cfg.reward.timeout_s, cfg.reward.kwargs)
        # held-out evaluation (rank 0) with its own checker (reward.eval_name)
        self.eval_rewards = RewardPool(cfg.reward.eval_name, 1, cfg.reward.timeout_s) \
            if self.rank == 0 and cfg.reward.eval_name not in (None, cfg.reward.name) else None

    def _start_rank0(self) -> list:
        cfg, urls = self.cfg, list(self.cfg.rollout.engine.urls)
        eval_spec = cfg.data.eval or (cfg.data.train if cfg.data.train in PROCEDURAL else None)
        with about(f"data.eval={eval_spec}"):
            self.eval_records = load_prompts(eval_spec, self.tok, cfg.data, "eval", prompt_tools(cfg)) \
                if eval_spec else []
        if not urls:
            self.servers = self.servers or self._launch_engines(now=True)
            urls = [server.wait_ready().url for server in self.servers]
        return urls

    def _launch_engines(self, now: bool = False) -> list[SGLangServer]:
        """Rank 0 launches the engines this job runs itself (none with rollout.engine.urls). On CPU they are launched
        as soon as the model folder exists, so SGLang's start-up overlaps the trainer's model build; on a GPU they
        are launched only once the trainer holds its memory (now=True: SGLang sizes its KV cache from the memory free
        at its start, which must not race the trainer's allocations)."""
        cfg = self.cfg
        if self.rank != 0 or cfg.rollout.engine.urls or (platform.on_gpu() and not now):
            return []
        # the one ServerConfig builder (megarl.rollout.server); several engines on one node: own GPUs each
        return [SGLangServer(engine_server_config(cfg, self.model_path, i,
                                                  base_gpu_id=i * cfg.rollout.engine.tp_size if i else None)).launch()
                for i in range(cfg.rollout.engine.num_engines)]

    def _launch_teacher(self, now: bool = False) -> SGLangServer | None:
        """opd with teacher.model: rank 0 launches ONE more SGLang server for the teacher, through the policy engines'
        ServerConfig builder (its own log folder, TP size and dtype; GPUs after the policy engines'), at the same
        moment as those (see _launch_engines)."""
        cfg = self.cfg
        if self.rank != 0 or not cfg.teacher.model or (platform.on_gpu() and not now):
            return None
        return SGLangServer(pool_server_config(cfg, "teacher", cfg.teacher)).launch()  # the teacher is a pool too

    def _start_teacher(self) -> list[str]:
        """Rank 0: the teacher's URLs (teacher.urls, tokenizers checked where visible; or the server this job started,
        once it generates)."""
        if self.cfg.teacher.urls:
            Teacher([EngineClient(u) for u in self.cfg.teacher.urls]).check_tokenizer(self.model_path)
            return list(self.cfg.teacher.urls)
        self.teacher_server = self.teacher_server or self._launch_teacher(now=True)
        return [self.teacher_server.wait_ready().url]

    def _resume(self) -> None:
        path = latest_checkpoint(self.ckpt_root) if self.cfg.checkpoint.resume and \
            os.path.isdir(self.ckpt_root) else None
        if path is None:
            return
        self.state = load_checkpoint(path, self.policy.chunks, self.policy.optimizer, self.policy.scheduler,
                                     critic=self.critic)
        self.step = self.state["step"]
        if self.rank in self.worker_ranks:  # every worker keeps the same prompt stream
            # asynchronous RL: the finished, untrained rollouts saved with the checkpoint come first, then the
            # prompts after them; without them (another world size), their prompts are generated again
            self._queued = self.state.pop("rank_state", {}).get("rollouts", [])
            self.stream.load(self.state["data"] if self._queued else self.state.get("data_untrained",
                                                                                   self.state["data"]))
            logger.info("resumed from %s (step %d, %d rollouts ahead)", path, self.step, len(self._queued))

    # ------------------------------------------------------------------------------------------- the RL step
    def step_once(self, step: int) -> dict:
        cfg, timer = self.cfg, PhaseTimer()
        start = time.perf_counter()

        # 1. Rollout: the rollout workers (rollout.workers) ask the engines for n samples per prompt of their share
        #    and score them, pack them as tensors and agree on the plan (whole groups per DP rank, balanced tokens,
        #    micro-batches by token budget).
        #    With rl.max_staleness > 0 the producer thread collected it while earlier steps trained.
        with timer("rollout"):
            self._batch = on_ranks(lambda: self.producer.take(step) if self.producer else self._collect(step),
                                   here=self.rank in self.worker_ranks)
        stats = dict(self._batch.stats) if self._batch is not None else {}
        self._engines("release_memory")  # colocated GPUs: the engine's memory goes to training (no-op on CPU)

        # 2. This DP rank's rows, and only those, arrive as tensors (megarl.trainer.dispatch).
        with timer("dispatch"):
            held = self._batch or RolloutBatch(step, [], None, None, {}, {}, {})
            got = dispatch(held.packed, held.plan, self.groups, sources=tuple(self.worker_ranks))
            rb = RankBatch(got.share.token_batch(got.rows, got.seq_len, self.tok.pad_id, self._routing_shape()),
                           got.share, got.num_microbatches)
        batch = rb.batch
        engine_routing = batch.routed_experts  # MoE: the experts the engine used; replayed only with R3
        if not cfg.rollout.routing_replay:
            batch.routed_experts = None
        if cfg.rl.dump_rollouts:
            self._dump(step, rb)

        # 3. Reference and old-policy log-probs of the engine's tokens.
        with timer("ref"):
            batch.ref_log_probs = self._ref_log_probs(rb) if self.ref is not None else None
        with timer("old_log_prob"):
            routing = RoutingStats(self.policy.chunks) \
                if engine_routing is not None and cfg.rollout.old_log_probs == "recompute" else None
            batch.old_log_probs, old_entropy = self._log_probs(self.policy.model, rb, entropy=True) \
                if cfg.rollout.old_log_probs == "recompute" else (batch.rollout_log_probs, None)
        mismatch = self._mismatch(batch) if cfg.rollout.old_log_probs == "recompute" else {}
        if old_entropy is not None:
            mismatch.update(self._entropy_dynamics(old_entropy, batch.loss_mask))
        if routing is not None:
            mismatch.update(self._routing_metrics(routing, engine_routing, rb))
        if cfg.rl.max_staleness:
            mismatch.update(self._staleness_metrics(rb, step))

        # 4. Advantages (groups are whole on this rank; batch-level statistics reduce over DP); with a critic, its
        #    values at rollout time and GAE returns.
        if self.critic is not None:
            with timer("values"):
                batch.old_values = _on_every_stage(compute_values(self.critic.model, batch, rb.num_microbatches,
                                                                  pack=cfg.algorithm.pack_sequences, pg=self.pg),
                                                   batch.loss_mask)
        with timer("advantages"):
            batch.advantages, batch.returns = self._advantages(rb)
        if cfg.algorithm.advantage_estimator in RETURNS_TEACHER_LOG_RATIO:  # returns: teacher - student log-prob
            sums = torch.stack([-(batch.returns * batch.loss_mask).sum(), batch.loss_mask.sum()]).double()
            dist.all_reduce(sums, group=self.pg.dp)
            mismatch["opd/reverse_kl"] = float(sums[0] / sums[1].clamp(min=1))  # sampled KL(student || teacher)

        # 5. PPO epochs x mini-batches, each one optimizer step through Megatron's schedule.
        train = []
        tracker = UpdateSparsity(self.policy.chunks, self.pg, self.bridge.vocab_size).snapshot() \
            if cfg.rl.log_update_sparsity else None  # RL dynamics: parameters the step's updates change
        with timer("train"):
            rows = batch.input_ids.shape[0] // cfg.rl.mini_batches
            for epoch in range(cfg.rl.ppo_epochs):
                for k in range(cfg.rl.mini_batches):
                    part, num_mb = slice(k * rows, (k + 1) * rows), max(1, rb.num_microbatches // cfg.rl.mini_batches)
                    # One optimizer step per phase (megarl.algorithms.token_selection: Lopti's two, else one), each
                    # normalised by its own global token count; the phases share the mini-batch's learning rate.
                    phases = loss_phases(batch.rows(part), cfg.algorithm, group=self.pg.dp,
                                         entropy=old_entropy[part] if old_entropy is not None else None,
                                         seed=((cfg.seed * 1_000_003 + step) * 1009 + epoch) * 101 + k)
                    for phase in phases:
                        train.append(train_step(self.policy.model, self.policy.optimizer, self._prepare(phase), num_mb,
                                                cfg.algorithm, self.bridge.vocab_size, pg=self.pg))
                    self.policy.scheduler.step(1)
                    if self.critic is not None:
                        critic = train_step(self.critic.model, self.critic.optimizer, self._prepare(batch.rows(part)),
                                            num_mb, cfg.algorithm, self.bridge.vocab_size, objective="value",
                                            pg=self.pg)
                        self.critic.scheduler.step(1)
                        for metrics in train[-len(phases):]:
                            metrics.update({f"critic/{k}": v for k, v in critic.items()})

        # 6. Reshard: the engines get the new weights (verified on the first sync and every reshard.verify_every).
        with timer("reshard"):
            sync_stats = self.sync_weights(step)

        metrics = {k: sum(t[k] for t in train) / len(train) for k in train[0]}
        if tracker is not None:
            changed, total = tracker.changed()
            metrics["dynamics/update_changed_frac"] = changed / max(total, 1.0)
        metrics.update(**stats, **mismatch, **timer.take())
        metrics.update({f"reshard/{k}": v for k, v in sync_stats.items() if isinstance(v, (int, float))})
        elapsed = time.perf_counter() - start
        metrics.update({"time/step_s": elapsed, "time/step_start": start - self.started,
                        "dispatch/bytes_received": got.bytes_received})
        if self.rank in self.worker_ranks:
            metrics["perf/tokens_per_s"] = metrics["rollout/tokens"] / elapsed
            if self.producer is not None:  # the share of the step's wall time the engines spent generating
                busy = self.producer.busy_s()
                metrics["async/rollout_busy_frac"] = min(1.0, (busy - self._busy_before) / elapsed)
                self._busy_before = busy
        return metrics

    def _routing_shape(self) -> tuple[int, int] | None:
        return self.routing_shape if self.cfg.rollout.engine_routing else None

    def _collect(self, step: int) -> RolloutBatch:
        """A rollout worker (the main thread, or the producer thread with rl.max_staleness > 0): its share of the
        step's samples (kept for metrics and dumps), packed under their step-wide indices (group * n_samples + j),
        the step's plan from every sample's length, and the rollout statistics; sums over the workers (the same on
        every worker). Only the workers' own group is used: the main thread's collectives run meanwhile."""
        cfg, n = self.cfg, self.cfg.rollout.n_samples
        before, started = self.stream.state(), time.perf_counter() - self.started
        samples, stats = self.rollout.collect(self.stream, step, self.workers)
        packed = PackedRollout.from_samples(samples, routing=self._routing_shape() is not None, group_size=n,
                                            teacher=cfg.teacher.enabled, versions=cfg.rl.max_staleness > 0,
                                            teacher_top_k=cfg.algorithm.opd_top_k)
        plan = BatchPlan.from_workers(packed, cfg.rollout.prompts_per_step * n, n, self.workers.sum, self.dp_size,
                                      self.pg.tp.size(), cfg.rl.max_tokens_per_microbatch,
                                      row_multiple=cfg.rl.mini_batches)
        stats.update(rollout_metrics(samples, self.workers, version_name(step - 1) if step > 1 else None))
        errors = self.workers.sum(torch.tensor([float(self.rewards.take_errors())]))
        stats["reward/errors"] = int(errors[0])
        if cfg.rl.max_staleness:
            versions = sample_version_stats(samples)
            (partial, count), oldest = self.workers.sum(versions[:2].clone()).tolist(), -self.workers.max(-versions[2:])
            stats.update({"async/partial_sample_frac": partial / max(count, 1),
                          "async/max_lag": step - 1 - float(oldest[0]) if count else 0.0})
        # when this worker generated it, in seconds since the trainer started (benchmarks/async_rl.py's timeline)
        stats.update({"time/generate_start": started, "time/generate_end": time.perf_counter() - self.started})
        return RolloutBatch(step, samples, packed, plan, stats, before, self.stream.state())

    def _dump(self, step: int, rb: RankBatch) -> None:
        """Each rollout worker: the engine's samples it generated (read them back with dumped_samples); the first
        TP/PP rank of each DP rank: the token rows it trains on."""
        folder = os.path.join(self.cfg.run_dir, "rollouts")
        os.makedirs(folder, exist_ok=True)
        if self.rank in self.worker_ranks:
            with open(os.path.join(folder, f"step_{step:06d}.worker{self.workers.index}.jsonl"), "w") as f:
                for index, s in zip(self._batch.packed.sample_index.tolist(), self._batch.samples):
                    f.write(json.dumps({"sample": index, "group": s.group, "prompt_index": s.prompt_index,
                                        "prompt_ids": _listed(s.prompt_ids),
                                        "response_ids": _listed(s.response_ids),
                                        "rollout_log_probs": _listed(s.rollout_log_probs), "reward": s.reward,
                                        "token_versions": _listed(s.token_versions),
                                        "finish_reason": s.finish_reason, "loss_mask": _listed(s.loss_mask),
                                        "extra": s.extra}) + "\n")
        if self.pg.tp.rank() == 0 and self.pg.pp.rank() == 0:
            with open(os.path.join(folder, f"step_{step:06d}.dp{self.dp_rank}.train.jsonl"), "w") as f:
                for row, (index, n) in enumerate(zip(rb.sample_index, rb.samples.seq_lens.tolist())):
                    f.write(json.dumps({"sample": index, "input_ids": rb.batch.input_ids[row, :n].tolist(),
                                        "trained": rb.batch.targets[row][rb.batch.loss_mask[row] > 0].tolist()})
                            + "\n")

    def _place_ref(self, device: str) -> None:
        """GPU with rl.offload_ref: the reference lives in host memory except while it computes log-probs."""
        if not self._offload_ref:
            return
        for chunk in self.ref:
            chunk.to(device if device == "cpu" else torch.cuda.current_device())
        if device == "cpu":
            torch.cuda.empty_cache()

    def _ref_log_probs(self, rb: RankBatch) -> torch.Tensor:
        self._place_ref("cuda")
        try:
            return self._log_probs(self.ref, rb)
        finally:
            self._place_ref("cpu")

    def _log_probs(self, model: list, rb: RankBatch, entropy: bool = False):
        """Log-probs [b, s] on every stage (zeros off the last); entropy=True: (log-probs, entropies)."""
        out = compute_log_probs(model, rb.batch, rb.num_microbatches, self.bridge.vocab_size,
                                temperature=self.cfg.algorithm.temperature, entropy=entropy,
                                fused=self.cfg.algorithm.fused_logprobs, pack=self.cfg.algorithm.pack_sequences,
                                pg=self.pg)
        if not entropy:
            return _on_every_stage(out, rb.batch.loss_mask)
        return tuple(self._from_last_stage(x, rb.batch.loss_mask) for x in (out if out is not None else (None, None)))

    def _from_last_stage(self, values: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """The last pipeline stage's per-token values on every stage: token selections (loss_phases) must agree on
        all ranks of a DP replica."""
        pp = self.pg.pp
        out = values.contiguous() if values is not None else torch.zeros_like(like)
        if dist.get_world_size(pp) > 1:
            dist.broadcast(out, src=dist.get_global_rank(pp, dist.get_world_size(pp) - 1), group=pp)
        return out

    def _prepare(self, batch):
        cfg = self.cfg.algorithm
        return prepare_global_batch(batch, cfg.aggregation, cfg.norm_length, self.pg.dp, seq_multiple=self.pg.tp.size())

    def _entropy_dynamics(self, entropy: torch.Tensor, mask: torch.Tensor) -> dict:
        """RL dynamics: the old policy's mean entropy over the top 20% highest-entropy response tokens of the global
        batch and over the other 80% (threshold over all DP ranks; summed over the ranks that hold results)."""
        sums = entropy_split(entropy, mask, 0.2, self.pg.dp) * holds_results(self.pg)
        dist.all_reduce(sums)
        return {"dynamics/entropy_top20": float(sums[0] / sums[1].clamp(min=1)),
                "dynamics/entropy_rest80": float(sums[2] / sums[3].clamp(min=1))}

    def _mismatch(self, batch) -> dict:
        """Trainer vs engine on the same tokens before any update: |old log-prob - rollout log-prob| over the global
        batch (only the last pipeline stage's TP-rank-0 ranks hold log-probs; the others add zeros)."""
        holder = holds_results(self.pg)
        diff = (batch.old_log_probs - batch.rollout_log_probs).abs() * batch.loss_mask
        sums = torch.stack([diff.sum(), batch.loss_mask.sum()]).double() * holder
        peak = diff.max().double().reshape(1) * holder if diff.numel() else torch.zeros(1, dtype=torch.float64)
        dist.all_reduce(sums)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return {"mismatch/logprob_abs_diff": float(sums[0] / sums[1].clamp(min=1)),
                "mismatch/logprob_abs_diff_max": float(peak[0])}

    def _staleness_metrics(self, rb: RankBatch, step: int) -> dict:
        """Asynchronous RL: trained tokens per lag (steps between the weights that sampled a token and the policy the
        step updates), and the trainer-engine log-prob mismatch per lag (over the global batch)."""
        k, batch = self.cfg.rl.max_staleness, rb.batch
        versions = rb.samples.per_token(rb.samples.token_versions.float(), *batch.loss_mask.shape)  # 0 off the mask
        tokens = lag_stats(versions, batch.loss_mask, step, k)
        diff = (batch.old_log_probs - batch.rollout_log_probs).abs() * batch.loss_mask
        lag = (step - 1 - versions.long()).clamp(0, k + 1)
        sums = torch.zeros(2, k + 2, dtype=torch.float64)
        sums[0] = tokens * holds_results(self.pg)
        sums[1].index_add_(0, lag.reshape(-1), diff.double().reshape(-1) * holds_results(self.pg))
        dist.all_reduce(sums)
        total = sums[0].sum().clamp(min=1)
        out = {f"async/lag{j}_token_frac": float(sums[0, j] / total) for j in range(k + 1)}
        out["async/stale_token_frac"] = float(sums[0, k + 1] / total)  # older than allowed: 0 by construction
        out.update({f"mismatch/logprob_abs_diff_lag{j}": float(sums[1, j] / sums[0, j].clamp(min=1))
                    for j in range(k + 1)})
        return out

    def _routing_metrics(self, routing: RoutingStats, engine_routing: torch.Tensor, rb: RankBatch) -> dict:
        """MoE: how often the routing of the old-log-prob forward (the trainer's own, or the engine's under R3) picked
        the engine's experts, expert load balance and dropped tokens, all over each sample's positions but its last
        (whose output is never trained, and which the engine never routed): padding never counts. Summed over all
        ranks (each pipeline stage holds its own layers)."""
        routing.close()
        positions = (torch.arange(rb.batch.input_ids.shape[1]) < rb.samples.seq_lens[:, None] - 1).float()
        positions = torch.cat([positions, positions.new_zeros(rb.batch.input_ids.shape[0] - len(positions),
                                                              positions.shape[1])])
        layouts = schedule_layouts(self.policy.model, rb.batch.split(rb.num_microbatches),
                                   self.cfg.algorithm.pack_sequences, pg=self.pg)  # the old-log-prob forward's order
        counted = (positions, rb.num_microbatches, layouts)  # the samples' routed tokens, as the engine routed them
        stats = torch.cat([routing.agreement(engine_routing, *counted), routing.assignments(*counted)])
        load = routing.load(self.bridge.config.num_layers, self.bridge.config.num_moe_experts, *counted)
        dist.all_reduce(stats)
        dist.all_reduce(load)  # each stage fills its own layers' rows
        return {"moe/routing_agreement": float(stats[0] / stats[1].clamp(min=1)),
                "moe/dropped_token_frac": float(1 - stats[2] / stats[3].clamp(min=1)), **load_balance_metrics(load)}

    def _advantages(self, rb: RankBatch) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, batch, real = self.cfg.algorithm, rb.batch, rb.samples.num_samples
        advantages, returns = torch.zeros_like(batch.loss_mask), torch.zeros_like(batch.loss_mask)
        scores, groups = rb.samples.score, rb.samples.group
        kl = None
        if cfg.kl_in_reward and batch.ref_log_probs is not None:
            kl = kl_estimate(batch.old_log_probs[:real], batch.ref_log_probs[:real], cfg.kl_estimator)
        values = batch.old_values[:real] if batch.old_values is not None else None
        teacher = rb.samples.teacher_log_probs  # opd: A_t = teacher - student, student = the old log-probs
        teacher = rb.samples.per_token(teacher, *batch.loss_mask.shape)[:real] if teacher is not None else None
        adv, ret = compute_advantages(cfg.advantage_estimator, scores=scores, group_ids=groups,
                                      mask=batch.loss_mask[:real], kl=kl, kl_coef=cfg.kl_coef, gamma=cfg.gamma,
                                      lam=cfg.lam, reward_weights=cfg.reward_weights, values=values,
                                      std_normalize=cfg.std_normalize, whiten_advantages=cfg.whiten_advantages,
                                      group=self.pg.dp, baseline=rb.samples.baseline, teacher_log_probs=teacher,
                                      student_log_probs=batch.old_log_probs[:real],
                                      opd_reward_weight=cfg.opd_reward_weight, opd_top_k=cfg.opd_top_k)
        advantages[:real], returns[:real] = adv, ret
        return advantages, returns

    # ------------------------------------------------------------------------------------------ engine side
    def _engines(self, method: str) -> None:
        if self.rank == 0 and platform.on_gpu() and not self.cfg.rollout.engine.urls:
            for client in self.clients:
                getattr(client, method)()

    def sync_weights(self, version: int, verify: bool | None = None) -> dict:
        """Push the weights after step `version` into the policy engines. With asynchronous rollouts in flight:
        partial rollouts pause the engines (their requests abort and continue under the new weights), verification
        runs once they generate again; the fixed schedule first waits for the rollout sampled from the old weights."""
        self._engines("resume_memory")
        partial = self.producer is not None and self.cfg.rl.partial_rollouts
        if self.producer is not None and not partial:
            self.producer.wait_generated(version + self.cfg.rl.max_staleness)
        if partial and self.rank == 0:
            self.router.pause_for_update()
        stats, due = {}, []
        try:
            for sync in self.syncs:
                due.append(sync.due(version) if verify is None else verify)
                stats = sync.sync(version_name(version), verify=False if partial else due[-1])
        finally:
            if partial and self.rank == 0:
                self.router.continue_after_update()
        if partial:
            for sync, check in zip(self.syncs, due):
                if check:
                    stats.update(sync.verify())
        if self.producer is not None:
            self.producer.set_version(version)
        return stats

    def evaluate(self, tag) -> dict:
        """Held-out evaluation on rank 0 (pass@k, maj@n, tool use); its pass@k curve is kept for the plot."""
        cfg = self.cfg

        def run():
            if not self.eval_records:
                return {}
            temperature = cfg.rl.eval_temperature if cfg.rl.eval_temperature is not None else cfg.rollout.temperature
            result, curve = self.rollout.evaluate(self.eval_records, cfg.rl.eval_samples, temperature, tag)
            self.state.setdefault("eval_curves", {})[str(tag)] = curve
            return result

        result = on_rank0(run) or {}
        if cfg.rl.forgetting_kl:
            result.update(self._forgetting_kl(tag))
        return result

    def _forgetting_kl(self, tag) -> dict:
        """eval/kl_to_initial (k3) and eval/kl_to_initial_k1: KL(policy || initial model) on one response per held-out
        prompt sampled by the engine (current weights), split over the DP ranks. A collective."""
        cfg = self.cfg

        def sample():
            samples = self.rollout.generate(self.eval_records, 1, (cfg.seed, "forgetting", tag),
                                            cfg.rollout.temperature, cfg.rollout.max_new_tokens)
            return [(list(s.prompt_ids), list(s.response_ids), s.loss_mask) for s in samples]

        mine = (on_rank0(lambda: sample() if self.eval_records else []) or [])[self.dp_rank::self.dp_size]
        mine = mine or [([self.tok.pad_id], [self.tok.pad_id], [0])]  # no prompt here: one row that counts nothing
        ids, targets, mask = shift_sequences([p for p, _, _ in mine], [r for _, r, _ in mine], self.tok.pad_id)
        mask = mask * place_response_values([[1] * len(r) if m is None else list(m) for _, r, m in mine],
                                            [len(p) for p, _, _ in mine], mask.shape[1])  # tool outputs: not sampled
        batch = TokenBatch(input_ids=ids, targets=targets, loss_mask=mask)
        args = dict(vocab_size=self.bridge.vocab_size, temperature=cfg.algorithm.temperature,
                    fused=cfg.algorithm.fused_logprobs, pack=cfg.algorithm.pack_sequences, pg=self.pg)
        policy = compute_log_probs(self.policy.model, batch, 1, **args)
        self._place_ref("cuda")
        try:
            initial = compute_log_probs(self.ref, batch, 1, **args)
        finally:
            self._place_ref("cpu")
        sums = kl_sums(policy, initial, mask) if holds_results(self.pg) else torch.zeros(3, dtype=torch.float64)
        dist.all_reduce(sums)
        return {"eval/kl_to_initial": float(sums[0] / sums[2].clamp(min=1)),
                "eval/kl_to_initial_k1": float(sums[1] / sums[2].clamp(min=1))}

    # --------------------------------------------------------------------------------------------- the run
    def train(self) -> dict:
        cfg = self.cfg
        self.stop = StopRequest(cfg.run_dir, self.rank, "cuda" if platform.on_gpu() else "cpu")
        self.sync_weights(self.step, verify=True)  # the engines start from the trainer's weights
        if self.step == 0:
            self.state["eval_before"] = self.evaluate("before")
            if self.log is not None and self.state["eval_before"]:
                self.log.log(0, self.state["eval_before"])
        if cfg.rl.max_staleness and self.rank in self.worker_ranks:
            self.producer = RolloutProducer(self._collect, self.step + 1, cfg.rl.steps, cfg.rl.max_staleness,
                                            self.step, ready=self._queued)
            self._busy_before = 0.0
        while self.step < cfg.rl.steps:
            step = self.step + 1
            metrics = self.step_once(step)
            if cfg.rl.eval_every and step % cfg.rl.eval_every == 0 and step < cfg.rl.steps:
                metrics.update(self.evaluate(step))
            self.step = step
            if self.log is not None:
                self.log.log(step, metrics, show=("reward/mean", "eval/pass_at_1", "loss"))
            if self.stop.requested() and step < cfg.rl.steps:  # preemption: save this step and leave
                self.save()
                self.stop.acknowledge(step)
                return {"preempted": True, "steps": step, "run_dir": cfg.run_dir}
            if cfg.checkpoint.save_every and step % cfg.checkpoint.save_every == 0 and step < cfg.rl.steps:
                self.save()
        after = self.evaluate("after")
        if self.log is not None and after:
            self.log.log(self.step, after)
            self._plot_pass_at_k()
        self.save()
        if cfg.checkpoint.export_hf:
            self.bridge.save_hf(self.policy.chunks, os.path.join(cfg.run_dir, "hf"))
        return self._summary(after)

    def _plot_pass_at_k(self) -> None:
        """<run_dir>/pass_at_k.png and .json: the held-out pass@k curves before and after training."""
        from ..evaluation import plot_pass_at_k

        curves = {tag: {int(k): v for k, v in c.items()} for tag, c in self.state.get("eval_curves", {}).items()
                  if tag in ("before", "after")}
        if curves:
            with open(os.path.join(self.cfg.run_dir, "pass_at_k.json"), "w") as f:
                json.dump(curves, f, indent=1)
            plot_pass_at_k(curves, os.path.join(self.cfg.run_dir, "pass_at_k.png"), title="held-out pass@k (%)")

    def save(self) -> None:
        """A checkpoint of the step just trained. Asynchronous RL: the rollout in progress is finished first, and each
        worker's finished, untrained rollouts are saved with it (the prompt cursor after them; data_untrained: the
        cursor before them, for a resume that cannot read them back)."""
        ahead = self.producer.drain() if self.producer is not None else []
        try:
            state = dict(self.state, data=self.stream.state()) if self.rank == 0 else {}  # rank 0 writes it
            if ahead and self.rank == 0:
                state["data_untrained"] = ahead[0].cursor_before
            save_checkpoint(self.ckpt_root, self.step, self.policy.chunks, self.policy.optimizer,
                            self.policy.scheduler, state, keep=self.cfg.checkpoint.keep, critic=self.critic,
                            rank_state={"rollouts": ahead} if self.producer is not None else None)
        finally:
            if self.producer is not None:
                self.producer.release()

    def _summary(self, after: dict) -> dict:
        before = self.state.get("eval_before") or {}
        summary = {"pass_at_1_before": before.get("eval/pass_at_1"), "pass_at_1_after": after.get("eval/pass_at_1"),
                   "wall_s": time.perf_counter() - self.started, "seed": self.cfg.seed, "steps": self.step,
                   "run_dir": self.cfg.run_dir}
        if self.rank == 0:
            with open(os.path.join(self.cfg.run_dir, "rl_summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
        return summary

    def close(self) -> None:
        if self.producer is not None:
            self.producer.stop()
        for sync in self.syncs:
            sync.close()
        if self.rank in self.worker_ranks:
            self.rollout.close()
            self.rewards.close()
            if self.eval_rewards is not None:
                self.eval_rewards.close()
            if self.log is not None:
                self.log.close()
        for server in self.servers + [self.teacher_server]:
            if server is not None:
                server.stop()
        self.pools.stop()
