"""torchtune-compatible training utilities: the distributed state-dict functions and sharding."""

from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.process import init_distributed
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import (
    StateDictError,
    gather_cpu_state_dict,
    get_full_optimizer_state_dict,
    load_from_full_model_state_dict,
    load_from_full_optimizer_state_dict,
)

__all__ = [
    "StateDictError",
    "init_distributed",
    "make_mesh",
    "shard_model",
    "gather_cpu_state_dict",
    "get_full_optimizer_state_dict",
    "load_from_full_model_state_dict",
    "load_from_full_optimizer_state_dict",
]
