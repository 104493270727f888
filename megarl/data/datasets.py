"""Prompt datasets (RL) and chat datasets (SFT) from JSONL or Parquet files, or the built-in synthetic task.

Every record is validated when the file is read; a bad one is an error naming the file, the line (JSONL) or row
(Parquet), and what is wrong with it — never a KeyError deep inside a training step.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

from ..errors import UserError
from .chat import ChatTokenizer, SFTSample
from .synthetic import noisy_answers, synthetic_splits, tool_use_demonstrations, wrong_answers


class DataError(UserError, ValueError):
    """A dataset record that cannot be used; the message names the file and line/row."""


@dataclass
class PromptRecord:
    index: int  # position in the dataset (the data cursor of a resumed run counts these)
    prompt_ids: list[int]
    answer: str | None
    text: str  # the rendered prompt, for logs


def read_records(path: str, limit: int | None = None) -> list[tuple[str, dict]]:
    """[(where, record)] from a .jsonl/.json lines or .parquet file, or a folder: a Hugging Face dataset saved with
    `save_to_disk` (one split), or shards (*.parquet / *.jsonl, read in name order). `where` is "file:line N" or
    "file:row N". limit: only the first records (a pre-flight check)."""
    if os.path.isdir(path):
        return _read_folder(path, limit)
    if not os.path.isfile(path):
        raise DataError(f"dataset file {path!r} does not exist. Fix: point the field at a JSONL / Parquet file or a "
                        "dataset folder (the preset's header names the command that writes its data)")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise DataError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        return [(f"{path}:row {i}", r) for i, r in enumerate(rows[:limit])]
    out = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:line {number}: not valid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise DataError(f"{path}:line {number}: expected a JSON object, got {type(record).__name__}")
            out.append((f"{path}:line {number}", record))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise DataError(f"dataset file {path!r} holds no records")
    return out


_SHARDS = (".parquet", ".jsonl")  # not *.json: a dataset folder's metadata files (dataset_info.json, ...)
_SPLITS = ("train", "test", "validation", "valid", "dev", "eval", "prompt")  # split prefixes of shard names


def _read_folder(path: str, limit: int | None) -> list[tuple[str, dict]]:
    names = sorted(os.listdir(path))
    if "dataset_dict.json" in names:  # a DatasetDict: its splits are save_to_disk folders of their own
        splits = sorted(n for n in names if os.path.isdir(os.path.join(path, n)))
        raise DataError(f"{path!r} is a Hugging Face DatasetDict with splits {splits}; name one. Fix: e.g. "
                        f"{os.path.join(path, splits[0] if splits else 'train')!r}")
    if "state.json" in names:  # Dataset.save_to_disk: read with the `datasets` library that wrote it
        import datasets

        try:
            rows = datasets.load_from_disk(path)
        except Exception as e:  # datasets raises several types for a folder it cannot read
            raise DataError(f"{path}: not a readable Hugging Face dataset folder ({type(e).__name__}: {e})") from None
        if limit is not None:
            rows = rows.select(range(min(limit, len(rows))))
        out = [(f"{path}:row {i}", r) for i, r in enumerate(rows)]
    else:
        shards = [os.path.join(path, n) for n in names if n.endswith(_SHARDS)]
        if not shards:
            raise DataError(f"dataset folder {path!r} holds neither a saved Hugging Face dataset (state.json) nor "
                            f"data shards ({', '.join('*' + e for e in _SHARDS)})")
        splits = sorted({s for n in names if n.endswith(_SHARDS) for s in _SPLITS if n.lower().startswith(s)})
        if len(splits) > 1:  # e.g. MBPP's train-*, test-*, validation-*, prompt-* parquet files side by side
            raise DataError(f"dataset folder {path!r} holds the shards of several splits ({', '.join(splits)}); "
                            "reading them all would mix them. Fix: point at one split's file, or a folder of its "
                            "shards only")
        out = []
        for shard in shards:
            out += read_records(shard, None if limit is None else limit - len(out))
            if limit is not None and len(out) >= limit:
                break
    if not out:
        raise DataError(f"dataset folder {path!r} holds no records")
    return out


def _messages(where: str, record: dict, cfg) -> list[dict]:
    if cfg.messages_key in record:
        messages = record[cfg.messages_key]
        _check_messages(where, messages, cfg.messages_key)
        messages = list(messages)
    elif cfg.prompt_key in record:
        prompt = record[cfg.prompt_key]
        if not isinstance(prompt, str) or not prompt:
            raise DataError(f"{where}: field {cfg.prompt_key!r} must be a non-empty string, got {prompt!r}")
        messages = [{"role": "user", "content": prompt}]
    else:
        raise DataError(f"{where}: has neither {cfg.prompt_key!r} (a prompt string) nor {cfg.messages_key!r} (chat "
                        f"messages); keys are {sorted(record)}. Fix the file or set data.prompt_key / "
                        "data.messages_key")
    if cfg.system_prompt and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    return messages


def _check_messages(where: str, messages, key: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: field {key!r} must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not isinstance(m.get("content", ""), (str, type(None))):
            raise DataError(f"{where}: {key}[{i}] must be an object with 'role' and string 'content', got {m!r}")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise DataError(f"{where}: {key}[{i}].role={m['role']!r}; expected system/user/assistant/tool")


PROCEDURAL = ("synthetic", "reasoning_gym")  # data sources generated here, each with its own held-out split


def prompt_source(spec: str, cfg, split: str = "train") -> list[tuple[str, dict]]:
    """[(where, record)] of a prompt source: a file or folder (read_records), "synthetic" (cfg.synthetic),
    "reasoning_gym" (cfg.reasoning_gym) or "humaneval" (megarl.data.code); split: "train" or "eval" (a procedural
    source's held-out split)."""
    if spec == "synthetic":
        train, held_out = synthetic_splits(cfg.synthetic)
        return [(f"synthetic:{split}[{i}]", r) for i, r in enumerate(train if split == "train" else held_out)]
    if spec == "humaneval":
        from .code import humaneval_records

        return [(where, {cfg.prompt_key: r["prompt"], cfg.answer_key: r["answer"]}) for where, r in humaneval_records()]
    if spec == "reasoning_gym":
        from . import reasoning_gym

        return [(where, {cfg.messages_key: r["messages"], cfg.answer_key: r["answer"]})
                for where, r in reasoning_gym.prompt_records(cfg.reasoning_gym, split)]
    records = read_records(spec)
    if cfg.eval_fraction and spec == cfg.train:  # the held-out part of the train file, or the rest
        records = [(where, r) for where, r in records if in_eval_fraction(r, cfg) == (split == "eval")]
    return records


def in_eval_fraction(record: dict, cfg) -> bool:
    """Whether data.eval_fraction holds this prompt out: a hash of its text (prompt_key, or the messages as JSON)
    below the fraction, the same on every run and machine; equal prompts fall on the same side."""
    text = record.get(cfg.prompt_key)
    if not isinstance(text, str):
        text = json.dumps(record.get(cfg.messages_key), sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") < cfg.eval_fraction * 2 ** 64


def load_prompts(spec: str, tokenizer: ChatTokenizer, cfg, split: str = "train", tools=None) -> list[PromptRecord]:
    """Prompt records for RL from `prompt_source(spec, cfg, split)`. tools: tool schemas the chat template renders
    into every prompt (multi-turn tool use)."""
    return [_prompt_record(i, where, record, tokenizer, cfg, tools)
            for i, (where, record) in enumerate(prompt_source(spec, cfg, split))]


def _prompt_record(index: int, where: str, record: dict, tokenizer: ChatTokenizer | None, cfg, tools=None):
    messages = _messages(where, record, cfg)
    if cfg.answer_format is not None and cfg.answer_key not in record:  # a code dataset's own shape: from its columns
        from .code import code_answer

        answer = json.dumps(code_answer(where, record, cfg.answer_format))
    else:
        answer = _answer(where, record, cfg.answer_key)
    if tokenizer is None:  # a pre-flight check before the model's tokenizer exists
        return None
    ids = tokenizer.prompt_ids(messages, tools=tools)
    if len(ids) > cfg.max_prompt_tokens:
        raise DataError(f"{where}: the prompt is {len(ids)} tokens, above data.max_prompt_tokens="
                        f"{cfg.max_prompt_tokens}. Fix: shorten it, drop it, or raise the limit")
    return PromptRecord(index, ids, answer, messages[-1]["content"])


def _answer(where: str, record: dict, key: str) -> str | None:
    """The reference a reward checks against, as a string: a string or number as written; an object (structured
    tests, e.g. {"test": ..., "entry_point": ...}) as its JSON, with the record's "format" field (if any) added."""
    answer, fmt = record.get(key), record.get("format")
    if isinstance(answer, dict):  # a "format" column only means the answer's format beside an object answer
        if fmt is not None:
            if not isinstance(fmt, str):
                raise DataError(f"{where}: field 'format'={fmt!r} must be a format name, e.g. \"humaneval\"")
            answer = dict(answer, format=fmt)
        return json.dumps(answer)
    if answer is not None and (isinstance(answer, bool) or not isinstance(answer, (str, int, float))):
        raise DataError(f"{where}: field {key!r} must be a string, number or object, got {answer!r}")
    return None if answer is None else str(answer)


def check_prompt_records(path: str, cfg, tokenizer: ChatTokenizer | None, first: int) -> int:
    """Pre-flight: the first `first` prompt records of a file are usable; returns how many were checked."""
    records = read_records(path, limit=first)
    for i, (where, record) in enumerate(records):
        _prompt_record(i, where, record, tokenizer, cfg)
    return len(records)


def load_sft_samples(spec: str, tokenizer: ChatTokenizer, cfg, tools=None) -> list[SFTSample]:
    """SFT samples with assistant-only loss masks. spec: a chat JSONL/Parquet file or folder ({"messages": [...]},
    optionally "tools": [...] schemas), "synthetic" (the synthetic task's training problems, answered directly or
    through the calculator tool) or "reasoning_gym" (its training problems with the reference answers). tools: the
    schemas rendered for records that carry none (the RL prompts' tools)."""
    if spec == "synthetic":
        train, _ = synthetic_splits(cfg.synthetic)
        noisy = noisy_answers(train, cfg.synthetic.sft_answer_noise, cfg.synthetic.seed + 2)
        problems = [dict(n, answer_true=t["answer"]) for n, t in zip(noisy, train)]
        records = [(f"synthetic:train[{i}]", {cfg.messages_key: messages}) for i, messages in
                   enumerate(tool_use_demonstrations(problems, cfg.synthetic.sft_tool_share, cfg.synthetic.seed + 3))]
    elif spec == "reasoning_gym":
        from . import reasoning_gym

        records = [(where, {cfg.messages_key: r["messages"]})
                   for where, r in reasoning_gym.sft_records(cfg.reasoning_gym)]
    else:
        records = read_records(spec)
    return [_sft_sample(where, record, tokenizer, cfg, tools) for where, record in records]


def _sft_sample(where: str, record: dict, tokenizer: ChatTokenizer | None, cfg, tools=None):
    messages = record.get(cfg.messages_key)
    if messages is None:
        raise DataError(f"{where}: no {cfg.messages_key!r} field (SFT samples are chat messages); keys are "
                        f"{sorted(record)}")
    _check_messages(where, messages, cfg.messages_key)
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant message, so nothing would be trained")
    if tokenizer is None:  # a pre-flight check before the model's tokenizer exists
        return None
    if cfg.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": cfg.system_prompt}] + list(messages)
    sample = tokenizer.sft_sample(messages, tools=record.get("tools", tools))
    if not any(sample.loss_mask[1:]):
        raise DataError(f"{where}: the assistant turns produced no trainable tokens")
    return sample


def check_sft_records(path: str, cfg, tokenizer: ChatTokenizer | None, first: int) -> int:
    """Pre-flight: the first `first` SFT records of a file are usable; returns how many were checked."""
    records = read_records(path, limit=first)
    for where, record in records:
        _sft_sample(where, record, tokenizer, cfg)
    return len(records)


def load_responses(spec: str, tokenizer: ChatTokenizer, cfg, tools=None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) pairs for perplexity/entropy evaluation, from a JSONL/Parquet file whose records
    hold a prompt (data.prompt_key or data.messages_key) and a "response" string. The prompt is rendered exactly as
    for RL; the response as the assistant turn the chat template would write (with its end-of-turn token)."""
    out = []
    for where, record in read_records(spec):
        messages = _messages(where, record, cfg)
        response = record.get("response")
        if not isinstance(response, str) or not response:
            raise DataError(f"{where}: field 'response' must be a non-empty string (the text to score), got "
                            f"{response!r}")
        out.append((tokenizer.prompt_ids(messages, tools=tools),
                    tokenizer.response_ids(messages, response, tools=tools)))
    return out


# ---------------------------------------------------------------------------------------------- preference pairs
@dataclass
class PreferencePair:
    """One preference record as token ids: the rendered prompt, and the chosen and the rejected response as the
    assistant turn after it (content and end-of-turn token, ChatTokenizer.response_ids)."""
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]


def _pair_prompt(where: str, record: dict, cfg) -> list[dict]:
    prompt = record.get(cfg.prompt_key)
    if isinstance(prompt, list):  # chat messages under "prompt" (the conversational preference format)
        _check_messages(where, prompt, cfg.prompt_key)
        messages = list(prompt)
        if cfg.system_prompt and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}] + messages
        return messages
    return _messages(where, record, cfg)


def _pair_response(where: str, record: dict, key: str) -> str:
    """A response: a string, or a list of messages ending with the assistant's (its content is the response)."""
    value = record.get(key)
    if isinstance(value, list) and value:
        _check_messages(where, value, key)
        value = value[-1].get("content") if value[-1]["role"] == "assistant" else None
    if not isinstance(value, str) or not value:
        raise DataError(f"{where}: field {key!r} must be a non-empty string (or chat messages ending with the "
                        f"assistant's), got {record.get(key)!r}. Fix the record: preference records are "
                        '{"prompt": ..., "chosen": "...", "rejected": "..."}')
    return value


def _preference_pair(where: str, record: dict, tokenizer: ChatTokenizer | None, cfg):
    messages = _pair_prompt(where, record, cfg)
    chosen, rejected = _pair_response(where, record, "chosen"), _pair_response(where, record, "rejected")
    if chosen == rejected:
        raise DataError(f"{where}: 'chosen' and 'rejected' are the same text, so the pair prefers nothing")
    if tokenizer is None:  # a pre-flight check before the model's tokenizer exists
        return None
    prompt_ids = tokenizer.prompt_ids(messages)
    if len(prompt_ids) > cfg.max_prompt_tokens:
        raise DataError(f"{where}: the prompt is {len(prompt_ids)} tokens, above data.max_prompt_tokens="
                        f"{cfg.max_prompt_tokens}. Fix: shorten it, drop it, or raise the limit")
    return PreferencePair(prompt_ids, tokenizer.response_ids(messages, chosen), tokenizer.response_ids(messages,
                                                                                                        rejected))


def load_preference_pairs(spec: str, tokenizer: ChatTokenizer, cfg) -> list[PreferencePair]:
    """Preference pairs for DPO / IPO. spec: a JSONL/Parquet file of {"prompt": string or chat messages (or
    data.messages_key), "chosen": response, "rejected": response} records, a response being a string or chat messages
    ending with the assistant's; or "synthetic": the synthetic task's training problems with the right answer chosen
    and a wrong one (off by 1-3) rejected."""
    if spec == "synthetic":
        train, _ = synthetic_splits(cfg.synthetic)
        wrong = wrong_answers(train, cfg.synthetic.seed + 4)
        records = [(f"synthetic:train[{i}]", {cfg.prompt_key: p["prompt"], "chosen": p["answer"],
                                              "rejected": w["answer"]}) for i, (p, w) in enumerate(zip(train, wrong))]
    else:
        records = read_records(spec)
    return [_preference_pair(where, record, tokenizer, cfg) for where, record in records]


def check_preference_records(path: str, cfg, tokenizer: ChatTokenizer | None, first: int) -> int:
    """Pre-flight: the first `first` preference records of a file are usable; returns how many were checked."""
    records = read_records(path, limit=first)
    for where, record in records:
        _preference_pair(where, record, tokenizer, cfg)
    return len(records)
