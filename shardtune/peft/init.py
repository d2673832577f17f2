"""Adapter initialization that does not depend on how the factors are sharded.

Rule: a random factor is drawn whole, on the CPU from torch's default generator, and each rank
keeps its own piece of it. With the same seed, a fresh adapter is then the same on 1 rank or
64, under FSDP2, HSDP or expert parallelism, on CPU or GPU, and equal to PEFT's unsharded draw
of the same shape (random ops on a DTensor would draw per local shard on a CPU mesh and from the
accelerator's generator elsewhere). Every rank draws the whole factor, so every rank's default
generator advances alike. Adapter factors are small (``r x in``, ``E·r x in`` for experts), so
the whole draw costs little memory once per run.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor


def kaiming_uniform_whole_(weight: Tensor) -> None:
    """PEFT's ``lora_A`` init (Kaiming-uniform, ``a = sqrt(5)``) of the whole ``weight``, drawn on
    the CPU; a DTensor keeps its local piece (cut locally: no communication)."""
    whole = torch.empty(weight.shape, dtype=weight.dtype, device="cpu")
    nn.init.kaiming_uniform_(whole, a=math.sqrt(5))
    with torch.no_grad():
        if isinstance(weight, DTensor):
            piece = distribute_tensor(whole, weight.device_mesh, weight.placements, src_data_rank=None)
            weight.to_local().copy_(piece.to_local())
        else:
            weight.copy_(whole)
