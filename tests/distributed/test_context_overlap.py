"""All-gather context attention computes while the keys travel (``shardtune.models.context_overlap``), on 2 gloo
ranks: every segment's causal diagonal runs while the K/V all-gather is in flight, every diagonal's backward
while the backward's own K/V all-gather is (the whole rows' keys are not kept from forward to backward), and no
collective is left in flight (NCCL's rules harness,
tests/nccl_rules.py, whose ``overlapped`` counts the ops run while a functional collective was in flight); the
outputs and the gradients of the queries, keys and values of packed rows (several documents per rank's
chunk, padding, grouped-query heads, values narrower than keys) equal one process's masked attention; unpacked
rows run all their diagonals in one kernel call."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.models.context_overlap import overlapped_attention
from shardtune.models.context_parallel import context_group, split_batch
from shardtune.models.lse_attention import CPU_FLASH
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(120)

LENGTHS = ([13, 7, 20, 3, 11, 7], [5, 17, 9, 12, 4, 14])  # 61 tokens: the split pads 3
UNPACKED = ([64], [64])  # one document a row, no padding: each rank's segments are its two chunks
FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _rows(heads: int, kv_heads: int, dk: int, dv: int, seq: int, b: int) -> dict[str, torch.Tensor]:
    """Queries, keys, values and an output weight of the whole rows, the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(b, heads, seq, dk, generator=gen),
        "k": torch.randn(b, kv_heads, seq, dk, generator=gen),
        "v": torch.randn(b, kv_heads, seq, dv, generator=gen),
        "w": torch.randn(b, heads, seq, dv, generator=gen),
    }


def _one_process(rows: dict[str, torch.Tensor], documents: tuple[tuple[int, ...], ...], scale: float):
    """Masked attention of the whole rows, each document causal within itself, and its gradients."""
    q, k, v = (rows[n].clone().requires_grad_() for n in "qkv")
    seq = q.shape[2]
    masks = []
    for lengths in documents:
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        masks.append((doc[:, None] == doc[None, :]) & torch.ones(seq, seq, dtype=torch.bool).tril())
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q,
        k.repeat_interleave(groups, 1),
        v.repeat_interleave(groups, 1),
        attn_mask=torch.stack(masks)[:, None],
        scale=scale,
    )
    (out * rows["w"]).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _overlapped(heads: int, kv_heads: int, dk: int, dv: int, lengths: tuple[list[int], ...]) -> dict:
    seq = sum(lengths[0])
    tokens = torch.zeros(len(lengths), seq, dtype=torch.long)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    part = split_batch(tokens, tokens, group=context_group(2, device="cpu"), position_ids=positions)
    shard, scale = part.shard, dk**-0.5
    padded = shard.gathered_rows.numel()
    rows = {n: F.pad(t, (0, 0, 0, padded - seq)) for n, t in _rows(heads, kv_heads, dk, dv, seq, len(lengths)).items()}
    mine = shard.gathered_rows.view(2, -1)[dist.get_rank()]
    q, k, v = (rows[n][:, :, mine].clone().requires_grad_() for n in "qkv")
    with nccl_rules() as rules:
        out = overlapped_attention(q, k, v, shard, kernel=CPU_FLASH, scale=scale)
        forward = (rules.overlapped[FORWARD.__name__], rules.counts["funcol.all_gather_into_tensor"])
        (out * rows["w"][:, :, mine]).sum().backward()
    backward = (
        rules.overlapped[BACKWARD.__name__],
        rules.counts["funcol.all_gather_into_tensor"],
        rules.counts["funcol.reduce_scatter_tensor"],
    )
    ref_out, ref_dq, ref_dk, ref_dv = _one_process(rows, shard.documents, scale)
    segments = sum(len(row) for row in shard.segments)
    errors = {
        name: ((got - ref[:, :, mine]).abs().max() / ref[:, :, mine].abs().max()).item()
        for name, got, ref in (
            ("out", out, ref_out),
            ("dq", q.grad, ref_dq),
            ("dk", k.grad, ref_dk),
            ("dv", v.grad, ref_dv),
        )
    }
    return {"segments": segments, "forward": forward, "backward": backward, "errors": errors}


@pytest.mark.parametrize(("heads", "kv_heads", "dk", "dv"), [(4, 2, 16, 16), (4, 4, 24, 16)])
def test_diagonals_run_while_the_keys_travel_and_equal_one_process(pool2, heads, kv_heads, dk, dv):
    for r in pool2.run_ok(_overlapped, heads, kv_heads, dk, dv, LENGTHS, timeout=60):
        assert r["segments"] > 2 * len(LENGTHS)  # documents split each rank's chunks: prefixes and diagonals
        # every diagonal (one kernel call per segment) ran while the one all-gather was in flight
        assert r["forward"] == (r["segments"], 1), r
        # every diagonal's backward ran while the backward's all-gather was in flight; one reduce-scatter
        assert r["backward"] == (r["segments"], 2, 1), r
        assert all(err <= 1e-5 for err in r["errors"].values()), r["errors"]


def test_the_diagonals_of_unpacked_rows_are_one_kernel_call(pool2):
    """Rows of one document each: a rank's segments are one length (rank 0: its two chunks; rank 1: its two
    neighbouring chunks, one segment), and all their diagonals run as one batch (forward and backward), while the
    keys travel."""
    results = pool2.run_ok(_overlapped, 4, 2, 16, 16, UNPACKED, timeout=60)
    assert [r["segments"] for r in results] == [4, 2]
    for r in results:
        assert r["forward"] == (1, 1), r
        assert r["backward"] == (1, 2, 1), r
        assert all(err <= 1e-5 for err in r["errors"].values()), r["errors"]
