"""A started run: this process's rank, world size, device and dtype, and where the run writes.

Rule: :func:`start` makes the one ``Run`` of a process (process group, logging, seeds, the checks
only the launched job can make, the claimed output directory); every builder and the resume checks
(``_resume.py``) read it and never change it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from shardtune.checkpoint import OutputDirError
from shardtune.checkpoint.safety import run_dir
from shardtune.checkpoint.safety.shared_dir import check_shared_output_dir
from shardtune.config import Config
from shardtune.models.context_parallel import context_group
from shardtune.ranks import comm
from shardtune.ranks.comm import agree, normalize_device
from shardtune.ranks.process import device_type, init_distributed

__all__ = ["Run", "claim_output_dir", "start"]

log = logging.getLogger("shardtune")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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


def start(cfg: Config) -> Run:
    """Process group (with the configured collective timeout), logging and seeds.

    Collective: call on all ranks with the same config; each returns its own ``Run`` (or every
    rank raises the same error: a config that differs between ranks, an output_dir it cannot claim)."""
    rank, world = init_distributed(timeout_s=cfg.process_group_timeout_s)
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )
    _agree_on_config(cfg)
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    device = normalize_device(device_type())  # the GPU init_distributed selected, with its index
    _check_parallelism(cfg, device=device, world=world)
    dtype = torch.float32 if cfg.mixed_precision else DTYPES[cfg.dtype]  # params, grads, optimizer state
    output_dir, lock = claim_output_dir(cfg, rank=rank)
    if cfg.shared_filesystem and world > 1:
        check_shared_output_dir(output_dir, rank=rank)
    cp = getattr(cfg, "context_parallel", 1)  # a key of every recipe but early exit (which refuses > 1)
    context = context_group(cp, device=device.type) if cp > 1 else None
    return Run(
        rank=rank, world_size=world, device=device, dtype=dtype, output_dir=output_dir, lock=lock, context=context
    )


def claim_output_dir(cfg: Config, *, rank: int) -> tuple[Path, run_dir.OutputDirLock | None]:
    """Collective: rank 0 locks ``output_dir`` and places this run (``output_dir_policy``); every
    rank gets where the run writes, or raises the same :class:`~shardtune.checkpoint.errors.OutputDirError`."""
    root, problems, lock, placed = Path(cfg.output_dir), comm.Problems(), None, None
    if rank == 0:
        try:
            lock = run_dir.OutputDirLock.acquire(root)
            resuming = bool(cfg.resume_from_checkpoint) and run_dir.has_resumable(root)
            placed = str(run_dir.place_run(root, policy=cfg.output_dir_policy, resuming=resuming))
        except (OutputDirError, OSError, ValueError) as exc:
            problems.append(str(exc) if isinstance(exc, OutputDirError) else f"{root}: {exc}")
            if lock is not None:
                lock.release()
                lock = None
    comm.raise_on_every_rank(problems, header="Cannot start the run:", error=OutputDirError)
    shared = comm.all_gather_objects(placed)[0]
    assert shared is not None  # rank 0 placed the run, or every rank raised above
    placed_dir = Path(shared)
    if rank == 0 and placed_dir != root:
        log.info(
            "output_dir_policy=%s: %s holds another run's outputs; this run writes to %s",
            cfg.output_dir_policy,
            root,
            placed_dir,
        )
    return placed_dir, lock


def _check_parallelism(cfg: Config, *, device: torch.device, world: int) -> None:
    """What only the launched job can check (the same on every rank, so every rank raises it)."""
    if cfg.fsdp_cpu_offload and device.type == "cpu":
        raise ValueError(
            "fsdp_cpu_offload: true needs a GPU (FSDP2 offloads from an accelerator); on a CPU-only machine the "
            "params already live in CPU memory: set fsdp_cpu_offload=false"
        )
    if cfg.enable_activation_offloading and device.type == "cpu":
        raise ValueError(
            "enable_activation_offloading: true moves activations from a GPU to CPU memory, but this run is on "
            "CPU, where they already are: set enable_activation_offloading=false"
        )
    if world % cfg.data_parallel_replicate:
        raise ValueError(
            f"data_parallel_replicate={cfg.data_parallel_replicate} does not divide the world size {world}; "
            "set it to a divisor (e.g. the number of nodes) or 1"
        )
    cp = getattr(cfg, "context_parallel", 1)
    if world % cp:
        raise ValueError(
            f"context_parallel={cp} does not divide the world size {world}; set it to a divisor of {world}"
        )


def _agree_on_config(cfg: Config) -> None:
    """Collective: every rank must run the same config (a node with other files or overrides
    would otherwise fail much later with a cryptic shape error or a hang)."""
    digest = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True, default=str).encode()).hexdigest()
    agree(
        digest,
        what="the config differs between ranks",
        fix="give every node the same config file and overrides",
        header="Cannot start the run:",
        error=ValueError,
    )
