"""Gated DeltaNet (block kind ``"gated_delta_net"``): the linear-attention layers of Qwen3.5/3.6 hybrids.

Rule: numerics as transformers' ``Qwen3_5GatedDeltaNet`` on its PyTorch path: projections, a causal depthwise
convolution with SiLU over queries, keys and values, L2-normed queries and keys, the gated delta rule
(:mod:`shardtune.models.gated_delta_rule`, in fp32) and a gated RMSNorm before ``out_proj``. A packed row runs
the convolution and the rule on every sample alone, so neither the convolution's window nor the recurrent
state crosses a sample boundary (as :mod:`shardtune.models.packed_attention` does for attention). Generation
keeps the convolution's last inputs and the rule's state in the layer's cache (``LayerCache.state``) and
goes on from them, equal to running the whole sequence; left-pad tokens are zeroed before the projections,
as transformers does, which leaves both states as if the row started at its first real token. Parameter
names and registration order are transformers', so ``state_dict`` keys and order equal its checkpoints'.
Context parallel: each rank runs the convolution and the rule of its share of the heads over the whole rows
(:mod:`shardtune.models.context_heads`).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from shardtune.models.args import ModelArgs
from shardtune.models.blocks.norm import init_linear
from shardtune.models.context_heads import by_rank, conv_channels, heads_of_rank, to_own_tokens, to_whole_rows
from shardtune.models.context_parallel import ContextAttention, ContextShard
from shardtune.models.gated_delta_kernels import chunk_rule
from shardtune.models.gated_delta_rule import recurrent_gated_delta_rule
from shardtune.models.kv_cache import LayerCache
from shardtune.models.linear_attention_args import LinearAttentionArgs
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
        rows run every sample alone; ``kv`` (generation: a :class:`LayerCache`) continues the cached states; a
        context-parallel shard trades tokens for heads (:mod:`shardtune.models.context_heads`)."""
        b, s, _ = x.shape
        geo = self.geo
        if isinstance(kv, LayerCache) and (real := kv.pad_mask(s, x.device)) is not None:
            x = x * real[..., None].to(x.dtype)
        qkv = self.in_proj_qkv(x)
        # transformers: beta in the activations' dtype, the log decay in fp32
        beta = self.in_proj_b(x).sigmoid()
        if isinstance(packed, ContextAttention):
            core = self._over_ranks(packed.shard, qkv, self.in_proj_a(x), beta)
        elif isinstance(kv, LayerCache):
            core = self._continue(kv, qkv, self._decay(self.in_proj_a(x), slice(None)), beta)
        elif kv is not None:
            raise TypeError(f"a linear_attention layer takes a LayerCache as kv, got {type(kv).__name__}")
        else:
            mix = partial(self._mix, geo=geo, weight=self.conv1d.weight)
            g = self._decay(self.in_proj_a(x), slice(None))
            # unpacked rows are one sequence each: the whole batch at once
            core = mix(qkv, g, beta) if packed is None else _per_sample(mix, packed.lengths, qkv, g, beta)
        z = self.in_proj_z(x).reshape(b, s, geo.num_value_heads, geo.value_head_dim)
        return self.out_proj(self.norm(core, z).reshape(b, s, geo.value_dim))

    def _decay(self, a: Tensor, heads: slice) -> Tensor:
        """The rule's log decay (fp32) of value heads ``heads`` from their ``in_proj_a`` outputs ``a``."""
        return -self.A_log[heads].float().exp() * F.softplus(a.float() + self.dt_bias[heads])

    def _over_ranks(self, shard: ContextShard, qkv: Tensor, a: Tensor, beta: Tensor) -> Tensor:
        """Context parallel: this rank's tokens' rule outputs ``[b, S / cp, heads, dv]``, each rank running the
        convolution and the rule of its heads over every document of the whole rows."""
        geo, cp = self.geo, shard.group.size()
        mine, rank = heads_of_rank(geo, cp), dist.get_rank(shard.group)
        b, n, _ = qkv.shape
        rows = to_whole_rows(by_rank(qkv, a, beta, geo=geo, cp=cp), shard)
        heads = mine.num_value_heads
        qkv_rows, a_rows, beta_rows = rows.split([mine.conv_dim, heads, heads], dim=-1)
        weight = torch.cat([self.conv1d.weight[part] for part in conv_channels(geo, cp=cp, rank=rank)])
        g = self._decay(a_rows, slice(rank * heads, (rank + 1) * heads))
        core = _per_sample(partial(self._mix, geo=mine, weight=weight), shard.documents, qkv_rows, g, beta_rows)
        return to_own_tokens(core.flatten(2), shard).reshape(b, n, geo.num_value_heads, geo.value_head_dim)

    def _mix(self, qkv: Tensor, g: Tensor, beta: Tensor, *, geo: LinearAttentionArgs, weight: Tensor) -> Tensor:
        """Causal sequences' ``[b, n, conv_dim]`` projections -> their rule outputs ``[b, n, heads, dv]``
        (``geo``: the heads they hold, ``weight``: their convolution channels)."""
        window = qkv.new_zeros(qkv.shape[0], weight.shape[-1] - 1, qkv.shape[-1])
        out, _ = self._rule(*_conv(window, qkv, geo=geo, weight=weight), g, beta, None)
        return out

    def _continue(self, cache: LayerCache, qkv: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """Generation: go on from the cached convolution inputs and rule state, and cache the new ones."""
        if cache.state is None:
            window = qkv.new_zeros(qkv.shape[0], self.conv1d.weight.shape[-1] - 1, qkv.shape[-1])
            state = None
        else:
            window, state = cache.state
        q, k, v = _conv(window, qkv, geo=self.geo, weight=self.conv1d.weight)
        window = torch.cat([window, qkv], dim=1)[:, -window.shape[1] :]
        out, state = self._rule(q, k, v, g, beta, state)
        cache.state = (window, state)
        return out

    @staticmethod
    def _rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor]:
        """One token: the recurrent form (no chunk padding); more: the chunked one (the Triton kernel on CUDA
        when flash-linear-attention is installed, :mod:`shardtune.models.gated_delta_kernels`)."""
        rule = recurrent_gated_delta_rule if q.shape[1] == 1 else chunk_rule(q)
        return rule(q, k, v, g, beta, state=state)


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


def _conv(window: Tensor, qkv: Tensor, *, geo: LinearAttentionArgs, weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The causal depthwise convolution (``weight``, one channel per ``qkv`` channel) with SiLU over ``qkv``
    ``[b, n, conv_dim]`` after the ``window`` ``[b, kernel - 1, conv_dim]`` of inputs before it (zeros at a
    sequence's start); queries and keys L2-normed per head and repeated to the value heads (``[b, n, heads,
    d]``), values ``[b, n, heads, dv]``, of ``geo``'s heads."""
    b, n, _ = qkv.shape
    inputs = torch.cat([window, qkv], dim=1).transpose(1, 2).to(weight.dtype)
    mixed = F.silu(F.conv1d(inputs, weight, groups=geo.conv_dim)).to(qkv.dtype).transpose(1, 2)
    q, k, v = mixed.split([geo.key_dim, geo.key_dim, geo.value_dim], dim=-1)
    groups = geo.num_value_heads // geo.num_key_heads
    q, k = (
        _l2norm(t.reshape(b, n, geo.num_key_heads, geo.key_head_dim)).repeat_interleave(groups, dim=2) for t in (q, k)
    )
    return q * geo.key_head_dim**-0.5, k, v.reshape(b, n, geo.num_value_heads, geo.value_head_dim)
