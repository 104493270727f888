"""megarl: RL post-training for LLMs on Megatron-Core, with SGLang as the rollout engine."""
__version__ = "0.1.0"
