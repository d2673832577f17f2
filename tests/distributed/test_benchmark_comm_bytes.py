"""The MoE benchmark's all-to-all byte counter (``benchmarks/_comm_bytes.py``) on 2 gloo ranks, against
bytes counted by hand from the split sizes given: c10d ``all_to_all_single`` and the autograd functional
one, forward and backward, with an empty block, and nothing outside its block."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

from benchmarks._comm_bytes import counting

pytestmark = pytest.mark.timeout(120)

SENDS = [[1, 3], [0, 5]]  # rank r sends SENDS[r][j] rows of 4 fp32 (16 bytes) to rank j
ROW = 4 * 4


def _exchange() -> dict:
    rank = dist.get_rank()
    send = SENDS[rank]
    receive = [SENDS[j][rank] for j in range(2)]
    group = dist.new_group([0, 1])
    rows = torch.arange(sum(send) * 4, dtype=torch.float32).view(-1, 4).requires_grad_()
    dist.all_to_all_single(torch.empty(2, dtype=torch.int64), torch.tensor(send), group=group)  # before: not counted
    with counting() as counted:
        dist.all_to_all_single(torch.empty(2, dtype=torch.int64), torch.tensor(send), group=group)
        arrived = all_to_all_single_autograd(rows, receive, send, group)
        (arrived * 3).sum().backward()
    dist.all_to_all_single(torch.empty(2, dtype=torch.int64), torch.tensor(send), group=group)  # after: not counted
    return {"counted": counted.to_json(), "grad": rows.grad.unique().tolist()}


def test_all_to_all_bytes_are_the_rows_to_and_from_other_ranks(pool2):
    res = pool2.run_ok(_exchange, timeout=60)
    for rank, r in enumerate(res):
        other = 1 - rank
        out_rows, in_rows = SENDS[rank][other], SENDS[other][rank]
        # counts: one int64 each way; rows forward; their gradients the reverse way in the backward
        sent = 8 + out_rows * ROW + in_rows * ROW
        received = 8 + in_rows * ROW + out_rows * ROW
        assert r["counted"] == {"calls": 3, "sent": sent, "received": received}, (rank, r)
        assert r["grad"] == [3.0]  # the backward really ran through the exchange
