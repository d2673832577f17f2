"""A started run: this process's rank, world size, device and dtype, and where the run writes.

Rule: :func:`shardtune.recipes.builders.start` makes the one ``Run`` of a process; every builder
and the resume checks (``_resume.py``) read it and never change it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from shardtune.checkpoint import run_dir

__all__ = ["Run"]


@dataclass
class Run:
    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype
    output_dir: Path | None = None  # where this run writes (``output_dir``, or a new run directory below it)
    lock: run_dir.OutputDirLock | None = None  # rank 0's lock on ``output_dir``, held until ``builders.finish``

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0
