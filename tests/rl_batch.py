"""A fixed RL batch with unequal sequence lengths, for layout-invariance tests."""
from __future__ import annotations

import torch

from megarl.losses import TokenBatch, shift_sequences

SEQ_LEN = 16
TEMPERATURE = 0.8


def rl_token_batch(model_path: str, n: int = 8, seed: int = 0) -> TokenBatch:
    """n sequences (prompt 2-5 tokens, response 2-10 tokens), with old/ref/rollout log-probs near the model's own
    (from transformers, at TEMPERATURE) so ratios straddle the clip range, and per-token advantages."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(n):
        p = int(torch.randint(2, 6, (1,), generator=g))
        r = int(torch.randint(2, SEQ_LEN - p + 1, (1,), generator=g))
        prompts.append(torch.randint(3, 384, (p,), generator=g).tolist())
        responses.append(torch.randint(3, 384, (r,), generator=g).tolist())
    input_ids, targets, mask = shift_sequences(prompts, responses, pad_id=0, seq_len=SEQ_LEN)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids).logits / TEMPERATURE, -1).gather(-1, targets[..., None])[..., 0]
    noise = lambda scale: scale * torch.randn(mask.shape, generator=g)  # noqa: E731
    old = (logp + noise(0.15)) * mask
    advantages = torch.randn(n, generator=g)[:, None] * mask + noise(0.3) * mask
    return TokenBatch(input_ids=input_ids, targets=targets, loss_mask=mask, advantages=advantages,
                      old_log_probs=old, ref_log_probs=(logp + noise(0.1)) * mask,
                      rollout_log_probs=(old + noise(0.05)) * mask)
