"""Bad input raises the same clear error on every rank, before data moves, and never hangs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from shardtune.training import gather_cpu_state_dict, load_from_full_model_state_dict
from tests.distributed import toy

pytestmark = pytest.mark.timeout(120)


def _rank0_only(sd):
    return sd if dist.get_rank() == 0 else {}


def _strict_missing():
    sd = toy.full_state_dict()
    del sd["layers.1.up_proj.weight"]
    sd["not.a.param"] = torch.zeros(3)
    model = toy.build_sharded(meta=True)
    load_from_full_model_state_dict(model, _rank0_only(sd), "cpu", strict=True)


def _shape_mismatch():
    sd = toy.full_state_dict()
    sd["layers.0.q_proj.weight"] = torch.zeros(7, 3)
    load_from_full_model_state_dict(toy.build_sharded(meta=True), sd, "cpu")


def _keys_differ_on_one_rank():
    sd = toy.full_state_dict()
    if dist.get_rank() == 1:
        del sd["norm"]
    load_from_full_model_state_dict(toy.build_sharded(meta=True), sd, "cpu")


def _given_on_rank1_only():
    sd = toy.full_state_dict() if dist.get_rank() == 1 else {}
    load_from_full_model_state_dict(toy.build_sharded(meta=True), sd, "cpu")


def _model_differs_on_one_rank():
    model = toy.build_sharded(meta=True)
    if dist.get_rank() == 1:
        model.extra = nn.Parameter(torch.zeros(2))
    load_from_full_model_state_dict(model, toy.full_state_dict(), "cpu")


def _nf4_not_row_sharded():
    mesh = toy.mesh_for("1d")
    local = to_nf4(torch.empty(256, 128, device="meta"))
    module = nn.Module()
    weight = DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=(256, 256), stride=(256, 1))
    module.weight = nn.Parameter(weight, requires_grad=False)
    load_from_full_model_state_dict(module, {"weight": torch.randn(256, 256)}, "cpu")


def _integers_for_a_float_weight():
    """Same shape, integer dtype (a corrupt header saying I32 for F32 bytes, say): not cast silently."""
    sd = toy.full_state_dict()
    sd["layers.0.q_proj.weight"] = sd["layers.0.q_proj.weight"].view(torch.int32)
    load_from_full_model_state_dict(toy.build_sharded(meta=True), _rank0_only(sd), "cpu")


def _wrong_is_rank_zero():
    model = toy.build_sharded(meta=True)
    load_from_full_model_state_dict(model, toy.full_state_dict(), "cpu")
    gather_cpu_state_dict(model, True)


class _FailingSlice:
    """A lazy checkpoint value whose read fails (a truncated file, say) after validation passed."""

    def __init__(self, shape):
        self.shape = shape

    def get_shape(self):
        return list(self.shape)

    def __getitem__(self, item):
        raise OSError("read failed: file truncated")


def _read_fails_on_one_rank(mode: str):
    sd = toy.full_state_dict()
    key = "layers.1.down_proj.weight"
    failing_rank = 1 if mode == "every_rank" else 0
    if dist.get_rank() == failing_rank:
        sd[key] = _FailingSlice(sd[key].shape)
    given = sd if mode == "every_rank" else _rank0_only(sd)
    load_from_full_model_state_dict(toy.build_sharded(meta=True), given, "cpu")


CASES = {
    "strict": (_strict_missing, ["layers.1.up_proj.weight", "not.a.param", "strict=False"]),
    "shape": (_shape_mismatch, ["layers.0.q_proj.weight", "(7, 3)", "(256, 256)"]),
    "keys_differ": (_keys_differ_on_one_rank, ["rank 1", "norm"]),
    "rank1_only": (_given_on_rank1_only, ["non-empty on ranks [1]", "rank 0 only"]),
    "model_differs": (_model_differs_on_one_rank, ["model differs between ranks", "[1]"]),
    "nf4_layout": (_nf4_not_row_sharded, ["weight", "whole rows"]),
    "is_rank_zero": (_wrong_is_rank_zero, ["[rank 1] is_rank_zero is True; pass is_rank_zero=(rank == 0)"]),
    "number_kind": (_integers_for_a_float_weight, ["layers.0.q_proj.weight", "int values", "torch.float32"]),
}


def _assert_same_error_everywhere(outcomes, needles):
    assert not any(o.ok for o in outcomes), [o.ok for o in outcomes]
    messages = {o.error for o in outcomes}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message.startswith("StateDictError"), message
    for needle in needles:
        assert needle in message, (needle, message)


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_on_every_rank(pool2, case):
    fn, needles = CASES[case]
    _assert_same_error_everywhere(pool2.run(fn, timeout=60), needles)


@pytest.mark.parametrize("mode", ["every_rank", "rank0"])
def test_read_failure_mid_load_raises_on_every_rank(pool2, mode):
    outcomes = pool2.run(_read_fails_on_one_rank, mode, timeout=60)
    _assert_same_error_everywhere(outcomes, ["layers.1.down_proj.weight", "file truncated"])
    # the pool is still usable: the failure left no rank stuck in a collective
    assert pool2.run_ok(dist.get_rank) == [0, 1]


def test_errors_on_world4(pool4):
    _assert_same_error_everywhere(pool4.run(_keys_differ_on_one_rank, timeout=60), ["rank 1", "norm"])


def _config_differs_on_one_rank():
    from shardtune.config import load_config
    from shardtune.recipes.registry import get_recipe
    from shardtune.recipes.run import _agree_on_config

    lr = "0.01" if dist.get_rank() == 0 else "0.02"
    cfg = load_config("tiny/full", [f"optimizer.lr={lr}"], schema=get_recipe("full_finetune_distributed").schema)
    _agree_on_config(cfg)


def test_recipe_setup_rejects_a_rank_with_another_config(pool2):
    outcomes = pool2.run(_config_differs_on_one_rank, timeout=60)
    assert not any(o.ok for o in outcomes) and len({o.error for o in outcomes}) == 1
    assert "the config differs between ranks: ranks [1] differ from rank 0" in outcomes[0].error


def _agree_case(case: str):
    from shardtune.ranks import comm

    rank = dist.get_rank()
    value = {"same": "v", "differs": f"v{rank // 2}", "problem": "v"}[case]
    problems = ["disk full"] if case == "problem" and rank == 3 else []
    return comm.agree(
        value, what="the value differs between ranks", fix="pass the same value", header="H:", problems=problems
    )


@pytest.mark.parametrize(
    "case, needles",
    [
        ("differs", ["H:\n  the value differs between ranks: ranks [2, 3] differ from rank 0; pass the same value"]),
        ("problem", ["H:\n  [rank 3] disk full"]),
    ],
)
def test_agree_raises_the_same_error_naming_the_odd_ranks(pool4, case, needles):
    _assert_same_error_everywhere(pool4.run(_agree_case, case, timeout=60), needles)


def test_agree_returns_every_rank_value(pool4):
    assert pool4.run_ok(_agree_case, "same") == [["v"] * 4] * 4
