"""Optimizers and learning-rate schedules built from config values.

Rule: :data:`OPTIMIZERS` is the one list of ``optimizer.name`` values (the config schema reads
it). The low-bit AdamWs (torchao) quantize a state tensor on every rank or on none, so a
checkpoint stores each state one way (see :mod:`shardtune.state_dict.quantized`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

from shardtune.state_dict import comm
from shardtune.state_dict.layout import layout_of, local_tensor

OPTIMIZERS = ("adamw", "adamw_fused", "adamw8bit", "adamw4bit", "sgd")
SCHEDULES = ("cosine", "linear", "constant")
_MIN_QUANTIZED = 4096  # torchao (after bitsandbytes) keeps smaller tensors' state in full precision


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    *,
    name: str = "adamw",
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    momentum: float = 0.0,
    eps: float = 1e-8,
) -> torch.optim.Optimizer:
    """The ``name`` optimizer (one of :data:`OPTIMIZERS`) over the trainable ``params`` (frozen ones are left out).

    ``adamw_fused`` is ``torch.optim.AdamW(fused=True)`` (CUDA, and CPU in recent torch);
    ``adamw8bit``/``adamw4bit`` are torchao's block-wise quantized AdamW (state in 8 or 4 bits).
    """
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("no trainable parameters: check the LoRA target_modules or which params are frozen")
    adam = {"lr": lr, "weight_decay": weight_decay, "betas": tuple(betas), "eps": eps}
    if name == "adamw":
        return torch.optim.AdamW(trainable, **adam)
    if name == "adamw_fused":
        try:
            return torch.optim.AdamW(trainable, **adam, fused=True)
        except RuntimeError as exc:
            raise ValueError(
                f"optimizer.name=adamw_fused: this torch has no fused AdamW for these params ({exc}); "
                "set optimizer.name=adamw"
            ) from None
    if name in ("adamw8bit", "adamw4bit"):
        return _low_bit_adamw(name)(trainable, **adam)
    if name == "sgd":
        return torch.optim.SGD(trainable, lr=lr, weight_decay=weight_decay, momentum=momentum)
    raise ValueError(f"optimizer.name={name!r} is not supported; choose one of {OPTIMIZERS}")


def _low_bit_adamw(name: str) -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit/AdamW4bit, deciding per tensor (not per rank) whether its state is quantized."""
    from torchao.optim import AdamW4bit, AdamW8bit

    base = AdamW8bit if name == "adamw8bit" else AdamW4bit

    class LowBitAdamW(base):
        """torchao quantizes a state when this rank's shard has >= 4096 values in whole blocks,
        so ranks of one uneven param could differ; here every rank with a non-empty shard
        quantizes when all of them qualify (empty shards stay plain)."""

        def _new_buffer(self, p: torch.Tensor, signed: bool):
            pieces = layout_of(p, comm.world_size()).pieces or (None,)
            sizes = [p.numel()] if pieces == (None,) else [piece.numel for piece in pieces if piece.numel]
            if all(n >= _MIN_QUANTIZED and n % self.block_size == 0 for n in sizes):
                return super()._new_buffer(p, signed)  # every non-empty shard qualifies in torchao too
            out = torch.zeros_like(local_tensor(p))
            if isinstance(p, DTensor):
                out = DTensor.from_local(
                    out, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
                )
            return out

    LowBitAdamW.__name__ = LowBitAdamW.__qualname__ = base.__name__
    return LowBitAdamW


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    name: str = "cosine",
    warmup_steps: int = 0,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """Linear warmup for ``warmup_steps``, then cosine / linear decay to ``min_lr_ratio`` or constant.

    A ``LambdaLR``: its ``state_dict`` (the step count) is all a resume needs.
    """
    if name not in SCHEDULES:
        raise ValueError(f"lr_scheduler.name={name!r} is not supported; choose one of {SCHEDULES}")
    total_steps = max(total_steps, 1)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if name == "constant":
            return 1.0
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        decay = 0.5 * (1.0 + math.cos(math.pi * progress)) if name == "cosine" else 1.0 - progress
        return min_lr_ratio + (1.0 - min_lr_ratio) * decay

    return LambdaLR(optimizer, factor)
