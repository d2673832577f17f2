"""Model FLOPs of a training step, and the peak a device can do, for ``tflops_per_device`` and ``mfu``.

Rule: model FLOPs, not hardware FLOPs: what one forward and backward of the model need, counted
from its shape, whatever activation checkpointing recomputes. Per processed token (padding
included) of a sequence of length ``t``:

* matmuls with weights: forward ``2 N`` and the input gradients ``2 N`` for every weight; the
  weight gradients ``2 N_trainable`` only for weights that train (a LoRA or QLoRA base's do not).
  ``N`` counts every weight that multiplies activations: not the embedding lookup, but the
  output head even when it shares the embedding's weight; of a mixture of experts only the
  ``top_k`` experts a token runs through (the active parameters), the router included;
* attention scores and values: ``12 * layers * heads * head_dim * t`` (forward and backward,
  no causal halving, as PaLM's and torchtitan's MFU count); with multi-head latent attention, whose keys
  and values differ in width, ``6 * layers * heads * (qk_head_dim + v_head_dim) * t``.

For full fine-tuning this is the usual ``6 N + 12 l h q t``.

With ``context_parallel`` = ``cp`` a rank runs ``1 / cp`` of every row (padded to a multiple of
``2 * cp``, :mod:`shardtune.models.context_parallel`) whose queries see the whole row, so it counts
``padded / cp`` tokens at sequence length ``padded`` (:func:`rank_batch_flops`): a ``cp`` group together
counts a row once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardtune.models.blocks.experts import Experts

__all__ = ["PEAK_BF16_TFLOPS", "flops_per_token_fn", "peak_tflops", "rank_batch_flops"]

# Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets, by device name fragment.
PEAK_BF16_TFLOPS: dict[str, float] = {
    "H200": 989.5,
    "H100": 989.5,
    "H800": 989.5,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.05,
    "B200": 2250.0,
}


def _weights(model: nn.Module) -> tuple[int, int]:
    """(N, N_trainable): elements of the weights that multiply activations (see the module doc)."""
    embedding_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    total = trainable = 0
    seen: set[int] = set()
    for module in model.modules():
        for param in module.parameters(recurse=False):
            tied_head = id(param) in embedding_ids and not isinstance(module, nn.Embedding)
            if (id(param) in seen and not tied_head) or (id(param) in embedding_ids and not tied_head):
                continue
            seen.add(id(param))
            numel = param.numel() * module.top_k // module.num_experts if isinstance(module, Experts) else param.numel()
            total += numel
            trainable += numel if param.requires_grad else 0
    return total, trainable


def flops_per_token_fn(model: nn.Module) -> Callable[[int], float]:
    """``seq_len -> model FLOPs per token`` of a training step of ``model`` (fwd + bwd)."""
    weights, trainable = _weights(model)
    args: Any = model.args  # a ModelArgs (nn.Module.__getattr__ is typed Tensor | Module)
    widths = (args.mla.qk_head_dim + args.mla.v_head_dim) if args.mla is not None else 2 * args.head_dim
    attention = 6 * args.n_layers * args.n_heads * widths
    return lambda seq_len: 4.0 * weights + 2.0 * trainable + attention * seq_len


def rank_batch_flops(
    flops_per_token: Callable[[int], float], rows: int, seq_len: int, *, context_parallel: int = 1
) -> float:
    """Model FLOPs this rank spends on a batch of ``rows`` x ``seq_len`` (the host batch every rank of a
    ``cp`` group reads): ``rows * seq_len * flops_per_token(seq_len)``, or with ``context_parallel`` > 1
    its ``1 / cp`` of the rows padded as the split pads them (see the module doc)."""
    if context_parallel == 1:
        return rows * seq_len * flops_per_token(seq_len)
    padded = -(-seq_len // (2 * context_parallel)) * (2 * context_parallel)
    return rows * (padded // context_parallel) * flops_per_token(padded)


def peak_tflops(device: torch.device, *, configured: float | None) -> float | None:
    """The device's peak for ``mfu``: the configured value, else the bf16 table entry of a known GPU."""
    if configured is not None:
        return configured
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)
