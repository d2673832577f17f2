"""A started run: this process's rank, world size, device and dtype, and where the run writes.

Rule: :func:`shardtune.recipes.builders.start` makes the one ``Run`` of a process; every builder
and the resume checks (``_resume.py``) read it and never change it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

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
    context: dist.ProcessGroup | None = None  # the ranks that share this rank's rows (``context_parallel`` > 1)

    @property
    def data_rank(self) -> int:
        """This rank's index among the ranks that read different data (the ranks of a ``cp`` group share it)."""
        return self.rank // self.context_parallel

    @property
    def data_world(self) -> int:
        """How many ranks read different data: the world size over ``context_parallel``."""
        return self.world_size // self.context_parallel

    @property
    def context_parallel(self) -> int:
        return 1 if self.context is None else self.context.size()

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0
