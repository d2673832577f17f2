"""Full state dict -> sharded model (``load_from_full_model_state_dict``).

Two ways to receive the full state dict, agreed on by all ranks up front
(:mod:`~shardtune.state_dict.agreement`):

* every rank passes a full mapping (possibly lazy, e.g. safetensors slices): each rank reads
  and casts only its own piece; no weights cross the network;
* rank 0 passes it and the others pass ``{}``: rank 0 reads each tensor once and scatters to
  every rank only that rank's piece (NF4 pieces are quantized once and sent packed; NF4
  experts are received plain and quantized by the rank holding them, expert by expert).

Validation (keys, shapes, NF4 layout, model structure) happens before any data moves and
raises the same error on every rank; the pieces come from :mod:`~shardtune.state_dict.blocks`
and go into the model through :mod:`~shardtune.state_dict.install`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from shardtune.ranks import comm
from shardtune.ranks.faults import fault_point
from shardtune.state_dict import nf4
from shardtune.state_dict.agreement import RANK0, LoadItem, agree_on_plan
from shardtune.state_dict.blocks import SendBuffer, copy_block, scatter_dense, scatter_nf4, slice_nf4
from shardtune.state_dict.byte_runs import RangeSource, RunReader, block_range, byte_view
from shardtune.state_dict.fresh_memory import prefault
from shardtune.state_dict.gc_pause import collector_paused
from shardtune.state_dict.install import fillable, install, run_load_hooks
from shardtune.state_dict.keys import ModelEntry, model_entries
from shardtune.state_dict.layout import Piece, TensorLayout, local_tensor
from shardtune.state_dict.lazy import file_range
from shardtune.state_dict.nf4_experts import NF4Experts, quantize_experts
from shardtune.state_dict.part_scatter import scatter_parts
from shardtune.state_dict.parts import Part, note_read_form, part_piece


@torch.no_grad()
def load_from_full_model_state_dict(
    model: nn.Module,
    full_sd: Mapping[str, Any],
    device: torch.device | str,
    strict: bool = False,
    cpu_offload: bool = False,
) -> _IncompatibleKeys:
    """Load a full (unsharded) state dict into a model whose params may be sharded DTensors.

    Collective: call on all ranks, in the same order. Every rank passes the full mapping
    (each reads only its own slices), or rank 0 passes it and the others pass ``{}``.
    Values are cast to each param's dtype; NF4 params are quantized with their block sizes.
    Meta-device params and buffers are replaced (assign); materialized ones are filled in
    place so optimizer references stay valid. Local shards go to ``device``, or to CPU when
    ``cpu_offload``. Returns the same ``_IncompatibleKeys(missing, unexpected)`` on every rank;
    with ``strict=True`` raises :class:`StateDictError` on every rank before any data moves.
    """
    with collector_paused():
        return load_entries(model_entries(model), full_sd, device, strict=strict, cpu_offload=cpu_offload)


@torch.no_grad()
def load_entries(
    entries: list[ModelEntry],
    full_sd: Mapping[str, Any],
    device: torch.device | str,
    *,
    strict: bool = False,
    cpu_offload: bool = False,
) -> _IncompatibleKeys:
    """:func:`load_from_full_model_state_dict` into the model of ``entries`` (its
    :func:`~shardtune.state_dict.keys.model_entries`, built once by a caller that needs them too).

    Collective: call on all ranks, in the same order. Returns the same
    ``_IncompatibleKeys(missing, unexpected)`` on every rank.
    """
    with collector_paused():
        return _load(entries, full_sd, device, strict=strict, cpu_offload=cpu_offload)


def _load(
    entries: list[ModelEntry],
    full_sd: Mapping[str, Any],
    device: torch.device | str,
    *,
    strict: bool,
    cpu_offload: bool,
) -> _IncompatibleKeys:
    device = comm.normalize_device(device)
    local_device = torch.device("cpu") if cpu_offload else device
    transfer_device = comm.comm_device(device)
    plan = agree_on_plan(entries, full_sd, strict=strict)
    problems = comm.Problems()
    moves = _Moves(plan.mode, local_device, transfer_device, problems, SendBuffer(), RunReader(problems))
    deferred: list[tuple[LoadItem, torch.Tensor | None]] = []
    for index, item in enumerate(plan.items):
        if item.parts is not None:
            new_local = _my_parts(item, full_sd, moves)
        else:
            new_local = _my_piece(item, full_sd[item.key] if full_sd else None, moves)
        like = local_tensor(item.entry.tensor)
        if nf4.is_nf4_experts(like):
            moves.runs.flush()  # its plain block, to quantize
            new_local = _quantized_experts(item.key, like, new_local, moves)
        if like.is_meta:
            # Replacing a meta tensor frees nothing, so it can wait: swapped in one pass after
            # the reads it is cheaper (each multi-MiB read evicts the interpreter's data from
            # the CPU caches; BENCHMARKS.md, "One-off measurements"). Others are installed now, so the
            # storage they replace or the copy they fill from is freed as the load goes.
            deferred.append((item, new_local))
        else:
            if new_local is not like:  # installed from a copy now (the model's own storage is filled by the reads)
                moves.runs.flush()
            _install_item(item, new_local, problems)
        if index == 0:
            with problems.guard(item.key):
                fault_point("load:mid")
    moves.runs.flush()  # the part reads still pending, in file order: into new tensors and the model's own
    swapped: dict[int, nn.Module] = {}  # their owners' load hooks run once each, after every swap
    for item, new_local in deferred:
        if _install_item(item, new_local, problems, run_hooks=False):
            swapped.update((id(module), module) for _, module, _ in item.entry.names)
    with problems.guard("the load hooks of the modules loaded"):
        run_load_hooks(swapped.values())
    comm.raise_on_every_rank(problems, header="Loading the full model state dict failed:")
    for item in plan.items:
        if item.entry.parts is not None:
            note_read_form(item.entry.names[0][1], as_parts=item.parts is not None)
    return _IncompatibleKeys(plan.missing, plan.unexpected)


@dataclass
class _Moves:
    """How this load moves every block: the agreed mode, where blocks go, the problems met."""

    mode: str
    device: torch.device
    transfer_device: torch.device
    problems: comm.Problems
    send_buffer: SendBuffer
    runs: RunReader  # part reads joined in file order, performed when flushed (before their tensors are used)


def _my_piece(item: LoadItem, value: Any, moves: _Moves) -> torch.Tensor | None:
    """This rank's local tensor for ``item`` (the param's own storage when it can be filled in
    place); collective in rank-0 mode and for NF4 params."""
    like = local_tensor(item.entry.tensor)
    if nf4.is_nf4(like):
        transfer = scatter_nf4 if moves.mode == RANK0 else slice_nf4
        return transfer(
            item.layout,
            value,
            like=like,
            device=moves.device,
            transfer_device=moves.transfer_device,
            on_error=moves.problems,
            key=item.key,
        )
    into = fillable(like, device=moves.device)
    return _dense_block(item.layout, value, item.key, like.dtype, into, moves)


def _quantized_experts(key: str, like: NF4Experts, plain: torch.Tensor | None, moves: _Moves) -> torch.Tensor | None:
    """This rank's NF4 experts (block sizes of ``like``), quantized from its plain block: its experts are
    whole (``Shard(0)``) and each is quantized on its own, so no other rank is needed. None when the
    block was not read."""
    with moves.problems.guard(key):
        if plain is not None:
            return quantize_experts(plain, block_size=like.block_size, scaler_block_size=like.scaler_block_size)
    return None


def _my_parts(item: LoadItem, full_sd: Mapping[str, Any], moves: _Moves) -> torch.Tensor | None:
    """This rank's local tensor for ``item`` assembled from its file tensors: each part's block
    that meets this rank's piece is read (or, in rank-0 mode, received) straight into its place.
    Collective in rank-0 mode only (rank 0 sends each rank its blocks of all the parts in as few
    exchanges as the batch limit allows: :mod:`~shardtune.state_dict.part_scatter`)."""
    like = local_tensor(item.entry.tensor)
    piece = item.layout.piece(comm.rank())
    local = fillable(like, device=moves.device)
    if local is None:
        local = torch.empty(piece.shape, dtype=like.dtype, device=moves.device)
        prefault(local)  # its parts tile it: fault its pages in once, not per part inside each read
    if moves.mode == RANK0:
        scatter_parts(
            item.parts or (),
            item.layout,
            full_sd,
            local=local,
            transfer_device=moves.transfer_device,
            on_error=moves.problems,
            send_buffer=moves.send_buffer,
        )
    else:
        _read_parts(item.parts or (), piece, full_sd, local, moves)
    return local


def _read_parts(
    parts: tuple[Part, ...], piece: Piece, full_sd: Mapping[str, Any], local: torch.Tensor, moves: _Moves
) -> None:
    """Read this rank's block of each of ``parts`` into its place in ``local`` (this rank's
    ``piece``): blocks that are byte ranges both of a file and of ``local`` are read straight
    into it, runs of them that continue each other in the file in one read
    (:mod:`~shardtune.state_dict.byte_runs`; pending in ``moves.runs`` until flushed); any other block
    on its own, now (cast, strided)."""
    local_bytes = byte_view(local)
    for part in parts:
        met = part_piece(part, piece)
        if met is None:
            continue  # this rank holds none of it
        block, slices = met
        value = full_sd.get(part.name)
        found = None if local_bytes is None else _file_run(value, block, local, slices)
        if local_bytes is not None and found is not None:
            source, start, (at, nbytes) = found
            moves.runs.add(source, start, local_bytes[at : at + nbytes], part.name)
            continue
        dst = local[slices]
        into = dst.view(block.shape) if dst.is_contiguous() else None
        read = _read_block(block, value, part.name, local.dtype, into, moves)
        if read is not None and into is None:
            dst.copy_(read.reshape(dst.shape))


def _file_run(
    value: Any, block: Piece, local: torch.Tensor, slices: tuple[slice, ...]
) -> tuple[RangeSource, int, tuple[int, int]] | None:
    """``(source, first byte, (offset, byte count) in local)`` when ``value``'s ``block`` is one byte
    range of a file in ``local``'s dtype and its place in ``local`` (``slices``) one range too."""
    found = file_range(value, block.slices, local.dtype)
    if found is None:
        return None
    at = block_range(tuple(local.shape), slices, local.element_size())
    return None if at is None or at[1] != found[2] else (found[0], found[1], at)


def _dense_block(
    layout: TensorLayout, value: Any, key: str, dtype: torch.dtype, into: torch.Tensor | None, moves: _Moves
) -> torch.Tensor | None:
    """This rank's block of ``layout`` from ``value``, in ``into`` when given: read by this rank,
    or (collective, in rank-0 mode) sent by rank 0. None when it could not be read (in the problems)."""
    if moves.mode == RANK0:
        return scatter_dense(
            layout,
            value,
            dtype=dtype,
            device=moves.device,
            transfer_device=moves.transfer_device,
            on_error=moves.problems,
            key=key,
            into=into,
            send_buffer=moves.send_buffer,
        )
    return _read_block(layout.piece(comm.rank()), value, key, dtype, into, moves)


def _read_block(
    piece: Piece, value: Any, key: str, dtype: torch.dtype, into: torch.Tensor | None, moves: _Moves
) -> torch.Tensor | None:
    """The block ``piece`` of ``value``, read by this rank (in ``into`` when given); None when it
    could not be read (in the problems)."""
    with moves.problems.guard(key):
        return copy_block(value, (piece.shape, piece.slices), dtype=dtype, device=moves.device, into=into)
    return None


def _install_item(
    item: LoadItem, new_local: torch.Tensor | None, problems: comm.Problems, *, run_hooks: bool = True
) -> bool:
    """Install one loaded piece (:func:`~shardtune.state_dict.install.install`), recording a failure
    under its key; True when it was swapped in."""
    with problems.guard(item.key):
        return install(item.entry, new_local, run_hooks=run_hooks)
    return False
