"""Test helpers: a fork-based multi-rank runner and tiny local models (no hub access)."""
from .distributed import RankFailure, run_ranks
from .models import tiny_model_dir

__all__ = ["RankFailure", "run_ranks", "tiny_model_dir"]
