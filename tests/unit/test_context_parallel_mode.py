"""``context_parallel_mode``: the config offers the two modes by name, and the all-to-all mode refuses a
``context_parallel`` the attention heads cannot divide, naming the key and the fix (the degrees that divide
them, or the all-gather mode)."""

from __future__ import annotations

import pytest

from shardtune.config_validation import validate
from shardtune.models.context_heads import check_attention_heads
from shardtune.recipes.schemas import FULL_FINETUNE_SCHEMA, LORA_FINETUNE_SCHEMA
from tests.unit.test_config import MINIMAL


def test_the_schemas_take_both_modes_and_refuse_others_by_name():
    for mode in ("all_gather", "all_to_all"):
        assert validate({**MINIMAL, "context_parallel_mode": mode}, FULL_FINETUNE_SCHEMA) == []
    assert validate({**MINIMAL, "context_parallel_mode": "ring"}, LORA_FINETUNE_SCHEMA) == [
        "context_parallel_mode: 'ring' is not one of ['all_gather', 'all_to_all']"
    ]


def test_all_to_all_needs_cp_to_divide_the_query_heads_only():
    check_attention_heads(8, 4)  # 8 query heads over 4 ranks: whatever the kv heads (they are repeated)
    check_attention_heads(4, 4)
    with pytest.raises(ValueError) as refused:
        check_attention_heads(6, 4)
    assert str(refused.value) == (
        "context_parallel=4 with context_parallel_mode=all_to_all: the attention layers split their 6 query heads "
        "(num_attention_heads) over the ranks of a cp group, so context_parallel must divide 6; set "
        "context_parallel to one of [1, 2, 3, 6], or context_parallel_mode=all_gather"
    )
