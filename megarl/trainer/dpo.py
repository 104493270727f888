"""Offline preference training: DPO or IPO (`dpo.loss_type`) on preference pairs, through the same Megatron step as RL
and SFT (objective "preference", megarl.losses.rl.preference_objective), against a frozen reference: the initial
policy (the model folder's weights, or model.load), built the way the RL trainer builds its KL reference.

Each pair is two adjacent rows, chosen then rejected, and a pair never straddles a micro-batch or a data-parallel
rank (pairs are dealt to DP ranks whole, micro-batches hold an even number of rows), so the loss, which needs both
sequences' log-prob sums at once, is the same whatever the layout. Writes <run_dir>/dpo/checkpoints/step_N (the format
`megarl train` loads with model.load), dpo_metrics.jsonl, dpo_summary.json and, with checkpoint.export_hf, an HF
folder <run_dir>/dpo/hf. Run it under torchrun: `megarl dpo CONFIG [key=value ...]`.
"""
from __future__ import annotations

import math

import torch

from ..config import ConfigError
from ..data import PreferencePair, load_preference_pairs
from ..errors import about
from ..losses import compute_log_probs, prepare_global_batch, shift_sequences, train_step
from ..losses.rl import TokenBatch
from .batching import micro_batches_for
from .logging import PhaseTimer
from .offline import OfflineTrainer
from .setup import build_reference


def pair_batch(pairs: list[PreferencePair], dp_rank: int, dp_size: int, pad_id: int, seq_multiple: int,
               max_seq_len: int, max_tokens: int) -> tuple[TokenBatch, int]:
    """This DP rank's pairs (dealt round-robin, whole) as a TokenBatch of adjacent rows (2k: chosen, 2k + 1:
    rejected), padded with empty pairs to the same count on every rank and a multiple of the micro-batch count, and
    that count. Rows longer than max_seq_len lose the end of their response."""
    for p in pairs:
        if len(p.prompt_ids) >= max_seq_len:
            raise ConfigError(f"dpo.max_seq_len={max_seq_len} leaves no room for a response after a prompt of "
                              f"{len(p.prompt_ids)} tokens. Fix: raise dpo.max_seq_len (or data.max_prompt_tokens "
                              "below it)")
    seq_len = max(min(len(p.prompt_ids) + max(len(p.chosen_ids), len(p.rejected_ids)), max_seq_len) for p in pairs)
    seq_len = int(math.ceil(seq_len / seq_multiple) * seq_multiple)
    per_rank = math.ceil(len(pairs) / dp_size)
    num_mb = micro_batches_for(per_rank, 2 * seq_len, max_tokens)  # a pair costs two rows
    per_rank = int(math.ceil(per_rank / num_mb) * num_mb)
    mine = pairs[dp_rank::dp_size]
    prompts, responses = [], []
    for p in mine:
        room = max_seq_len - len(p.prompt_ids)
        prompts += [p.prompt_ids, p.prompt_ids]
        responses += [p.chosen_ids[:room], p.rejected_ids[:room]]
    padding = 2 * (per_rank - len(mine))
    prompts += [[pad_id]] * padding  # padding rows: no response tokens, so no loss and a pair weight of 0
    responses += [[]] * padding
    ids, targets, mask = shift_sequences(prompts, responses, pad_id, seq_len)
    return TokenBatch(input_ids=ids, targets=targets, loss_mask=mask), num_mb


class DPOTrainer(OfflineTrainer):
    name, show = "dpo", ("loss", "reward_accuracy", "margin")

    def load_items(self) -> list:
        with about(f"dpo.data={self.section.data}"):
            return load_preference_pairs(self.section.data, self.tok, self.cfg.data)

    def build(self, policy) -> None:
        self.ref = build_reference(policy)  # the initial policy, before resumed weights load

    def train_on(self, chosen: list) -> dict:
        d, pg, policy = self.section, self.pg, self.policy
        timer = PhaseTimer()
        batch, num_mb = pair_batch(chosen, pg.dp.rank(), pg.dp.size(), self.tok.pad_id, pg.tp.size(),
                                   d.max_seq_len, d.max_tokens_per_microbatch)
        # seq-mean-token-mean: every real row's weights sum to 1 / rows, so a pair (two rows) weighs 1 / pairs
        batch = prepare_global_batch(batch, "seq-mean-token-mean", dp_group=pg.dp, seq_multiple=pg.tp.size())
        with timer("ref"):
            with self.ref.active():
                ref_lp = compute_log_probs(self.ref.model, batch, num_mb, policy.bridge.vocab_size,
                                           fused=d.fused_logprobs, pg=pg)
            batch.ref_log_probs = ref_lp if ref_lp is not None else torch.zeros_like(batch.loss_mask)
        with timer("train"):
            metrics = train_step(policy.model, policy.optimizer, batch, num_mb, d, policy.bridge.vocab_size,
                                 objective="preference", pg=pg)
            policy.scheduler.step(1)
        metrics.update(timer.take(), **{"dpo/pairs": len(chosen)})
        return metrics

    def counts(self) -> dict:
        return {"pairs": len(self.items), "loss_type": self.section.loss_type}

    def summarize(self, history: list[dict]) -> dict:
        if not history:
            return {}
        return {f"{key}_{end}": history[i].get(key) for key in ("loss", "reward_accuracy", "margin")
                for end, i in (("first", 0), ("last", -1))}


def run_dpo(cfg) -> dict:
    return DPOTrainer(cfg).run()
