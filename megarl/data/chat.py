"""Chat tokenisation through the model's own chat template (transformers), with assistant-only loss masks.

A multi-turn sample is rendered once, as the template renders it, and tokenised once (no per-turn re-tokenisation that
could split differently at turn boundaries). The characters each assistant turn contributes are found by rendering the
conversation up to that turn with and without it: [render(messages[:i], add_generation_prompt) ,
render(messages[:i+1])) is the assistant's own text (content, tool calls, the end-of-turn token) without the role
header the template writes. Tokens whose character span starts inside such a range carry loss.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SFTSample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 where input_ids[t] is an assistant token (trained as the target of position t - 1)


def stop_token_ids(tok) -> list[int]:
    """EOS and the chat template's end-of-turn token (where the HF tokenizer `tok` has one): where a chat model's turn
    ends, which its EOS alone may not mark (a ChatML template ends turns with <|im_end|>)."""
    ids = {tok.eos_token_id}
    for token in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"):
        tid = tok.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != tok.unk_token_id and tid is not None and tid >= 0:
            ids.add(tid)
    ids.discard(None)
    return sorted(ids)


class ChatTokenizer:
    def __init__(self, tokenizer):
        self.tok = tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer at {getattr(tokenizer, 'name_or_path', '?')} has no chat template; "
                             "megarl renders prompts and SFT samples with it. Fix: use an instruct model's tokenizer "
                             "or set tokenizer.chat_template in tokenizer_config.json")

    @classmethod
    def from_pretrained(cls, path: str) -> "ChatTokenizer":
        from transformers import AutoTokenizer

        return cls(AutoTokenizer.from_pretrained(path))

    def render(self, messages: list[dict], add_generation_prompt: bool = False, tools=None) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            tools=tools)

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, messages: list[dict], tools=None) -> list[int]:
        return self.encode(self.render(messages, add_generation_prompt=True, tools=tools))

    def response_ids(self, messages: list[dict], response: str, tools=None) -> list[int]:
        """The ids of `response` as the assistant turn after `messages` (content and end-of-turn token, as the chat
        template writes it), tokenised on its own: what a model continuing prompt_ids(messages) would generate."""
        prompt = self.render(messages, add_generation_prompt=True, tools=tools)
        full = self.render(list(messages) + [{"role": "assistant", "content": response}], tools=tools)
        if not full.startswith(prompt):
            raise ValueError("the chat template renders the assistant turn differently from its generation prompt")
        return self.encode(full[len(prompt):len(full.rstrip("\n"))])

    def continuation_ids(self, messages: list[dict], tools=None) -> list[int]:
        """Token ids the chat template writes after a finished assistant turn for `messages` (e.g. tool results) up to
        and including the next assistant header. Rendered after a placeholder conversation and cut where the
        assistant's end-of-turn token ends, so the ids continue the engine's own tokens (which end with that token)
        without re-tokenising them."""
        base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "."}]
        before = self.render(base, tools=tools)
        after = self.render(base + list(messages), add_generation_prompt=True, tools=tools)
        if not after.startswith(before):
            raise ValueError("the chat template rewrites earlier turns when tool messages follow; megarl cannot "
                             "append observations token-in/token-out with it")
        return self.encode(after[len(before.rstrip("\n")):])

    @property
    def pad_id(self) -> int:
        pad = self.tok.pad_token_id
        return pad if pad is not None else self.tok.eos_token_id

    @property
    def stop_ids(self) -> list[int]:
        return stop_token_ids(self.tok)

    def sft_sample(self, messages: list[dict], tools=None) -> SFTSample:
        text = self.render(messages, tools=tools)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            start = len(self.render(messages[:i], add_generation_prompt=True, tools=tools)) if i else 0
            before, upto = self.render(messages[:i], tools=tools) if i else "", self.render(messages[: i + 1],
                                                                                            tools=tools)
            if not text.startswith(upto) or not upto.startswith(before):
                raise ValueError("the chat template does not render conversations prefix-by-prefix (turn "
                                 f"{i} changes earlier text); megarl cannot locate assistant tokens with it")
            end = len(upto.rstrip("\n"))  # the template's newline after the end-of-turn token is formatting
            spans.append((start, end))
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(s <= begin < e for s, e in spans)) for begin, _ in enc["offset_mapping"]]
        return SFTSample(list(enc["input_ids"]), mask)


def pack_samples(samples: list[SFTSample], max_seq_len: int, pack: bool = True) -> list[list[SFTSample]]:
    """Rows of samples whose total length fits max_seq_len (first-fit decreasing); pack=False: one per row.
    Longer samples are cut to max_seq_len."""
    samples = [SFTSample(s.input_ids[:max_seq_len], s.loss_mask[:max_seq_len]) for s in samples]
    if not pack:
        return [[s] for s in samples]
    rows: list[list[SFTSample]] = []
    room: list[int] = []
    for s in sorted(samples, key=lambda s: -len(s.input_ids)):
        for i, free in enumerate(room):
            if len(s.input_ids) <= free:
                rows[i].append(s)
                room[i] -= len(s.input_ids)
                break
        else:
            rows.append([s])
            room.append(max_seq_len - len(s.input_ids))
    return rows


def rows_to_tensors(rows: list[list[SFTSample]], pad_id: int, seq_len: int | None = None):
    """(input_ids, targets, loss_mask, segment_ids) [b, s] for packed rows. targets[t] = input_ids[t + 1];
    loss_mask[t] = 1 when that next token is an assistant token of the same sample; segment_ids number the samples
    of a row from 1 (0 = padding), so attention and positions restart at every sample."""
    seq_len = seq_len or max(sum(len(s.input_ids) for s in row) for row in rows)
    ids = torch.full((len(rows), seq_len), pad_id, dtype=torch.long)
    next_mask = torch.zeros(len(rows), seq_len)
    segments = torch.zeros(len(rows), seq_len, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for k, s in enumerate(row, start=1):
            n = len(s.input_ids)
            ids[r, at:at + n] = torch.tensor(s.input_ids)
            segments[r, at:at + n] = k
            # the first token of a sample is never a target (nothing of its own sample precedes it)
            next_mask[r, at:at + n - 1] = torch.tensor(s.loss_mask[1:], dtype=torch.float32)
            at += n
    targets = torch.cat([ids[:, 1:], torch.full((len(rows), 1), pad_id, dtype=torch.long)], dim=1)
    return ids, targets, next_mask, segments
