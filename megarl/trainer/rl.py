"""The RL trainer. `RLTrainer.step_once()` is one RL step, its phases in megarl.trainer.step:

    rollout (the rollout workers -> SGLang, rewards in parallel) -> this DP rank's rows as tensors -> reference and
    old log-probs -> advantages -> ppo_epochs x mini-batches through Megatron's pipeline schedule -> the new weights
    into the engines (verified) -> metrics (megarl.trainer.metrics)

Everything else here is set-up (model, engines, data, resume) and bookkeeping (checkpoints, evaluation, summary).
Run it under torchrun: `megarl train CONFIG [key=value ...]`.
"""
from __future__ import annotations

import json
import logging
import os
import time

import torch
import torch.distributed as dist

from .. import parallel, platform
from ..algorithms.advantages import estimator
from ..config import ConfigError, to_dict
from ..errors import on_rank0, on_ranks
from ..data import ChatTokenizer
from ..models.moe import RoutingStats
from ..reshard import engine_syncs
from ..reshard.engines import with_engines
from ..rollout.fleet import EngineFleet
from ..rollout.teacher import check_same_tokenizer
from . import metrics, step as phases
from .async_rollout import version_name
from .batching import RankBatch, dump_train_rows
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import adapter_sync, fleet_spec, rl_algorithm, rollout_inputs
from .evaluate import forgetting_kl, held_out_metrics, held_out_prompts, save_pass_at_k
from .logging import MetricsLog, PhaseTimer
from .numerics import SkippedSteps
from .preemption import StopRequest
from .workers import RolloutWorkers
from .setup import (build_critic, build_policy, build_reference, init_parallel, moe_config_overrides,
                    prepare_model_folder, prompt_tools, resolve_load)


logger = logging.getLogger("megarl")


def dumped_samples(run_dir: str, step: int) -> list[dict]:
    """The engine samples of one step that rl.dump_rollouts wrote (one file per rollout worker), in step-wide sample
    order: record i is sample i, the one `"sample": i` names in the DP ranks' step_N.dpR.train.jsonl rows."""
    import glob

    pattern = os.path.join(run_dir, "rollouts", f"step_{step:06d}.worker*.jsonl")
    records = [json.loads(line) for path in glob.glob(pattern) for line in open(path)]
    return sorted(records, key=lambda r: r["sample"])


NO_HELD_OUT = "none: pass@1 needs held-out prompts; set data.eval (a file) or data.eval_fraction (e.g. 0.05 of data.train)"


class RLTrainer:
    def __init__(self, cfg, metrics_log: bool = True):
        self.cfg, self.started = cfg, time.perf_counter()
        self.algorithm = rl_algorithm(cfg)  # the step's algorithm section, its cross-section defaults resolved
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
        self.fleet = EngineFleet(fleet_spec(cfg), self.model_path, self.rank)  # policy engines, teacher, pools
        try:
            self._build(cfg, metrics_log)
        except BaseException:  # the engines launched above do not outlive a failed set-up
            self.fleet.stop()
            raise

    def _build(self, cfg, metrics_log: bool) -> None:
        folder = init_parallel(cfg, self.model_path)
        self.groups = parallel.groups()
        self.pg = self.groups.mcore  # megatron-core's ProcessGroupCollection: passed to every collective below
        self.dp_rank, self.dp_size = self.groups.dp_rank, self.groups.dp_size
        self.tok = ChatTokenizer.from_pretrained(self.model_path)
        updates = cfg.rl.steps * cfg.rl.ppo_epochs * cfg.rl.mini_batches
        self.policy = build_policy(folder, cfg.optim, updates, load=resolve_load(cfg),
                                   config_overrides=moe_config_overrides(cfg, folder), lora=cfg.model.lora,
                                   pg=self.pg)
        self.bridge = self.policy.bridge
        hf = folder.config  # the engine's routing per position: [layers, top-k] (MoE with rollout.engine_routing)
        self.routing_shape = (hf.num_hidden_layers, hf.num_experts_per_tok) \
            if folder.is_moe and cfg.rollout.engine_routing else None
        use_ref = cfg.rl.ref_model if cfg.rl.ref_model is not None else self.algorithm.kl_coef > 0 or \
            cfg.rl.forgetting_kl  # the reference is the initial model: the forgetting KL's anchor
        # GPU with rl.offload_ref: the reference lives in host memory except while it computes log-probs (a LoRA
        # policy is its own reference: no second model)
        self.ref = build_reference(self.policy, cfg.rl.offload_ref and platform.on_gpu()) if use_ref else None
        self.critic = build_critic(self.bridge, self.policy.chunks, cfg.optim, cfg.rl.critic_lr, updates) \
            if self.algorithm.use_critic else None
        self.ckpt_root = os.path.join(cfg.run_dir, "checkpoints")
        self.step, self.state = 0, {}
        self.skips = SkippedSteps(cfg.rl.max_skipped_steps)  # non-finite updates in a row (megarl.trainer.numerics)
        self.restores = 0  # times no engine could generate and the restarted ones got the weights back (with_engines)
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
        # the rollout workers read the training prompts and start their reward pools (a bad data file fails in
        # seconds, before anything waits for an engine); then rank 0 reads the held-out data and waits for its
        # engines. A failure on one rank reaches every rank.
        self.side = RolloutWorkers(rollout_inputs(cfg), self.tok, self.groups, self.rank, self.started,
                                   self.routing_shape)
        self.eval_records = on_rank0(lambda: held_out_prompts(cfg.data, self.tok, prompt_tools(cfg.env)))
        self.clients = self.fleet.connect().clients
        self.side.connect(self.fleet)
        self.syncs = engine_syncs(self.clients, self.bridge, self.policy.chunks, cfg.reshard, cfg.rollout.engine,
                                  cfg.run_dir, self.rank, local=self.fleet.local,
                                  adapter=adapter_sync(cfg), min_engines=cfg.rollout.min_engines)

    def _resume(self) -> None:
        path = latest_checkpoint(self.ckpt_root) if self.cfg.checkpoint.resume and \
            os.path.isdir(self.ckpt_root) else None
        if path is None:
            return
        self.state = load_checkpoint(path, self.policy.chunks, self.policy.optimizer, self.policy.scheduler,
                                     critic=self.critic)
        self.step = self.state["step"]
        self.side.resume(self.state, self.step, path)

    # ------------------------------------------------------------------------------------------- the RL step
    def step_once(self, step: int) -> dict:
        """One RL step as the papers write it: each phase a function of megarl.trainer.step, each metric a reduction
        of megarl.trainer.metrics over the group that holds its values."""
        cfg, algo, pg, timer, start = self.cfg, self.algorithm, self.pg, PhaseTimer(), time.perf_counter()
        with timer("rollout"):  # 1. engines sample, rewards score (the rollout workers; under rl.max_staleness the
            #                        producer thread did it while earlier steps trained)
            rollout = self.with_engines(lambda: self.side.take(step))
        self.fleet.release_memory()  # colocated GPUs: the engine's memory goes to training (no-op on CPU)
        with timer("dispatch"):  # 2. this DP rank's rows, and only those, as tensors
            rb, received = phases.dispatch_rank_batch(rollout, step, self.groups, self.side.ranks,
                                                      self.tok.pad_id, self.routing_shape)
        batch, engine_routing = rb.batch, rb.batch.routed_experts  # MoE: the engine's experts, replayed only with R3
        batch.routed_experts = engine_routing if cfg.rollout.routing_replay else None
        if cfg.rl.dump_rollouts:  # the engine's samples (each worker) and the rows each DP rank trains on
            folder = os.path.join(cfg.run_dir, "rollouts")
            os.makedirs(folder, exist_ok=True)
            self.side.dump(step, folder)
            dump_train_rows(rb, folder, step, self.dp_rank, first=self.pg.tp.rank() == 0 and self.pg.pp.rank() == 0)
        with timer("ref"):  # 3. reference and old-policy log-probs of the engine's tokens
            if self.ref is not None:
                with self.ref.active():
                    batch.ref_log_probs = phases.log_probs(self.ref.model, rb, algo, self.bridge.vocab_size, pg)
        with timer("old_log_prob"):
            signals, old_entropy = self._old_log_probs(rb, engine_routing, step)
        if self.critic is not None:
            with timer("values"):
                batch.old_values = phases.critic_values(self.critic.model, rb, algo, pg)
        with timer("advantages"):  # 4. advantages (and returns)
            batch.advantages, batch.returns = phases.advantages(rb, algo, pg.dp)
        if estimator(algo.advantage_estimator).returns_teacher_log_ratio:  # opd: returns = teacher - student log-prob
            signals.update(metrics.opd_reverse_kl(batch.returns, batch.loss_mask, pg))
        with timer("train"):  # 5. rl.ppo_epochs x rl.mini_batches optimizer steps through Megatron's schedule
            trained = phases.update(self.policy, self.critic, rb, algo, cfg.rl, self.bridge.vocab_size, pg,
                                    seed=cfg.seed * 1_000_003 + step, old_entropy=old_entropy, skips=self.skips,
                                    step=step)
        with timer("reshard"):  # 6. the engines get the new weights (verified first and every reshard.verify_every)
            synced = self.sync_weights(step)
        return self._step_metrics(trained, signals, timer, synced, received, start)

    def _old_log_probs(self, rb: RankBatch, engine_routing, step: int) -> tuple[dict, torch.Tensor | None]:
        """Sets the old policy's log-probs (the trainer's recompute, or the engine's: rollout.old_log_probs); returns
        what is measured on them before any update (trainer-engine mismatch, entropy dynamics, MoE routing,
        staleness) and the old entropies (recompute only)."""
        cfg, algo, batch, pg = self.cfg, self.algorithm, rb.batch, self.pg
        signals, entropy = {}, None
        if cfg.rollout.old_log_probs == "recompute":
            routing = RoutingStats(self.policy.chunks) if engine_routing is not None else None
            batch.old_log_probs, entropy = phases.log_probs(self.policy.model, rb, algo,
                                                            self.bridge.vocab_size, pg, entropy=True)
            signals.update(metrics.logprob_mismatch(batch.old_log_probs, batch.rollout_log_probs, batch.loss_mask, pg))
            signals.update(metrics.entropy_dynamics(entropy, batch.loss_mask, pg))
            if routing is not None:
                signals.update(metrics.routing(routing, engine_routing, rb, self.policy.model,
                                               algo.pack_sequences, self.bridge.config.num_layers,
                                               self.bridge.config.num_moe_experts, pg))
        else:
            batch.old_log_probs = batch.rollout_log_probs
        if cfg.rl.max_staleness:
            signals.update(metrics.staleness(rb, step, cfg.rl.max_staleness, pg))
        return signals, entropy

    def _step_metrics(self, trained: dict, signals: dict, timer: PhaseTimer, synced: dict, received: int,
                      start: float) -> dict:
        elapsed = time.perf_counter() - start
        out = {**trained, **self.side.step_stats(elapsed), **signals, **timer.take()}
        out.update({f"reshard/{k}": v for k, v in synced.items() if isinstance(v, (int, float))})
        out.update({"time/step_s": elapsed, "time/step_start": start - self.started,
                    "dispatch/bytes_received": received, "engine/restores": self.restores,
                    "engine/retired": len(self.syncs.retired)})
        return out

    # ------------------------------------------------------------------------------------------ engine side
    def sync_weights(self, version: int, verify: bool | None = None, restore: bool = False) -> dict:
        """Push the weights after step `version` into the policy engines. With asynchronous rollouts in flight:
        partial rollouts pause the engines (their requests abort and continue under the new weights), verification
        runs once they generate again; the fixed schedule first waits for the rollout sampled from the old weights.
        restore: only into the engines that lost them (restarted), before a rollout is generated again."""
        self.fleet.resume_memory()
        producer, k = self.side.producer, self.cfg.rl.max_staleness
        partial = bool(k) and self.cfg.rl.partial_rollouts  # the same on every rank (the producer is the workers')
        if k and not partial and not restore:
            def wait() -> None:  # until the rollout sampled from the old weights is complete
                on_ranks(lambda: producer.wait_generated(version + k), here=producer is not None)

            self.with_engines(wait, weights=version)  # (the trainer holds the weights after `version` already)
        if partial and self.rank == 0:
            self.side.router.pause_for_update()
        try:
            stats, deferred = self.syncs.push(version, version_name(version), verify, defer_verify=partial,
                                              restore=restore)
            self.side.engines_synced(version_name(version), self.syncs.retired)  # they generate again
        finally:
            if partial and self.rank == 0:
                self.side.router.continue_after_update()
        for sync in deferred:
            stats.update(sync.verify())
        if producer is not None and not restore:
            producer.set_version(version)
        return stats

    def with_engines(self, collective, weights: int | None = None):
        """collective(), generated again after the restarted engines got the trainer's weights back: those after step
        `weights` (default: the last step trained) (megarl.reshard.engines.with_engines)."""
        def restore() -> None:
            self.restores += 1
            self.sync_weights(self.step if weights is None else weights, restore=True)

        return with_engines(collective, restore, (self.cfg.rollout.engine.max_restarts + 1) * len(self.clients) + 1)

    def evaluate(self, tag) -> dict:
        """Held-out evaluation on rank 0 (pass@k, maj@n, tool use); its pass@k curve is kept for the plot."""
        cfg = self.cfg

        def run():
            result, curve = held_out_metrics(self.side.rollout, self.eval_records, cfg.rl, cfg.rollout, tag)
            if curve is not None:
                self.state.setdefault("eval_curves", {})[str(tag)] = curve
            return result

        # (an evaluation between steps runs before self.step moves on: the trainer holds the weights after `tag`)
        result = self.with_engines(lambda: on_rank0(run), weights=tag if isinstance(tag, int) else None) or {}
        if cfg.rl.forgetting_kl:
            result.update(self._forgetting_kl(tag))
        return result

    def _forgetting_kl(self, tag) -> dict:
        """eval/kl_to_initial(_k1): KL(policy || initial model) on one engine sample per held-out prompt (rank 0
        samples, the DP ranks split them). A collective."""
        cfg = self.cfg
        sampled = on_rank0(lambda: [(list(s.prompt_ids), list(s.response_ids), s.loss_mask) for s in (
            self.side.rollout.generate(self.eval_records, 1, (cfg.seed, "forgetting", tag), cfg.rollout.temperature,
                                       cfg.rollout.max_new_tokens) if self.eval_records else [])]) or []
        return forgetting_kl(self.policy.model, self.ref, sampled[self.dp_rank::self.dp_size], self.tok.pad_id,
                             self.algorithm, self.bridge.vocab_size, self.pg)

    # --------------------------------------------------------------------------------------------- the run
    def train(self) -> dict:
        cfg = self.cfg
        self.stop = StopRequest(cfg.run_dir, self.rank, "cuda" if platform.on_gpu() else "cpu")
        self.resumed_from = self.step  # 0: a new run; else the checkpoint's step (the summary says it)
        self.sync_weights(self.step, verify=True)  # the engines start from the trainer's weights
        if self.step == 0:
            self.state["eval_before"] = self.evaluate("before")
            if self.log is not None and self.state["eval_before"]:
                self.log.log(0, self.state["eval_before"])
        self.side.start_producer(self.step)
        while self.step < cfg.rl.steps:
            step = self.step + 1
            metrics = self.step_once(step)
            if cfg.rl.eval_every and step % cfg.rl.eval_every == 0 and step < cfg.rl.steps:
                metrics.update(self.evaluate(step))
                if not cfg.rl.max_staleness:  # (asynchronous: the producer's requests are in flight; no flush)
                    self.fleet.flush_prefix_cache()
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
            save_pass_at_k(self.state.get("eval_curves", {}), cfg.run_dir)
        self.save()
        if cfg.checkpoint.export_hf:
            self.bridge.save_hf(self.policy.chunks, os.path.join(cfg.run_dir, "hf"))
        return self._summary(after)

    def save(self) -> None:
        """A checkpoint of the step just trained. Asynchronous RL: the rollout in progress is finished first, and each
        worker's finished, untrained rollouts are saved with it (the prompt cursor after them; data_untrained: the
        cursor before them, for a resume that cannot read them back)."""
        producer = self.side.producer
        ahead = producer.drain() if producer is not None else []
        try:
            state = dict(self.state, data=self.side.stream.state()) if self.rank == 0 else {}  # rank 0 writes it
            if ahead and self.rank == 0:
                state["data_untrained"] = ahead[0].cursor_before
            save_checkpoint(self.ckpt_root, self.step, self.policy.chunks, self.policy.optimizer,
                            self.policy.scheduler, state, keep=self.cfg.checkpoint.keep, critic=self.critic,
                            rank_state={"rollouts": ahead} if producer is not None else None)
        finally:
            if producer is not None:
                producer.release()

    def _summary(self, after: dict) -> dict:
        before = self.state.get("eval_before") or {}
        summary = {"pass_at_1_before": before.get("eval/pass_at_1"), "pass_at_1_after": after.get("eval/pass_at_1"),
                   "wall_s": time.perf_counter() - self.started, "seed": self.cfg.seed, "steps": self.step,
                   "resumed_from_step": self.resumed_from, "run_dir": self.cfg.run_dir}
        if self.rank == 0 and not self.eval_records:
            summary["held_out"] = NO_HELD_OUT
        if self.rank == 0:
            with open(os.path.join(self.cfg.run_dir, "rl_summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
        return summary

    def close(self) -> None:
        self.side.close()
        self.syncs.close()
        if self.log is not None:
            self.log.close()
        self.fleet.stop()
