"""The gated delta rule of Gated DeltaNet layers (Qwen3.5/3.6), in PyTorch: recurrent and chunked.

Rule: :func:`recurrent_gated_delta_rule` is the definition, one token at a time; :func:`chunk_gated_delta_rule`
computes exactly the same outputs and final state a chunk of tokens at a time (the UT transform of the
DeltaNet papers), and is what training runs. Both take queries and keys already L2-normed, scaled and
repeated to the value heads, compute in fp32 (fp64 inputs: fp64) whatever the inputs' dtype, and continue from an optional
``state`` ``[b, heads, dk, dv]``: the state update is affine in the state, so a row may be cut anywhere and
the parts run one after the other. Per token ``t`` and head (``S`` is ``dk x dv``)::

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["DEFAULT_CHUNK", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]

DEFAULT_CHUNK = 64  # tokens per chunk: the chunked form's matrices are chunk x chunk per head


def _heads_first(*tensors: Tensor) -> list[Tensor]:
    """``[b, s, h, ...]`` -> ``[b, h, s, ...]`` in fp32 or wider (the rule's precision in every dtype)."""
    return [
        t.transpose(1, 2).to(torch.promote_types(t.dtype, torch.float32), memory_format=torch.contiguous_format)
        for t in tensors
    ]


def _initial_state(state: Tensor | None, q: Tensor, v: Tensor) -> Tensor:
    b, h, _, dk = q.shape
    if state is None:
        return q.new_zeros(b, h, dk, v.shape[-1])
    if tuple(state.shape) != (b, h, dk, v.shape[-1]):
        raise ValueError(f"gated delta rule: state must be {(b, h, dk, v.shape[-1])}, got {tuple(state.shape)}")
    return state.to(q.dtype)


def recurrent_gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, state: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The rule token by token: ``q``, ``k`` ``[b, s, h, dk]``, ``v`` ``[b, s, h, dv]``, ``g`` (log decay,
    ``<= 0``) and ``beta`` ``[b, s, h]``. Returns the outputs ``[b, s, h, dv]`` (``v``'s dtype) and the final
    state ``[b, h, dk, dv]`` (fp32 or wider). Generation's one-token steps use it; training uses the chunked form."""
    out_dtype = v.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    s_state = _initial_state(state, q, v)
    outs = []
    for t in range(q.shape[2]):
        s_state = s_state * g[:, :, t].exp()[..., None, None]
        delta = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", s_state, k[:, :, t]))
        s_state = s_state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s_state, q[:, :, t]))
    out = torch.stack(outs, dim=2) if outs else v.new_zeros(v.shape)
    return out.transpose(1, 2).to(out_dtype), s_state


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    state: Tensor | None = None,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[Tensor, Tensor]:
    """:func:`recurrent_gated_delta_rule`'s result, ``chunk`` tokens at a time.

    Within a chunk with cumulative log decay ``c_i`` and initial state ``S0``, the written values
    ``U`` solve ``(I + A) U = beta V - (beta exp(c)) K S0`` with ``A_ij = beta_i exp(c_i - c_j) k_i.k_j``
    (``j < i``), a unit lower-triangular system; then ``o_i = exp(c_i) S0^T q_i + sum_{j<=i} exp(c_i - c_j)
    (q_i.k_j) u_j`` and the next chunk starts from ``exp(c_C) S0 + sum_j exp(c_C - c_j) k_j u_j^T``. The
    triangular solves and the intra-chunk products of all chunks run at once; only the state is carried
    from chunk to chunk. Decay differences are taken as ``exp(c_i - c_j)``, never as a ratio, so strong
    decay underflows to 0 instead of dividing by it."""
    if chunk <= 0:
        raise ValueError(f"gated delta rule: chunk must be a positive number of tokens, got {chunk}")
    out_dtype = v.dtype
    b, seq = q.shape[:2]
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    s_state = _initial_state(state, q, v)
    pad = (-seq) % chunk
    if pad:  # zero keys, values and log decay after the end change neither the outputs before it nor the state
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    h, n = q.shape[1], q.shape[2] // chunk
    q, k, v = (t.reshape(b, h, n, chunk, t.shape[-1]) for t in (q, k, v))
    c = g.reshape(b, h, n, chunk).cumsum(-1)
    beta = beta.reshape(b, h, n, chunk, 1)
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(future, float("-inf")).exp()  # exp(c_i - c_j), j <= i
    kk = (beta * k) @ k.transpose(-1, -2) * decay
    system = kk.tril(-1) + torch.eye(chunk, dtype=kk.dtype, device=q.device)  # I + A (strictly lower A)
    # one solve for both right-hand sides: the values written and how much each key reads of the state
    rhs = torch.cat([beta * v, beta * c.exp().unsqueeze(-1) * k], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values, key_reads = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * c.exp().unsqueeze(-1)
    k_to_end = (k * (c[..., -1:] - c).exp().unsqueeze(-1)).transpose(-1, -2)
    chunk_decay = c[..., -1].exp()[..., None, None]
    outs = []
    # unbind, not indexing in the loop: one backward node per tensor instead of a zero-filled copy per chunk
    per_chunk = (t.unbind(2) for t in (values, key_reads, q_decayed, intra, k_to_end, chunk_decay))
    for vals, reads, q_i, intra_i, k_end, decay_i in zip(*per_chunk, strict=True):
        u = vals - reads @ s_state
        outs.append(q_i @ s_state + intra_i @ u)
        s_state = s_state * decay_i + k_end @ u
    out = torch.stack(outs, dim=2).reshape(b, h, n * chunk, -1)[:, :, :seq]
    return out.transpose(1, 2).to(out_dtype), s_state
