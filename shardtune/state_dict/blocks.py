"""A rank's block of a full tensor: read from a value it holds, or sent to it by rank 0.

A value is a tensor, an NF4 tensor, or a lazy slice (e.g. of a safetensors file). Reading
copies once, into the caller's tensor when given. Rank 0's sends move only each rank's
block, in batched exchanges (:func:`comm.exchange`); it reads and stages the next batch while
the last one is in flight, so it holds at most two batches of staged blocks. A plain tensor,
needed whole everywhere, is broadcast.

An NF4 parameter's block is whole rows of ONE quantization of the full tensor: cut from an
NF4 value, quantized per shard from a plain one (only the mean of the block scalers is
shared), or quantized once by rank 0 and sent packed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from shardtune.ranks import comm
from shardtune.state_dict import nf4
from shardtune.state_dict.layout import Piece, TensorLayout

if TYPE_CHECKING:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor


def read_block(value: Any, slices: tuple[slice, ...]) -> torch.Tensor:
    """The block ``slices`` of a full value (tensor, NF4 tensor or experts, or lazy slice object)."""
    if nf4.is_quantized(value):
        value = nf4.dequantize(value)
    if not slices:  # 0-dim
        return value if isinstance(value, torch.Tensor) else value[...]
    return value[slices]


def fill_block(value: Any, slices: tuple[slice, ...], out: torch.Tensor) -> torch.Tensor:
    """Write the block ``slices`` of ``value`` into ``out`` (its shape) and return ``out``.

    A lazy value offering ``read_block_into(slices, out) -> bool`` (a file-backed slice) reads
    straight into ``out`` when it can; anything else is read, then copied (and cast) once.
    """
    # getattr, not isinstance(value, lazy.BlockReader): a runtime Protocol check costs more than a small
    # read, and a load of per-expert files makes one per file tensor
    read_into = None if isinstance(value, torch.Tensor) else getattr(value, "read_block_into", None)
    if read_into is None or not read_into(slices, out):
        out.copy_(read_block(value, slices))
    return out


def copy_block(
    value: Any,
    block: tuple[tuple[int, ...], tuple[slice, ...]],
    *,
    dtype: torch.dtype,
    device: torch.device,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """``value``'s block as a contiguous tensor on ``device`` in ``dtype`` (one copy), written
    into ``into`` (of the block's shape) when given, else into new memory."""
    shape, slices = block
    if into is not None:
        return fill_block(value, slices, into)
    data = read_block(value, slices)
    if _is_fresh(value, data, dtype=dtype, device=device):
        return data  # a lazy read returned new memory nobody else holds: adopt it, no second copy
    return torch.empty(shape, dtype=dtype, device=device).copy_(data)


def _is_fresh(value: Any, data: torch.Tensor, *, dtype: torch.dtype, device: torch.device) -> bool:
    """True when ``data`` came from a lazy (file-backed) value, already in the wanted dtype, device and layout."""
    return (
        not isinstance(value, torch.Tensor)
        and data.dtype == dtype
        and data.device == device
        and data.is_contiguous()
        and data.storage_offset() == 0
        and data.untyped_storage().nbytes() == data.nbytes  # not a view of a bigger read
    )


class SendBuffer:
    """Rank 0's reusable staging memory for the outgoing blocks that need a copy (a cast, a
    strided view, a lazy read, a host-to-device move), in two halves that take turns: while the
    batch staged in one half is in flight (:meth:`send`), the next batch is read and staged in
    the other. Each half holds one batch (at most :data:`comm.BATCH_BYTES`, or one block that
    alone is larger), so the buffer never holds more than two batches; its pages are faulted in
    once."""

    _ALIGN = 64

    def __init__(self) -> None:
        self._halves: list[torch.Tensor | None] = [None, None]
        self._senders: list[comm.InFlight | None] = [None, None]  # the exchange reading each half
        self._turn = 1
        self._used = 0

    @property
    def nbytes(self) -> int:
        """Bytes of staging memory held (both halves)."""
        return sum(half.numel() for half in self._halves if half is not None)

    def reserve(self, sizes: list[int], device: torch.device) -> None:
        """Make room for one batch's blocks of ``sizes`` bytes on ``device`` in the half the last
        batch did not use, once the exchange sending from that half is done; blocks taken from
        it before are given up."""
        self._turn ^= 1
        sender, self._senders[self._turn] = self._senders[self._turn], None
        if sender is not None:
            sender.wait()
        nbytes = sum(self._aligned(n) for n in sizes)
        half = self._halves[self._turn]
        if nbytes and (half is None or half.numel() < nbytes or half.device != device):
            self._halves[self._turn] = None  # free the smaller one first
            self._halves[self._turn] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._used = 0

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next block of the reserved room, as a tensor of ``shape`` and ``dtype``."""
        half = self._halves[self._turn]
        if half is None:
            raise RuntimeError("SendBuffer.take: call reserve() with the batch's block sizes first")
        nbytes = math.prod(shape) * dtype.itemsize
        start, self._used = self._used, self._used + self._aligned(nbytes)
        return half[start : start + nbytes].view(dtype).view(shape)

    def send(
        self,
        outgoing: list[tuple[Any, Piece, str]],
        dsts: list[int],
        *,
        dtype: torch.dtype,
        device: torch.device,
        on_error: comm.Problems,
    ) -> None:
        """Rank 0's side of one exchange batch: the blocks of ``outgoing`` (as :meth:`blocks`) are
        staged while the batch before is still in flight, then block i starts towards rank
        ``dsts[i]`` (:func:`comm.start_exchange`, which first waits for the batch before).
        Returns while the bytes move: the caller may read its next blocks meanwhile; comm's next
        collective waits for them."""
        sent = self.blocks(outgoing, dtype=dtype, device=device, on_error=on_error)
        self._senders[self._turn] = comm.start_exchange(list(zip(sent, dsts)), [])

    def blocks(
        self,
        outgoing: list[tuple[Any, Piece, str]],
        *,
        dtype: torch.dtype,
        device: torch.device,
        on_error: comm.Problems,
    ) -> list[torch.Tensor]:
        """One exchange batch's blocks to send, for ``(value, piece, key)`` each, in order: a view of
        an in-memory value that already is contiguous in ``dtype`` on the transfer ``device``, else
        a copy staged in the next half (see :meth:`reserve`). A block that cannot be read is sent
        as zeros, since its rank still waits for the bytes; the error goes in ``on_error`` under
        its key, to be raised on every rank at the end."""
        views = [_view_to_send(value, piece, dtype, device) for value, piece, _ in outgoing]
        self.reserve([piece.numel * dtype.itemsize for (_, piece, _), v in zip(outgoing, views) if v is None], device)
        sent = []
        for (value, piece, key), view in zip(outgoing, views):
            sent.append(view if view is not None else self._staged(value, piece, dtype, on_error, key))
        return sent

    def _staged(self, value: Any, piece: Piece, dtype: torch.dtype, on_error: comm.Problems, key: str) -> torch.Tensor:
        """``piece`` of ``value`` copied into the next reserved room; zeros when it cannot be read."""
        block = self.take(piece.shape, dtype)
        failures = len(on_error)
        with on_error.guard(key):
            fill_block(value, piece.slices, block)
        if len(on_error) > failures:
            block.zero_()
        return block

    @classmethod
    def _aligned(cls, nbytes: int) -> int:
        return -(-nbytes // cls._ALIGN) * cls._ALIGN


def scatter_dense(
    layout: TensorLayout,
    value: Any,
    *,
    dtype: torch.dtype,
    device: torch.device,
    transfer_device: torch.device,
    on_error: comm.Problems,
    key: str,
    into: torch.Tensor | None = None,
    send_buffer: SendBuffer | None = None,
) -> torch.Tensor | None:
    """Collective: call on all ranks. Rank 0 holds ``value``; returns this rank's block of it on
    ``device`` (None on rank 0 when its own block could not be read; the error is in ``on_error``).

    Sharded tensors go in batched point-to-point exchanges (:func:`comm.exchange`, in
    :func:`comm.batches`): rank 0 sends every other rank only its block, staging each batch in
    ``send_buffer`` while the one before is in flight, and takes its own while the last one is
    (still in flight on return; comm's next collective waits for it); each other rank receives
    once and waits for its bytes. Plain tensors, needed whole on every rank, are broadcast. ``into``
    (this rank's block shape, ``dtype``, ``device``) receives the data in place when it is on
    the transfer device.
    """
    if layout.pieces is None:
        buf = _receive_buffer(into, layout.shape, dtype, transfer_device)
        if comm.rank() == 0:
            with on_error.guard(key):
                fill_block(value, tuple(slice(None) for _ in layout.shape), buf)
        comm.broadcast_from_rank0(buf)
        return _deliver(buf, into, device)
    mine = layout.pieces[comm.rank()]
    itemsize = dtype.itemsize
    others = {r: p.numel * itemsize for r, p in enumerate(layout.pieces) if r and p.numel}
    if comm.rank() != 0:
        buf = _receive_buffer(into, mine.shape, dtype, transfer_device)
        if mine.numel:
            comm.exchange([], [(buf, 0)])
        return _deliver(buf, into, device)
    send_buffer = send_buffer if send_buffer is not None else SendBuffer()
    for batch in comm.batches(others):
        outgoing = [(value, layout.pieces[r], key) for r in batch]
        send_buffer.send(outgoing, batch, dtype=dtype, device=transfer_device, on_error=on_error)
    own = None
    with on_error.guard(key):  # read while the last batch is in flight
        own = copy_block(value, (mine.shape, mine.slices), dtype=dtype, device=device, into=into)
    return own


def _view_to_send(value: Any, piece: Piece, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """``piece`` of an in-memory ``value`` when it already is a contiguous tensor in ``dtype`` on
    the transfer ``device`` (sent without a copy); None when it must be staged."""
    if isinstance(value, torch.Tensor) and not nf4.is_quantized(value):
        view = value[piece.slices]
        if view.is_contiguous() and view.dtype == dtype and comm.on_transfer_device(view, device):
            return view
    return None


def _receive_buffer(
    into: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, transfer_device: torch.device
) -> torch.Tensor:
    """``into`` when the collective can write straight into it, else new memory on ``transfer_device``."""
    if into is not None and comm.on_transfer_device(into, transfer_device):
        return into
    return torch.empty(shape, dtype=dtype, device=transfer_device)


def _deliver(received: torch.Tensor, into: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The received block, copied into ``into`` when given (unless it already is ``into``)."""
    if into is None:
        return received.to(device)
    return into if received is into else into.copy_(received)


def slice_nf4(
    layout: TensorLayout,
    value: Any,
    *,
    like: NF4Tensor,
    device: torch.device,
    transfer_device: torch.device,
    on_error: comm.Problems,
    key: str,
) -> NF4Tensor | None:
    """Collective: call on all ranks, each holding the full ``value``. Returns this rank's NF4
    block with ``like``'s dtype and block sizes on ``device`` (None when it could not be made;
    the error is in ``on_error``).

    An NF4 value (same block sizes) is cut by rows. A plain value is read and quantized per
    shard: each rank reads only its rows; the one global quantity (the mean of the block
    scalers) comes from a small all-gather of every shard's scalers (1/block_size of the data).
    """
    if nf4.is_nf4(value) and nf4.block_sizes(value) == nf4.block_sizes(like) and value.dtype == like.dtype:
        with on_error.guard(key):
            return nf4.nf4_rows(value.to(device), *_row_blocks(layout)[comm.rank()])
        return None
    if layout.pieces is None:
        with on_error.guard(key):
            return nf4.quantize_like(_whole(value, layout), like, device=device)
        return None
    owners = sorted(layout.owners().items(), key=lambda kv: kv[0].offset)
    numels = [p.numel // like.block_size for p in layout.pieces]
    rows, scalers = None, torch.zeros(numels[comm.rank()], dtype=like.dtype, device=device)
    with on_error.guard(key):
        rows = read_block(value, layout.pieces[comm.rank()].slices).to(device=device, dtype=like.dtype)
        scalers = nf4.block_scalers(rows, like)
    parts = comm.all_gather_varlen(scalers, numels, device=transfer_device)  # collective even after a failed read
    mean = torch.cat([parts[rank] for _, rank in owners]).mean().to(device)
    if rows is None:
        return None
    with on_error.guard(key):
        return nf4.quantize_shard(rows, like, scaler_mean=mean)
    return None


def scatter_nf4(
    layout: TensorLayout,
    value: Any,
    *,
    like: NF4Tensor,
    device: torch.device,
    transfer_device: torch.device,
    on_error: comm.Problems,
    key: str,
) -> NF4Tensor:
    """Collective: call on all ranks; rank 0 holds ``value``. Rank 0 quantizes it once (with
    ``like``'s dtype and block sizes) and sends each rank its packed rows; returns this rank's
    NF4 block on ``device`` (zeros where rank 0 failed; the error is in rank 0's ``on_error``)."""
    blocks = _row_blocks(layout)
    row_numel = like.numel() // like.shape[0] if like.shape[0] else 0
    sizes = [
        nf4.packed_numel(rows * row_numel, like.block_size, like.scaler_block_size, like.dtype) for _, rows in blocks
    ]
    quantized: list[NF4Tensor] = []

    def block_for(r: int) -> torch.Tensor | None:
        with on_error.guard(key):
            if not quantized:
                quantized.append(nf4.quantize_like(_whole(value, layout), like, device=transfer_device))
            packed = torch.empty(sizes[r], dtype=torch.uint8, device=transfer_device)
            nf4.pack(nf4.nf4_rows(quantized[0], *blocks[r]), packed)
            return packed
        return None

    flat = comm.scatter_from_rank0(
        block_for if comm.rank() == 0 else None, sizes, dtype=torch.uint8, device=transfer_device
    )
    _, rows = blocks[comm.rank()]
    return nf4.unpack(flat, (rows, *layout.shape[1:]), like, device=device)


def _row_blocks(layout: TensorLayout) -> list[tuple[int, int]]:
    """(first row, row count) of every rank's NF4 block; a plain param is whole on every rank."""
    if layout.pieces is None:
        return [(0, layout.shape[0])] * comm.world_size()
    return [(p.offset[0], p.shape[0]) for p in layout.pieces]


def _whole(value: Any, layout: TensorLayout) -> Any:
    """The full value: an NF4 tensor as it is, anything else read (a lazy value loaded) whole."""
    return value if nf4.is_nf4(value) else read_block(value, tuple(slice(None) for _ in layout.shape))
