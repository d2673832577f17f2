"""The run-wise reorder of context parallel (``context_parallel.runs``/``reorder``) against index_select, forward
and backward, on the gathered order of real splits (chunks of every rank, packed or not)."""

from __future__ import annotations

import pytest
import torch

from shardtune.models.context_parallel import chunk_positions, reorder, runs


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_reorder_to_row_order_and_back_equals_index_select(cp):
    seq = 8 * cp * 3
    gathered_rows = torch.cat([chunk_positions(seq, cp=cp, rank=r) for r in range(cp)])
    gathered_at = torch.argsort(gathered_rows)
    to_rows, to_gathered = runs(gathered_at), runs(gathered_rows)
    assert len(to_rows) <= 2 * cp  # whole chunks move, not single positions
    x = torch.randn(2, seq, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, seq, 3, dtype=torch.float64)
    ours = reorder(x, 1, to_rows, to_gathered)
    theirs = x.index_select(1, gathered_at)
    assert torch.equal(ours, theirs)
    (grad_ours,) = torch.autograd.grad((ours * w).sum(), x)
    (grad_theirs,) = torch.autograd.grad((theirs * w).sum(), x)
    assert torch.equal(grad_ours, grad_theirs)
    assert torch.equal(reorder(ours, 1, to_gathered, to_rows), x)  # and back


def test_runs_of_a_span_and_of_scattered_positions():
    assert runs(torch.tensor([4, 5, 6, 0, 1, 9])) == (slice(4, 7), slice(0, 2), slice(9, 10))
    assert runs(torch.tensor([3])) == (slice(3, 4),)
    assert runs(torch.tensor([2, 1, 0])) == (slice(2, 3), slice(1, 2), slice(0, 1))
