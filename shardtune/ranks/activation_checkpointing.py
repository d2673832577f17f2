"""Activation checkpointing of decoder layers: what each layer keeps for backward, what it recomputes.

Rule: checkpointing trades memory for time and never changes a value: whatever is recomputed is
computed again from the same inputs (and RNG state), so losses and gradients are those of an
uncheckpointed model. Two policies per layer:

- ``full`` (``enable_activation_checkpointing: true``): only the layer's input is saved; backward
  runs the whole layer's forward again.
- ``selective``: the outputs of matrix multiplications and attention are saved, everything cheap
  (norms, rope, activations, casts, residual adds) is recomputed, as torchtitan's op-level policy:
  less memory than no checkpointing, much less recompute than ``full``.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

__all__ = ["POLICIES", "checkpointed"]

POLICIES = ("full", "selective")

_aten = torch.ops.aten
# The expensive ops: their outputs are kept, so backward never recomputes a GEMM or an attention.
_SAVED = frozenset(
    op
    for op in (
        _aten.mm.default,
        _aten.addmm.default,
        _aten.bmm.default,
        getattr(_aten, "_grouped_mm", None) and _aten._grouped_mm.default,
        _aten._scaled_dot_product_flash_attention.default,
        _aten._scaled_dot_product_efficient_attention.default,
        _aten._scaled_dot_product_cudnn_attention.default,
        _aten._scaled_dot_product_flash_attention_for_cpu.default,
    )
    if op is not None
)


def _keep_matmuls(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in _SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(layer: nn.Module, policy: str) -> nn.Module:
    """``layer`` wrapped for activation checkpointing with ``policy`` (one of :data:`POLICIES`).
    The wrapper keeps state-dict names (``checkpoint_wrapper`` strips its prefix)."""
    if policy == "full":
        return checkpoint_wrapper(layer)
    if policy == "selective":
        return checkpoint_wrapper(layer, context_fn=partial(create_selective_checkpoint_contexts, _keep_matmuls))
    raise ValueError(f"activation checkpointing policy {policy!r} is not one of {POLICIES}")
