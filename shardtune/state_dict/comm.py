"""Collectives used by the state-dict functions, with exact byte accounting.

Every function here is collective over the default process group unless it says it is
point-to-point. All ranks must call them in the same order with matching arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardtune.state_dict.keys import StateDictError, format_problems


@dataclass
class TransferStats:
    """Bytes this process sent and received through the state-dict functions' collectives."""

    bytes_sent: int = 0
    bytes_received: int = 0

    def reset(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0


stats = TransferStats()


class Problems(list):
    """Problems met while data moves. Collectives go on after one, so no rank is left
    waiting; :func:`raise_on_every_rank` reports them all at the end."""

    @contextmanager
    def guard(self, key: str):
        try:
            yield
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank by raise_on_every_rank
            self.append(f"{key}: {type(exc).__name__}: {exc}")


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def comm_device(device: torch.device | str | None) -> torch.device:
    """Device that tensors must be on for this process group's backend.

    gloo moves CPU tensors; NCCL-like backends need accelerator tensors, on ``device`` when
    given (CPU-offloaded shards are moved there for the collective) or the current accelerator.
    """
    if not dist.is_initialized() or dist.get_backend() == "gloo":
        return torch.device("cpu")
    if device is not None and torch.device(device).type != "cpu":
        return torch.device(device)
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return torch.device("cpu")
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def all_gather_objects(obj: object) -> list[object]:
    """Collective: call on all ranks. Returns every rank's ``obj``, indexed by rank."""
    if world_size() == 1:
        return [obj]
    gathered: list[object] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def raise_on_every_rank(local_problems: list[str], *, header: str, error: type[Exception] = StateDictError) -> None:
    """Collective: call on all ranks. Raises the same ``error`` on every rank if any rank has problems.

    Each rank passes what it found wrong locally; problems reported by several ranks are
    listed once with the ranks that saw them, so every rank raises an identical message.
    Returns normally on every rank when no rank reported anything.
    """
    per_rank = all_gather_objects(list(local_problems))
    seen: dict[str, list[int]] = {}
    for r, problems in enumerate(per_rank):
        for problem in problems:
            seen.setdefault(problem, []).append(r)
    if not seen:
        return
    world = world_size()
    lines = [
        problem if len(ranks) == world else f"[rank {', '.join(map(str, ranks))}] {problem}"
        for problem, ranks in seen.items()
    ]
    raise error(format_problems(header, lines))


def scatter_from_rank0(
    block_for: Callable[[int], torch.Tensor | None] | None,
    numels: list[int],
    *,
    dtype: torch.dtype,
    device: torch.device,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """Collective: call on all ranks. Rank 0 sends each rank r its own block.

    ``numels[r]`` is rank r's block size (known to every rank). On rank 0, ``block_for(r)``
    returns rank r's block (any shape/dtype/device; None if it could not be produced, which
    sends zeros so the collective still completes); other ranks pass None. Blocks are padded
    to the longest so one ``scatter`` moves them and each rank receives only its own bytes.
    Returns this rank's block, flat: written into ``into`` (a contiguous tensor of this rank's
    size, dtype and device) when given, so no new memory is needed, else in new memory.
    """
    me = rank()
    longest = max(numels)
    direct = into is not None and into.numel() == longest and into.dtype == dtype and into.device == device
    out = into.view(-1) if direct else torch.empty(longest, dtype=dtype, device=device)
    scatter_list = None
    if me == 0:
        # Views of the caller's blocks where they fit: the scatter itself copies rank 0's own
        # block into ``out``, so each byte is copied once.
        scatter_list = [_flat_padded(block_for(r), longest, dtype, device) for r in range(len(numels))]
        stats.bytes_sent += longest * out.element_size() * (len(numels) - 1)
    else:
        stats.bytes_received += longest * out.element_size()
    dist.scatter(out, scatter_list, src=0)
    if into is not None and not direct:
        into.view(-1).copy_(out[: numels[me]])
        return into.view(-1)
    return out[: numels[me]]


def _flat_padded(block: torch.Tensor | None, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``block`` flattened to ``length`` elements; a view (no copy) when it already fits."""
    if (
        block is not None
        and block.numel() == length
        and block.is_contiguous()
        and block.dtype == dtype
        and block.device == device
    ):
        return block.view(-1)
    buf = torch.empty(length, dtype=dtype, device=device)
    _copy_into(block, buf)
    return buf


def _copy_into(block: torch.Tensor | None, flat: torch.Tensor) -> None:
    if block is None:
        flat.zero_()
    else:
        flat[: block.numel()].view(block.shape).copy_(block)


def all_gather_varlen(local: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
    """Collective: call on all ranks. Every rank's flat ``local`` (rank r has ``numels[r]``
    elements), padded to the longest for one ``all_gather``; returned unpadded, by rank."""
    longest = max(numels)
    padded = torch.zeros(longest, dtype=local.dtype, device=local.device)
    padded[: local.numel()] = local.flatten()
    gathered = [torch.empty_like(padded) for _ in numels]
    dist.all_gather(gathered, padded)
    stats.bytes_sent += longest * padded.element_size() * (len(numels) - 1)
    stats.bytes_received += longest * padded.element_size() * (len(numels) - 1)
    return [g[:n] for g, n in zip(gathered, numels)]


def broadcast_from_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """Collective: call on all ranks. Rank 0's ``tensor`` is copied into every rank's ``tensor``."""
    nbytes = tensor.numel() * tensor.element_size()
    dist.broadcast(tensor, src=0)
    if rank() == 0:
        stats.bytes_sent += nbytes * (world_size() - 1)
    else:
        stats.bytes_received += nbytes
    return tensor


def send(tensor: torch.Tensor, dst: int) -> dist.Work:
    """Point-to-point: starts sending a contiguous ``tensor`` to rank ``dst``."""
    stats.bytes_sent += tensor.numel() * tensor.element_size()
    return dist.isend(tensor, dst)


def recv(tensor: torch.Tensor, src: int) -> dist.Work:
    """Point-to-point: starts receiving into the contiguous ``tensor`` from rank ``src``."""
    stats.bytes_received += tensor.numel() * tensor.element_size()
    return dist.irecv(tensor, src)


def normalize_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a ``torch.device``; ``"cuda"`` without an index means the current CUDA device
    (``torch.device("cuda") != torch.device("cuda", k)``, so an unnormalized one defeats every
    device comparison). None stays None."""
    if device is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
