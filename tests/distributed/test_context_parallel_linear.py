"""Context parallel for the linear-attention (Gated DeltaNet) layers of Qwen3.5 hybrids, on gloo ranks against one
process: packed rows of six uneven samples (documents crossing chunk boundaries, one shorter than the
convolution), split over ``cp`` ranks under FSDP2, give the loss and every gradient of the unsplit model in one
process (fp32, 1e-5 relative) at cp 2 (with and without activation checkpointing) and cp 4, the linear layers
trading tokens for heads with two all-to-alls each way (under NCCL's rules) and the gated attention layer
gathering keys. A ``cp`` the key heads cannot divide is refused on every rank by name."""

from __future__ import annotations

import pytest

from shardtune.models import from_hf_config
from shardtune.models.context_parallel import context_group, split_batch
from tests.distributed.test_context_parallel import _batch, _check, _families

pytestmark = pytest.mark.timeout(300)

NAME = "qwen3_5_cp4"  # 3 Gated DeltaNet layers and 1 gated attention layer; 4 key heads, 8 value heads
LINEAR_LAYERS, FULL_LAYERS = 3, 1


def _check_hybrid(results: list, *, recomputed: bool = False) -> None:
    _check(results, NAME, [0], layers=FULL_LAYERS, gathers=2 if recomputed else 1)
    # per linear layer, forward: tokens -> heads and back (again when recomputed); backward: the two, reversed
    assert {r[NAME]["all_to_alls"] for r in results} == {(6 if recomputed else 4) * LINEAR_LAYERS}


def test_cp2_hybrid_equals_one_process(pool2):
    _check_hybrid(pool2.run_ok(_families, [NAME], 2, timeout=240))


def test_cp2_hybrid_with_activation_checkpointing_equals_one_process(pool2):
    _check_hybrid(pool2.run_ok(_families, [NAME], 2, "full", timeout=240), recomputed=True)


def test_cp4_hybrid_equals_one_process(pool4):
    results = pool4.run_ok(_families, [NAME], 4, timeout=240)
    assert results[0][NAME]["local"] == (2, 16)  # 61 tokens padded to 64: chunks of 8, two per rank
    _check_hybrid(results)


def _refusal() -> str:
    """The error of a context-parallel forward of a hybrid whose 3 key heads 2 ranks cannot split."""
    from tests.unit.test_models_families import VOCAB
    from tests.unit.test_qwen3_5 import hf_model

    hf = hf_model(vocab_size=VOCAB, linear_num_key_heads=3, linear_num_value_heads=6)
    model = from_hf_config(hf.config.to_dict())
    tokens, labels, positions = _batch(0)
    part = split_batch(tokens, labels, group=context_group(2, device="cpu"), position_ids=positions)
    try:
        model(part.tokens, position_ids=part.position_ids, context=part.shard)
    except ValueError as e:
        return str(e)
    return "not refused"


def test_a_cp_the_key_heads_cannot_divide_is_refused_on_every_rank(pool2):
    messages = set(pool2.run_ok(_refusal, timeout=120))
    assert messages == {
        "context_parallel=2: the linear_attention (Gated DeltaNet) layers split their 3 key heads "
        "(linear_num_key_heads) over the ranks of a cp group, so context_parallel must divide 3; set "
        "context_parallel to one of [1, 3]"
    }
