"""Train/inference mismatch correction: the rollout engine's log-probs differ from the trainer's (kernels, precision,
MoE routing). These give a detached per-token weight (and keep-mask) that multiplies the policy loss.

  tis           token-level truncated IS:  w_t = min(pi_train_old / pi_rollout, cap)
  seq_tis       sequence-level truncated IS: w = min(prod_t ratio_t, cap), the same for all tokens of a sequence
  mis           masked IS: sequences whose IS ratio (geometric mean per token) leaves [low, high] are dropped
  icepop        token masking: tokens whose ratio leaves [low, high] are dropped
  none          no correction (explicit; unset = none for synchronous steps, tis with rl.max_staleness >= 1)
"""
from __future__ import annotations

import torch

MISMATCH_MODES = (None, "none", "tis", "seq_tis", "mis", "icepop")


def mismatch_weights(old_log_prob, rollout_log_prob, mask, mode, seq_sum, cap=2.0, low=0.5, high=2.0):
    """(weights [b, s], kept mask [b, s]); seq_sum(x) sums a token tensor per sequence across context-parallel
    shards. Weights carry no gradient."""
    with torch.no_grad():
        log_ratio = (old_log_prob - rollout_log_prob) * mask
        ones = torch.ones_like(mask, dtype=torch.float32)
        if mode in (None, "none"):
            return ones, mask
        if mode == "tis":
            return torch.exp(log_ratio).clamp(max=cap), mask
        seq_log_ratio = seq_sum(log_ratio)
        if mode == "seq_tis":
            return torch.exp(seq_log_ratio).clamp(max=cap)[:, None] * ones, mask
        if mode == "mis":
            per_token = seq_log_ratio / seq_sum(mask.float()).clamp(min=1)
            keep = (per_token >= torch.log(torch.tensor(low))) & (per_token <= torch.log(torch.tensor(high)))
            return ones, mask * keep[:, None]
        if mode == "icepop":
            ratio = torch.exp(log_ratio)
            return ones, mask * ((ratio >= low) & (ratio <= high))
    raise ValueError(f"algorithm.mismatch.mode={mode!r} is unknown; choose one of {MISMATCH_MODES}")
