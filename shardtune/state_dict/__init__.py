"""The distributed state-dict core: full <-> sharded for models and optimizers.

Depends on torch, torchao and :mod:`shardtune.ranks` (errors, collectives) only. All public functions are collective.
"""

from shardtune.ranks.comm import stats
from shardtune.ranks.errors import StateDictError
from shardtune.state_dict.gather import gather_cpu_state_dict
from shardtune.state_dict.keys import clean_fqn, is_adapter_key
from shardtune.state_dict.load import load_from_full_model_state_dict
from shardtune.state_dict.optim import get_full_optimizer_state_dict, load_from_full_optimizer_state_dict

__all__ = [
    "StateDictError",
    "clean_fqn",
    "gather_cpu_state_dict",
    "get_full_optimizer_state_dict",
    "is_adapter_key",
    "load_from_full_model_state_dict",
    "load_from_full_optimizer_state_dict",
    "stats",
]
