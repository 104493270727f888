"""RL losses as Megatron loss functions (in progress): vocab-parallel log-probs and entropy."""
from .vocab_parallel import vocab_parallel_logprob_entropy

__all__ = ["vocab_parallel_logprob_entropy"]
