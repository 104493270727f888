"""RL and SFT objectives as Megatron pipeline-aware loss functions, and the step that runs them.

    pg = megarl.parallel.groups().mcore        # or megarl.parallel.user_groups() in your own Megatron loop
    loss_func = make_loss_func(micro_batch, algorithm_config, num_microbatches=n, vocab_size=V, pg=pg)
    # return (logits, loss_func) from your forward_step_func; see docs/losses.md
"""
from .rl import (OBJECTIVES, TokenBatch, make_loss_func, place_response_values, prepare_global_batch,
                 reduce_metrics, rl_objective, sft_objective, shift_sequences)
from .step import compute_log_probs, compute_values, forward_backward, run_schedule, train_step
from .vocab_parallel import vocab_parallel_logprob_entropy

__all__ = ["OBJECTIVES", "TokenBatch", "compute_log_probs", "compute_values", "forward_backward", "make_loss_func",
           "place_response_values", "prepare_global_batch", "reduce_metrics", "rl_objective", "run_schedule",
           "sft_objective", "shift_sequences", "train_step", "vocab_parallel_logprob_entropy"]
