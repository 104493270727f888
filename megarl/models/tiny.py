"""Tiny random Hugging Face models of each supported family, written locally (config + tokenizer + safetensors).

Used by the tests and the smoke run; nothing is downloaded. Every tensor is random (norm weights too), so a
round-trip or a layout bug cannot hide behind a tensor of ones.
"""
from __future__ import annotations

import os

import torch

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v3", "glm4_moe")

_BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, hidden_act="silu",
             attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_FAMILY = {
    "llama": dict(tie_word_embeddings=False),
    "qwen2": dict(tie_word_embeddings=False, use_sliding_window=False),  # Qwen2 has q/k/v biases
    "qwen3": dict(tie_word_embeddings=True, head_dim=32),  # qk-norm; head_dim != hidden/heads; tied lm_head
    "qwen3_moe": dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, router_aux_loss_coef=0.0),
    # Qwen2-MoE: q/k/v biases, a shared expert scaled by a sigmoid gate, and (norm_topk_prob=False, its default) top-k
    # probabilities taken from a softmax over all experts, not renormalised: the other router path than qwen3_moe's.
    "qwen2_moe": dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=False, router_aux_loss_coef=0.0, use_sliding_window=False, qkv_bias=True),
    # Mixtral: experts as wide as intermediate_size, softmax over the top-k router logits, no biases.
    "mixtral": dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, intermediate_size=64,
                    router_aux_loss_coef=0.0, router_jitter_noise=0.0, sliding_window=None),
    # DeepSeek-V3: MLA (q/kv LoRA ranks, rope/nope head split, interleaved RoPE), a dense first layer then MoE layers
    # with a shared expert, sigmoid router scores with the e_score_correction_bias, group-limited top-k (4 of 8
    # experts, taken from the best 2 of 4 groups, a group scored by its best 2 experts: V3 takes 8 of 256 from the best
    # 4 of 8 groups), norm_topk_prob and the routed scaling factor, YaRN RoPE as V3 ships it (V3: factor 40 over 4096
    # positions; SGLang's CPU engine serves MLA only with it). No MTP layer (transformers does not build one).
    "deepseek_v3": dict(tie_word_embeddings=False, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=4,
                        n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1,
                        q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                        routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0,
                        rope_interleave=True, rope_parameters=dict(
                            rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=32,
                            beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0),
                        # fields of DeepSeek-V3's config.json that transformers ignores and SGLang reads
                        topk_method="noaux_tc", scoring_func="sigmoid", moe_layer_freq=1, ep_size=1),
    # GLM-4.5 / 4.6 / 4.5-Air: GQA with q/k/v biases (attention_bias), QK-norm (GLM-4.5's use_qk_norm; 4.5-Air has
    # none), head_dim != hidden/heads and RoPE on the first half of each head (partial_rotary_factor 0.5, not
    # interleaved), a dense first layer then MoE layers with shared experts (two here, so a shared-expert width that
    # ignores n_shared_experts cannot pass), sigmoid router scores with the e_score_correction_bias, group-limited top-k
    # (GLM-4.5 itself has n_group 1), norm_topk_prob and the routed scaling factor. No MTP layer.
    "glm4_moe": dict(tie_word_embeddings=False, head_dim=32, partial_rotary_factor=0.5, attention_bias=True,
                     use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=4, n_group=4, topk_group=2,
                     n_shared_experts=2, moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5,
                     norm_topk_prob=True, num_nextn_predict_layers=0),
}
# ChatML, with tool calls written the way Qwen2.5's template writes them (a <tools> list in the system turn, tool calls
# as <tool_call> JSON blocks in the assistant turn, tool results as <tool_response> blocks in a user turn). Without tools
# it renders exactly "<|im_start|>{role}\n{content}<|im_end|>\n" per message.
_CHAT_TEMPLATE = (  # newlines are {{ NL }} expressions: transformers renders templates with trim_blocks
    "{%- set NL = '\\n' %}"
    "{%- if tools %}<|im_start|>system{{ NL }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}{{ NL }}{{ NL }}{% endif %}"
    "# Tools{{ NL }}<tools>{% for t in tools %}{{ NL }}{{ t | tojson }}{% endfor %}{{ NL }}</tools><|im_end|>{{ NL }}"
    "{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'system' and tools and loop.first %}"
    "{%- elif m['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ NL }}<tool_response>{{ NL }}{{ m['content'] }}{{ NL }}</tool_response>"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>{{ NL }}{% endif %}"
    "{%- else %}<|im_start|>{{ m['role'] }}"
    "{%- if m.get('tool_calls') %}{% if m['content'] %}{{ NL }}{{ m['content'] }}{% endif %}"
    "{%- for c in m['tool_calls'] %}{% set f = c['function'] if c.get('function') else c %}"
    "{{ NL }}<tool_call>{{ NL }}{\"name\": \"{{ f['name'] }}\", \"arguments\": {{ f['arguments'] | tojson }}}"
    "{{ NL }}</tool_call>{%- endfor %}<|im_end|>{{ NL }}"
    "{%- else %}{{ NL }}{{ m['content'] }}<|im_end|>{{ NL }}{% endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant{{ NL }}{% endif %}")
# Qwen2.5's tool markers, added (not special) tokens as in its tokenizer: decoded text keeps them.
_TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
_CORPUS = ["The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9 + - * / = ?",
           "What is 12 plus 30? The answer is 42.", "Question: 7 times 6. Answer: 42."]


def write_tokenizer(out_dir: str, vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a few sentences, with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def write_char_tokenizer(out_dir: str):
    """A byte-level tokenizer without merges (one token per byte: digits and signs are single tokens, which synthetic
    arithmetic tasks need), the same special tokens, tool markers and ChatML template. 263 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.add_tokens(_TOOL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


TOKENIZERS = {"bpe": write_tokenizer, "char": write_char_tokenizer}


def write_tiny_model(out_dir: str, family: str, seed: int = 0, dtype: torch.dtype = torch.float32,
                     tokenizer: str = "bpe", **overrides) -> str:
    """Write a tiny random `family` model to out_dir and return out_dir. tokenizer: "bpe" (384 ids, merges) or
    "char" (one token per byte)."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"unknown tiny tokenizer {tokenizer!r}; choose one of {sorted(TOKENIZERS)}")
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in _FAMILY:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {FAMILIES}")
    os.makedirs(out_dir, exist_ok=True)
    fields = {**_BASE, **_FAMILY[family], **overrides}
    config = AutoConfig.for_model(family, **fields)
    config.torch_dtype = dtype
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=generator))
        for name, b in model.named_buffers():
            # DeepSeek-V3 / GLM-4.5's router bias (a buffer, saved with the weights)
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=generator))
    model.to(dtype).save_pretrained(out_dir)
    if tokenizer == "char":
        write_char_tokenizer(out_dir)
    else:
        write_tokenizer(out_dir, vocab_size=min(fields["vocab_size"], 384))
    return out_dir
