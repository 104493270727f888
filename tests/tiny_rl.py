"""The tiny RL run the end-to-end tests launch (torchrun, Slurm, multi-node): a 2-layer Qwen2 with a one-token-per-byte
tokenizer on single-digit addition, a reward that varies even for a random model, real SGLang on CPU."""
import copy

import yaml

# Deliberately "odd" shapes, as real models have: untied, multi-head attention (as many KV heads as heads),
# intermediate_size 176 (SGLang's CPU engine zero-pads it to a multiple of 32) and a vocabulary of 300 (padded to 64):
# every run of this config (megarl train, engine TP 1) checks that weight-sync verification follows the engine's
# real layout. tests/reshard/test_sync_shapes.py covers tied, GQA and head_dim != hidden/heads at engine TP 2.
TINY = {"family": "qwen2", "tokenizer": "char",
        "overrides": {"hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 4, "vocab_size": 300, "max_position_embeddings": 128}}
BASE = {"model": {"tiny": TINY},
        "data": {"train": "synthetic", "synthetic": {"max_operand": 9, "num_train": 60, "num_eval": 4},
                 "max_prompt_tokens": 64},
        "sft": {"steps": 0},
        "rollout": {"prompts_per_step": 4, "n_samples": 4, "max_new_tokens": 6, "request_size": 2,
                    "engine": {"max_total_tokens": 4096}},
        "reward": {"name": "reward_fns:digit_fraction", "workers": 1},
        "optim": {"lr": 2e-3},
        "rl": {"steps": 2, "eval_samples": 2},
        "reshard": {"bucket_mb": 1},
        "checkpoint": {"export_hf": False},
        "logging": {"wandb": "disabled", "progress": False}}


def _merge(base: dict, updates: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in updates.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def write_config(folder, name: str, **updates) -> str:
    """<folder>/<name>.yaml: BASE with `updates` merged section by section, run_dir <folder>/<name>."""
    cfg = _merge(BASE, dict(updates, run_dir=str(folder / name)))
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)
