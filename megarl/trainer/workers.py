"""The rollout side of the RL trainer: the ranks that generate each step's samples (rollout.workers), their prompt
stream and reward pools, the Rollout that asks the engines and scores, and, under rl.max_staleness, the producer
thread that collects the next steps' rollouts while earlier steps train.

    inputs = rollout_inputs(cfg)  # what the rollout side reads of the run (megarl.trainer.config)
    side = RolloutWorkers(inputs, tok, groups, rank, started, routing_shape)  # a collective: picks workers, reads data
    side.connect(fleet)           # after the engines are up: routers and the Rollout
    batch = side.take(step)       # a worker's share of the step (None elsewhere)
"""
from __future__ import annotations

import json
import logging
import os
import socket
import time

import torch
import torch.distributed as dist

from ..data import load_prompts
from ..errors import PeerFailed, UserError, about, on_ranks
from ..rollout.client import engine_unavailable
from ..rewards import RewardPool
from ..rewards.judge import reward_judges
from ..rollout import EngineRouter
from .async_rollout import RolloutBatch, RolloutProducer, sample_version_stats, version_name
from .batching import BatchPlan, PackedRollout
from .config import RewardConfig, RolloutInputs
from .rollout import PromptStream, Rollout, Workers, rollout_metrics
from .setup import prompt_tools

logger = logging.getLogger("megarl")


def choose_workers(mode: str, remote_engines: bool, groups, rank: int) -> tuple[Workers, list[int]]:
    """The ranks that run rollouts (rollout.workers: rank0 | dp_leaders | auto), and this rank's place among them. A
    collective."""
    leaders = list(groups.leaders)
    if mode == "rank0":
        ranks = [0]
    elif mode == "dp_leaders" or remote_engines:
        ranks = leaders
    else:  # auto with engines this job started on rank 0's node, reachable at 127.0.0.1 from that node only
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname())
        ranks = [r for r in leaders if hosts[r] == hosts[0]]
    group = dist.new_group(ranks) if len(ranks) > 1 else None  # every rank creates it (torch.distributed)
    return Workers(ranks.index(rank) if rank in ranks else 0, len(ranks), group), ranks


def recoverable(error: BaseException) -> bool:
    """A rollout that failed because no engine could generate (or because another worker's did): the producer
    collects it again once the trainer has pushed its weights into the restarted engines."""
    return engine_unavailable(error) or isinstance(error, PeerFailed)


def reward_pools(reward: RewardConfig, rank: int) -> tuple[RewardPool, RewardPool | None]:
    """The reward section's pool, and on rank 0 the held-out evaluation's own checker (reward.eval_name; None when it
    is the training reward)."""
    pool = RewardPool(reward.name, reward.workers, reward.timeout_s, reward.kwargs)
    checker = RewardPool(reward.eval_name, 1, reward.timeout_s, field="reward.eval_name") \
        if rank == 0 and reward.eval_name not in (None, reward.name) else None
    return pool, checker


def build_rollout(inputs: RolloutInputs, tok, router, rewards: RewardPool, *, pool_routers: dict | None = None,
                  teacher=None, eval_rewards: RewardPool | None = None) -> Rollout:
    """The Rollout of a run's rollout side (RolloutWorkers, megarl eval): its sections and values, with the tools the
    prompts render, the judges reward.name asks for over the pools' routers ({name: EngineRouter},
    megarl.rollout.pools), the teacher (opd: a megarl.rollout.teacher.Teacher) and the held-out checker."""
    judge, quality = reward_judges(inputs.reward, inputs.pools, pool_routers or {}, inputs.rollout.deterministic)
    return Rollout(inputs.rollout, inputs.env, tok, router, rewards, seed=inputs.seed, partial=inputs.partial,
                   greedy_baseline=inputs.greedy_baseline, opd_top_k=inputs.opd_top_k, progress=inputs.progress,
                   judge=judge, verification_quality=quality, tools=prompt_tools(inputs.env), teacher=teacher,
                   eval_rewards=eval_rewards)


def _listed(values):
    """JSON-ready: arrays (what the rollout holds) as lists; None stays None."""
    return values.tolist() if hasattr(values, "tolist") else values


class RolloutWorkers:
    """inputs: what the rollout side reads of the run (megarl.trainer.config.rollout_inputs); started: the trainer's
    start (time.perf_counter), for the generation timeline; routing_shape: MoE with the engine's routing."""

    def __init__(self, inputs: RolloutInputs, tok, groups, rank: int, started: float,
                 routing_shape: tuple[int, int] | None):
        self.inputs, self.tok, self.rank, self.started = inputs, tok, rank, started
        self.tp_size, self.dp_size = groups.mcore.tp.size(), groups.dp_size
        self.routing_shape = routing_shape  # MoE with the engine's routing: [layers, top-k] per position
        engine = inputs.rollout.engine
        self.workers, self.ranks = choose_workers(inputs.rollout.workers, bool(engine.urls), groups, rank)
        self.here = rank in self.ranks
        self.batch: RolloutBatch | None = None  # this worker's share of the current step's rollout
        self.producer: RolloutProducer | None = None
        self.queued: list[RolloutBatch] = []  # asynchronous rollouts restored from a checkpoint
        self.rollout = self.rewards = self.eval_rewards = self.router = None
        self._busy_before = 0.0
        # each worker reads the training prompts and starts its reward pool: a bad data file fails in seconds, before
        # anything waits for an engine; a failure on one rank reaches every rank
        on_ranks(self._start, here=self.here)

    def _start(self) -> None:
        data = self.inputs.data
        with about(f"data.train={data.train}"):
            records = load_prompts(data.train, self.tok, data, "train", prompt_tools(self.inputs.env))
        self.stream = PromptStream(records, self.inputs.seed, data.shuffle)
        self.rewards, self.eval_rewards = reward_pools(self.inputs.reward, self.rank)

    def connect(self, fleet) -> None:
        """The workers' router over the policy engines, and the Rollout (with the teacher and the pools)."""
        if self.here:
            self.router = EngineRouter(fleet.clients, self.inputs.rollout.engine.router_policy,
                                       self.inputs.rollout.min_engines)
            self.rollout = build_rollout(self.inputs, self.tok, self.router, self.rewards,
                                         pool_routers=fleet.pool_routers(), teacher=fleet.teacher(),
                                         eval_rewards=self.eval_rewards)

    def resume(self, state: dict, step: int, path: str) -> None:
        """Every worker keeps the same prompt stream. Asynchronous RL: the finished, untrained rollouts saved with the
        checkpoint come first, then the prompts after them; without them (another world size), their prompts are
        generated again."""
        if self.here:
            self.queued = state.pop("rank_state", {}).get("rollouts", [])
            self.stream.load(state["data"] if self.queued else state.get("data_untrained", state["data"]))
            logger.info("resumed from %s (step %d, %d rollouts ahead)", path, step, len(self.queued))

    def start_producer(self, step: int) -> None:
        """rl.max_staleness > 0: the producer thread collects the rollouts of the steps after `step`."""
        inputs = self.inputs
        if inputs.max_staleness and self.here:
            self.producer = RolloutProducer(self.collect, step + 1, inputs.steps, inputs.max_staleness, step,
                                            ready=self.queued, recoverable=recoverable)

    def take(self, step: int) -> RolloutBatch | None:
        """This worker's share of the step's rollout (the producer's, or collected now); None off the workers. When a
        worker fails (e.g. no engine could generate), every worker keeps its prompt stream (or the producer its
        rollout) as it was, so the step can be taken again."""
        taken = []

        def take() -> RolloutBatch:
            taken.append(self.producer.take(step) if self.producer else self.collect(step))
            return taken[-1]

        try:
            self.batch = on_ranks(take, here=self.here)
        except UserError:
            if taken and self.producer is not None:
                self.producer.put_back(taken[0])
            elif taken:
                self.stream.load(taken[0].cursor_before)
            raise
        return self.batch

    def engines_synced(self, version: str, retired) -> None:
        """After a weight sync (a collective): the workers' routers leave the retired engines out, take the others
        again (each holds `version` now) and accept tokens sampled by it; a producer that waited for them goes on."""
        def update() -> None:
            self.router.retire(sorted(retired))
            self.router.weights_pushed(version)
            if self.producer is not None:
                self.producer.engines_restored()

        on_ranks(update, here=self.here)

    def collect(self, step: int) -> RolloutBatch:
        """A rollout worker (the main thread, or the producer thread with rl.max_staleness > 0): its share of the
        step's samples (kept for metrics and dumps), packed under their step-wide indices (group * n_samples + j),
        the step's plan from every sample's length, and the rollout statistics; sums over the workers (the same on
        every worker). Only the workers' own group is used: the main thread's collectives run meanwhile."""
        inputs, n = self.inputs, self.inputs.rollout.n_samples
        before, started = self.stream.state(), time.perf_counter() - self.started
        try:
            samples, stats = self.rollout.collect(self.stream, step, self.workers)
        except BaseException:  # nothing was consumed: the step is collected again from the same prompts
            self.stream.load(before)
            raise
        packed = PackedRollout.from_samples(samples, routing=self.routing_shape is not None, group_size=n,
                                            teacher=inputs.teacher, versions=inputs.max_staleness > 0,
                                            teacher_top_k=inputs.opd_top_k)
        plan = BatchPlan.from_workers(packed, inputs.rollout.prompts_per_step * n, n, self.workers.sum, self.dp_size,
                                      self.tp_size, inputs.max_tokens_per_microbatch, row_multiple=inputs.mini_batches)
        stats.update(rollout_metrics(samples, self.workers, version_name(step - 1) if step > 1 else None))
        errors = self.workers.sum(torch.tensor([float(self.rewards.take_errors()),
                                                float(self.rewards.take_worker_failures())]))
        stats["reward/errors"], stats["reward/worker_failures"] = int(errors[0]), int(errors[1])
        if inputs.max_staleness:
            versions = sample_version_stats(samples)
            (partial, count), oldest = self.workers.sum(versions[:2].clone()).tolist(), -self.workers.max(-versions[2:])
            stats.update({"async/partial_sample_frac": partial / max(count, 1),
                          "async/max_lag": step - 1 - float(oldest[0]) if count else 0.0})
        # when this worker generated it, in seconds since the trainer started (benchmarks/async_rl.py's timeline)
        stats.update({"time/generate_start": started, "time/generate_end": time.perf_counter() - self.started})
        return RolloutBatch(step, samples, packed, plan, stats, before, self.stream.state())

    def step_stats(self, elapsed: float) -> dict:
        """The step's rollout statistics (workers), with its throughput and the share of its wall time the engines
        spent generating (asynchronous RL)."""
        if self.batch is None:
            return {}
        out = dict(self.batch.stats)
        out["perf/tokens_per_s"] = out["rollout/tokens"] / elapsed
        if self.producer is not None:
            busy = self.producer.busy_s()
            out["async/rollout_busy_frac"] = min(1.0, (busy - self._busy_before) / elapsed)
            self._busy_before = busy
        return out

    def dump(self, step: int, folder: str) -> None:
        """The engine samples this worker generated for the step (read them back with rl.dumped_samples)."""
        if not self.here:
            return
        with open(os.path.join(folder, f"step_{step:06d}.worker{self.workers.index}.jsonl"), "w") as f:
            for index, s in zip(self.batch.packed.sample_index.tolist(), self.batch.samples):
                f.write(json.dumps({"sample": index, "group": s.group, "prompt_index": s.prompt_index,
                                    "prompt_ids": _listed(s.prompt_ids), "response_ids": _listed(s.response_ids),
                                    "rollout_log_probs": _listed(s.rollout_log_probs), "reward": s.reward,
                                    "token_versions": _listed(s.token_versions), "finish_reason": s.finish_reason,
                                    "loss_mask": _listed(s.loss_mask), "extra": s.extra}) + "\n")

    def close(self) -> None:
        if self.producer is not None:
            self.producer.stop()
        for part in (self.rollout, self.rewards, self.eval_rewards):
            if part is not None:
                part.close()
