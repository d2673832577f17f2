"""Routed experts beside a layer's dense MLP (``Blocks.experts_beside_mlp``, Gemma 4's MoE), as transformers.

Rule: a sparse layer keeps its dense ``mlp`` and adds its own ``router`` and ``experts`` (any router and
experts kinds, ``blocks/kinds.py``) with three norms, under transformers' names and in its order
(:func:`layer_modules`). The router sees the feed-forward branch's input un-normed, the experts its
``pre_feedforward_layernorm_2`` norm; the branch's output is ``post_feedforward_layernorm_1(mlp out) +
post_feedforward_layernorm_2(experts out)`` (:func:`add_experts`). The experts run as a sparse block's
do (:func:`~shardtune.models.blocks.moe.run_experts`: across the expert-parallel group when they have one),
and the router's logits go to the load-balancing loss (:mod:`shardtune.models.moe_aux`).
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor, nn

from shardtune.models.args import ModelArgs
from shardtune.models.blocks.experts import Experts
from shardtune.models.blocks.kinds import build_router_and_experts
from shardtune.models.blocks.moe import run_experts
from shardtune.models.blocks.norm import RMSNorm
from shardtune.models.blocks.routers import Router
from shardtune.models.moe_aux import Routing
from shardtune.models.spec import SparseSpec

__all__ = ["add_experts", "layer_modules"]


def layer_modules(
    args: ModelArgs, spec: SparseSpec, *, norm: dict[str, Any], device=None, dtype=None
) -> dict[str, nn.Module]:
    """A sparse layer's modules beside its ``mlp``, by name in transformers' order."""
    router, experts = build_router_and_experts(args, spec, device=device, dtype=dtype)
    kw = {**norm, "device": device, "dtype": dtype}
    return {
        "router": router,
        "experts": experts,
        "post_feedforward_layernorm_1": RMSNorm(args.dim, **kw),
        "post_feedforward_layernorm_2": RMSNorm(args.dim, **kw),
        "pre_feedforward_layernorm_2": RMSNorm(args.dim, **kw),
    }


def add_experts(layer: nn.Module, h: Tensor, mlp_out: Tensor, *, layer_idx: int, routing: Routing | None) -> Tensor:
    """The feed-forward branch's output of a layer whose input is ``h`` and whose dense MLP gave ``mlp_out``."""
    router, experts = cast(Router, layer.router), cast(Experts, layer.experts)
    flat = h.reshape(-1, h.shape[-1])
    logits = router(flat)
    weights, indices = router.select(logits)
    out = run_experts(experts, cast(nn.Module, layer.pre_feedforward_layernorm_2)(flat), weights, indices)
    if routing is not None:
        out = routing.attach(out, routing.record(layer_idx, logits, indices), layer_idx=layer_idx)
    dense = cast(nn.Module, layer.post_feedforward_layernorm_1)(mlp_out)
    return dense + cast(nn.Module, layer.post_feedforward_layernorm_2)(out.view(h.shape))
