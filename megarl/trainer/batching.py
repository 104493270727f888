"""From rollout samples to the token batches each data-parallel rank trains on.

- Samples are packed into flat tensors (`PackedRollout`): token ids back to back with their lengths, one rollout
  log-prob and one loss-mask byte per response token, one score, greedy baseline and group id per sample, the MoE
  routing as a compact integer tensor. That is what moves between ranks (megarl.trainer.dispatch); nothing per
  token is a Python object.
- Whole prompt groups go to one DP rank (group-relative advantages and the loss's global counts need no more), and
  groups are spread so that every rank gets about the same number of tokens (longest first, to the lightest rank).
- Every rank's share is padded to the same number of rows and the same sequence length (a multiple of TP for sequence
  parallelism), so pipeline stages and DP ranks agree on shapes; padding rows carry no loss (`BatchPlan`).
- The number of micro-batches follows a token budget: ceil(rows * seq_len / max_tokens_per_microbatch).
- Token ids are the engine's ids, copied as they are: nothing is re-tokenised between rollout and training.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from ..losses.rl import TokenBatch


@dataclass
class Sample:
    group: int  # index of the prompt within the step (samples of one prompt share it)
    prompt_index: int  # dataset index of the prompt
    prompt_ids: list[int] | np.ndarray  # the rollout makes arrays (int32 ids, float32 log-probs, uint8 masks)
    response_ids: list[int] | np.ndarray
    rollout_log_probs: list[float] | np.ndarray
    finish_reason: str
    reward: float = 0.0
    score: float = 0.0  # the reward after shaping (overlong penalty): what advantages see
    baseline: float = 0.0  # the score of the prompt's greedy rollout (estimators registered with greedy_baseline, e.g. remax)
    trained: bool = True  # False: kept for metrics, no loss (overlong masking)
    loss_mask: list[int] | np.ndarray | None = None  # per response token (multi-turn: 0 on observations); None: all
    routed_experts: torch.Tensor | list[int] | None = None  # the engine's MoE routing, flat [positions, layers, top-k]
    teacher_log_probs: list[float] | np.ndarray | None = None  # opd: the teacher's log-prob of each response token
    teacher_top_ids: np.ndarray | None = None  # opd_top_k: [response tokens, k] int32, the teacher's top-k there
    teacher_top_log_probs: np.ndarray | None = None  # opd_top_k: [response tokens, k] float32, their log-probs
    token_versions: np.ndarray | None = None  # int32 per response token: the weight version that sampled it (-1: none)
    extra: dict = field(default_factory=dict)


def _routing_dtype(largest: int) -> torch.dtype:
    """The smallest integer type that holds every expert index (uint8 up to 256 experts, as DeepSeek-V3 has)."""
    return torch.uint8 if largest < 256 else torch.int16 if largest < 2 ** 15 else torch.int32


def _offsets(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Concatenated arange(start, start + length) for every (start, length), without a Python loop."""
    total = int(lengths.sum())
    if not total:
        return torch.zeros(0, dtype=torch.long)
    shift = torch.repeat_interleave(starts - _offsets(lengths)[:-1], lengths)
    return torch.arange(total) + shift


TEACHER_TOP_K = ("teacher_top_ids", "teacher_top_log_probs")  # opd_top_k: k values per response token, [R, k]
# per response token, packed when the run needs them
PER_TOKEN_OPTIONAL = ("teacher_log_probs", "token_versions") + TEACHER_TOP_K


@dataclass
class PackedRollout:
    """A list of samples as flat tensors. Sample i's prompt + response ids are the i-th run of seq_lens[i] tokens;
    its response tokens' values (rollout log-probs, loss mask) the i-th run of response_lens[i] values; its routing
    the i-th run of (seq_lens[i] - 1) positions x layers x top-k."""
    tokens: torch.Tensor  # [T] int32 (vocabularies are far below 2**31 ids)
    seq_lens: torch.Tensor  # [n] int64, prompt + response
    prompt_lens: torch.Tensor  # [n] int64
    rollout_log_probs: torch.Tensor  # [R] float32, one per response token
    loss_mask: torch.Tensor  # [R] uint8: 1 where the response token is trained (0: observations, untrained samples)
    score: torch.Tensor  # [n] float32, the shaped reward the advantages see
    baseline: torch.Tensor  # [n] float32, the prompt's greedy-rollout score (remax; 0 otherwise)
    group: torch.Tensor  # [n] int64, the prompt group within the step
    sample_index: torch.Tensor  # [n] int64, the sample's index in the step's sample list
    routed_experts: torch.Tensor | None = None  # [sum(seq_lens - 1) * layers * top-k], uint8 / int16 / int32
    teacher_log_probs: torch.Tensor | None = None  # [R] float32, one per response token (opd's teacher), or None
    token_versions: torch.Tensor | None = None  # [R] int32: the weight version that sampled each response token
    teacher_top_ids: torch.Tensor | None = None  # [R, k] int32: the teacher's top-k tokens at each response token
    teacher_top_log_probs: torch.Tensor | None = None  # [R, k] float32: their teacher log-probs

    @classmethod
    def from_samples(cls, samples: list[Sample], routing: bool = True, group_size: int | None = None,
                     teacher: bool | None = None, versions: bool = False,
                     teacher_top_k: int | None = None) -> "PackedRollout":
        """Pack `samples`. sample_index: with group_size, the step-wide index group * group_size + j (j: the sample's
        place among this list's samples of its group), else the position in the list. routing=False leaves the MoE
        routing out. The samples' ids / log-probs / masks may be numpy arrays (the rollout makes them as each chunk
        returns: packing is then a concatenation) or lists. teacher: pack the teacher log-probs (None: when the
        samples carry them); versions: pack every response token's weight version (asynchronous RL); teacher_top_k:
        the width of the teacher's top-k to pack (0: none; None: as the samples carry them)."""
        def flat(parts, dtype, width=None):  # width: k values per token ([R, k])
            shape = (-1,) if width is None else (-1, width)
            arrays = [np.asarray(p, dtype=dtype).reshape(shape) for p in parts]
            return torch.from_numpy(np.concatenate(arrays) if arrays else np.zeros((0,) + shape[1:], dtype))

        prompt_lens = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.long)
        response_lens = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long)
        tokens = flat(itertools.chain.from_iterable((s.prompt_ids, s.response_ids) for s in samples), np.int32)
        mask = flat(((s.loss_mask if s.loss_mask is not None else np.ones(len(s.response_ids), np.uint8))
                     if s.trained else np.zeros(len(s.response_ids), np.uint8) for s in samples), np.uint8)
        counts = [len(s.rollout_log_probs) for s in samples]
        if counts != response_lens.tolist():
            bad = next(i for i, (c, n) in enumerate(zip(counts, response_lens.tolist())) if c != n)
            raise ValueError(f"sample {bad}: {counts[bad]} rollout log-probs for {int(response_lens[bad])} response "
                             "tokens: the engine must return one log-prob per output token")
        log_probs = flat((s.rollout_log_probs for s in samples), np.float32)
        if teacher is None:
            teacher = bool(samples) and samples[0].teacher_log_probs is not None
        teacher_lp = None
        if teacher:
            if any(s.teacher_log_probs is None or len(s.teacher_log_probs) != len(s.response_ids) for s in samples):
                raise ValueError("every sample needs one teacher log-prob per response token")
            teacher_lp = flat((s.teacher_log_probs for s in samples), np.float32)
        if teacher_top_k is None:
            teacher_top_k = samples[0].teacher_top_ids.shape[1] if samples and samples[0].teacher_top_ids is not None \
                else 0
        top_ids = top_log_probs = None
        if teacher_top_k:
            if any(s.teacher_top_ids is None or s.teacher_top_log_probs is None or
                   np.shape(s.teacher_top_ids) != (len(s.response_ids), teacher_top_k) or
                   np.shape(s.teacher_top_log_probs) != (len(s.response_ids), teacher_top_k) for s in samples):
                raise ValueError(f"every sample needs the teacher's top-{teacher_top_k} ids and log-probs per response "
                                 "token")
            top_ids = flat((s.teacher_top_ids for s in samples), np.int32, teacher_top_k)
            top_log_probs = flat((s.teacher_top_log_probs for s in samples), np.float32, teacher_top_k)
        token_versions = None
        if versions:
            if any(s.token_versions is None or len(s.token_versions) != len(s.response_ids) for s in samples):
                raise ValueError("every sample needs one weight version per response token")
            token_versions = flat((s.token_versions for s in samples), np.int32)
        routed = None
        if routing and (not samples or samples[0].routed_experts is not None):
            entries = torch.cat([torch.as_tensor(s.routed_experts).reshape(-1) for s in samples]) if samples \
                else torch.zeros(0, dtype=torch.int32)
            routed = entries.to(_routing_dtype(int(entries.max()) if entries.numel() else 0))
        if group_size is None:
            index = list(range(len(samples)))
        else:
            seen: dict[int, int] = {}
            index = []
            for s in samples:
                seen[s.group] = seen.get(s.group, -1) + 1
                index.append(s.group * group_size + seen[s.group])
        return cls(tokens=tokens, seq_lens=prompt_lens + response_lens, prompt_lens=prompt_lens,
                   rollout_log_probs=log_probs, loss_mask=mask,
                   score=torch.tensor([s.score for s in samples], dtype=torch.float32),
                   baseline=torch.tensor([s.baseline for s in samples], dtype=torch.float32),
                   group=torch.tensor([s.group for s in samples], dtype=torch.long),
                   sample_index=torch.tensor(index, dtype=torch.long), routed_experts=routed,
                   teacher_log_probs=teacher_lp, token_versions=token_versions, teacher_top_ids=top_ids,
                   teacher_top_log_probs=top_log_probs)

    @classmethod
    def cat(cls, parts: list["PackedRollout"]) -> "PackedRollout":
        """The samples of all parts, ordered by sample_index."""
        names = parts[0].tensors()
        merged = cls(**{name: torch.cat([p.tensors()[name] for p in parts]) for name in names})
        return merged.select(torch.argsort(merged.sample_index))

    @property
    def num_samples(self) -> int:
        return self.seq_lens.numel()

    @property
    def response_lens(self) -> torch.Tensor:
        return self.seq_lens - self.prompt_lens

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def select(self, index: torch.Tensor | list[int]) -> "PackedRollout":
        """The samples at `index`, in that order (vectorised gathers of their token ranges)."""
        index = torch.as_tensor(index, dtype=torch.long)
        seq, resp = self.seq_lens[index], self.response_lens[index]
        out = dict(seq_lens=seq, prompt_lens=self.prompt_lens[index], score=self.score[index],
                   baseline=self.baseline[index], group=self.group[index], sample_index=self.sample_index[index],
                   tokens=self.tokens[_ranges(_offsets(self.seq_lens)[index], seq)])
        response_at = _ranges(_offsets(self.response_lens)[index], resp)
        out.update(rollout_log_probs=self.rollout_log_probs[response_at], loss_mask=self.loss_mask[response_at])
        for name in PER_TOKEN_OPTIONAL:
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)[response_at]
        if self.routed_experts is not None:  # gathered by position rows ([positions, layers * top-k]), not entries
            positions = int((self.seq_lens - 1).sum())
            rows = self.routed_experts.view(positions, -1) if positions else self.routed_experts.view(0, 0)
            out["routed_experts"] = rows[_ranges(_offsets(self.seq_lens - 1)[index], seq - 1)].reshape(-1)
        return PackedRollout(**out)

    def token_batch(self, rows: int, seq_len: int, pad_id: int,
                    routing_shape: tuple[int, int] | None = None) -> TokenBatch:
        """A TokenBatch of exactly `rows` rows (padding rows at the end carry no loss), with the rollout log-probs (and,
        given routing_shape = (layers, top-k) and routing in the pack, the engine's MoE routing): response token j of
        sample i sits at absolute position prompt_len + j and is predicted (loss_mask, log-prob) at the one before."""
        n = self.num_samples
        if rows < n:
            raise ValueError(f"{n} samples do not fit {rows} rows")
        if n and int(self.seq_lens.max()) > seq_len:
            raise ValueError(f"a sample of {int(self.seq_lens.max())} tokens does not fit seq_len={seq_len}")
        if n and int(self.prompt_lens.min()) < 1:
            raise ValueError("a sample has an empty prompt (the first response token needs a token to predict it)")
        input_ids = torch.full((rows, seq_len), pad_id, dtype=torch.long)
        row = torch.repeat_interleave(torch.arange(n), self.seq_lens)
        input_ids[row, _ranges(torch.zeros_like(self.seq_lens), self.seq_lens)] = self.tokens.long()
        targets = torch.cat([input_ids[:, 1:], torch.full((rows, 1), pad_id, dtype=torch.long)], dim=1)
        mask = self.per_token(self.loss_mask.float(), rows, seq_len)
        rollout = self.per_token(self.rollout_log_probs, rows, seq_len)
        top = {name: self.per_token(getattr(self, name), rows, seq_len)
               for name in TEACHER_TOP_K if getattr(self, name) is not None}
        return TokenBatch(input_ids=input_ids, targets=targets, loss_mask=mask, rollout_log_probs=rollout,
                          routed_experts=self._routing(rows, seq_len, routing_shape) if routing_shape else None, **top)

    def per_token(self, values: torch.Tensor, rows: int, seq_len: int) -> torch.Tensor:
        """[rows, seq_len, ...]: the per-response-token `values` ([R, ...], e.g. rollout or teacher log-probs, the
        teacher's top-k ids) where the token batch predicts them (response token j of sample i at position
        prompt_len + j - 1) where the loss mask is 1; 0 elsewhere. Floats become float32, integers int64."""
        resp = self.response_lens
        row = torch.repeat_interleave(torch.arange(self.num_samples), resp)
        dtype = torch.float32 if values.is_floating_point() else torch.long
        out = torch.zeros((rows, seq_len) + tuple(values.shape[1:]), dtype=dtype)
        keep = self.loss_mask.bool().view(-1, *[1] * (values.dim() - 1))
        out[row, _ranges(self.prompt_lens - 1, resp)] = torch.where(keep, values.to(dtype), 0)
        return out

    def _routing(self, rows: int, seq_len: int, shape: tuple[int, int]) -> torch.Tensor | None:
        """[rows, seq_len, layers, top-k] in the routing's compact integer type (the replay widens one layer at a
        time): each sample's engine routing at its positions (prompt + response[:-1]); elsewhere (the last token,
        whose output is never trained, and padding) experts 0..k-1."""
        if self.routed_experts is None:
            return None
        layers, k = shape
        positions = self.seq_lens - 1
        if self.routed_experts.numel() != int(positions.sum()) * layers * k:
            raise ValueError(f"the engine's routing has {self.routed_experts.numel()} entries, expected "
                             f"{int(positions.sum())} positions x {layers} layers x top-{k}")
        out = torch.arange(k, dtype=self.routed_experts.dtype).expand(rows, seq_len, layers, k).clone()
        row = torch.repeat_interleave(torch.arange(self.num_samples), positions)
        out[row, _ranges(torch.zeros_like(positions), positions)] = self.routed_experts.view(-1, layers, k)
        return out


def shard_groups(tokens: torch.Tensor, groups: torch.Tensor, dp_size: int) -> list[list[int]]:
    """Sample indices per DP rank: whole groups, balanced by token count (deterministic). tokens, groups: [n]."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups.tolist()):
        members.setdefault(g, []).append(i)
    load_of = {g: int(tokens[idx].sum()) for g, idx in members.items()}
    shares: list[list[int]] = [[] for _ in range(dp_size)]
    load = [0] * dp_size
    for g in sorted(members, key=lambda g: (-load_of[g], g)):
        rank = min(range(dp_size), key=lambda r: (load[r], r))
        shares[rank].extend(members[g])
        load[rank] += load_of[g]
    return [sorted(s) for s in shares]


def padded_length(seq_lens: torch.Tensor, multiple: int) -> int:
    return int(math.ceil(int(seq_lens.max()) / multiple) * multiple)


def micro_batches_for(rows: int, seq_len: int, max_tokens: int) -> int:
    return max(1, min(rows, math.ceil(rows * seq_len / max_tokens)))


@dataclass(frozen=True)
class BatchPlan:
    """How a step's samples become every DP rank's token batch: the same rows, sequence length and micro-batch count
    everywhere; `shares[r]` are the sample indices DP rank r trains."""
    shares: list[list[int]]
    rows: int
    seq_len: int
    num_microbatches: int

    @classmethod
    def make(cls, seq_lens: torch.Tensor, groups: torch.Tensor, dp_size: int, seq_multiple: int,
             max_tokens_per_microbatch: int, row_multiple: int = 1) -> "BatchPlan":
        """From every sample's length and group (indexed by step-wide sample index). The row count is a multiple of
        num_microbatches * row_multiple (mini-batches)."""
        shares = shard_groups(seq_lens, groups, dp_size)
        seq_len = padded_length(seq_lens, seq_multiple)
        rows = max(len(s) for s in shares)
        num_mb = micro_batches_for(rows // row_multiple or 1, seq_len, max_tokens_per_microbatch) * row_multiple
        return cls(shares, int(math.ceil(rows / num_mb) * num_mb), seq_len, num_mb)  # equal micro-batches

    @classmethod
    def from_workers(cls, held: PackedRollout, samples: int, group_size: int, reduce, dp_size: int,
                     seq_multiple: int, max_tokens_per_microbatch: int, row_multiple: int = 1) -> "BatchPlan":
        """The step's plan on a rollout worker that holds some of the step's `samples` (sample_index = group *
        group_size + j): every sample's length, summed over the workers by `reduce` (one tensor all-reduce; each
        sample is held by one worker), so every worker makes the same plan."""
        seq_lens = reduce(torch.zeros(samples, dtype=torch.long).index_put_((held.sample_index,), held.seq_lens))
        return cls.make(seq_lens, torch.arange(samples) // group_size, dp_size, seq_multiple,
                        max_tokens_per_microbatch, row_multiple)


@dataclass
class RankBatch:
    """One DP rank's rows of a step: the token batch and the packed samples behind its first rows (padding follows)."""
    batch: TokenBatch
    samples: PackedRollout
    num_microbatches: int

    @property
    def sample_index(self) -> list[int]:
        """The step-wide index of each real row's sample."""
        return self.samples.sample_index.tolist()


def make_rank_batch(share: PackedRollout, plan: BatchPlan, pad_id: int,
                    routing_shape: tuple[int, int] | None = None) -> RankBatch:
    return RankBatch(share.token_batch(plan.rows, plan.seq_len, pad_id, routing_shape), share, plan.num_microbatches)


def rank_batch(samples: list[Sample], dp_rank: int, dp_size: int, pad_id: int, seq_multiple: int,
               max_tokens_per_microbatch: int, row_multiple: int = 1,
               routing_shape: tuple[int, int] | None = None) -> RankBatch:
    """This DP rank's rows when every rank holds all the samples (evaluation; the RL step uses dispatch instead)."""
    packed = PackedRollout.from_samples(samples, routing=routing_shape is not None)
    plan = BatchPlan.make(packed.seq_lens, packed.group, dp_size, seq_multiple, max_tokens_per_microbatch,
                          row_multiple)
    return make_rank_batch(packed.select(plan.shares[dp_rank]), plan, pad_id, routing_shape)


def token_batch(samples: list[Sample], rows: int, seq_len: int, pad_id: int,
                routing_shape: tuple[int, int] | None = None) -> TokenBatch:
    """The TokenBatch of `samples` in `rows` rows (see PackedRollout.token_batch)."""
    return PackedRollout.from_samples(samples).token_batch(rows, seq_len, pad_id, routing_shape)


def dump_train_rows(rb: RankBatch, folder: str, step: int, dp_rank: int, first: bool) -> None:
    """<folder>/step_N.dpR.train.jsonl: the token rows DP rank R trains on (written by its first TP/PP rank: `first`),
    each with its step-wide sample index, input ids and trained target ids."""
    if not first:
        return
    import json
    import os

    with open(os.path.join(folder, f"step_{step:06d}.dp{dp_rank}.train.jsonl"), "w") as f:
        for row, (index, n) in enumerate(zip(rb.sample_index, rb.samples.seq_lens.tolist())):
            f.write(json.dumps({"sample": index, "input_ids": rb.batch.input_ids[row, :n].tolist(),
                                "trained": rb.batch.targets[row][rb.batch.loss_mask[row] > 0].tolist()}) + "\n")
