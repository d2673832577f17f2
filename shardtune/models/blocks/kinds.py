"""The registry of block kinds: the names a family's spec (``shardtune.models.spec``) picks its blocks by.

Rule: the decoder builds a layer's ``self_attn`` and ``mlp`` only through :func:`build_attention` and
:func:`build_feed_forward`, from the layer's spec; each kind is one entry here and one module of its
own. A new attention, feed-forward, router or experts kind is a module plus its entry; a family using
existing kinds adds nothing here. Every attention kind takes ``(x, cos, sin, mask, kv, packed)`` (one that
shares keys and values across layers, ``ModelArgs.kv_sharing``, also ``shared_kv``) and every feed-forward
kind ``(x, routing)`` (see ``llama.DecoderLayer``), and has ``init_weights(std)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

from torch import Tensor, nn

from shardtune.models.args import ModelArgs
from shardtune.models.blocks.attention import Attention
from shardtune.models.blocks.biased_experts import GptOssExperts
from shardtune.models.blocks.experts import Experts
from shardtune.models.blocks.gated_delta_net import GatedDeltaNet
from shardtune.models.blocks.mla_attention import MLAttention
from shardtune.models.blocks.mlp import MLP
from shardtune.models.blocks.moe import SparseMoeBlock
from shardtune.models.blocks.qkv_norm_attention import QKVNormAttention
from shardtune.models.blocks.routers import GptOssRouter, Router, ScaledRouter, SigmoidGroupRouter
from shardtune.models.blocks.sink_attention import SinkAttention
from shardtune.models.spec import GROUPED_ROUTER, AttentionSpec, MlpSpec, SparseSpec

__all__ = [
    "ATTENTION",
    "EXPERTS",
    "FEED_FORWARD",
    "ROUTERS",
    "Block",
    "build_attention",
    "build_feed_forward",
    "build_router_and_experts",
]

_T = TypeVar("_T")


class Block(Protocol):
    """What the decoder needs of every attention and feed-forward block (each an ``nn.Module``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor: ...

    def init_weights(self, std: float) -> None:
        """transformers' initialization of the block's weights (normal(0, ``std``), norms at identity)."""
        ...


class AttentionKind(Protocol):
    """Builds layer ``layer_idx``'s ``self_attn`` (``norm_offset``: the family's RMSNorm order, for q/k norms)."""

    def __call__(
        self, args: ModelArgs, *, spec: AttentionSpec, norm_offset: bool, layer_idx: int, device: Any, dtype: Any
    ) -> Block: ...


class FeedForwardKind(Protocol):
    """Builds layer ``layer_idx``'s ``mlp`` from its spec (an ``MlpSpec`` or a ``SparseSpec``)."""

    def __call__(self, args: ModelArgs, *, spec: Any, layer_idx: int, device: Any, dtype: Any) -> Block: ...


def build_router_and_experts(args: ModelArgs, spec: SparseSpec, *, device=None, dtype=None) -> tuple[Router, Experts]:
    """The spec's router and experts kinds, built for ``args.moe``."""
    kw = {"device": device, "dtype": dtype}
    router = _kind(ROUTERS, spec.router, "router").from_args(args, spec, **kw)
    return router, _kind(EXPERTS, spec.experts, "experts").from_args(args, spec, **kw)


def _sparse_moe(args: ModelArgs, *, spec: SparseSpec, layer_idx: int, device: Any, dtype: Any) -> Block:
    """A :class:`SparseMoeBlock` of the spec's router and experts kinds, with its shared expert if any."""
    kw = {"device": device, "dtype": dtype}
    router, experts = build_router_and_experts(args, spec, device=device, dtype=dtype)
    shared = gate = None
    if spec.shared is not None:
        assert args.moe is not None  # family_of checked it sets the shared expert's width
        shared = (spec.shared.name, MLP(args, intermediate_size=args.moe.shared_expert_intermediate_size, **kw))
        if spec.shared.gate_name is not None:
            gate = (spec.shared.gate_name, nn.Linear(args.dim, 1, bias=False, **kw))
    return SparseMoeBlock(
        router,
        experts,
        layer_idx=layer_idx,
        router_name=spec.router_name,
        router_first=spec.router_first,
        shared=shared,
        shared_gate=gate,
    )


ATTENTION: dict[str, AttentionKind] = {
    "attention": Attention,
    "sink_attention": SinkAttention,
    "gated_delta_net": GatedDeltaNet,
    "qkv_norm_attention": QKVNormAttention,
    "mla_attention": MLAttention,
}
FEED_FORWARD: dict[str, FeedForwardKind] = {"gated_mlp": MLP, "sparse_moe": _sparse_moe}
ROUTERS: dict[str, type[Router]] = {
    "softmax_topk": Router,
    "topk_softmax": GptOssRouter,
    "scaled_softmax_topk": ScaledRouter,
    GROUPED_ROUTER: SigmoidGroupRouter,
}
EXPERTS: dict[str, type[Experts]] = {"gated": Experts, "clamped_swiglu": GptOssExperts}


def _kind(table: Mapping[str, _T], name: str, what: str) -> _T:
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown {what} block kind {name!r} in a family spec; known kinds: {sorted(table)}") from None


def build_attention(
    args: ModelArgs, spec: AttentionSpec, *, norm_offset: bool, layer_idx: int = 0, device=None, dtype=None
) -> Block:
    """The ``self_attn`` of layer ``layer_idx``, whose attention is ``spec``."""
    kind = _kind(ATTENTION, spec.kind, "attention")
    return kind(args, spec=spec, norm_offset=norm_offset, layer_idx=layer_idx, device=device, dtype=dtype)


def build_feed_forward(
    args: ModelArgs, spec: MlpSpec | SparseSpec, *, layer_idx: int, device=None, dtype=None
) -> Block:
    """The ``mlp`` of layer ``layer_idx`` whose feed-forward block is ``spec``."""
    kind = _kind(FEED_FORWARD, spec.kind, "feed-forward")
    return kind(args, spec=spec, layer_idx=layer_idx, device=device, dtype=dtype)
