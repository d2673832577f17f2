"""Activation checkpointing policies: ``full`` and ``selective`` give the gradients of the plain model;
``full`` recomputes the layers' matmuls in backward, ``selective`` none (its memory is measured in
``benchmarks/train.py``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune.models import ModelArgs, build_model
from shardtune.ranks.activation_checkpointing import checkpointed

ARGS = ModelArgs(vocab_size=96, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=160)


class _CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


def _step(policy: str | None):
    """(gradients, matmuls run in backward) of one step of the tiny model."""
    torch.manual_seed(0)
    model = build_model(ARGS, dtype=torch.float32)
    if policy is not None:
        for i, layer in enumerate(model.model.layers):
            model.model.layers[i] = checkpointed(layer, policy)
    tokens = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = model(tokens).logsumexp(-1).mean()
    counter = _CountMatmuls()
    with counter:
        loss.backward()
    grads = {n.replace("._checkpoint_wrapped_module", ""): p.grad.clone() for n, p in model.named_parameters()}
    return grads, counter.count


def test_policies_keep_gradients_full_recomputes_matmuls_selective_none():
    plain, plain_mms = _step(None)
    full, full_mms = _step("full")
    selective, selective_mms = _step("selective")
    for grads in (full, selective):
        assert grads.keys() == plain.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, plain[name], rtol=1e-6, atol=1e-7, msg=name)
    assert full_mms > plain_mms  # full recomputes every layer's projections
    assert selective_mms == plain_mms  # selective recomputes no matmul


def test_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="'everything'.*full.*selective"):
        checkpointed(torch.nn.Linear(2, 2), "everything")
