"""The end-to-end trainer: SFT cold start and the RL loop (GRPO/PPO family) over Megatron + SGLang."""
from .config import TrainConfig, load_train_config
from .rl import RLTrainer
from .sft import run_sft

__all__ = ["RLTrainer", "TrainConfig", "load_train_config", "run_sft"]
