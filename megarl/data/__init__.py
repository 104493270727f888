"""Datasets: prompt sets for RL and chat samples for SFT (JSONL / Parquet files, Hugging Face dataset folders, the
built-in synthetic task, reasoning-gym tasks), and chat
tokenisation with assistant-only loss masks and sequence packing."""
from .chat import ChatTokenizer, pack_samples
from .datasets import (PROCEDURAL, DataError, PreferencePair, PromptRecord, load_preference_pairs, load_prompts,
                       load_responses, load_sft_samples, prompt_source, read_records)
from .synthetic import arithmetic_problems

__all__ = ["PROCEDURAL", "ChatTokenizer", "DataError", "PreferencePair", "PromptRecord", "arithmetic_problems",
           "load_preference_pairs", "load_prompts", "load_responses", "load_sft_samples", "pack_samples",
           "prompt_source", "read_records"]
