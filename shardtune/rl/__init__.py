"""Online RL (GRPO) on shardtune's core: advantages, per-token log-probs, policy losses, rewards.

The pieces of a GRPO step, each TRL's ``GRPOTrainer`` arithmetic (1.16, tested against it):
:mod:`~shardtune.rl.advantages` (group-relative advantages), :mod:`~shardtune.rl.logps`
(completion log-probs from hidden states, chunked), :mod:`~shardtune.rl.losses` (``grpo``,
``dr_grpo``, ``dapo``, ``bnpo`` and their metrics), :mod:`~shardtune.rl.global_batch` (what a step
averages over, on any number of ranks), :mod:`~shardtune.rl.rewards` (``module:function`` reward
functions) and :mod:`~shardtune.rl.toy_rewards` (rule rewards of small verifiable tasks).
"""

from shardtune.rl.advantages import SCALE_REWARDS, Advantages, group_advantages, nanstd, total_rewards
from shardtune.rl.global_batch import gather_rewards, loss_units, step_normalizer
from shardtune.rl.logps import completion_logps_head_loss, token_logps
from shardtune.rl.losses import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_TYPES,
    PolicyLoss,
    PolicyLossConfig,
    PolicyMetrics,
    policy_loss,
    reduce_metrics,
)
from shardtune.rl.rewards import RewardError, RewardFunctions, load_reward_function

__all__ = [
    "IMPORTANCE_SAMPLING_LEVELS",
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "Advantages",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyMetrics",
    "RewardError",
    "RewardFunctions",
    "completion_logps_head_loss",
    "gather_rewards",
    "group_advantages",
    "load_reward_function",
    "loss_units",
    "nanstd",
    "policy_loss",
    "reduce_metrics",
    "step_normalizer",
    "token_logps",
    "total_rewards",
]
