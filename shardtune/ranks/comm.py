"""What every rank shares: the collectives, with exact byte accounting, and the cross-rank error contract.

Used by every layer that communicates (the state-dict core, checkpoints, training, recipes).
Every function here is collective over the default process group. All ranks must call them
in the same order with matching arguments. NCCL's rules hold for every call, so a process
group created with NCCL alone works: tensors handed to a collective are on the transfer
device (:func:`comm_device`; :func:`to_transfer` is the one way there), with a dtype NCCL
knows (others travel as raw bytes), and point-to-point traffic goes through
``batch_isend_irecv`` (:func:`exchange`), which reuses the group's communicator rather than
building one per pair of ranks.

At most one exchange per process is in flight: :func:`start_exchange` returns while its bytes
move (so rank 0 can read the next blocks meanwhile) and waits first for the one started
before it; every other collective here, and :func:`settle`, waits for it too. So every rank
still issues the same collectives in the same order, and none queues a second batch behind
one that has not arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from shardtune.ranks.errors import StateDictError, format_problems


@dataclass
class TransferStats:
    """Bytes this process sent and received through these collectives, and
    read from checkpoint files (``bytes_read``: safetensors reads of :mod:`shardtune.checkpoint`)."""

    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_read: int = 0

    def reset(self) -> None:
        self.bytes_sent = 0
        self.bytes_received = 0
        self.bytes_read = 0


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


@overload
def normalize_device(device: torch.device | str) -> torch.device: ...
@overload
def normalize_device(device: None) -> None: ...
def normalize_device(device: torch.device | str | None) -> torch.device | None:
    """``device`` as a ``torch.device`` with an index for accelerators: ``"cuda"`` means the
    current CUDA device (``torch.device("cuda") != torch.device("cuda", 0)``, so comparing an
    unindexed device with a tensor's never matches). CPU, meta and None pass through."""
    if device is None:
        return None
    device = torch.device(device)
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    current = getattr(getattr(torch, device.type, None), "current_device", None)
    return device if current is None else torch.device(device.type, current())


def comm_device(device: torch.device | str | None) -> torch.device:
    """Device that tensors must be on for this process group's backend (the transfer device).

    gloo moves CPU tensors; a group with an accelerator backend (NCCL alone, or
    ``"cpu:gloo,cuda:nccl"``) moves accelerator tensors: on ``device`` when it is an
    accelerator (CPU-offloaded shards are copied there for the collective), else on the
    current accelerator.
    """
    if not dist.is_initialized():
        return torch.device("cpu")
    backend = str(dist.get_backend())
    accelerator = torch.accelerator.current_accelerator()
    if backend == "gloo" or accelerator is None or (":" in backend and f"{accelerator.type}:" not in backend):
        return torch.device("cpu")
    device = normalize_device(device)
    if device is not None and device.type != "cpu":
        return device
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


def on_transfer_device(tensor: torch.Tensor, device: torch.device) -> bool:
    """True when a collective may use ``tensor``'s own memory: it lives on the transfer ``device``.

    The one place that decides it (the CPU test harness answers False for memory that is the
    host's on a GPU run, such as CPU-offloaded shards, so the code copies as it would there)."""
    return tensor.device == device


def to_transfer(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` as a contiguous tensor on the transfer ``device``: itself when it already is
    one, else a copy. Every tensor that may live in host memory reaches a collective through here."""
    if on_transfer_device(tensor, device):
        return tensor.contiguous()
    return tensor.to(device=device, memory_format=torch.contiguous_format, copy=True)


def host_empty(shape: tuple[int, ...] | int, *, dtype: torch.dtype) -> torch.Tensor:
    """New CPU memory for results on the host (gathered tensors, write buffers); a collective
    writes into it only when :func:`on_transfer_device` allows."""
    return torch.empty(shape, dtype=dtype, device="cpu")


# What NCCL can reduce or move as typed data; other dtypes travel as their bytes (uint8).
NCCL_DTYPES = frozenset(
    {
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.float8_e4m3fnuz,
        torch.float8_e5m2fnuz,
    }
)


def wire(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (contiguous) or, for a dtype NCCL lacks (uint16/32/64, int16, ...), a flat
    uint8 view of the same memory: moving it moves the same bytes. Not for reductions."""
    if tensor.dtype in NCCL_DTYPES:
        return tensor
    return tensor.reshape(-1).view(torch.uint8)


T = TypeVar("T")


def all_gather_objects(obj: T) -> list[T]:
    """Collective: call on all ranks. Returns every rank's ``obj``, indexed by rank."""
    if world_size() == 1:
        return [obj]
    settle()
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def raise_on_every_rank(local_problems: list[str], *, header: str, error: type[Exception] = StateDictError) -> None:
    """Collective: call on all ranks. Raises the same ``error`` on every rank if any rank has problems.

    Each rank passes what it found wrong locally; problems reported by several ranks are
    listed once with the ranks that saw them, so every rank raises an identical message.
    Returns normally on every rank when no rank reported anything.
    """
    lines = _merge_problems(all_gather_objects(list(local_problems)))
    if lines:
        raise error(format_problems(header, lines))


def agree(
    value: T,
    *,
    what: str,
    fix: str,
    header: str,
    problems: Sequence[str] = (),
    error: type[Exception] = StateDictError,
) -> list[T]:
    """Collective: call on all ranks. Every rank's ``value`` must equal rank 0's.

    One gather carries ``value`` and this rank's ``problems``. When any rank reported a problem
    (listed once with the ranks that saw it, as in :func:`raise_on_every_rank`) or some rank's
    value differs from rank 0's (``"<what>: ranks [..] differ from rank 0; <fix>"``, see
    :func:`disagreement`), every rank raises the same ``error`` under ``header``. Otherwise
    returns every rank's value, indexed by rank, on every rank.
    """
    gathered = all_gather_objects((list(problems), value))
    lines = _merge_problems([p for p, _ in gathered]) + disagreement([v for _, v in gathered], what=what, fix=fix)
    if lines:
        raise error(format_problems(header, lines))
    return [v for _, v in gathered]


def disagreement(values: Sequence[object], *, what: str, fix: str) -> list[str]:
    """The problem line of :func:`agree` for values gathered by rank: none when all equal rank 0's."""
    odd = [r for r, v in enumerate(values) if v != values[0]]
    return [f"{what}: ranks {odd} differ from rank 0; {fix}"] if odd else []


def rank_zero_problems(is_rank_zero: bool) -> list[str]:
    """This rank's problem (for :func:`agree`) when ``is_rank_zero`` is not ``rank() == 0``."""
    if bool(is_rank_zero) == (rank() == 0):
        return []
    return [f"is_rank_zero is {bool(is_rank_zero)}; pass is_rank_zero=(rank == 0)."]


def _merge_problems(per_rank: list[list[str]]) -> list[str]:
    """Each distinct problem once, prefixed with the ranks that saw it unless every rank did."""
    seen: dict[str, list[int]] = {}
    for r, problems in enumerate(per_rank):
        for problem in problems:
            seen.setdefault(problem, []).append(r)
    return [
        problem if len(ranks) == len(per_rank) else f"[rank {', '.join(map(str, ranks))}] {problem}"
        for problem, ranks in seen.items()
    ]


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
    to the longest so one ``scatter`` (on ``device``, the transfer device) moves them and
    each rank receives only its own bytes. Returns this rank's block, flat: written into
    ``into`` (a contiguous tensor of this rank's size, dtype and device) when given, so no
    new memory is needed, else in new memory.
    """
    me = rank()
    longest = max(numels)
    direct = into is not None and into.numel() == longest and into.dtype == dtype and on_transfer_device(into, device)
    out = into.view(-1) if into is not None and direct else torch.empty(longest, dtype=dtype, device=device)
    scatter_list = None
    if me == 0:
        if block_for is None:
            raise ValueError("scatter_from_rank0: rank 0 passes block_for (None is for the other ranks)")
        # Views of the caller's blocks where they fit: the scatter itself copies rank 0's own
        # block into ``out``, so each byte is copied once.
        scatter_list = [wire(_flat_padded(block_for(r), longest, dtype, device)) for r in range(len(numels))]
        stats.bytes_sent += longest * out.element_size() * (len(numels) - 1)
    else:
        stats.bytes_received += longest * out.element_size()
    settle()
    dist.scatter(wire(out), scatter_list, src=0)
    if into is not None and not direct:
        into.view(-1).copy_(out[: numels[me]])
        return into.view(-1)
    return out[: numels[me]]


def _flat_padded(block: torch.Tensor | None, length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``block`` flattened to ``length`` elements on ``device``; a view (no copy) when it already fits."""
    if (
        block is not None
        and block.numel() == length
        and block.is_contiguous()
        and block.dtype == dtype
        and on_transfer_device(block, device)
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


def all_gather_varlen(local: torch.Tensor, numels: list[int], *, device: torch.device) -> list[torch.Tensor]:
    """Collective: call on all ranks. Every rank's flat ``local`` (rank r has ``numels[r]``
    elements, anywhere), padded to the longest for one ``all_gather`` on the transfer
    ``device``; returned unpadded, by rank, on ``device``."""
    longest = max(numels)
    padded = torch.zeros(longest, dtype=local.dtype, device=device)
    padded[: local.numel()] = local.flatten()  # the host-to-device copy, when local is offloaded
    gathered = [torch.empty_like(padded) for _ in numels]
    settle()
    dist.all_gather([wire(g) for g in gathered], wire(padded))
    stats.bytes_sent += longest * padded.element_size() * (len(numels) - 1)
    stats.bytes_received += longest * padded.element_size() * (len(numels) - 1)
    return [g[:n] for g, n in zip(gathered, numels)]


def broadcast_from_rank0(tensor: torch.Tensor) -> torch.Tensor:
    """Collective: call on all ranks. Rank 0's ``tensor`` (contiguous, on the transfer device)
    is copied into every rank's ``tensor``; returns it."""
    nbytes = tensor.nbytes
    settle()
    dist.broadcast(wire(tensor), src=0)
    if rank() == 0:
        stats.bytes_sent += nbytes * (world_size() - 1)
    else:
        stats.bytes_received += nbytes
    return tensor


class InFlight:
    """An exchange :func:`start_exchange` started: its works, and the tensors they read or write
    (kept alive until the bytes have moved)."""

    def __init__(self, works: list[Any], tensors: list[torch.Tensor]) -> None:
        self._works: list[Any] | None = works
        self._tensors = tensors

    def wait(self) -> None:
        """Return once every send and receive of the exchange has completed (at once if it had).
        On an accelerator the host waits too, so no rank queues a second batch behind this one."""
        if self._works is None:
            return
        works, self._works = self._works, None
        tensors, self._tensors = self._tensors, []
        for work in works:
            work.wait()
        if tensors and tensors[0].device.type != "cpu":
            torch.accelerator.current_stream(tensors[0].device).synchronize()


_in_flight: InFlight | None = None


def settle() -> None:
    """Wait for the exchange :func:`start_exchange` left in flight on this process, if any.

    Not a collective: it only waits for this rank's own sends and receives. Every collective of
    this module calls it first; call it before any other collective or before reusing a tensor
    that an exchange may still be sending."""
    global _in_flight
    pending, _in_flight = _in_flight, None
    if pending is not None:
        pending.wait()


def start_exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> InFlight:
    """Batched point-to-point: sends each ``(tensor, dst)`` and receives into each ``(tensor, src)``
    in one ``batch_isend_irecv``, and returns while the bytes move.

    Collective over the ranks named: every rank that appears in another rank's call makes one
    matching call (a send to rank r pairs with r's receive from this rank, in the same order,
    same size). On NCCL the batch runs on the group's own communicator. Tensors are contiguous
    and on the transfer device; they must stay unchanged (sends) or unread (receives) until the
    returned :class:`InFlight` is waited (by this rank's next collective here, or :func:`settle`).
    The exchange started before this one is waited first. Returns the new exchange's handle on
    every rank (one that is already complete where this rank has no ops).
    """
    global _in_flight
    settle()
    ops = [dist.P2POp(dist.isend, wire(t), dst) for t, dst in sends]
    ops += [dist.P2POp(dist.irecv, wire(t), src) for t, src in recvs]
    if not ops:
        return InFlight([], [])
    stats.bytes_sent += sum(t.nbytes for t, _ in sends)
    stats.bytes_received += sum(t.nbytes for t, _ in recvs)
    _in_flight = InFlight(list(dist.batch_isend_irecv(ops)), [op.tensor for op in ops])
    return _in_flight


def exchange(sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]]) -> None:
    """:func:`start_exchange`, then wait for it: collective over the ranks named, with the same
    matching rules. On an accelerator the host waits until the bytes arrived, so a rank never
    queues more than one batch and then idles inside a collective until the timeout while rank 0
    reads a large checkpoint. Returns None on every rank; a rank with no ops returns at once
    (after the exchange it had in flight)."""
    start_exchange(sends, recvs)
    settle()


BATCH_BYTES = 256 << 20  # bytes one exchange batch moves at most (unless one block alone is larger)


K = TypeVar("K")


def batches(nbytes: dict[K, int], *, limit: int | None = None) -> list[list[K]]:
    """The ranks of ``nbytes`` (rank -> bytes it sends or receives; or any other key, e.g. a
    rank's share of one tensor's blocks), in order, split into consecutive batches of at most
    ``limit`` bytes (default :data:`BATCH_BYTES`; a larger block gets a batch of its own).

    Identical on every rank given the same ``nbytes``: rank 0 takes part in every batch, each
    other rank in its own one, so rank 0 holds at most two batches of staged blocks (the one in
    flight and the next, :class:`~shardtune.state_dict.blocks.SendBuffer`)."""
    limit = BATCH_BYTES if limit is None else limit
    groups: list[list[K]] = []
    total = 0
    for r, size in nbytes.items():
        if not groups or total + size > limit:
            groups.append([])
            total = 0
        groups[-1].append(r)
        total += size
    return groups


def full_tensor(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Collective for a DTensor: call on all ranks of its mesh. Returns the whole tensor on the
    transfer ``device`` (a plain tensor is returned as it is).

    ``DTensor.full_tensor()`` would all-gather the local tensor where it lives, in host memory
    for a CPU-offloaded param, which NCCL refuses; the local tensor is copied first."""
    if not isinstance(tensor, DTensor):
        return tensor
    local = to_transfer(tensor._local_tensor, device)
    settle()
    moved = DTensor.from_local(
        local, tensor.device_mesh, tensor.placements, run_check=False, shape=tensor.shape, stride=tensor.stride()
    )
    return moved.full_tensor()
