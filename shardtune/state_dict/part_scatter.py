"""Rank 0 sends every rank its blocks of all the file tensors (parts) of one model tensor.

Rule: a tensor stored as many file tensors (``E x 2`` per-expert weights of one stacked
``gate_up_proj``) costs as many exchanges as its bytes need, never one per file tensor.
Every rank knows every rank's block of every part (:func:`~shardtune.state_dict.parts.part_piece`):
a rank's blocks of all the parts travel in one exchange, split only where they pass
:data:`comm.BATCH_BYTES`, with several ranks per exchange of rank 0 (:func:`comm.batches`),
in part order on both sides. A receiver takes each block straight into its place in its
local tensor where that place is contiguous on the transfer device, the rest into one buffer
copied after. Rank 0 stages each batch while the one before is in flight and reads its own
blocks while the last one is, so it holds at most two batches (its
:class:`~shardtune.state_dict.blocks.SendBuffer`); a part it cannot read is sent as zeros and
its error kept under the part's name, to be raised on every rank at the end.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from shardtune.ranks import comm
from shardtune.state_dict.blocks import SendBuffer, fill_block
from shardtune.state_dict.layout import Piece, TensorLayout
from shardtune.state_dict.parts import Part, part_piece

# One part's block for one rank: the part's index, the block (file tensor coordinates), and
# the slices of the rank's local tensor it fills.
Block = tuple[int, Piece, tuple[slice, ...]]


def scatter_parts(
    parts: tuple[Part, ...],
    layout: TensorLayout,
    files: Mapping[str, Any],
    *,
    local: torch.Tensor,
    transfer_device: torch.device,
    on_error: comm.Problems,
    send_buffer: SendBuffer,
) -> None:
    """Collective: call on all ranks. Rank 0 holds ``files`` (file tensor name -> value; the
    others pass an empty mapping); every rank's block of each of ``parts`` is written into that
    rank's ``local`` tensor (its piece of ``layout``, contiguous, in the tensor's dtype).
    Returns None on every rank. A part rank 0 could not read arrives as zeros (rank 0's own
    block of it is left as it was); the error is in rank 0's ``on_error``."""
    itemsize = local.dtype.itemsize
    if comm.rank() != 0:
        for run in _runs(parts, layout.piece(comm.rank()), itemsize):
            _receive(run, local, transfer_device)
        return
    runs = {
        (r, j): run
        for r in range(1, comm.world_size())
        for j, run in enumerate(_runs(parts, layout.piece(r), itemsize))
    }
    sizes = {unit: sum(piece.numel for _, piece, _ in run) * itemsize for unit, run in runs.items()}
    for batch in comm.batches(sizes):
        to = [(r, i, piece) for r, j in batch for i, piece, _ in runs[(r, j)]]
        outgoing = [(files.get(parts[i].name), piece, parts[i].name) for _, i, piece in to]
        dsts = [r for r, _, _ in to]
        send_buffer.send(outgoing, dsts, dtype=local.dtype, device=transfer_device, on_error=on_error)
    for i, piece, slices in _blocks(parts, layout.piece(0)):  # read while the last batch is in flight
        with on_error.guard(parts[i].name):
            fill_block(files.get(parts[i].name), piece.slices, local[slices].squeeze(parts[i].squeeze))


def _blocks(parts: tuple[Part, ...], piece: Piece) -> list[Block]:
    """The blocks of ``parts`` that meet a rank's ``piece``, in part order."""
    blocks = []
    for i, part in enumerate(parts):
        met = part_piece(part, piece)
        if met is not None:
            blocks.append((i, *met))
    return blocks


def _runs(parts: tuple[Part, ...], piece: Piece, itemsize: int) -> list[list[Block]]:
    """A rank's blocks of ``parts`` in consecutive runs of at most :data:`comm.BATCH_BYTES` (a
    larger block alone): one exchange each. Two runs of one rank never share a batch of rank
    0's (each run stopped because the next block did not fit), so both sides agree on it."""
    blocks = _blocks(parts, piece)
    runs = comm.batches({j: block[1].numel * itemsize for j, block in enumerate(blocks)})
    return [[blocks[j] for j in run] for run in runs]


def _receive(run: list[Block], local: torch.Tensor, transfer_device: torch.device) -> None:
    """A non-zero rank's side of one exchange: ``run``'s blocks into their places in ``local``."""
    places = [local[slices] for _, _, slices in run]
    direct = [place.is_contiguous() and comm.on_transfer_device(place, transfer_device) for place in places]
    staged = sum(place.numel() for place, ok in zip(places, direct) if not ok)
    buffer = torch.empty(staged, dtype=local.dtype, device=transfer_device)  # one for the places not direct
    recvs, copies, offset = [], [], 0
    for place, ok in zip(places, direct):
        target = place
        if not ok:
            n = math.prod(place.shape)
            target = buffer[offset : offset + n].view(place.shape)
            offset += n
            copies.append((place, target))
        recvs.append((target, 0))
    comm.exchange([], recvs)
    for place, target in copies:
        place.copy_(target)
