"""Which ``_StridedShard`` placements the state-dict core maps to one rectangle per rank
(``layout.unsupported_placement``): FSDP2 over expert parallel's experts, and nothing that
interleaves a rank's rows; torch's local-shape rule then gives each rank its rows, checked here
against a hand computation for E=8 experts on an (efsdp 2, ep 2) mesh."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from shardtune.state_dict.layout import unsupported_placement


def test_fsdp_over_expert_parallel_is_one_rectangle_per_rank():
    placements = (_StridedShard(0, split_factor=2), Shard(0))
    assert unsupported_placement(placements, (2, 2)) is None
    for f in range(2):
        for j in range(2):  # ep rank j holds experts 4j..4j+3, efsdp rank f half of them
            shape, offset = _compute_local_shape_and_global_offset((8, 48, 64), (2, 2), [f, j], placements)
            assert (tuple(shape), tuple(offset)) == ((2, 48, 64), (4 * j + 2 * f, 0, 0))
    assert unsupported_placement((Shard(1), Shard(0)), (2, 2)) is None
    assert unsupported_placement((Replicate(), Shard(0)), (2, 2)) is None


def test_interleaving_or_unknown_placements_are_refused():
    wrong_factor = _StridedShard(0, split_factor=4)
    assert unsupported_placement((wrong_factor, Shard(0)), (2, 2)) == wrong_factor
    alone = _StridedShard(0, split_factor=2)
    assert unsupported_placement((alone, Replicate()), (2, 2)) == alone
    other_dim = _StridedShard(1, split_factor=2)
    assert unsupported_placement((other_dim, Shard(0)), (2, 2)) == other_dim
    assert unsupported_placement((Partial(), Shard(0)), (2, 2)) == Partial()
