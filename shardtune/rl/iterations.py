"""Several optimizer steps per generation batch (TRL's ``num_iterations``, the GRPO paper's μ).

Rule: a **cycle** is ``num_iterations`` optimizer steps on one generation batch. The loader yields
each step's ``gradient_accumulation_steps`` prompt batches ``num_iterations`` times
(:class:`RepeatedSteps`, as TRL's ``RepeatSampler`` repeats them), each tagged with its micro-batch
and iteration; the loop's phase before each step (:class:`~shardtune.rl.step.RolloutPhase`)
generates the rollouts of the whole step, and the sampling policy's log-probs (TRL's
``old_per_token_logps``), at iteration 0 and returns them again at the others, so
steps ``k·μ .. k·μ+μ-1`` train on the rollouts of step ``k·μ`` with the clipped ratio against it.

A cycle never spans a checkpoint: mid-epoch saves fall on cycle boundaries (the config checks
that ``save_every_n_steps`` and ``max_steps_per_epoch`` are multiples of ``num_iterations``), an
epoch ends on one, and a resume refuses a checkpoint inside a cycle (:func:`check_resume`). The
old log-probs come from the weights of the cycle's first step, which a mid-cycle resume no longer
has; at a boundary the resumed run regenerates the cycle's rollouts from the checkpoint's weights
and step exactly as the uninterrupted run did, so nothing of a cycle is saved.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from shardtune.checkpoint.formats.training_state import TrainingProgress

__all__ = ["RepeatedSteps", "check_resume"]


class RepeatedSteps:
    """``loader``'s batches in steps of ``accumulation``, each step yielded ``iterations`` times.

    Item: ``{"tokens": the micro-batch's prompt tokens, "prompts": the step's prompt batches,
    "micro_batch": i, "iteration": j}``; a partial last step is dropped (as the loop drops it).
    Its length is in yielded batches: what the loop and the lr schedule count."""

    def __init__(self, loader: Any, *, accumulation: int, iterations: int) -> None:
        self.loader, self.accumulation, self.iterations = loader, accumulation, iterations
        self.dataset = loader.dataset  # the checkpoint's fingerprint reads it

    def __len__(self) -> int:
        return len(self.loader) // self.accumulation * self.accumulation * self.iterations

    def __iter__(self) -> Iterator[dict[str, Any]]:
        batches = iter(self.loader)
        while len(step := list(itertools.islice(batches, self.accumulation))) == self.accumulation:
            for j in range(self.iterations):
                for i, batch in enumerate(step):
                    yield {"tokens": batch["tokens"], "prompts": step, "micro_batch": i, "iteration": j}


def check_resume(progress: TrainingProgress, *, accumulation: int, iterations: int) -> None:
    """Raise ``ValueError`` when ``progress`` (a resumed checkpoint's) stands inside a cycle."""
    if progress.batches_in_epoch % (accumulation * iterations):
        raise ValueError(
            f"the checkpoint of step {progress.step} stands inside a cycle of grpo.num_iterations={iterations} "
            "optimizer steps on one generation batch, whose sampling log-probs it does not hold; resume with the "
            "grpo.num_iterations and gradient_accumulation_steps it was saved with, or from a checkpoint at a multiple "
            f"of {iterations} steps"
        )
