"""``num_iterations`` cycles (:mod:`shardtune.rl.iterations`): the loader yields each step's prompt
batches once per iteration, as TRL's ``RepeatSampler`` repeats them (hand-written expected order),
and a resume from inside a cycle is refused naming the key and the fix."""

from __future__ import annotations

import pytest

from shardtune.checkpoint.formats.training_state import TrainingProgress
from shardtune.rl.iterations import RepeatedSteps, check_resume


class _Loader(list):
    dataset = "prompts"


def test_each_step_is_yielded_once_per_iteration_and_a_partial_step_is_dropped():
    loader = _Loader({"tokens": f"b{k}"} for k in range(5))
    steps = RepeatedSteps(loader, accumulation=2, iterations=3)
    got = [(b["tokens"], b["micro_batch"], b["iteration"], [p["tokens"] for p in b["prompts"]]) for b in steps]
    want = [
        (f"b{first + i}", i, j, [f"b{first}", f"b{first + 1}"]) for first in (0, 2) for j in range(3) for i in range(2)
    ]
    assert got == want
    assert len(steps) == len(want) == 12
    assert steps.dataset == "prompts"


def test_a_resume_inside_a_cycle_is_refused_by_name():
    check_resume(TrainingProgress(step=2, batches_in_epoch=8), accumulation=2, iterations=2)
    check_resume(TrainingProgress(step=3, batches_in_epoch=3), accumulation=1, iterations=1)
    with pytest.raises(ValueError, match=r"step 3 stands inside a cycle of grpo.num_iterations=2"):
        check_resume(TrainingProgress(step=3, batches_in_epoch=6), accumulation=2, iterations=2)
