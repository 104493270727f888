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

from ..data import load_responses
from ..errors import on_rank0
from ..evaluation import plot_pass_at_k
from ..losses import compute_log_probs
from .batching import Sample, rank_batch
from .metrics import over_last_stage
from .rl import RLTrainer
from .setup import prompt_tools


def response_stats(trainer: RLTrainer, pairs: list[tuple[list[int], list[int]]]) -> dict:
    """Perplexity and mean entropy (nats) of the responses under the trainer's model (temperature 1), and their
    perplexity under the engine; token-weighted over all responses."""
    samples = [Sample(group=i, prompt_index=i, prompt_ids=p, response_ids=r, rollout_log_probs=[0.0] * len(r),
                      finish_reason="stop") for i, (p, r) in enumerate(pairs)]
    rb = rank_batch(samples, trainer.dp_rank, trainer.dp_size, trainer.tok.pad_id,
                    seq_multiple=trainer.pg.tp.size(),
                    max_tokens_per_microbatch=trainer.cfg.rl.max_tokens_per_microbatch)
    sums = torch.zeros(3, dtype=torch.float64)  # sum log-prob, sum entropy, tokens
    per_token = compute_log_probs(trainer.policy.model, rb.batch, rb.num_microbatches, trainer.bridge.vocab_size,
                                  entropy=True, fused=trainer.cfg.algorithm.fused_logprobs,
                                  pack=trainer.cfg.algorithm.pack_sequences, pg=trainer.pg)
    if per_token is not None:  # the last pipeline stage
        sums += torch.stack([per_token[0].sum(), per_token[1].sum(), rb.batch.loss_mask.sum()]).double()
    over_last_stage(sums, trainer.pg)
    stats = {"responses": len(pairs), "tokens": int(sums[2]), "trainer_ppl": math.exp(-sums[0] / sums[2]),
             "trainer_entropy": float(sums[1] / sums[2])}

    def engine_ppl():
        sequences = [p + r for p, r in pairs]
        log_probs = trainer.clients[0].prompt_log_probs(sequences)  # log p(seq[t] | seq[:t]) for t >= 1
        tail = [lp[len(lp) - len(r):] for lp, (_, r) in zip(log_probs, pairs)]
        return math.exp(-sum(map(sum, tail)) / sum(map(len, tail)))

    stats["engine_ppl"] = on_rank0(engine_ppl)
    stats["ppl_rel_diff"] = abs(stats["engine_ppl"] - stats["trainer_ppl"]) / stats["trainer_ppl"]
    return stats


def run_eval(cfg, samples: int | None = None, responses: str | None = None, out: str | None = None) -> dict:
    out = out or os.path.join(cfg.run_dir, "eval")
    trainer = RLTrainer(cfg, metrics_log=False)
    try:
        trainer.sync_weights(trainer.step, verify=True)
        result: dict = {"step": trainer.step}
        if samples:
            cfg.rl.eval_samples = samples
        result.update(trainer.evaluate("eval"))
        curve = trainer.state.get("eval_curves", {}).get("eval")
        if responses:
            pairs = on_rank0(lambda: load_responses(responses, trainer.tok, cfg.data, prompt_tools(cfg)))
            result.update({f"responses/{k}": v for k, v in response_stats(trainer, pairs).items()})
        if trainer.rank == 0:
            os.makedirs(out, exist_ok=True)
            if curve:
                result["pass_at_k_curve"] = {str(k): v for k, v in curve.items()}
                result["pass_at_k_png"] = plot_pass_at_k({f"step {trainer.step}": curve},
                                                         os.path.join(out, "pass_at_k.png"))
            with open(os.path.join(out, "eval.json"), "w") as f:
                json.dump(result, f, indent=1)
        return result
    finally:
        trainer.close()
