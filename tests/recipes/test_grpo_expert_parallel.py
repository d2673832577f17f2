"""GRPO on a mixture-of-experts policy with ``expert_parallel=2`` on 4 CPU ranks (tiny Qwen3-MoE, 8
experts, so 4 per expert-parallel rank): rollouts (every rank steps until all are done, so the
experts' all-to-all sees as many forwards on each rank), the sampling policy's and the frozen
reference's forwards and the training step log the same rewards, loss, gradient norm, aux loss and
KL at steps 1 and 2 as the same run at ``expert_parallel=1`` on the same 4 ranks (1e-5 relative;
measured: step 1's grad norms differ by 1e-7 relative, the rollouts' rewards not at all).

Full weights with ``beta`` > 0, so the frozen reference is built at the same expert-parallel degree
too; two optimizer steps per generation batch (``num_iterations=2``), so the sampling policy's
log-probs are a forward of their own and step 2 replays step 1's rollouts with a ratio that is no
longer 1; SGD, so step 2 shows step 1's update as it is. Both runs run in-process (``recipe_pool``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)

# A reward a random tiny model already earns unevenly, so the advantages and the policy loss are not 0.
REWARD_MODULE = """
def digit_share(prompts, completions, **columns):
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]
"""


def _rows(pool, base: Path, out: Path, degree: int) -> dict[int, dict]:
    pool.run(
        "grpo_distributed", "tiny/grpo",
        f"output_dir={out}", f"checkpoint_dir={base}", "model=tiny_moe", "lora=null",
        "max_steps_per_epoch=2", "batch_size=1", "gradient_accumulation_steps=2", "save_every_n_steps=null",
        "optimizer.name=sgd", "optimizer.lr=0.5", "grpo.max_completion_tokens=8", "grpo.beta=0.04",
        "grpo.num_iterations=2",
        "grpo.rewards=[rewards_for_test:digit_share,shardtune.rl.toy_rewards:answer_format]",
        "grpo.reward_weights=[1.0,0.5]", f"expert_parallel={degree}",
        nproc=4, timeout=400, extra_path=out.parent,  # where rewards_for_test.py is
    )  # fmt: skip
    return {row["step"]: row for row in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


def test_grpo_at_expert_parallel_2_logs_the_step_of_expert_parallel_1(tmp_path, recipe_pool):
    (tmp_path / "rewards_for_test.py").write_text(REWARD_MODULE)
    base = tmp_path / "tiny_moe_base"
    one, two = (_rows(recipe_pool, base, tmp_path / f"ep{degree}", degree) for degree in (1, 2))
    assert sorted(one) == sorted(two) == [1, 2]
    assert one[1]["reward_std"] > 0, one[1]  # the advantages are not all 0: the policy loss has a gradient
    assert one[1]["grad_norm"] > 0, one[1]
    assert one[2]["kl"] > 0 and one[2]["clip_ratio/region_mean"] > 0, one[2]  # step 1's update shows at step 2
    for step in (1, 2):
        for key in ("loss", "grad_norm", "reward", "reward_std", "rewards/digit_share/mean", "completion_length",
                    "aux_loss", "kl", "entropy", "clip_ratio/region_mean"):  # fmt: skip
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-5, abs=1e-9), (step, key, one, two)
