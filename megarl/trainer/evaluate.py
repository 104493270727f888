"""`megarl eval CONFIG [overrides] [--samples N] [--responses FILE] [--out DIR]` (under torchrun): evaluate the
policy the run folder holds (its latest checkpoint, else model.load / model.path) the way papers report it.

- Held-out prompts (data.eval, or a procedural source's held-out split): N samples each from SGLang (single- or
  multi-turn, as configured) -> the unbiased pass@k estimator for k = 1..N (a curve, <out>/pass_at_k.png), mean@N,
  maj@N.
- Given responses (a JSONL of prompt + "response"): perplexity and mean token entropy under the trainer's model
  (Megatron, vocab-parallel), and perplexity under the engine (SGLang prompt log-probs) on the same token ids.
Writes <out>/eval.json (default out: <run_dir>/eval).
"""
from __future__ import annotations

import json
import math
import os

import torch
import torch.distributed as dist

from .. import parallel
from ..data import PROCEDURAL, ChatTokenizer, PromptRecord, load_prompts, load_responses
from ..errors import about, on_rank0
from ..evaluation import plot_pass_at_k
from ..losses import TokenBatch, compute_log_probs
from ..losses.rl import place_response_values, shift_sequences
from ..reshard import engine_syncs
from ..reshard.engines import with_engines
from ..rollout import EngineRouter
from ..rollout.fleet import EngineFleet
from .async_rollout import version_name
from .batching import Sample, rank_batch
from .checkpoint import latest_checkpoint
from .config import DataConfig, adapter_sync, fleet_spec, rollout_inputs
from .metrics import forgetting_kl as kl_to_initial, over_last_stage
from .rollout import Rollout
from .workers import build_rollout, reward_pools
from .setup import build_policy, init_parallel, moe_config_overrides, prepare_model_folder, prompt_tools, resolve_load


def held_out_prompts(data: DataConfig, tok, tools: list[dict] | None) -> list[PromptRecord]:
    """The held-out prompts (data.eval, a procedural source's held-out split, or data.eval_fraction of the train
    file; none without any), with the tool schemas the prompts render (megarl.trainer.setup.prompt_tools)."""
    spec = data.eval or (data.train if data.train in PROCEDURAL or data.eval_fraction else None)
    with about(f"data.eval={spec}"):
        return load_prompts(spec, tok, data, "eval", tools) if spec else []


def held_out_metrics(rollout: Rollout, records: list, rl, rollout_cfg, tag, samples: int | None = None):
    """(metrics, pass@k curve) of `samples` (default rl.eval_samples) engine samples per held-out prompt, at
    rl.eval_temperature (default the rollout's); ({}, None) without prompts."""
    if not records:
        return {}, None
    temperature = rl.eval_temperature if rl.eval_temperature is not None else rollout_cfg.temperature
    return rollout.evaluate(records, samples or rl.eval_samples, temperature, tag)


def response_stats(policy, tok, groups, algo, max_tokens_per_microbatch: int, client,
                   pairs: list[tuple[list[int], list[int]]]) -> dict:
    """Perplexity and mean entropy (nats) of the responses under the trainer's model (temperature 1), and their
    perplexity under the engine (`client`, rank 0); token-weighted over all responses."""
    samples = [Sample(group=i, prompt_index=i, prompt_ids=p, response_ids=r, rollout_log_probs=[0.0] * len(r),
                      finish_reason="stop") for i, (p, r) in enumerate(pairs)]
    pg = groups.mcore
    rb = rank_batch(samples, groups.dp_rank, groups.dp_size, tok.pad_id, seq_multiple=pg.tp.size(),
                    max_tokens_per_microbatch=max_tokens_per_microbatch)
    sums = torch.zeros(3, dtype=torch.float64)  # sum log-prob, sum entropy, tokens
    per_token = compute_log_probs(policy.model, rb.batch, rb.num_microbatches, policy.bridge.vocab_size,
                                  entropy=True, fused=algo.fused_logprobs, pack=algo.pack_sequences, pg=pg)
    if per_token is not None:  # the last pipeline stage
        sums += torch.stack([per_token[0].sum(), per_token[1].sum(), rb.batch.loss_mask.sum()]).double()
    over_last_stage(sums, pg)
    stats = {"responses": len(pairs), "tokens": int(sums[2]), "trainer_ppl": math.exp(-sums[0] / sums[2]),
             "trainer_entropy": float(sums[1] / sums[2])}

    def engine_ppl():
        sequences = [p + r for p, r in pairs]
        log_probs = client.prompt_log_probs(sequences)  # log p(seq[t] | seq[:t]) for t >= 1
        tail = [lp[len(lp) - len(r):] for lp, (_, r) in zip(log_probs, pairs)]
        return math.exp(-sum(map(sum, tail)) / sum(map(len, tail)))

    stats["engine_ppl"] = on_rank0(engine_ppl)
    stats["ppl_rel_diff"] = abs(stats["engine_ppl"] - stats["trainer_ppl"]) / stats["trainer_ppl"]
    return stats


def run_eval(cfg, samples: int | None = None, responses: str | None = None, out: str | None = None) -> dict:
    """Builds only what evaluation needs: the engines, the policy's weights (no optimizer), the weight sync into the
    engines and, on rank 0, the rollout with the reward."""
    out = out or os.path.join(cfg.run_dir, "eval")
    parallel.init_distributed(parallel=cfg.parallel)
    rank = dist.get_rank()
    model_path = prepare_model_folder(cfg)
    fleet = EngineFleet(fleet_spec(cfg), model_path, rank)
    records = rewards = eval_rewards = rollout = None
    syncs, router = [], None
    try:
        folder = init_parallel(cfg, model_path)
        groups, tok = parallel.groups(), ChatTokenizer.from_pretrained(model_path)
        checkpoints = os.path.join(cfg.run_dir, "checkpoints")
        latest = latest_checkpoint(checkpoints) if cfg.checkpoint.resume and os.path.isdir(checkpoints) else None
        step = 0
        if latest is not None:
            with open(os.path.join(latest, "trainer_state.json")) as f:
                step = json.load(f)["step"]
        policy = build_policy(folder, None, 0, load=latest or resolve_load(cfg),
                              config_overrides=moe_config_overrides(cfg, folder), lora=cfg.model.lora,
                              pg=groups.mcore)

        def start_rollout():
            nonlocal records, rewards, eval_rewards
            records = held_out_prompts(cfg.data, tok, prompt_tools(cfg.env))
            rewards, eval_rewards = reward_pools(cfg.reward, 0)  # with the held-out set's own checker

        on_rank0(start_rollout)  # a bad data file fails before anything waits for an engine
        fleet.connect()
        if rank == 0:
            router = EngineRouter(fleet.clients, cfg.rollout.engine.router_policy, cfg.rollout.min_engines)
            rollout = build_rollout(rollout_inputs(cfg), tok, router, rewards, pool_routers=fleet.pool_routers(),
                                    eval_rewards=eval_rewards)
        fleet.resume_memory()
        syncs = engine_syncs(fleet.clients, policy.bridge, policy.chunks, cfg.reshard, cfg.rollout.engine,
                             cfg.run_dir, rank, local=fleet.local, adapter=adapter_sync(cfg),
                             min_engines=cfg.rollout.min_engines)

        def push(restore: bool = False) -> None:  # the engines hold exactly the weights evaluated
            syncs.push(step, version_name(step), verify=True, restore=restore)
            if rank == 0:
                router.retire(sorted(syncs.retired))
                router.weights_pushed(version_name(step))

        push()
        result: dict = {"step": step}
        metrics, curve = with_engines(
            lambda: on_rank0(lambda: held_out_metrics(rollout, records, cfg.rl, cfg.rollout, "eval", samples)),
            lambda: push(restore=True), (cfg.rollout.engine.max_restarts + 1) * len(syncs) + 1)
        result.update(metrics)
        if responses:
            pairs = on_rank0(lambda: load_responses(responses, tok, cfg.data, prompt_tools(cfg.env)))
            stats = response_stats(policy, tok, groups, cfg.algorithm, cfg.rl.max_tokens_per_microbatch,
                                   fleet.clients[0] if rank == 0 else None, pairs)
            result.update({f"responses/{k}": v for k, v in stats.items()})
        if rank == 0:
            os.makedirs(out, exist_ok=True)
            if curve:
                result["pass_at_k_curve"] = {str(k): v for k, v in curve.items()}
                result["pass_at_k_png"] = plot_pass_at_k({f"step {step}": curve}, os.path.join(out, "pass_at_k.png"))
            with open(os.path.join(out, "eval.json"), "w") as f:
                json.dump(result, f, indent=1)
        return result
    finally:
        for closeable in (*syncs, rollout, rewards, eval_rewards):
            if closeable is not None:
                closeable.close()
        fleet.stop()


def forgetting_kl(policy_model, reference, sequences: list, pad_id: int, algo, vocab_size: int, pg) -> dict:
    """eval/kl_to_initial (k3) and eval/kl_to_initial_k1: KL(policy || initial model; reference: setup.Reference) on
    this DP rank's share of sampled (prompt ids, response ids, loss mask or None) responses, tool outputs excluded. A
    collective: a rank
    without a sequence runs one row that counts nothing."""
    sequences = sequences or [([pad_id], [pad_id], [0])]
    ids, targets, mask = shift_sequences([p for p, _, _ in sequences], [r for _, r, _ in sequences], pad_id)
    mask = mask * place_response_values([[1] * len(r) if m is None else list(m) for _, r, m in sequences],
                                        [len(p) for p, _, _ in sequences], mask.shape[1])  # tool outputs: not sampled
    batch = TokenBatch(input_ids=ids, targets=targets, loss_mask=mask)
    args = dict(vocab_size=vocab_size, temperature=algo.temperature, fused=algo.fused_logprobs,
                pack=algo.pack_sequences, pg=pg)
    policy_log_probs = compute_log_probs(policy_model, batch, 1, **args)
    with reference.active():  # a LoRA policy is its own reference: the adapters switch only here
        initial_log_probs = compute_log_probs(reference.model, batch, 1, **args)
    return kl_to_initial(policy_log_probs, initial_log_probs, mask, pg)


def save_pass_at_k(curves: dict, run_dir: str) -> None:
    """<run_dir>/pass_at_k.png and .json: the held-out pass@k curves before and after training ({tag: {k: value}})."""
    curves = {tag: {int(k): v for k, v in c.items()} for tag, c in curves.items() if tag in ("before", "after")}
    if curves:
        with open(os.path.join(run_dir, "pass_at_k.json"), "w") as f:
            json.dump(curves, f, indent=1)
        plot_pass_at_k(curves, os.path.join(run_dir, "pass_at_k.png"), title="held-out pass@k (%)")
