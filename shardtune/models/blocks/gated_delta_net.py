"""Gated DeltaNet (block kind ``"gated_delta_net"``): the linear-attention layers of Qwen3.5/3.6 hybrids.

Rule: numerics as transformers' ``Qwen3_5GatedDeltaNet`` on its PyTorch path: projections, a causal depthwise
convolution with SiLU over queries, keys and values, L2-normed queries and keys, the gated delta rule
(:mod:`shardtune.models.gated_delta_rule`, in fp32) and a gated RMSNorm before ``out_proj``. A packed row runs
the convolution and the rule on every sample alone, so neither the convolution's window nor the recurrent
state crosses a sample boundary (as :mod:`shardtune.models.packed_attention` does for attention). Parameter
names and registration order are transformers', so ``state_dict`` keys and order equal its checkpoints'.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardtune.models.args import ModelArgs
from shardtune.models.blocks.norm import init_linear
from shardtune.models.context_parallel import ContextAttention
from shardtune.models.gated_delta_rule import chunk_gated_delta_rule
from shardtune.models.packed_attention import PackedSamples
from shardtune.models.spec import AttentionSpec

__all__ = ["GatedDeltaNet", "GatedRMSNorm"]

_L2_EPS = 1e-6  # transformers' (and flash-linear-attention's) l2norm epsilon


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head (Llama order: cast back, then scale by ``w``), times ``silu(gate)`` in fp32."""

    def __init__(self, dim: int, *, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            nn.init.ones_(self.weight)

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * h.to(dtype) * F.silu(gate.float())).to(dtype)


def _l2norm(x: Tensor) -> Tensor:
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


class GatedDeltaNet(nn.Module):
    """One Gated DeltaNet layer (``linear_attn``); takes the attention blocks' arguments and uses ``packed``."""

    def __init__(
        self,
        args: ModelArgs,
        *,
        spec: AttentionSpec | None = None,
        norm_offset: bool = False,
        layer_idx: int = 0,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        geo = args.linear_attention
        if geo is None:
            raise ValueError("a linear_attention layer needs ModelArgs.linear_attention (its Gated DeltaNet geometry)")
        self.geo = geo
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        kernel = geo.conv_kernel_size
        self.conv1d = nn.Conv1d(
            geo.conv_dim, geo.conv_dim, kernel, bias=False, groups=geo.conv_dim, padding=kernel - 1, **kw
        )
        self.dt_bias = nn.Parameter(torch.empty(geo.num_value_heads, **kw))
        self.A_log = nn.Parameter(torch.empty(geo.num_value_heads, **kw))
        self.norm = GatedRMSNorm(geo.value_head_dim, eps=args.norm_eps, **kw)
        self.out_proj = nn.Linear(geo.value_dim, args.dim, bias=False, **kw)
        self.in_proj_qkv = nn.Linear(args.dim, geo.conv_dim, bias=False, **kw)
        self.in_proj_z = nn.Linear(args.dim, geo.value_dim, bias=False, **kw)
        self.in_proj_b = nn.Linear(args.dim, geo.num_value_heads, bias=False, **kw)
        self.in_proj_a = nn.Linear(args.dim, geo.num_value_heads, bias=False, **kw)

    def init_weights(self, std: float) -> None:
        """transformers' init: normal linears and convolution, ``dt_bias`` ones, ``A`` uniform in [0.01, 16]."""
        for proj in (self.out_proj, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a):
            init_linear(proj, std)
        if self.A_log.is_meta:
            return
        nn.init.normal_(self.conv1d.weight, mean=0.0, std=std)
        nn.init.ones_(self.dt_bias)
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log, dtype=torch.float32).uniform_(0.01, 16).log_())
        self.norm.reset_parameters()

    def forward(
        self,
        x: Tensor,
        cos: Tensor | None = None,
        sin: Tensor | None = None,
        mask: Tensor | None = None,
        kv: Any = None,
        packed: PackedSamples | ContextAttention | None = None,
    ) -> Tensor:
        """``x`` ``[b, s, dim]`` -> ``[b, s, dim]``. Positions, masks and rotary tables do not apply; ``packed``
        rows run every sample alone. A context-parallel shard or a KV cache is refused by name."""
        if isinstance(packed, ContextAttention):
            raise NotImplementedError(
                "context parallel does not cover linear_attention (Gated DeltaNet) layers yet; "
                "train this model with parallel.context=1"
            )
        if kv is not None:
            raise NotImplementedError(
                "KV-cache generation does not cover linear_attention (Gated DeltaNet) layers; generate without a "
                "cache (or with transformers)"
            )
        b, s, _ = x.shape
        geo = self.geo
        qkv = self.in_proj_qkv(x)
        # transformers: beta in the activations' dtype, the log decay in fp32
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        lengths = packed.lengths if isinstance(packed, PackedSamples) else ((s,),) * b
        core = _per_sample(self._mix, lengths, qkv, g, beta)
        z = self.in_proj_z(x).reshape(b, s, geo.num_value_heads, geo.value_head_dim)
        return self.out_proj(self.norm(core, z).reshape(b, s, geo.value_dim))

    def _mix(self, qkv: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """One causal sequence's ``[1, n, conv_dim]`` projections -> its rule outputs ``[1, n, heads, dv]``."""
        geo = self.geo
        n = qkv.shape[1]
        weight = self.conv1d.weight
        conv = F.conv1d(qkv.transpose(1, 2).to(weight.dtype), weight, padding=weight.shape[-1] - 1, groups=geo.conv_dim)
        mixed = F.silu(conv[..., :n]).to(qkv.dtype).transpose(1, 2)
        q, k, v = mixed.split([geo.key_dim, geo.key_dim, geo.value_dim], dim=-1)
        groups = geo.num_value_heads // geo.num_key_heads
        q, k = (
            _l2norm(t.reshape(1, n, geo.num_key_heads, geo.key_head_dim)).repeat_interleave(groups, dim=2)
            for t in (q, k)
        )
        v = v.reshape(1, n, geo.num_value_heads, geo.value_head_dim)
        out, _ = chunk_gated_delta_rule(q / math.sqrt(geo.key_head_dim), k, v, g, beta)
        return out


@torch.compiler.disable  # per-sample shapes would recompile a compiled layer for every new packing
def _per_sample(mix: Any, lengths: tuple[tuple[int, ...], ...], qkv: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """``mix`` on every sample's slice of each row (views, nothing copied in); outputs put back in place."""
    rows = []
    for i, row in enumerate(lengths):
        outs, start = [], 0
        for n in row:
            span = slice(start, start + n)
            outs.append(mix(qkv[i : i + 1, span], g[i : i + 1, span], beta[i : i + 1, span]))
            start += n
        rows.append(outs[0] if len(outs) == 1 else torch.cat(outs, dim=1))
    return rows[0] if len(rows) == 1 else torch.cat(rows, dim=0)
