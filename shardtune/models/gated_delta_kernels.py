"""Which implementation runs the gated delta rule: flash-linear-attention's Triton kernel on CUDA when it is
installed (``pip install flash-linear-attention``), else :func:`~shardtune.models.gated_delta_rule.chunk_gated_delta_rule`.

Rule: both take the same inputs (queries and keys L2-normed, queries scaled, heads repeated to the value
heads; ``[b, s, h, d]``) and return the outputs in the values' dtype and the final state in fp32, so a
layer never knows which ran. ``SHARDTUNE_GATED_DELTA_KERNEL=torch`` keeps the PyTorch one on CUDA too (a
reference, or a kernel that does not build for the GPU). tests/gpu checks the kernel against the PyTorch rule.
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable

import torch
from torch import Tensor

from shardtune.models.gated_delta_rule import chunk_gated_delta_rule

__all__ = ["KERNEL_ENV", "chunk_rule", "fla_rule"]

KERNEL_ENV = "SHARDTUNE_GATED_DELTA_KERNEL"  # "torch": never the Triton kernel
Rule = Callable[..., tuple[Tensor, Tensor]]


@functools.cache
def fla_rule() -> Rule | None:
    """flash-linear-attention's ``chunk_gated_delta_rule``, or None where it does not import."""
    try:
        return importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except Exception:  # not installed, or a build for another GPU / torch: the PyTorch rule runs
        return None


def chunk_rule(q: Tensor) -> Rule:
    """The chunked rule for inputs like ``q``: the Triton kernel on CUDA when available, else PyTorch's."""
    kernel = fla_rule() if q.is_cuda and os.environ.get(KERNEL_ENV, "auto") != "torch" else None
    if kernel is None:
        return chunk_gated_delta_rule
    return functools.partial(_fla, kernel)


def _fla(kernel: Rule, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, state: Tensor | None = None):
    """The Triton kernel with the PyTorch rule's contract (queries already scaled: ``scale=1``)."""
    dtype = v.dtype
    out, final = kernel(
        q.to(dtype),
        k.to(dtype),
        v,
        g.float(),
        beta.to(dtype),
        scale=1.0,
        initial_state=None if state is None else state.float(),
        output_final_state=True,
        use_qk_l2norm_in_kernel=False,
    )
    return out.to(dtype), final.to(torch.float32)
