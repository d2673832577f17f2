"""Attention of queries that follow earlier keys, exact and maskless, from kernels that return their log-sum-exp.

Rule: queries that are the last ``n`` of a causal sequence's keys, ``earlier`` keys before the first of them
(a context-parallel segment), attend to the earlier keys (all visible) and to their own (plain causal) in
two calls of an attention kernel that returns each query's log-sum-exp with its output; the outputs merge by
their log-sum-exps (the softmax over both parts, exactly). Backward calls each part's kernel backward with the
*merged* output, the merged log-sum-exp and the merged output's gradient: the probabilities it rebuilds,
``exp(scores - lse)``, and its ``rowsum(grad * out)`` are then the whole softmax's, so each part's query, key
and value gradients are exact, and no score is computed beyond the kernels' own. Nothing of ``queries x keys``
is kept: the inputs, the merged output and the log-sum-exp.

A kernel is one device's op pair (:class:`LseKernel`): the CPU flash kernel, CUDA's flash (half precision)
and memory-efficient (fp32 too) kernels, chosen by :func:`kernel_for` from the inputs' device, dtype and head
sizes; None where none can, and the caller keeps its masked kernel, the reason logged once by name
(:func:`log_fallback`). Grouped-query heads: a kernel that groups heads itself gets them as they are; for any
other, in the prefix the ``g`` query heads of a kv head are regrouped as ``g * n`` queries of it (every earlier
key is visible to all, so nothing is expanded), and on the causal diagonal the kv heads are repeated (the
diagonal's own ``n`` keys). Values narrower than keys (multi-head latent attention) are zero-padded to the
keys' width for a kernel that needs equal widths: the padded output columns are zero and dropped, and the
zero gradient columns change nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["LseKernel", "Part", "kernel_for", "log_fallback", "merge", "prefix_then_causal"]

log = logging.getLogger(__name__)
aten = torch.ops.aten

# (q, k, v, causal, scale) -> (out, lse [b, h, n] fp32 or wider, what backward needs of this call)
Forward = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor, Any]]
# (grad, q, k, v, out, lse [b, h, n], causal, scale, what forward kept) -> (dq, dk, dv)
Backward = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, bool, float, Any], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class LseKernel:
    """An attention op that returns its log-sum-exp, and its backward op. ``gqa``: takes fewer key/value heads
    than query heads; ``narrow_values``: takes values narrower than keys."""

    name: str
    forward: Forward
    backward: Backward
    gqa: bool
    narrow_values: bool


def _cpu_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, Any]:
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    return out, lse, None


def _cpu_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float, _: Any
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad, q, k, v, out, lse, 0.0, causal, scale=scale
    )
    return dq, dk, dv


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, Any]:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float, kept: Any
) -> tuple[Tensor, Tensor, Tensor]:
    cum_q, cum_k, max_q, max_k, seed, offset = kept
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale
    )
    return dq, dk, dv


def _efficient_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor, Any]:
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
    # its log-sum-exp may be padded past the queries: merge the queries', give back the padded length
    return out, lse[..., : q.shape[2]], (seed, offset, lse.shape[-1])


def _efficient_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool, scale: float, kept: Any
) -> tuple[Tensor, Tensor, Tensor]:
    seed, offset, length = kept
    lse = F.pad(lse, (0, length - lse.shape[-1])).contiguous()
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scale
    )
    return dq, dk, dv


CPU_FLASH = LseKernel("cpu_flash", _cpu_forward, _cpu_backward, gqa=True, narrow_values=False)
CUDA_FLASH = LseKernel("cuda_flash", _flash_forward, _flash_backward, gqa=True, narrow_values=False)
CUDA_EFFICIENT = LseKernel("cuda_efficient", _efficient_forward, _efficient_backward, gqa=False, narrow_values=True)

_logged: set[str] = set()


def log_fallback(what: str, reason: str) -> None:
    """Log once per ``what`` and ``reason`` that attention after earlier keys keeps its masked kernel."""
    key = f"{what}: {reason}"
    if key not in _logged:
        _logged.add(key)
        log.info("attention after earlier keys uses a masked kernel for %s (%s)", what, reason)


def _cuda_kernel(q: Tensor, k: Tensor, v: Tensor) -> LseKernel | None:
    """CUDA's flash kernel, else its memory-efficient one, where SDPA's own rules take both parts' layouts."""
    b, heads, _, dk = q.shape
    kv_heads, dv = k.shape[1], v.shape[-1]
    grad = q.requires_grad or k.requires_grad or v.requires_grad

    def takes(check: Callable[..., bool], q_heads: int, k_heads: int, q_len: int, d_v: int, causal: bool) -> bool:
        def new(h: int, s: int, d: int) -> Tensor:  # the checks read shapes, dtypes and strides: one key suffices
            return q.new_empty(b, h, s, d).requires_grad_(grad)

        params = (new(q_heads, q_len, dk), new(k_heads, 1, dk), new(k_heads, 1, d_v), None, 0.0, causal)
        return check(torch.backends.cuda.SDPAParams(*params, q_heads != k_heads))

    groups = heads // kv_heads  # the prefix: a kv head's queries regrouped; the diagonal: one query, one key
    flash = torch.backends.cuda.can_use_flash_attention
    if takes(flash, kv_heads, kv_heads, groups, dk, False) and takes(flash, heads, kv_heads, 1, dk, True):
        return CUDA_FLASH
    efficient = torch.backends.cuda.can_use_efficient_attention
    if takes(efficient, kv_heads, kv_heads, groups, dv, False) and takes(efficient, heads, heads, 1, dv, True):
        return CUDA_EFFICIENT
    return None


def kernel_for(q: Tensor, k: Tensor, v: Tensor) -> LseKernel | None:
    """The kernel for queries ``q`` ``[b, heads, n, dk]`` against keys ``k`` ``[b, kv_heads, s, dk]`` and values
    ``v`` ``[b, kv_heads, s, dv]`` on their device and dtype; None (logged once) when no kernel takes them."""
    kernel = CPU_FLASH if q.device.type == "cpu" else _cuda_kernel(q, k, v) if q.device.type == "cuda" else None
    if kernel is None:
        what = f"{q.device.type} {q.dtype}, {q.shape[1]}/{k.shape[1]} heads of widths {q.shape[-1]}/{v.shape[-1]}"
        log_fallback(what, "no kernel returns its log-sum-exp")
    return kernel


class Part:
    """One part's layout for its kernel: for a kernel without grouped heads, queries regrouped under their kv head
    (the prefix) or kv heads repeated (the causal diagonal); values padded to the keys' width if needed. Built
    from the part's queries ``q``, keys ``k`` and values ``v``; its :meth:`forward` and :meth:`backward` take them."""

    def __init__(self, kernel: LseKernel, q: Tensor, k: Tensor, v: Tensor, *, causal: bool) -> None:
        b, heads, n, _ = q.shape
        self.kernel = kernel
        self.shape = (b, heads, n)
        self.kv_heads, self.groups = k.shape[1], heads // k.shape[1]
        self.regroup = self.groups > 1 and not causal and not kernel.gqa
        self.repeat = self.groups > 1 and causal and not kernel.gqa
        self.dv, self.pad = v.shape[-1], 0 if kernel.narrow_values else q.shape[-1] - v.shape[-1]
        self.causal = causal

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Any]:
        """The part's output ``[b, heads, n, dv]``, log-sum-exp ``[b, heads, n]`` and what its backward needs."""
        keys, values = self._keys(k, v)
        out, lse, state = self.kernel.forward(self._queries(q), keys, values, self.causal, scale)
        return self._unqueries(out)[..., : self.dv], self._unqueries(lse), state

    def backward(
        self, grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, state: Any
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The part's ``dq``, ``dk``, ``dv`` given the *merged* output ``out``, its log-sum-exp ``lse`` and its
        gradient ``grad`` (``state``: what :meth:`forward` returned for backward)."""
        keys, values = self._keys(k, v)
        g, o = self._queries(self._padded(grad)), self._queries(self._padded(out))
        dq, dk, dv = self.kernel.backward(
            g, self._queries(q), keys, values, o, self._queries(lse).contiguous(), self.causal, scale, state
        )
        return (self._unqueries(dq), *self._unkeys(dk, dv))

    def _queries(self, t: Tensor) -> Tensor:
        """A per-query tensor (``[b, heads, n, ...]``) in the kernel's layout."""
        if not self.regroup:
            return t
        b, _, n = self.shape
        return t.reshape(b, self.kv_heads, self.groups * n, *t.shape[3:])

    def _unqueries(self, t: Tensor) -> Tensor:
        """The kernel's per-query tensor back as ``[b, heads, n, ...]``."""
        return t.reshape(*self.shape, *t.shape[3:]) if self.regroup else t

    def _keys(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.repeat:
            k, v = k.repeat_interleave(self.groups, dim=1), v.repeat_interleave(self.groups, dim=1)
        return k, F.pad(v, (0, self.pad)) if self.pad else v

    def _unkeys(self, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor]:
        dv = dv[..., : self.dv]
        if self.repeat:
            b, _, s, _ = dk.shape
            dk = dk.reshape(b, self.kv_heads, self.groups, s, -1).sum(2)
            dv = dv.reshape(b, self.kv_heads, self.groups, s, -1).sum(2)
        return dk, dv

    def _padded(self, t: Tensor) -> Tensor:
        """An output-shaped tensor padded to the kernel's value width."""
        return F.pad(t, (0, self.pad)) if self.pad else t


def merge(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Two parts' outputs of the same queries merged by their log-sum-exps: the softmax over both parts' keys
    (in the output's dtype), and its log-sum-exp."""
    lse = torch.logaddexp(lse1, lse2)
    acc = lse.dtype
    merged = (lse1 - lse).exp().unsqueeze(-1) * out1.to(acc) + (lse2 - lse).exp().unsqueeze(-1) * out2.to(acc)
    return merged.to(out1.dtype), lse


class _PrefixThenCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, earlier: int, scale: float, kernel: LseKernel) -> Tensor:
        spans = (slice(0, earlier), slice(earlier, k.shape[2]))
        parts = [Part(kernel, q, k, v, causal=False), Part(kernel, q, k, v, causal=True)]
        (out1, lse1, kept1), (out2, lse2, kept2) = (
            part.forward(q, k[:, :, span], v[:, :, span], scale) for part, span in zip(parts, spans, strict=True)
        )
        out, lse = merge(out1, lse1, out2, lse2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.parts, ctx.spans, ctx.kept, ctx.scale = parts, spans, (kept1, kept2), scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        grad = grad.contiguous()
        dq = torch.zeros_like(q, dtype=lse.dtype)
        dks, dvs = [], []
        for part, span, state in zip(ctx.parts, ctx.spans, ctx.kept, strict=True):
            dq_part, dk, dv = part.backward(grad, q, k[:, :, span], v[:, :, span], out, lse, ctx.scale, state)
            dq += dq_part
            dks.append(dk)
            dvs.append(dv)
        return dq.to(q.dtype), torch.cat(dks, dim=2), torch.cat(dvs, dim=2), None, None, None


def prefix_then_causal(q: Tensor, k: Tensor, v: Tensor, earlier: int, *, scale: float, kernel: LseKernel) -> Tensor:
    """Queries ``q`` ``[b, heads, n, dk]``, the last ``n`` of the keys ``k`` ``[b, kv_heads, earlier + n, dk]``
    (values ``v`` ``[..., dv]``, ``dv <= dk``), attending causally: output ``[b, heads, n, dv]``."""
    return _PrefixThenCausal.apply(q, k, v, earlier, scale, kernel)
