"""Aux-loss-free load balancing (DeepSeek-V3's): after each optimizer step, every group-limited sigmoid
router's ``e_score_correction_bias`` moves a fixed ``rate`` towards even expert load, outside the optimizer.

Rule: per sparse layer, ``bias_e += rate * sign(mean load - load_e)`` (an overloaded expert is chosen less,
an underloaded one more; the routing weights never see the bias), from the step's tokens per expert summed
over its micro-batches and every rank: the loop's one all-reduce of its step metrics (``tokens_per_expert``,
:class:`~shardtune.models.moe_aux.Routing`'s counts of the experts each router chose), so balancing adds no
collective, and every rank, holding the same totals and its own copy of each bias, updates it alike. Off
(``rate`` 0) the bias stays as loaded, as transformers keeps it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from shardtune.models.blocks.routers import SigmoidGroupRouter

__all__ = ["balanced_routers", "update_router_biases"]


def balanced_routers(model: nn.Module, rate: float) -> list[SigmoidGroupRouter]:
    """The routers whose biases ``rate`` moves, in layer order (none when ``rate`` is 0); a model without
    group-limited sigmoid routers is refused naming the key."""
    if not rate:
        return []
    routers = [m for m in model.modules() if isinstance(m, SigmoidGroupRouter)]
    if not routers:
        raise ValueError(
            f"router_bias_update_rate={rate}: aux-loss-free balancing moves the correction bias of group-limited "
            "sigmoid routers (glm4_moe), and this model has none; set router_bias_update_rate=0"
        )
    return routers


@torch.no_grad()
def update_router_biases(routers: list[SigmoidGroupRouter], loads: Tensor, *, rate: float) -> None:
    """Move each router's bias by ``rate`` towards even load; ``loads``: tokens per expert of every sparse
    layer, ``[layers * E]`` in layer order (the same on every rank)."""
    if loads.numel() != sum(r.e_score_correction_bias.numel() for r in routers):
        raise ValueError(
            f"router_bias_update_rate: {loads.numel()} expert loads for {len(routers)} routers of "
            f"{[r.e_score_correction_bias.numel() for r in routers]} experts; every sparse layer must use the "
            "group-limited sigmoid router"
        )
    for router, load in zip(routers, loads.split([r.e_score_correction_bias.numel() for r in routers]), strict=True):
        bias = router.e_score_correction_bias
        step = torch.sign(load.mean() - load).mul_(rate)
        bias.add_(step.to(device=bias.device, dtype=bias.dtype))
