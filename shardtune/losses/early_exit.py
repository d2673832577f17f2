"""Early-exit loss (LayerSkip): the final layer's cross-entropy plus weighted cross-entropies of
chosen intermediate layers through the shared final norm and ``lm_head``.

Rule: an exit's weight comes from :func:`early_exit_loss_scales` alone and the weighted sum from
:func:`weighted_exits` alone, whether the per-layer losses come from full logits
(:func:`early_exit_loss`) or, in training, from the hidden states in chunks inside the model's
forward (:func:`early_exit`, summed over the rows' label tokens like the next-token loss, whole or
split over a ``cp`` group: :class:`~shardtune.losses.rows.Rows`).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Mapping
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor

from shardtune.losses.chunked import DEFAULT_CHUNK_TOKENS
from shardtune.losses.logits import cross_entropy_loss
from shardtune.losses.next_token import token_head_loss
from shardtune.losses.rows import Rows
from shardtune.losses.step import KindLoss, Summed, loop_loss
from shardtune.models import LlamaForCausalLM, Routing
from shardtune.models.context_parallel import ALL_GATHER

__all__ = [
    "EarlyExitScale",
    "early_exit",
    "early_exit_loss",
    "early_exit_loss_fn",
    "early_exit_loss_scales",
    "weighted_exits",
]

EarlyExitScale = Literal["one", "l", "sum_l", "sqrt_l", "sum_sqrt_l", "inv_l", "sum_inv_l"]


def early_exit_loss_scales(
    layer_ids: list[int],
    n_layers: int,
    *,
    scale_type: EarlyExitScale | str = "sum_l",
    e_scale: float = 1.0,
) -> Tensor:
    """LayerSkip loss weights for ``layer_ids`` (sorted ascending), normalized to sum to 1.

    ``l`` means ``layer_id + 1``; ``sum_*`` are cumulative sums over the chosen layers. Every
    layer except the last one of the model is further multiplied by ``e_scale``.
    """
    ids = torch.tensor(sorted(layer_ids), dtype=torch.float64) + 1
    if scale_type == "one":
        scales = torch.ones_like(ids)
    elif scale_type == "l":
        scales = ids
    elif scale_type == "sum_l":
        scales = torch.cumsum(ids, 0)
    elif scale_type == "sqrt_l":
        scales = ids.sqrt()
    elif scale_type == "sum_sqrt_l":
        scales = torch.cumsum(ids.sqrt(), 0)
    elif scale_type == "inv_l":
        scales = 1.0 / ids
    elif scale_type == "sum_inv_l":
        scales = torch.cumsum(1.0 / ids, 0)
    else:
        raise ValueError(
            f"early-exit scale_type {scale_type!r} is unknown; use one of "
            "'one', 'l', 'sum_l', 'sqrt_l', 'sum_sqrt_l', 'inv_l', 'sum_inv_l'"
        )
    scales = scales * torch.where(ids - 1 < n_layers - 1, e_scale, 1.0)
    return (scales / scales.sum()).float()


def early_exit_loss(
    logits_by_layer: Mapping[int, Tensor],
    labels: Tensor,
    *,
    n_layers: int,
    scale_type: EarlyExitScale | str = "sum_l",
    e_scale: float = 1.0,
    ignore_index: int = -100,
) -> Tensor:
    """Weighted sum of per-layer cross-entropies of early-exit logits.

    ``logits_by_layer`` is ``{layer_id: logits}``, e.g. from
    ``model(tokens, output_hidden_states=ids, hidden_to_logits=True)[1]``. Add the
    final-layer loss separately, as the LayerSkip recipe does.
    """
    if not logits_by_layer:
        raise ValueError("early_exit_loss needs at least one layer's logits")
    losses = {i: cross_entropy_loss(logits, labels, ignore_index=ignore_index) for i, logits in logits_by_layer.items()}
    return weighted_exits(losses, n_layers, scale_type=scale_type, e_scale=e_scale)


def weighted_exits(loss_by_layer: Mapping[int, Tensor], n_layers: int, *, scale_type: str, e_scale: float) -> Tensor:
    """The exits' losses ``{layer_id: loss}`` (at least one) weighted by :func:`early_exit_loss_scales`, summed."""
    ids = sorted(loss_by_layer)
    scales = early_exit_loss_scales(ids, n_layers, scale_type=scale_type, e_scale=e_scale)
    return functools.reduce(operator.add, [s * loss_by_layer[i] for s, i in zip(scales.tolist(), ids, strict=True)])


def early_exit(
    model: LlamaForCausalLM,
    *,
    exits: Callable[[], list[int]],
    scale_type: str,
    scale: float,
    chunk_tokens: int | None,
    compile: bool = False,
) -> KindLoss:
    """The kind: ``model``'s final-layer cross-entropy plus its early exits' (``exits()``, the layers that
    count at this step) weighted by :func:`early_exit_loss_scales`, summed over the rows' label tokens."""
    n_layers = len(model.model.layers)

    def loss(rows: Rows, routing: Routing | None) -> Summed:
        head_loss = token_head_loss(rows, chunk_tokens=chunk_tokens, compile=compile)
        loss_sum, by_layer = model(
            rows.tokens, **rows.forward, output_hidden_states=exits(), head_loss=head_loss, routing=routing
        )
        if by_layer:
            loss_sum = loss_sum + weighted_exits(by_layer, n_layers, scale_type=scale_type, e_scale=scale)
        return Summed(loss_sum, rows.label_tokens)

    return loss


def early_exit_loss_fn(
    model: LlamaForCausalLM,
    *,
    device: torch.device,
    exits: Callable[[], list[int]],
    scale_type: str,
    scale: float,
    chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS,
    compile: bool = False,
    router_aux_loss_coef: float | None = None,
    group: dist.ProcessGroup | None = None,
    context_parallel_mode: str = ALL_GATHER,
):
    """``loss_fn`` for the loop: :func:`early_exit` per label token; with ``group`` every row split over it
    (context parallel: each rank the exits' losses of its tokens, collective on ``group``). A
    mixture-of-experts model adds ``router_aux_loss_coef`` (None: its config's) times the load-balancing
    loss of the sparse layers that ran (layer dropout skips a layer's router too)."""
    kind = early_exit(
        model, exits=exits, scale_type=scale_type, scale=scale, chunk_tokens=chunk_tokens, compile=compile
    )
    return loop_loss(
        kind,
        model,
        device=device,
        group=group,
        context_parallel_mode=context_parallel_mode,
        router_aux_loss_coef=router_aux_loss_coef,
    )
