"""This rank's process: the default process group from the launcher's environment, its device, its end.

Rule: every rank starts and ends the same way. :func:`init_distributed` runs the launch checks
(:mod:`shardtune.ranks.launch_checks`) before the process group exists, so a launch that would
hang is refused on every rank alike; :func:`end_process` is the last call of an entry point.
"""

from __future__ import annotations

import logging
import os
import sys
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from shardtune.ranks.launch_checks import check_launch

log = logging.getLogger(__name__)


def end_process(code: int) -> NoReturn:
    """Flush output and logs, then end this rank's process without interpreter finalization.

    For the last call of a distributed entry point, after ``destroy_process_group``. gloo's
    worker threads may still be releasing the tensors of the last collective when the
    interpreter finalizes; taking the GIL then aborts the process (SIGABRT, "terminate called
    without an active exception", about 1 run in 20 here; pytorch/pytorch#179291), turning a
    finished run into a failed one. Nothing is left to clean up at this point.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def device_type() -> str:
    """The accelerator type when one is present, else ``cpu``."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


def init_distributed(*, backend: str | None = None, timeout_s: float = 600.0) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; returns (rank, world size).

    Without torchrun's variables, a single-process group is created so recipes also run with
    plain ``python`` (but not under ``srun``/``mpirun`` with several tasks: see
    :mod:`shardtune.ranks.launch_checks`, whose checks run first on every rank). ``timeout_s``
    bounds every collective: a dead rank surfaces as an error on the others after that long
    instead of a hang. On CUDA the group is bound to ``LOCAL_RANK``'s GPU (``device_id``), so
    NCCL's communicator is created at once and every collective and batched point-to-point
    transfer shares it.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    kind = device_type()
    if backend is None:
        backend = "gloo" if kind == "cpu" else "cpu:gloo,cuda:nccl" if kind == "cuda" else None
    for warning in check_launch(os.environ, backend=backend):
        log.warning(warning)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    device_id = None
    if kind != "cpu":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.accelerator.set_device_index(local_rank)
        device_id = torch.device(kind, local_rank) if kind == "cuda" else None
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=timeout_s), device_id=device_id)
    return dist.get_rank(), dist.get_world_size()
