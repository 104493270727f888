"""SFT cold start: chat samples -> the model's chat template -> token ids with loss on assistant tokens only ->
packed rows -> teacher-forced cross-entropy through the same Megatron step as RL (objective "sft").

Writes <run_dir>/sft/checkpoints/step_N (the format `megarl train` loads with model.load; `model.load: sft` names
it) and, when checkpoint.export_hf is set, an HF folder <run_dir>/sft/hf. Run it under torchrun: `megarl sft CONFIG [key=value ...]`.
"""
from __future__ import annotations

import math

from ..data import load_sft_samples, pack_samples
from ..data.chat import rows_to_tensors
from ..losses import TokenBatch, prepare_global_batch, train_step
from .batching import micro_batches_for
from .logging import PhaseTimer
from .offline import OfflineTrainer
from .setup import prompt_tools, resolve_load


def sft_batch(rows, dp_rank: int, dp_size: int, pad_id: int, seq_multiple: int, max_tokens: int):
    """This DP rank's packed rows as a TokenBatch (rows dealt round-robin, padded to equal counts) and its number of
    micro-batches."""
    seq_len = max(sum(len(s.input_ids) for s in row) for row in rows)
    seq_len = int(math.ceil(seq_len / seq_multiple) * seq_multiple)
    mine = rows[dp_rank::dp_size]
    per_rank = math.ceil(len(rows) / dp_size)
    num_mb = micro_batches_for(per_rank, seq_len, max_tokens)
    per_rank = int(math.ceil(per_rank / num_mb) * num_mb)
    ids, targets, mask, segments = rows_to_tensors(mine + [[]] * (per_rank - len(mine)), pad_id, seq_len)
    return TokenBatch(input_ids=ids, targets=targets, loss_mask=mask, segment_ids=segments), num_mb


class SFTTrainer(OfflineTrainer):
    name, show = "sft", ("nll",)

    def load_items(self) -> list:
        return load_sft_samples(self.section.data, self.tok, self.cfg.data, tools=prompt_tools(self.cfg.env))

    def load_path(self) -> str | None:
        return None if self.cfg.model.load == "sft" else resolve_load(self.cfg)  # "sft" is what this run produces

    def train_on(self, chosen: list) -> dict:
        s, pg, policy = self.section, self.pg, self.policy
        timer = PhaseTimer()
        rows = pack_samples(chosen, s.max_seq_len, s.pack)
        batch, num_mb = sft_batch(rows, pg.dp.rank(), pg.dp.size(), self.tok.pad_id, pg.tp.size(),
                                  s.max_tokens_per_microbatch)
        with timer("train"):
            batch = prepare_global_batch(batch, "token-mean", dp_group=pg.dp, seq_multiple=pg.tp.size())
            metrics = train_step(policy.model, policy.optimizer, batch, num_mb, None, policy.bridge.vocab_size,
                                 objective="sft", pack=self.cfg.algorithm.pack_sequences, pg=pg)
            policy.scheduler.step(1)
        metrics.update(timer.take(), **{"sft/rows": len(rows), "sft/samples": len(chosen)})
        return metrics

    def counts(self) -> dict:
        return {"samples": len(self.items)}


def run_sft(cfg) -> dict:
    return SFTTrainer(cfg).run()
