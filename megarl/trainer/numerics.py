"""The numerics guard's stop rule. train_step (megarl.losses.step) already skips, on every rank together, an optimizer
step whose loss or gradients are not finite; `SkippedSteps` counts those skips in a row, across the RL step's
updates and across steps, and stops the run with one line at rl.max_skipped_steps of them: one NaN batch is
survived, a run that diverged is not trained on (nor synced, nor checkpointed) for ever."""
from __future__ import annotations

from ..errors import UserError, agree


class NonFiniteTraining(UserError):
    """rl.max_skipped_steps optimizer steps in a row had a non-finite loss or gradient."""


class SkippedSteps:
    """count(metrics) after every train_step; every rank gets the same metrics (the skip was agreed by a reduction),
    so every rank stops at the same update."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row = limit, 0

    def count(self, metrics: dict, where: str) -> None:
        """metrics: one train_step's; where: the step as the user reads it (e.g. "RL step 7, epoch 1, mini-batch 2")."""
        if not metrics.get("skipped_updates"):
            self.in_a_row = 0
            return
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            # rank 0 says it, the others raise it quietly (megarl.cli prints a RemoteUserError from no rank but 0)
            loss, steps = metrics.get("loss", float("nan")), "steps" if self.in_a_row > 1 else "step"
            agree(NonFiniteTraining(
                f"rl.max_skipped_steps={self.limit}: {self.in_a_row} optimizer {steps} in a row had a non-finite "
                f"loss or gradient, the last at {where} (loss {loss:.4g}); each was skipped, "
                "so the weights, the engines and the checkpoints hold the last finite step. Fix: lower optim.lr (or "
                "optim.clip_grad), check the rewards and data of those steps, then resume from the last checkpoint "
                "(or allow more skips in a row with rl.max_skipped_steps)"))
