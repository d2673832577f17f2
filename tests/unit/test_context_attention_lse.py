"""A context-parallel segment's maskless attention (:mod:`shardtune.models.lse_attention`: the queries against
``earlier`` keys, all visible, and against their own, causally, each through a kernel that returns its
log-sum-exp, merged by it; backward through each part's kernel backward with the merged output) equals SDPA
over the concatenated keys with the explicit mask, forward and every gradient: fp64 to rounding, fp32, bf16
within SDPA's own bf16 error, grouped-query heads, values narrower than keys (latent attention), batch 2.
Layers that need a mask (soft-capping, sinks, windows) keep it, and say so once in the log."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from shardtune.models import lse_attention
from shardtune.models.args import ModelArgs
from shardtune.models.blocks.attention import Attention
from shardtune.models.blocks.sink_attention import SinkAttention


def _inputs(dtype, *, batch=1, heads=4, kv_heads=2, dk=8, dv=8, earlier=59, n=37):
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    q = rand(batch, heads, n, dk).requires_grad_()
    k = rand(batch, kv_heads, earlier + n, dk).requires_grad_()
    v = rand(batch, kv_heads, earlier + n, dv).requires_grad_()
    return q, k, v, rand(batch, heads, n, dv)


def _masked_sdpa(q, k, v, grad, earlier, scale):
    """SDPA over the concatenated keys, query ``i`` seeing keys ``<= earlier + i``: output and gradients."""
    n = q.shape[2]
    mask = torch.arange(earlier + n)[None, :] <= torch.arange(earlier, earlier + n)[:, None]
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, attn_mask=mask, scale=scale, enable_gqa=True)
    return out, torch.autograd.grad(out, leaves, grad)


def _lse(q, k, v, grad, earlier, scale):
    kernel = lse_attention.kernel_for(q, k, v)
    assert kernel is lse_attention.CPU_FLASH
    out = lse_attention.prefix_then_causal(q, k, v, earlier, scale=scale, kernel=kernel)
    return out, torch.autograd.grad(out, (q, k, v), grad)


SHAPES = {
    "mha": {"kv_heads": 4},
    "gqa": {"kv_heads": 2},
    "gqa_3_groups_batch_2": {"batch": 2, "heads": 6, "kv_heads": 2, "earlier": 20},
    "values_narrower": {"kv_heads": 4, "dk": 12, "dv": 8},
    "gqa_values_narrower": {"heads": 6, "kv_heads": 3, "dk": 12, "dv": 8, "earlier": 1, "n": 5},
}


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, 1e-12), (torch.float32, 2e-6)])
def test_prefix_then_causal_equals_masked_sdpa(shape, dtype, tol):
    q, k, v, grad = _inputs(dtype, **SHAPES[shape])
    out, got = _lse(q, k, v, grad, k.shape[2] - q.shape[2], 0.3)
    ref, want = _masked_sdpa(q, k, v, grad, k.shape[2] - q.shape[2], 0.3)
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for name, a, b in zip("qkv", got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.parametrize("shape", SHAPES)
def test_prefix_then_causal_in_bf16_is_as_close_as_sdpa_in_bf16(shape):
    """In bf16 the merged attention is within twice masked SDPA's own bf16 error of the fp64 result, or four
    bf16 rounding steps of its largest entry (kernels round in different places)."""
    q, k, v, grad = _inputs(torch.bfloat16, **SHAPES[shape])
    earlier = k.shape[2] - q.shape[2]
    out, got = _lse(q, k, v, grad, earlier, 0.3)
    ref, want = _masked_sdpa(q, k, v, grad, earlier, 0.3)
    exact, exact_grads = _masked_sdpa(*(t.double() for t in (q, k, v, grad)), earlier, 0.3)
    for a, b, truth in zip((out, *got), (ref, *want), (exact, *exact_grads), strict=True):
        assert a.dtype == torch.bfloat16
        bound = max(2 * (b.double() - truth).abs().max(), 2**-6 * truth.abs().max())
        assert (a.double() - truth).abs().max() <= bound


def _layer(kind: type[Attention] = Attention, **kw) -> Attention:
    return kind(ModelArgs(vocab_size=8, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, intermediate_size=8, **kw))


def test_a_layer_attends_after_earlier_keys_through_the_kernel():
    layer = _layer()
    q, k, v, grad = _inputs(torch.float64)
    out = layer._attend_after(q, k, v, 59, None)
    ref, want = _masked_sdpa(q, k, v, grad, 59, layer.scale)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert out.grad_fn is not None and "PrefixThenCausal" in type(out.grad_fn).__name__


@pytest.mark.parametrize(
    ("make", "window", "reason"),
    [
        (lambda: _layer(attn_logit_softcapping=30.0), None, "logit soft-capping"),
        (lambda: _layer(SinkAttention), None, "its own attention kernel"),
        (_layer, 16, "a sliding window"),
    ],
)
def test_layers_that_need_a_mask_keep_it_and_log_why_once(caplog, monkeypatch, make, window, reason):
    monkeypatch.setattr(lse_attention, "_logged", set())
    layer = make()
    if isinstance(layer, SinkAttention):
        torch.nn.init.normal_(layer.sinks)
    q, k, v, _ = _inputs(torch.float64)
    mask = torch.arange(96)[None, :] <= torch.arange(59, 96)[:, None]
    if window is not None:
        mask &= torch.arange(96)[None, :] > torch.arange(59, 96)[:, None] - window
    with caplog.at_level(logging.INFO, logger=lse_attention.__name__):
        for _ in range(2):
            out = layer._attend_after(q, k, v, 59, window)
    torch.testing.assert_close(out, layer._attend(q, k, v, mask, causal=False), rtol=0, atol=0)
    logged = [r.getMessage() for r in caplog.records if r.name == lse_attention.__name__]
    assert logged == [f"attention after earlier keys uses a masked kernel for {type(layer).__name__} ({reason})"]
