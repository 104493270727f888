"""RL algorithms as small pure functions in registries chosen by name (advantages, policy losses, KL, aggregation,
train/inference mismatch correction). The Megatron loss function that combines them is in megarl.losses."""
from .advantages import (ADVANTAGE_ESTIMATORS, AdvantageInputs, Estimator, compute_advantages, estimator, masked_whiten,
                         register_advantage)
from .aggregation import AGGREGATIONS, global_counts, loss_weights
from .config import AlgorithmConfig, AlgorithmConfigError, MismatchConfig
from .kl import KL_ESTIMATORS, TOP_K_KL, kl_estimate, topk_kl, topk_reverse_kl
from .mismatch import MISMATCH_MODES, mismatch_weights
from .policy_losses import POLICY_LOSSES, register_policy_loss, value_loss
from .token_selection import entropy_split, global_top_mask, loss_phases

__all__ = ["ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "KL_ESTIMATORS", "MISMATCH_MODES", "POLICY_LOSSES",
           "AdvantageInputs", "Estimator", "estimator", "AlgorithmConfig", "AlgorithmConfigError", "MismatchConfig", "compute_advantages", "entropy_split",
           "global_counts", "global_top_mask", "loss_phases",
           "kl_estimate", "loss_weights", "masked_whiten", "mismatch_weights", "register_advantage",
           "register_policy_loss", "TOP_K_KL", "topk_kl", "topk_reverse_kl", "value_loss"]
