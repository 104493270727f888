"""AlgorithmConfig: which advantage estimator, policy loss, KL, entropy, aggregation and mismatch correction."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..errors import UserError, unknown_name
from .advantages import ADVANTAGE_ESTIMATORS
from .aggregation import AGGREGATIONS
from .kl import KL_ESTIMATORS, TOP_K_KL
from .mismatch import MISMATCH_MODES
from .policy_losses import POLICY_LOSSES


class AlgorithmConfigError(UserError, ValueError):
    """An algorithm setting that cannot work; the message names the field and the fix."""


@dataclass
class MismatchConfig:
    # none | tis | seq_tis | mis | icepop; unset: tis with rl.max_staleness >= 1 (the decoupled PPO objective),
    # none otherwise (resolved for an RL run by megarl.trainer.config.rl_algorithm)
    mode: Optional[str] = None
    cap: float = 2.0  # tis / seq_tis truncation
    low: float = 0.5  # mis / icepop: keep ratios within [low, high]
    high: float = 2.0


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = "grpo"
    policy_loss: str = "ppo_clip"
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2  # DAPO clip-higher: e.g. 0.28
    dual_clip: Optional[float] = None  # dual-clip PPO constant c > 1
    aggregation: str = "token-mean"
    norm_length: Optional[int] = None  # seq-mean-token-sum-norm constant (e.g. max new tokens)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_in_reward: bool = False  # REINFORCE++/GAE: -kl_coef*kl per token in the reward instead of in the loss
    entropy_coef: float = 0.0
    temperature: float = 1.0  # the rollout's sampling temperature: log-probs are of logits / temperature
    gamma: float = 1.0
    lam: float = 0.95
    use_critic: bool = False
    value_clip: Optional[float] = 0.2
    reward_weights: Optional[list] = None  # gdpo: one weight per reward
    std_normalize: bool = True  # grpo / grpo_passk / gdpo: divide by the group's reward std (false: centre only)
    whiten_advantages: bool = False  # gae: whiten the advantages over the global batch
    sapo_tau_pos: float = 1.0  # sapo: gate temperature for A > 0
    sapo_tau_neg: float = 1.05  # sapo: gate temperature for A <= 0
    adv_reweight_alpha: float = 0.3  # adv_reweight: A * (alpha * p_t + 1 - alpha)
    # Lopti (arXiv:2505.12929): two optimizer steps per mini-batch, first the tokens with pi_old < lopti_eta
    lopti: bool = False
    lopti_eta: float = 0.5
    # "Beyond the 80/20 Rule" (arXiv:2506.01939): train only the high_entropy_rho highest-entropy response tokens
    high_entropy_only: bool = False
    high_entropy_rho: float = 0.2
    fipo_decay_rate: float = 32.0  # fipo: gamma = 2^(-1/decay_rate) (the Future-KL half-life in tokens)
    fipo_clip_range: float = 0.2  # fipo: influence weight within [1 - r, 1 + r] ([1, 1 + r] with clip_high_only)
    fipo_clip_high_only: bool = True
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of response tokens whose gradient is cut
    clip_cov_lb: float = 1.0  # clip_cov: candidates have lb < Cov < ub
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of response tokens (largest Cov) that get the KL penalty
    kl_cov_coef: float = 1.0  # kl_cov: the penalty kl_cov_coef * |log(pi / pi_old)|
    # opd (on-policy distillation from the teacher: section): A_t = teacher log-prob - student log-prob per token,
    # plus opd_reward_weight x the task reward's GRPO advantage (0: pure distillation; > 0 needs rollout.n_samples >= 2)
    opd_reward_weight: float = 0.0
    # opd_top_k k > 0: instead of the sampled token's log-ratio, the loss adds the exact KL between student and teacher
    # at every response position over k + 1 outcomes: the teacher's top-k tokens there and one bucket for the rest of
    # the vocabulary (megarl.algorithms.kl.topk_kl; opd_top_k_kl picks the direction). No sampling noise in the
    # distillation signal; the teacher returns its top-k per position in the same prefill request. The advantage is
    # then only the task reward's share (opd_reward_weight). The k log-probs come from the sampled token's vocabulary
    # pass (one normaliser for 1 + k targets).
    opd_top_k: int = 0
    opd_top_k_kl: str = "reverse"  # with opd_top_k: "reverse" KL(student || teacher) or "forward" KL(teacher || student)
    mismatch: MismatchConfig = field(default_factory=MismatchConfig)
    # Log-probs and entropy straight from the final hidden states and the output weight, chunked over tokens: the
    # [tokens, vocab/tp] logits and their gradient never exist (megarl/losses/fused_linear.py). Same values and
    # gradients as false (tested); false runs the model's own output layer and reads its logits.
    fused_logprobs: bool = True
    # The model's forward reads each micro-batch's real tokens packed together (per-sample attention and positions;
    # THD PackedSeqParams on the TransformerEngine path, packed rows of at most the padded length with a block mask
    # on CPU) instead of rows padded to the longest; outputs are unpacked before the objective, so results equal the
    # padded forward (tests/losses/test_packing.py). Used by RL, SFT and DPO alike (megarl/losses/step.py run_schedule). On
    # by default: measured on CPU not slower on short uniform rows (quickstart shape: 0.93x) and 3.4x faster on a
    # long-tailed RL batch (benchmarks/packing.py); false restores the padded forward. None (the default): packed
    # unless context parallelism is on (parallel.cp > 1, which the packed path does not cover yet: padded there).
    pack_sequences: bool | None = None

    def validate(self) -> "AlgorithmConfig":
        _choice("advantage_estimator", self.advantage_estimator, ADVANTAGE_ESTIMATORS)
        _choice("policy_loss", self.policy_loss, POLICY_LOSSES)
        _choice("aggregation", self.aggregation, AGGREGATIONS)
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        _choice("mismatch.mode", self.mismatch.mode, MISMATCH_MODES)
        if not 0 <= self.clip_eps_low < 1:
            raise AlgorithmConfigError(f"algorithm.clip_eps_low={self.clip_eps_low} must be in [0, 1): the lower "
                                       "ratio bound is 1 - clip_eps_low. Fix: e.g. 0.2.")
        if self.clip_eps_high < 0:
            raise AlgorithmConfigError(f"algorithm.clip_eps_high={self.clip_eps_high} must be >= 0: the upper ratio "
                                       "bound is 1 + clip_eps_high (bounds would be inverted). Fix: e.g. 0.2 or 0.28.")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise AlgorithmConfigError(f"algorithm.dual_clip={self.dual_clip} must be > 1 (it caps -A * ratio for "
                                       "negative advantages). Fix: e.g. 3.0, or null to disable.")
        if self.mismatch.low >= self.mismatch.high or self.mismatch.low <= 0:
            raise AlgorithmConfigError(f"algorithm.mismatch.low={self.mismatch.low} must be > 0 and below "
                                       f"algorithm.mismatch.high={self.mismatch.high}.")
        if self.mismatch.cap <= 0:
            raise AlgorithmConfigError(f"algorithm.mismatch.cap={self.mismatch.cap} must be > 0 (e.g. 2.0).")
        if self.temperature <= 0:
            raise AlgorithmConfigError(f"algorithm.temperature={self.temperature} must be > 0.")
        if self.advantage_estimator == "gae" and not self.use_critic:
            raise AlgorithmConfigError("algorithm.advantage_estimator=gae needs a critic's values. Fix: set "
                                       "algorithm.use_critic: true, or pick a critic-free estimator (grpo, rloo, ...).")
        if self.use_critic and self.advantage_estimator != "gae":
            raise AlgorithmConfigError(f"algorithm.use_critic=true but advantage_estimator="
                                       f"{self.advantage_estimator!r} does not use values. Fix: use gae or drop the "
                                       "critic.")
        if self.kl_in_reward:
            if self.advantage_estimator not in ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
                raise AlgorithmConfigError(
                    f"algorithm.kl_in_reward=true needs token-level returns, which advantage_estimator="
                    f"{self.advantage_estimator!r} does not compute. Fix: kl_in_reward: false (KL in the loss) or "
                    "use gae / reinforce_plus_plus / reinforce_plus_plus_baseline.")
            if not self.kl_coef:
                raise AlgorithmConfigError("algorithm.kl_in_reward=true with kl_coef=0 adds nothing. "
                                           "Fix: set kl_coef > 0 or kl_in_reward: false.")
        if self.aggregation == "seq-mean-token-sum-norm" and not self.norm_length:
            raise AlgorithmConfigError("algorithm.aggregation=seq-mean-token-sum-norm needs algorithm.norm_length "
                                       "(a constant, e.g. the rollout's max new tokens).")
        if self.advantage_estimator == "dr_grpo" and self.aggregation == "seq-mean-token-mean":
            raise AlgorithmConfigError("algorithm.advantage_estimator=dr_grpo removes length normalisation, but "
                                       "aggregation=seq-mean-token-mean puts it back. Fix: aggregation: "
                                       "seq-mean-token-sum-norm (or token-mean).")
        # what the chosen estimator reads (its registry entry: megarl.algorithms.advantages.register_advantage)
        if self.reward_weights is not None and "reward_weights" not in ADVANTAGE_ESTIMATORS[
                self.advantage_estimator].reads:
            raise AlgorithmConfigError("algorithm.reward_weights is only used by advantage_estimator=gdpo.")
        if not self.std_normalize and "std_normalize" not in ADVANTAGE_ESTIMATORS[self.advantage_estimator].reads:
            normalising = sorted(n for n, e in ADVANTAGE_ESTIMATORS.items() if "std_normalize" in e.reads)
            raise AlgorithmConfigError(
                f"algorithm.std_normalize=false has no effect with advantage_estimator={self.advantage_estimator!r}. "
                f"Fix: use one of {normalising}, or drop std_normalize.")
        if self.whiten_advantages and self.advantage_estimator != "gae":
            raise AlgorithmConfigError(
                f"algorithm.whiten_advantages=true is only used by advantage_estimator=gae (got "
                f"{self.advantage_estimator!r}, which normalises its own advantages). Fix: whiten_advantages: false.")
        if self.policy_loss == "aspo" and self.dual_clip is None:
            raise AlgorithmConfigError("algorithm.policy_loss=aspo needs algorithm.dual_clip (its soft dual clip "
                                       "bounds the flipped ratio pi_old/pi). Fix: dual_clip: 3.0.")
        if self.sapo_tau_pos <= 0 or self.sapo_tau_neg <= 0:
            raise AlgorithmConfigError(f"algorithm.sapo_tau_pos={self.sapo_tau_pos} / sapo_tau_neg="
                                       f"{self.sapo_tau_neg} must be > 0 (gate temperatures). Fix: e.g. 1.0 / 1.05.")
        if not 0 <= self.adv_reweight_alpha <= 1:
            raise AlgorithmConfigError(f"algorithm.adv_reweight_alpha={self.adv_reweight_alpha} must be in [0, 1] "
                                       "(the weight alpha * p_t + 1 - alpha must stay positive). Fix: e.g. 0.3.")
        if self.opd_reward_weight < 0 or (self.opd_reward_weight and self.advantage_estimator != "opd"):
            raise AlgorithmConfigError(f"algorithm.opd_reward_weight={self.opd_reward_weight} must be >= 0 and is only "
                                       "used by advantage_estimator=opd. Fix: opd_reward_weight: 0 (or e.g. 0.5 with "
                                       "opd).")
        if self.opd_top_k < 0 or (self.opd_top_k and self.advantage_estimator != "opd"):
            raise AlgorithmConfigError(f"algorithm.opd_top_k={self.opd_top_k} must be >= 0 and is only used by "
                                       "advantage_estimator=opd. Fix: opd_top_k: 0 (or e.g. 8 with opd).")
        if self.opd_top_k_kl not in TOP_K_KL:
            raise AlgorithmConfigError(f"algorithm.opd_top_k_kl={self.opd_top_k_kl!r} is unknown; choose one of "
                                       f"{list(TOP_K_KL)}")
        self._validate_token_selection()
        return self

    def _validate_token_selection(self) -> None:
        if not 0 < self.lopti_eta < 1:
            raise AlgorithmConfigError(f"algorithm.lopti_eta={self.lopti_eta} must be in (0, 1) (a probability "
                                       "threshold on pi_old). Fix: e.g. 0.5.")
        if not 0 < self.high_entropy_rho <= 1:
            raise AlgorithmConfigError(f"algorithm.high_entropy_rho={self.high_entropy_rho} must be in (0, 1] (the "
                                       "fraction of response tokens trained). Fix: e.g. 0.2.")
        if self.fipo_decay_rate <= 0 or not 0 < self.fipo_clip_range < 1:
            raise AlgorithmConfigError(f"algorithm.fipo_decay_rate={self.fipo_decay_rate} must be > 0 and "
                                       f"fipo_clip_range={self.fipo_clip_range} in (0, 1). Fix: e.g. 32.0 and 0.2.")
        for name in ("clip_cov_ratio", "kl_cov_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise AlgorithmConfigError(f"algorithm.{name}={getattr(self, name)} must be in (0, 1] (a fraction "
                                           "of the response tokens). Fix: e.g. 0.0002.")
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise AlgorithmConfigError(f"algorithm.clip_cov_lb={self.clip_cov_lb} must be below clip_cov_ub="
                                       f"{self.clip_cov_ub} (the covariance band). Fix: e.g. 1.0 and 5.0.")
        if self.kl_cov_coef < 0:
            raise AlgorithmConfigError(f"algorithm.kl_cov_coef={self.kl_cov_coef} must be >= 0. Fix: e.g. 1.0.")


def _choice(name, value, choices) -> None:
    if value not in choices:
        listed = sorted(str(c) for c in choices if c is not None)  # None is "unset", not a value to write
        raise AlgorithmConfigError(unknown_name(f"algorithm.{name}", value, listed))
