"""``context_parallel_mode: all_to_all`` (``shardtune.models.context_heads.heads_attention``) on gloo ranks against
one process: the packed rows of six uneven samples of ``test_context_parallel`` (padded by the split), split
over ``cp`` ranks under FSDP2, give the loss and every gradient of the unsplit model in one process (fp32,
1e-5 relative) with every attention layer trading tokens for heads (two all-to-alls each way, no key
gather, under NCCL's rules): dense Llama, sliding windows with soft-capping (Gemma 2), sinks with
windows and experts (gpt-oss), latent attention (values narrower than keys), a Qwen3.5 hybrid (every
layer exchanges heads), Qwen3-MoE through the recipes' loss with its load-balancing loss over the whole
rows, and at cp 4 (sliding, soft-capped, sinks with experts) grouped-query attention whose 2 key/value heads are
fewer than the ranks. A ``cp`` the query heads cannot divide is refused on every rank by name."""

from __future__ import annotations

import pytest

from shardtune.models import from_hf_config
from shardtune.models.context_parallel import ALL_TO_ALL, context_group, split_batch
from tests.distributed.test_context_parallel import (
    LENGTHS,
    _batch,
    _check_equal,
    _families,
    _moe_cp_step,
    _moe_reference,
)

pytestmark = pytest.mark.timeout(300)

TOL = 1e-5
# name -> (attention layers, Gated DeltaNet layers): each exchanges twice forward and twice backward
LAYERS = {"llama_yarn": (3, 0), "gemma2": (3, 0), "gpt_oss": (3, 0), "deepseek_v3": (3, 0), "qwen3_5_cp4": (1, 3)}


def _heads(names: list[str], cp: int) -> dict:
    return _families(names, cp, False, None, None, LENGTHS, ALL_TO_ALL)


def _check_heads(results: list, name: str, attention: int = 3, linear: int = 0) -> None:
    _check_equal(results, name, [0])
    assert {r[name]["gathers"] for r in results} == {0}  # no K/V all-gather
    assert {r[name]["all_to_alls"] for r in results} == {4 * (attention + linear)}


@pytest.mark.parametrize("name", list(LAYERS))
def test_all_to_all_cp2_equals_one_process(pool2, name):
    _check_heads(pool2.run_ok(_heads, [name], 2, timeout=240), name, *LAYERS[name])


def test_all_to_all_cp4_with_fewer_kv_heads_than_ranks_equals_one_process(pool4):
    """4 query heads and 2 key/value heads at cp 4: each rank takes one query head and a copy of the key/value
    head it reads (Qwen2's sliding windows on the first layer; Gemma 2's soft-capped windows; gpt-oss's sinks,
    windows and experts)."""
    names = ["qwen2_sliding", "gemma2", "gpt_oss"]
    results = pool4.run_ok(_heads, names, 4, timeout=240)
    assert results[0]["qwen2_sliding"]["local"] == (2, 16)
    for name in names:
        _check_heads(results, name, *LAYERS.get(name, (3, 0)))


def _moe_heads_step(name: str) -> dict:
    return _moe_cp_step(name, mode=ALL_TO_ALL)


def test_all_to_all_moe_loss_aux_loss_and_grads_equal_one_process(pool2):
    """Qwen3-MoE through ``next_token_loss(context_parallel_mode="all_to_all")``: the loss with its
    load-balancing loss, the aux loss and every gradient equal one unsplit process."""
    name = "qwen3_moe"
    loss, (aux,), grads = _moe_reference(name)
    results = pool2.run_ok(_moe_heads_step, name, timeout=240)
    first = results[0]
    assert {(r["loss"], r["aux"]) for r in results} == {(first["loss"], first["aux"])}
    assert abs(first["aux"] - aux) <= TOL * aux, (first["aux"], aux)
    assert abs(first["loss"] - loss) <= TOL * loss, (first["loss"], loss)
    assert first["grads"].keys() == grads.keys()
    for key, expected in grads.items():
        diff = ((first["grads"][key] - expected).abs().max() / expected.abs().max()).item()
        assert diff <= TOL, f"{name} {key}: gradient rel diff {diff:.2e}"
    assert first["all_to_alls"] == 4 * 3  # per attention layer, none for the experts


def _refusal() -> str:
    """The error of an all-to-all forward of a model whose 3 query heads 2 ranks cannot split."""
    from tests.unit.test_models_families import VOCAB, hf_config

    config = hf_config("qwen3")
    config.num_attention_heads, config.num_key_value_heads = 3, 1
    model = from_hf_config(config.to_dict())
    tokens, labels, positions = _batch(0)
    part = split_batch(
        tokens % VOCAB, labels, group=context_group(2, device="cpu"), position_ids=positions,
        context_parallel_mode=ALL_TO_ALL,
    )  # fmt: skip
    try:
        model(part.tokens, position_ids=part.position_ids, context=part.shard)
    except ValueError as e:
        return str(e)
    return "not refused"


def test_a_cp_the_query_heads_cannot_divide_is_refused_on_every_rank(pool2):
    assert set(pool2.run_ok(_refusal, timeout=120)) == {
        "context_parallel=2 with context_parallel_mode=all_to_all: the attention layers split their 3 query heads "
        "(num_attention_heads) over the ranks of a cp group, so context_parallel must divide 3; set "
        "context_parallel to one of [1, 3], or context_parallel_mode=all_gather"
    }


def test_all_to_all_with_activation_checkpointing_equals_one_process(pool2):
    """Full checkpointing recomputes each layer's forward in backward: its two all-to-alls again."""
    name = "gemma2"
    results = pool2.run_ok(_families, [name], 2, "full", None, None, LENGTHS, ALL_TO_ALL, timeout=240)
    _check_equal(results, name, [0])
    assert {r[name]["all_to_alls"] for r in results} == {6 * 3}


def test_all_to_all_rows_of_one_sample_each_equal_one_process(pool2):
    """Unpacked rows whose length the split needs no padding for: each row is one document, and the rank's heads
    attend over both rows in one call (soft-capped windows in bands; sinks with windows and experts)."""
    names, lengths = ["gemma2", "gpt_oss"], ([64], [64])
    results = pool2.run_ok(_families, names, 2, False, None, None, lengths, ALL_TO_ALL, timeout=240)
    for name in names:
        _check_equal(results, name, [0], lengths=lengths)
