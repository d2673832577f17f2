"""A context-parallel segment's maskless attention (``Attention._prefix_then_causal``: the queries
against ``earlier`` keys, all visible, and against their own, causally, merged by log-sum-exp) equals
SDPA with the explicit mask, forward and backward, also when its log-sum-exps run in several uneven
blocks of queries (grouped-query heads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardtune.models.args import ModelArgs
from shardtune.models.blocks import attention
from shardtune.models.blocks.attention import Attention


@pytest.mark.parametrize("block_elements", [1 << 23, 5 * 4 * 96])  # one block; blocks of 5 queries (last 2)
def test_prefix_then_causal_equals_masked_sdpa(monkeypatch, block_elements):
    monkeypatch.setattr(attention, "LSE_BLOCK_ELEMENTS", block_elements)
    heads, kv_heads, d, earlier, n = 4, 2, 8, 59, 37
    layer = Attention(ModelArgs(vocab_size=8, dim=heads * d, n_layers=1, n_heads=heads, n_kv_heads=kv_heads,
                                intermediate_size=8))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, heads, n, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, kv_heads, earlier + n, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, kv_heads, earlier + n, d, generator=g, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(1, heads, n, d, generator=g, dtype=torch.float64)

    out = layer._prefix_then_causal(q, k, v, earlier)
    got = torch.autograd.grad(out, (q, k, v), grad)
    mask = torch.arange(earlier + n)[None, :] <= torch.arange(earlier, earlier + n)[:, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=layer.scale, enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
