"""Full state dict -> sharded model (``load_from_full_model_state_dict``).

Two ways to receive the full state dict, agreed on by all ranks up front:

* every rank passes a full mapping (possibly lazy, e.g. safetensors slices): each rank reads
  and casts only its own piece; no weights cross the network;
* rank 0 passes it and the others pass ``{}``: rank 0 reads each tensor once and scatters to
  every rank only that rank's piece (NF4 pieces are quantized once and sent packed).

Validation (keys, shapes, NF4 layout, model structure) happens before any data moves and
raises the same error on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import _IncompatibleKeys

from shardtune.state_dict import comm, nf4
from shardtune.state_dict.blocks import SendBuffer, copy_block, read_block, scatter_dense
from shardtune.state_dict.dtypes import SAFETENSORS_DTYPES
from shardtune.state_dict.faults import fault_point
from shardtune.state_dict.keys import ModelEntry, model_entries
from shardtune.state_dict.layout import TensorLayout, layout_of, unsupported_placement

EVERY_RANK = "every_rank"
RANK0 = "rank0"
NOTHING = "nothing"


@dataclass
class _Item:
    entry: ModelEntry
    key: str  # the full_sd key this entry is loaded from
    layout: TensorLayout


@dataclass
class _Plan:
    mode: str
    items: list[_Item]
    missing: list[str]
    unexpected: list[str]


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
    device = comm.normalize_device(device)
    local_device = torch.device("cpu") if cpu_offload else device
    transfer_device = comm.comm_device(device)
    plan = _agree_on_plan(model_entries(model), full_sd, strict=strict)
    problems = comm.Problems()
    send_buffer = SendBuffer()
    deferred: list[tuple[_Item, torch.Tensor | None]] = []
    for index, item in enumerate(plan.items):
        value = full_sd[item.key] if full_sd else None
        new_local = _my_piece(item, value, plan.mode, local_device, transfer_device, problems, send_buffer)
        if _local(item.entry.tensor).is_meta:
            # Replacing a meta tensor frees nothing, so it can wait: swapped in one pass after
            # the reads it is cheaper (each multi-MiB read evicts the interpreter's data from
            # the CPU caches; BENCHMARKS.md, "One-off measurements"). Others are installed now, so the
            # storage they replace or the copy they fill from is freed as the load goes.
            deferred.append((item, new_local))
        else:
            _install_item(item, new_local, problems)
        if index == 0:
            with problems.guard(item.key):
                fault_point("load:mid")
    for item, new_local in deferred:
        _install_item(item, new_local, problems)
    comm.raise_on_every_rank(problems, header="Loading the full model state dict failed:")
    return _IncompatibleKeys(plan.missing, plan.unexpected)


# --- agreement: decided identically on every rank before any data moves ---------------------


def describe_value(value: Any) -> tuple:
    """Kind and shape of a full-state-dict value, without reading its data.

    The dtype is left out on purpose: values are cast to the param's dtype, so ranks whose
    copies differ only in dtype (or lazy vs. in-memory) still agree.
    """
    if isinstance(value, torch.Tensor):
        if nf4.is_nf4(value):
            return ("nf4", tuple(value.shape), *nf4.block_sizes(value))
        return ("dense", tuple(value.shape))
    if hasattr(value, "get_shape"):  # lazy: a safetensors slice or anything alike
        return ("dense", tuple(value.get_shape()))
    return ("invalid", type(value).__name__)


def number_kind(value: Any) -> str | None:
    """``"float"`` or ``"int"`` (bool included) of a dtype, a tensor, or a lazy value with ``get_dtype()``
    (a torch dtype or a safetensors name such as ``"BF16"``); None when unknown."""
    if hasattr(value, "get_dtype"):
        dtype = value.get_dtype()
    elif isinstance(value, torch.Tensor):
        dtype = value.dtype
    else:
        dtype = value if isinstance(value, torch.dtype) else None
    if isinstance(dtype, str):
        dtype = SAFETENSORS_DTYPES.get(dtype.upper())
    if isinstance(dtype, torch.dtype):
        return "float" if dtype.is_floating_point or dtype.is_complex else "int"
    return None


# How comm.agree / comm.disagreement report ranks whose model_signature differs from rank 0's.
SAME_MODEL = {
    "what": "the model differs between ranks (names, shapes or placements)",
    "fix": "build and shard the same model on every rank.",
}


def model_signature(entries: list[ModelEntry]) -> str:
    """A digest of names, shapes and placements: equal on all ranks iff their models agree."""
    text = repr(
        [
            (e.fqns, tuple(e.tensor.shape), str(getattr(e.tensor, "placements", None)))
            for e in entries
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()


def agree_on_mode(has_data: list[bool], what: str) -> tuple[str, list[str]]:
    """Pick how the full state dict was passed from every rank's ``has_data``; problems if inconsistent."""
    if all(has_data):
        return EVERY_RANK, []
    if not any(has_data):
        return NOTHING, []
    if has_data[0] and not any(has_data[1:]):
        return RANK0, []
    given = [r for r, h in enumerate(has_data) if h]
    empty = [r for r, h in enumerate(has_data) if not h]
    return NOTHING, [
        f"{what} is non-empty on ranks {given} but empty on ranks {empty}; pass it on every rank, "
        "or on rank 0 only with {} on the other ranks."
    ]


def _agree_on_plan(entries: list[ModelEntry], full_sd: Mapping[str, Any], *, strict: bool) -> _Plan:
    local_desc = {key: describe_value(full_sd[key]) for key in full_sd} if full_sd else None
    gathered = comm.all_gather_objects((local_desc, model_signature(entries)))
    descs = [d for d, _ in gathered]
    mode, problems = agree_on_mode([bool(d) for d in descs], "full_sd")
    problems += comm.disagreement([s for _, s in gathered], **SAME_MODEL)
    reference = descs[0] or {}
    if mode == EVERY_RANK:
        problems += _desc_mismatch_problems(descs)
    plan, plan_problems = _match(entries, reference, mode, strict=strict)
    local_problems = _number_kind_problems(entries, full_sd) if full_sd else []
    comm.raise_on_every_rank(problems + plan_problems + local_problems, header="Cannot load the full model state dict:")
    return plan


def _desc_mismatch_problems(descs: list[dict]) -> list[str]:
    problems = []
    reference = descs[0]
    for r, desc in enumerate(descs[1:], start=1):
        if desc == reference:
            continue
        missing = sorted(set(reference) - set(desc))[:5]
        extra = sorted(set(desc) - set(reference))[:5]
        differ = sorted(k for k in set(desc) & set(reference) if desc[k] != reference[k])[:5]
        problems.append(
            f"full_sd on rank {r} differs from rank 0 (keys only on rank 0: {missing}, only on rank {r}: "
            f"{extra}, different shape: {differ}); every rank must pass the same checkpoint."
        )
    return problems


def _match(entries: list[ModelEntry], desc: dict, mode: str, *, strict: bool) -> tuple[_Plan, list[str]]:
    world = comm.world_size()
    items, missing, problems = [], [], []
    known = set()
    for entry in entries:
        known.update(entry.fqns)
        key = next((fqn for fqn in entry.fqns if fqn in desc), None)
        if key is None:
            missing.extend(entry.fqns)
            continue
        problem = _entry_problem(entry, key, desc[key])
        if problem is None:
            try:
                items.append(_Item(entry=entry, key=key, layout=layout_of(entry.tensor, world)))
            except ValueError as exc:
                problem = f"{key}: {exc}"
        if problem is None and nf4.is_nf4(_local(entry.tensor)):
            local = _local(entry.tensor)
            problem = nf4.nf4_layout_problem(key, items[-1].layout, *nf4.block_sizes(local))
        if problem is not None:
            problems.append(problem)
    unexpected = [k for k in desc if k not in known]
    if strict and (missing or unexpected):
        problems.append(
            f"strict loading: missing keys {missing[:20]}, unexpected keys {unexpected[:20]}; "
            "load a checkpoint of this model or pass strict=False."
        )
    return _Plan(mode=mode, items=items, missing=missing, unexpected=unexpected), problems


def _number_kind_problems(entries: list[ModelEntry], full_sd: Mapping[str, Any]) -> list[str]:
    """This rank's values that are integers for a float tensor of the model, or floats for an
    integer one: casting would silently turn bytes into wrong numbers (a corrupt header, say)."""
    problems = []
    for entry in entries:
        key = next((fqn for fqn in entry.fqns if fqn in full_sd), None)
        if key is None:
            continue
        have, want = number_kind(full_sd[key]), number_kind(entry.tensor.dtype)
        if have is not None and have != want:
            problems.append(
                f"{key}: the checkpoint holds {have} values but the model's tensor is {entry.tensor.dtype}; "
                "the file's header is corrupt or the checkpoint belongs to another model."
            )
    return problems


def _entry_problem(entry: ModelEntry, key: str, desc: tuple) -> str | None:
    if desc[0] == "invalid":
        return f"{key}: expected a tensor (or lazy tensor with get_shape()), got {desc[1]}"
    shape = tuple(entry.tensor.shape)
    if desc[1] != shape:
        return (
            f"{key}: checkpoint shape {desc[1]} does not match the model's {shape}; "
            "the checkpoint was made for a different model configuration."
        )
    placement = unsupported_placement(tuple(getattr(entry.tensor, "placements", ())))
    if placement is not None:
        return f"{key}: placement {placement} is not supported; use Shard(d) or Replicate."
    return None


# --- data: this rank's piece of one tensor ---------------------------------------------------


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _my_piece(
    item: _Item,
    value: Any,
    mode: str,
    device: torch.device,
    transfer_device: torch.device,
    problems: comm.Problems,
    send_buffer: SendBuffer,
) -> torch.Tensor | None:
    """This rank's local tensor for ``item`` (the param's own storage when it can be filled in
    place); collective in rank-0 mode."""
    like = _local(item.entry.tensor)
    if nf4.is_nf4(like):
        if mode == RANK0:
            return _scatter_nf4(item, value, like, device, transfer_device, problems)
        return _slice_nf4(item, value, like, device, transfer_device, problems)
    into = fillable(like, device=device)
    if mode == RANK0:
        return scatter_dense(
            item.layout, value, dtype=like.dtype, device=device, transfer_device=transfer_device,
            on_error=problems, key=item.key, into=into, send_buffer=send_buffer,
        )
    with problems.guard(item.key):
        return copy_block(value, _my_block(item.layout), dtype=like.dtype, device=device, into=into)
    return None


def fillable(local: torch.Tensor | None, *, device: torch.device) -> torch.Tensor | None:
    """``local`` when new values can be written straight into it (materialized, contiguous, on ``device``)."""
    if local is None or local.is_meta or nf4.is_nf4(local) or not local.is_contiguous() or local.device != device:
        return None
    return local


def _my_block(layout: TensorLayout) -> tuple[tuple[int, ...], tuple[slice, ...]]:
    if layout.pieces is None:
        return layout.shape, tuple(slice(None) for _ in layout.shape)
    piece = layout.pieces[comm.rank()]
    return piece.shape, piece.slices


def _row_blocks(layout: TensorLayout) -> list[tuple[int, int]]:
    """(first row, row count) of every rank's NF4 block; a plain param is whole on every rank."""
    if layout.pieces is None:
        return [(0, layout.shape[0])] * comm.world_size()
    return [(p.offset[0], p.shape[0]) for p in layout.pieces]


def _whole(value: Any, layout: TensorLayout) -> Any:
    return value if nf4.is_nf4(value) else read_block(value, tuple(slice(None) for _ in layout.shape))


def _slice_nf4(
    item: _Item,
    value: Any,
    like: torch.Tensor,
    device: torch.device,
    transfer_device: torch.device,
    problems: comm.Problems,
) -> torch.Tensor | None:
    """This rank's NF4 block when every rank holds the full value.

    An NF4 value (same block sizes) is cut by rows. A plain value is read and quantized per
    shard: each rank reads only its rows; the one global quantity (the mean of the block
    scalers) comes from a small all-gather of every shard's scalers (1/block_size of the data).
    """
    if nf4.is_nf4(value) and nf4.block_sizes(value) == nf4.block_sizes(like) and value.dtype == like.dtype:
        with problems.guard(item.key):
            return nf4.nf4_rows(value.to(device), *_row_blocks(item.layout)[comm.rank()])
        return None
    if item.layout.pieces is None:
        with problems.guard(item.key):
            return nf4.quantize_like(_whole(value, item.layout), like, device=device)
        return None
    owners = sorted(item.layout.owners().items(), key=lambda kv: kv[0].offset)
    numels = [p.numel // like.block_size for p in item.layout.pieces]
    rows, scalers = None, torch.zeros(numels[comm.rank()], dtype=like.dtype, device=device)
    with problems.guard(item.key):
        rows = read_block(value, item.layout.pieces[comm.rank()].slices).to(device=device, dtype=like.dtype)
        scalers = nf4.block_scalers(rows, like)
    parts = comm.all_gather_varlen(scalers, numels, device=transfer_device)  # collective even after a failed read
    mean = torch.cat([parts[rank] for _, rank in owners]).mean().to(device)
    if rows is None:
        return None
    with problems.guard(item.key):
        return nf4.quantize_shard(rows, like, scaler_mean=mean)
    return None


def _scatter_nf4(item, value, like, device, transfer_device, problems) -> torch.Tensor:
    """Rank 0 quantizes the full tensor once and sends each rank its packed rows."""
    blocks = _row_blocks(item.layout)
    row_numel = like.numel() // like.shape[0] if like.shape[0] else 0
    sizes = [
        nf4.packed_numel(rows * row_numel, like.block_size, like.scaler_block_size, like.dtype) for _, rows in blocks
    ]
    quantized: list[torch.Tensor] = []

    def block_for(r: int) -> torch.Tensor | None:
        with problems.guard(item.key):
            if not quantized:
                quantized.append(nf4.quantize_like(_whole(value, item.layout), like, device=transfer_device))
            packed = torch.empty(sizes[r], dtype=torch.uint8, device=transfer_device)
            nf4.pack(nf4.nf4_rows(quantized[0], *blocks[r]), packed)
            return packed
        return None

    flat = comm.scatter_from_rank0(block_for if comm.rank() == 0 else None, sizes, dtype=torch.uint8, device=transfer_device)
    _, rows = blocks[comm.rank()]
    return nf4.unpack(flat, (rows, *item.layout.shape[1:]), like, device=device)


# --- installing the new local tensor into the model ------------------------------------------


def _install_item(item: _Item, new_local: torch.Tensor | None, problems: comm.Problems) -> None:
    """Install one loaded piece, recording a failure under its key."""
    with problems.guard(item.key):
        _install(item.entry, new_local)


def _install(entry: ModelEntry, new_local: torch.Tensor | None) -> None:
    """Put ``new_local`` into the model, keeping the Parameter objects the caller holds.

    Materialized tensors of the same shape/dtype/device are filled in place. Otherwise
    (meta, NF4, another dtype or device) the new tensor is swapped into the existing
    Parameter object, so an optimizer created before the load still holds the model's
    params and tied weights stay tied; assignment is the fallback when a swap is refused.
    """
    current = entry.tensor
    if new_local is None or new_local is _local(current):  # failed, or already written in place
        return
    if _can_fill_in_place(_local(current), new_local):
        _local(current).copy_(new_local)
        return
    if isinstance(current, DTensor):
        new_local = DTensor.from_local(
            new_local, current.device_mesh, current.placements, run_check=False, shape=current.shape, stride=current.stride()
        )
    new = new_local if entry.is_buffer else nn.Parameter(new_local, requires_grad=current.requires_grad)
    try:
        torch.utils.swap_tensors(current, new)
    except RuntimeError:
        for _, module, name in entry.names:  # one object for every alias keeps ties
            module.load_state_dict({name: new}, strict=False, assign=True)
        entry.tensor = new
        return
    # Run the owners' post-load hooks: FSDP2 re-registers (and re-pads) the sharded param there.
    for _, module, _ in entry.names:
        module.load_state_dict({}, strict=False)


def _can_fill_in_place(current: torch.Tensor, new_local: torch.Tensor) -> bool:
    return (
        not current.is_meta
        and not nf4.is_nf4(current)
        and not nf4.is_nf4(new_local)
        and current.shape == new_local.shape
        and current.dtype == new_local.dtype
        and current.device == new_local.device
    )


@torch.no_grad()
def materialize_meta(model: nn.Module, device: torch.device | str) -> list[str]:
    """Give every meta-device param and persistent buffer uninitialized local storage on ``device``.

    Local to each rank (no collectives). The storage is swapped into the existing Parameter
    objects, as a load does, for readers that fill tensors in place (e.g. DCP). NF4 params
    are skipped (they need values to be quantized). Returns the names materialized.
    """
    done = []
    for entry in model_entries(model):
        local = _local(entry.tensor)
        if local.is_meta and not nf4.is_nf4(local):
            _install(entry, torch.empty(local.shape, dtype=local.dtype, device=device))
            done.extend(entry.fqns)
    return done
