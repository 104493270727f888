"""Running the sharded model: inputs for a causal forward, and full-vocabulary logits through Megatron's schedule."""
from __future__ import annotations

from dataclasses import dataclass

import torch


def causal_inputs(input_ids: torch.Tensor, segment_ids: torch.Tensor | None = None):
    """(input_ids, position_ids, attention_mask) for GPTModel; the mask is True where attention is blocked.

    With segment_ids (packed samples numbered from 1 within a row, 0 for padding), attention is causal within each
    sample only and positions restart at every sample, so a packed row computes exactly what the samples would alone.
    """
    batch, seq = input_ids.shape
    causal = torch.triu(torch.ones(1, 1, seq, seq, dtype=torch.bool, device=input_ids.device), diagonal=1)
    if segment_ids is None:
        position_ids = torch.arange(seq, device=input_ids.device).unsqueeze(0).expand(batch, seq).contiguous()
        return input_ids, position_ids, causal
    same = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return input_ids, restarting_positions(segment_ids), causal | ~same


def restarting_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """[b, s] positions counted from 0 at the start of every segment (a change of segment id along the row)."""
    batch, seq = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    index = torch.arange(seq, device=segment_ids.device).expand(batch, seq)
    start_index = torch.cummax(torch.where(starts, index, torch.zeros_like(index)), dim=1).values
    return (index - start_index).contiguous()


# --------------------------------------------------------------------------------------------- packed sequences
@dataclass(frozen=True)
class PackedLayout:
    """One micro-batch of [rows, seq] padded rows as packed rows [out_rows, length]: each row's real tokens (its first
    kept positions) back to back, each packed row ending in an inert padding tail.

    The samples stay separate: every row (or, for rows that already hold several samples, every segment of a row) is
    one segment of its packed row, with causal attention inside it only and positions restarting at its start; a
    packed row's padding tail is one more segment. Per-token outputs of the packed forward go back to the
    [rows, seq] layout with `unpack` (zeros where nothing was computed), so whatever runs on [rows, seq]
    (objectives, aggregation weights, per-sequence sums) sees exactly what the padded forward would have given it.

    One packed row (out_rows 1) is the THD format of TransformerEngine (cu_seqlens). The local attention (CPU) builds a
    dense [length, length] mask per row instead, whose cost grows with the square of the row: there the rows are
    packed into several rows of at most the padded length (see packed_layouts)."""
    rows: int
    seq: int
    out_rows: int
    length: int
    index: torch.Tensor  # [tokens] flat source position row * seq + t of each packed token
    dest: torch.Tensor  # [tokens] flat packed position out_row * length + t of the same token
    segment_ids: torch.Tensor  # [out_rows, length] segments numbered from 1 within each packed row; tails are 0
    cu_seqlens: torch.Tensor  # [segments + 1] int32 boundaries over the flattened packed rows, tails included (THD)
    max_seqlen: int

    @property
    def tokens(self) -> int:
        return self.index.numel()

    @property
    def total(self) -> int:
        """Positions the model computes: out_rows x length."""
        return self.out_rows * self.length

    def pack(self, x: torch.Tensor, repeat_last: bool = False) -> torch.Tensor:
        """[rows, seq, ...] -> [out_rows, length, ...]; tails hold zeros, or the last packed token's value with
        repeat_last (for values that must stay valid there, e.g. an MoE routing)."""
        flat = x.reshape(self.rows * self.seq, *x.shape[2:])[self.index.to(x.device)]
        if repeat_last and self.tokens:
            out = flat[-1:].expand(self.total, *flat.shape[1:]).clone()
        else:
            out = flat.new_zeros((self.total, *flat.shape[1:]))
        out[self.dest.to(x.device)] = flat
        return out.view(self.out_rows, self.length, *flat.shape[1:])

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """[out_rows, length, ...] -> [rows, seq, ...] with zeros at the positions that were not packed
        (differentiable)."""
        y = y.reshape(self.total, *y.shape[2:])[self.dest.to(y.device)]
        out = y.new_zeros((self.rows * self.seq, *y.shape[1:])).index_copy(0, self.index.to(y.device), y)
        return out.view(self.rows, self.seq, *y.shape[1:])

    def model_inputs(self, input_ids: torch.Tensor, thd: bool) -> tuple[tuple, dict]:
        """(args, kwargs) for GPTModel.forward on the packed input_ids [out_rows, length].

        thd=True (the TransformerEngine layer spec, one packed row): megatron-core's documented packed format,
        PackedSeqParams(qkv_format="thd", cu_seqlens_q/kv, max_seqlen_q/kv) with attention_mask None; TE's attention
        and the rotary embedding read the boundaries from cu_seqlens. thd=False (the local spec, CPU): the local
        attention does not take PackedSeqParams (DotProductAttention asserts it is None), so the same boundaries
        become causal_inputs' block-causal mask and restarting positions."""
        segment_ids = self.segment_ids.to(input_ids.device)
        if not thd:
            return causal_inputs(input_ids, segment_ids), {}
        if self.out_rows != 1:
            raise ValueError("THD packed sequences need one packed row (packed_layouts without row_length)")
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens.to(input_ids.device)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=self.max_seqlen,
                                 max_seqlen_kv=self.max_seqlen)
        return (input_ids, restarting_positions(segment_ids), None), {"packed_seq_params": params}


def packed_layouts(loss_masks: list[torch.Tensor], segment_ids: list[torch.Tensor | None], multiple: int = 1,
                   equal_shapes: bool = True, row_length: int | None = None) -> list[PackedLayout]:
    """The PackedLayout of every micro-batch of one schedule call.

    A row keeps its positions up to its last loss_mask position + 1: later positions are neither trained nor read by
    a trained position (causal attention). segment_ids: None (one sample per row) or [rows, seq] samples numbered
    within each row (SFT's loader-packed rows), kept as separate segments.

    row_length None: one packed row per micro-batch (THD), its length the token count rounded up to `multiple` (the TP
    size under sequence parallelism). row_length L: the rows go first-fit-decreasing into packed rows of L positions
    (L rounded up to `multiple`; at least the longest kept row), so attention never spans more than L positions.
    equal_shapes: every micro-batch gets the same packed shape, the largest one's (pipeline stages exchange
    activations of one fixed shape)."""
    kept = []
    for mask, segments in zip(loss_masks, segment_ids):
        rows, seq = mask.shape
        position = torch.arange(1, seq + 1, device=mask.device)
        lengths = ((mask > 0) * position).amax(dim=1) if seq else torch.zeros(rows, dtype=torch.long)
        kept.append((lengths.tolist(), seq, segments))

    def rounded(tokens: int) -> int:
        return max(multiple, -(-tokens // multiple) * multiple)

    if row_length is None:
        bins = [[list(range(len(lengths)))] for lengths, _, _ in kept]
        sizes = [rounded(sum(lengths)) for lengths, _, _ in kept]
    else:
        size = rounded(max([row_length] + [max(lengths, default=0) for lengths, _, _ in kept]))
        bins = [_first_fit(lengths, size) for lengths, _, _ in kept]
        sizes = [size] * len(kept)
    if equal_shapes:
        out_rows = max(len(b) for b in bins)
        bins = [b + [[] for _ in range(out_rows - len(b))] for b in bins]
        sizes = [max(sizes)] * len(kept)
    return [_layout(lengths, seq, segments, b, length) for (lengths, seq, segments), b, length in
            zip(kept, bins, sizes)]


def _first_fit(lengths: list[int], size: int) -> list[list[int]]:
    """Rows (by index) into bins of `size` positions, longest first, each into the first bin it fits; >= 1 bin."""
    bins, used = [], []
    for row in sorted((r for r, n in enumerate(lengths) if n > 0), key=lambda r: -lengths[r]):
        slot = next((k for k, u in enumerate(used) if u + lengths[row] <= size), None)
        if slot is None:
            bins.append([])
            used.append(0)
            slot = len(bins) - 1
        bins[slot].append(row)
        used[slot] += lengths[row]
    return bins or [[]]


def _layout(lengths: list[int], seq: int, segments: torch.Tensor | None, bins: list[list[int]],
            length: int) -> PackedLayout:
    index, dest, seg_out = [], [], torch.zeros(len(bins), length, dtype=torch.long)
    for k, members in enumerate(bins):
        at, number = 0, 0
        for row in members:
            n = lengths[row]
            if n == 0:
                continue
            index.append(torch.arange(row * seq, row * seq + n))
            dest.append(torch.arange(k * length + at, k * length + at + n))
            own = segments[row, :n].cpu() if segments is not None else torch.zeros(n, dtype=torch.long)
            new = torch.ones(n, dtype=torch.bool)
            new[1:] = own[1:] != own[:-1]  # a new sample within a loader-packed row
            seg_out[k, at:at + n] = number + torch.cumsum(new.long(), 0)
            number, at = int(seg_out[k, at + n - 1]), at + n
    # THD boundaries over the flattened packed rows: wherever the segment changes, and at every packed row's start
    label = (seg_out + torch.arange(len(bins))[:, None] * (length + 1)).reshape(-1)
    change = torch.ones_like(label, dtype=torch.bool)
    change[1:] = label[1:] != label[:-1]
    bounds = torch.cat([change.nonzero().squeeze(1), torch.tensor([label.numel()])])
    device = segments.device if segments is not None else torch.device("cpu")
    cat = (lambda parts: torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long))
    return PackedLayout(rows=len(lengths), seq=seq, out_rows=len(bins), length=length, index=cat(index).to(device),
                        dest=cat(dest).to(device), segment_ids=seg_out.to(device), cu_seqlens=bounds.to(torch.int32),
                        max_seqlen=int((bounds[1:] - bounds[:-1]).max()))


@torch.no_grad()
def forward_logits(chunks: list, micro_batches: list[torch.Tensor], vocab_size: int | None = None, *, pg):
    """Full-vocabulary logits [b, s, vocab] per micro-batch on the last pipeline stage (None on other stages).

    Runs Megatron's forward-only pipeline schedule (PP/VPP) on pg (megatron-core's ProcessGroupCollection, the one the
    model was built on: ModelBridge.pg), gathers the vocab-parallel logits over its TP group and drops the padded
    vocabulary rows when vocab_size is given. Meant for checks and probes: training never gathers the vocabulary.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def forward_step(data_iterator, model):
        output = model(*causal_inputs(next(data_iterator)))

        def keep_logits(logits):
            full = gather_from_tensor_model_parallel_region(logits, group=pg.tp)
            if vocab_size is not None:
                full = full[..., :vocab_size]
            return torch.zeros((), device=logits.device), {"logits": full}

        return output, keep_logits

    # Sequence parallelism splits the sequence over TP ranks: right-pad to a multiple of TP (causal attention keeps
    # the real positions unaffected) and cut the padding off the logits again.
    tp = pg.tp.size()
    lengths = [b.shape[1] for b in micro_batches]
    micro_batches = [torch.nn.functional.pad(b, (0, -b.shape[1] % tp)) for b in micro_batches]
    seq_length = micro_batches[0].shape[1]
    iterators = [iter(micro_batches) for _ in chunks] if len(chunks) > 1 else iter(micro_batches)
    for chunk in chunks:
        chunk.eval()
    groups = {"pg_collection": pg}
    if pg.pp.size() > 1:  # megatron-core's pipelined schedules take explicit groups with their p2p communicator
        groups["p2p_communicator"] = P2PCommunicator(pp_group=pg.pp, config=chunks[0].config)
    results = get_forward_backward_func(pp_size=pg.pp.size(), vp_size=len(chunks) if len(chunks) > 1 else None)(
        forward_step_func=forward_step, data_iterator=iterators, model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=micro_batches[0].shape[0],
        forward_only=True, **groups)
    if pg.pp.rank() != pg.pp.size() - 1:
        return None
    return [r["logits"][:, :n] for r, n in zip(results, lengths)]
