"""Writing a sharded model's tensors into HF safetensors files in place (internals of
``save_hf_checkpoint``).

Every rank computes the same export plan (names, dtypes, shapes, files, header bytes) from
the model alone. Rank 0 creates the files (header written, size set); then each rank writes
its own rows in place (``O_DIRECT`` where the filesystem allows it), at once or, for a
background save, from copies staged in CPU memory first. Only blocks that are not whole rows
travel (to rank 0, one tensor at a time; without a shared filesystem every tensor does, and
rank 0 writes them in a background thread, see ``rank0_writes``); LoRA's small ``lora_A``
(and ``lora_B`` when its rows do not line up with the base's) are gathered whole on every
rank to merge ``W + scaling * B @ A`` per rank.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardtune.checkpoint import checksums
from shardtune.checkpoint.rank0_writes import BackgroundWrites, ByteRing
from shardtune.checkpoint.safetensors_io import RangeWriter, build_header
from shardtune.checkpoint.staging_memory import StagingMemory, aligned
from shardtune.faults import fault_point
from shardtune.peft.adapters import merge_lora_weight
from shardtune.peft.lora import LoRALinear
from shardtune.state_dict import comm, nf4
from shardtune.state_dict.gather import gather_to_rank0
from shardtune.state_dict.keys import ModelEntry, clean_fqn, model_entries
from shardtune.state_dict.layout import Piece, TensorLayout, layout_of, unsupported_placement

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass
class LoRAMerge:
    """The adapters merged into a base weight: ``W + scaling * B @ A``."""

    lora_a: ModelEntry
    lora_b: ModelEntry
    scaling: float


@dataclass
class ExportItem:
    """One tensor of the HF checkpoint and where its data comes from."""

    name: str
    entry: ModelEntry
    dtype: torch.dtype  # written dtype
    layout: TensorLayout
    merge: LoRAMerge | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.layout.shape

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class FilePlan:
    name: str
    header: bytes
    offsets: dict[str, int]  # absolute byte offset of each tensor
    size: int
    items: list[ExportItem] = field(default_factory=list)


# --- planning (local, identical on every rank) -----------------------------------------------


def plan_export(
    model: nn.Module, *, dtype: torch.dtype | None, merge_adapters: bool, tie_word_embeddings: bool
) -> tuple[list[ExportItem], list[str]]:
    """The tensors to write, in ``state_dict()`` order, and any problems found (not raised)."""
    entries = model_entries(model)
    by_fqn = {fqn: e for e in entries for fqn in e.fqns}
    merges, skipped, problems = _lora_merges(model, by_fqn) if merge_adapters else ({}, set(), [])
    named = sorted((pos, fqn, e) for e in entries for pos, fqn in zip(e.positions, e.fqns))
    items: list[ExportItem] = []
    world = comm.world_size()
    for _, fqn, entry in named:
        if fqn in skipped or (tie_word_embeddings and _is_tied_head(fqn, entry)):
            continue
        if fqn in merges and len(entry.fqns) > 1:
            problems.append(
                f"{fqn}: a LoRA base weight tied to {entry.fqns} cannot be merged without changing the others; "
                "leave it out of LoRA target_modules or save with merge_adapters=False"
            )
            continue
        if _local(entry.tensor).is_meta:
            problems.append(f"{fqn}: still on the meta device; load or initialize the weights before saving")
            continue
        placement = unsupported_placement(tuple(getattr(entry.tensor, "placements", ())))
        if placement is not None:
            problems.append(f"{fqn}: placement {placement} is not supported; use Shard(d) or Replicate")
            continue
        try:
            layout = layout_of(entry.tensor, world)
        except ValueError as exc:
            problems.append(f"{fqn}: {exc}")
            continue
        out_dtype = dtype if dtype is not None and entry.tensor.dtype.is_floating_point else entry.tensor.dtype
        items.append(ExportItem(name=fqn, entry=entry, dtype=out_dtype, layout=layout, merge=merges.get(fqn)))
    return items, problems


def _is_tied_head(fqn: str, entry: ModelEntry) -> bool:
    return fqn == "lm_head.weight" and "model.embed_tokens.weight" in entry.fqns


def _lora_merges(model: nn.Module, by_fqn: dict[str, ModelEntry]) -> tuple[dict[str, LoRAMerge], set[str], list[str]]:
    merges: dict[str, LoRAMerge] = {}
    skipped: set[str] = set()
    problems: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, LoRALinear):
            continue
        prefix = clean_fqn(name)
        keys = [f"{prefix}.weight", f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight"]
        missing = [k for k in keys if k not in by_fqn]
        if missing:
            problems.append(f"{prefix}: LoRA module lacks state-dict entries {missing}; cannot merge its adapters")
            continue
        merges[keys[0]] = LoRAMerge(by_fqn[keys[1]], by_fqn[keys[2]], float(module.scaling))
        skipped.update(keys[1:])
    return merges, skipped, problems


def saved_dtype(items: list[ExportItem]) -> torch.dtype | None:
    """The floating dtype holding most of the written bytes (what ``config.json`` reports)."""
    totals: dict[torch.dtype, int] = {}
    for item in items:
        if item.dtype.is_floating_point:
            totals[item.dtype] = totals.get(item.dtype, 0) + item.nbytes
    return max(totals, key=totals.get) if totals else None


def plan_files(items: list[ExportItem], max_shard_bytes: int) -> list[FilePlan]:
    """Split ``items`` in order into files of at most ``max_shard_bytes`` of tensor data (a larger
    tensor gets a file of its own), named as transformers names them."""
    groups: list[list[ExportItem]] = [[]]
    size = 0
    for item in items:
        if groups[-1] and size + item.nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += item.nbytes
    n = len(groups)
    files = []
    for i, group in enumerate(groups, start=1):
        header, offsets = build_header((it.name, it.dtype, it.shape) for it in group)
        name = SINGLE_FILE if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        files.append(FilePlan(name, header, offsets, len(header) + sum(it.nbytes for it in group), group))
    return files


def plan_digest(items: list[ExportItem], files: list[FilePlan]) -> str:
    """Equal on two ranks iff they would write the same files with the same layout."""
    text = repr([(f.name, f.header, [(it.name, it.layout.pieces, it.merge is not None) for it in f.items]) for f in files])
    return hashlib.sha256(text.encode()).hexdigest()


def index_json(files: list[FilePlan]) -> dict:
    """transformers' ``model.safetensors.index.json`` content."""
    weight_map = {it.name: f.name for f in files for it in f.items}
    total = sum(it.nbytes for f in files for it in f.items)
    params = sum(it.nbytes // it.dtype.itemsize for f in files for it in f.items)
    return {"metadata": {"total_parameters": params, "total_size": total}, "weight_map": dict(sorted(weight_map.items()))}


# --- rank 0: the files' skeletons ------------------------------------------------------------


def create_files(out_dir: str, files: list[FilePlan]) -> None:
    """Write each file's header and set its final size (data regions are filled by the ranks)."""
    for plan in files:
        path = os.path.join(out_dir, plan.name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.pwrite(fd, plan.header, 0)
            os.ftruncate(fd, plan.size)
            os.fsync(fd)
        finally:
            os.close(fd)
        checksums.record(path, 0, plan.header)


# --- every rank: data ------------------------------------------------------------------------


@torch.no_grad()
def write_data(
    out_dir: str,
    files: list[FilePlan],
    *,
    on_item: Callable[[int], None] | None = None,
    fault: str | None = None,
    direct_io: bool = True,
    rank0_writes: bool = False,
) -> list[str]:
    """Collective: call on all ranks. Each rank writes its blocks into the files; returns this
    rank's problems (to be raised on every rank by the caller, after the last collective).

    With ``rank0_writes`` (``out_dir`` only on rank 0's filesystem) every tensor is gathered to
    rank 0 in turn and written there by a background thread while the next one is gathered;
    rank 0's gathered tensors in flight never hold more than the largest tensor's bytes.
    ``direct_io``: see :class:`~shardtune.checkpoint.safetensors_io.RangeWriter`. ``fault``
    names the :func:`~shardtune.faults.fault_point` reached once, after this rank's first
    tensor is written (reliability tests)."""
    problems = comm.Problems()
    writer = _Writer(out_dir, problems, fault=fault, direct_io=direct_io)
    if rank0_writes:
        _gather_and_write(files, writer, problems, on_item)
    else:
        _visit_items(files, writer, problems, on_item)
    writer.close()
    return list(problems)


@dataclass
class StagePlan:
    """One set of files to stage (planned, created by rank 0, not yet copied)."""

    out_dir: str
    files: list[FilePlan]
    fault: str | None = None
    direct_io: bool = True


@torch.no_grad()
def stage_data(plans: list[StagePlan], *, memory: StagingMemory | None = None) -> tuple[list[StagedWrites], list[str]]:
    """Collective: call on all ranks. Like :func:`write_data`, but each rank copies its blocks
    to CPU memory (its own shard's bytes) instead of writing them; returns them, one
    :class:`StagedWrites` per plan, with this rank's problems. The model may change afterwards:
    :meth:`StagedWrites.flush` writes the copies.

    Every plan's blocks go into one arena of exactly their size (``memory``'s, reused by the
    next save of that size, when given; else one that goes with the returned objects)."""
    memory = memory if memory is not None else StagingMemory()
    items = [item for plan in plans for file in plan.files for item in file.items]
    memory.reserve(
        sum(aligned(_block_nbytes(item)) for item in items),
        pinned=any(_local(item.entry.tensor).device.type != "cpu" for item in items),
    )
    problems = comm.Problems()
    staged = []
    for plan in plans:
        staged.append(StagedWrites(plan.out_dir, memory=memory, fault=plan.fault, direct_io=plan.direct_io))
        _visit_items(plan.files, staged[-1], problems, None)
    return staged, list(problems)


def _visit_items(
    files: list[FilePlan],
    writer: _Writer | StagedWrites,
    problems: comm.Problems,
    on_item: Callable[[int], None] | None,
) -> None:
    for plan in files:
        for item in plan.items:
            _write_item(item, plan, writer, problems)
            if on_item is not None:
                on_item(item.nbytes)


def _gather_and_write(
    files: list[FilePlan], writer: _Writer, problems: comm.Problems, on_item: Callable[[int], None] | None
) -> None:
    """Collective: call on all ranks. Rank 0 gathers each tensor into a reused ring (the
    largest tensor's size) and writes it in the background while gathering the next; the
    other ranks send their blocks. Rank 0's write problems land in ``problems``."""
    background = ring = None
    if comm.rank() == 0:
        ring = ByteRing(max((item.nbytes for plan in files for item in plan.items if item.layout.is_sharded), default=0))
        background = BackgroundWrites(writer, problems)
    try:
        for plan in files:
            for item in plan.items:
                if item.layout.is_sharded:
                    full = _gather_item(item, problems, out=ring.take(item.shape, item.dtype) if ring is not None else None)
                    if background is not None:
                        background.write(plan.name, full, plan.offsets[item.name], done=ring.release_oldest)
                else:  # rank 0 queues it whole, from the model's memory: the save waits for the write
                    _write_item(item, plan, background if background is not None else writer, problems)
                if on_item is not None:
                    on_item(item.nbytes)
    finally:
        if background is not None:
            background.close()


class _Writer:
    """This rank's output files, opened on first write and fsynced at the end."""

    block_device: str | None = "cpu"  # blocks are written at once, straight from CPU views

    def __init__(self, out_dir: str, problems: comm.Problems, *, fault: str | None = None, direct_io: bool = True) -> None:
        self.out_dir = out_dir
        self.problems = problems
        self.ranges = RangeWriter(direct_io=direct_io)
        self.fault = fault  # reached after the first write, then cleared

    def write(self, file_name: str, tensor: torch.Tensor, offset: int) -> None:
        path = os.path.join(self.out_dir, file_name)
        try:
            self.ranges.write(path, tensor, offset)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path} does not exist on rank {comm.rank()}; rank 0 created it, so out_dir must be on a "
                "filesystem shared by all ranks"
            ) from None
        if self.fault is not None:
            fault, self.fault = self.fault, None
            fault_point(fault)

    def close(self) -> None:
        for path in self.ranges.paths:
            with self.problems.guard(path):
                self.ranges.close(path)
        self.ranges.release()


class StagedWrites:
    """This rank's blocks of a checkpoint, copied to CPU memory by :func:`stage_data`, to be
    written into the files (which rank 0 already created) by :meth:`flush`."""

    block_device: str | None = None  # blocks stay where the shards live until copied into CPU buffers

    def __init__(self, out_dir: str, *, memory: StagingMemory, fault: str | None = None, direct_io: bool = True) -> None:
        self.out_dir = out_dir
        self.memory = memory  # holds the arena the blocks are slices of
        self.fault = fault
        self.direct_io = direct_io
        self.blocks: list[tuple[str, torch.Tensor, int]] = []

    def write(self, file_name: str, tensor: torch.Tensor, offset: int) -> None:
        # A copy, never a view: the model and optimizer keep training while it waits.
        buffer = self.memory.take(tensor)  # the slice stage_data reserved for this block
        buffer.copy_(tensor)
        self.blocks.append((file_name, buffer, offset))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for _, t, _ in self.blocks)

    def flush(self) -> list[str]:
        """Write every staged block and fsync the files; returns this rank's problems. No
        collectives: it may run in a background thread."""
        problems = comm.Problems()
        writer = _Writer(self.out_dir, problems, fault=self.fault, direct_io=self.direct_io)
        blocks, self.blocks = self.blocks, []
        for file_name, tensor, offset in blocks:
            with problems.guard(os.path.join(self.out_dir, file_name)):
                writer.write(file_name, tensor, offset)
        writer.close()
        return list(problems)


def _write_item(
    item: ExportItem, plan: FilePlan, writer: _Writer | StagedWrites | BackgroundWrites, problems: comm.Problems
) -> None:
    """Write (or stage) ``item``: its owner ranks write their rows in place, or, for blocks
    that are not whole rows, rank 0 writes the gathered tensor."""
    route, piece = _route(item)
    offset = plan.offsets[item.name]
    if route == "gather":
        full = _gather_item(item, problems)
        if full is not None:
            with problems.guard(item.name):
                writer.write(plan.name, full, offset)
        return
    adapters = _gather_adapters(item)  # collective for sharded adapters: every rank, same order
    if piece is not None:
        with problems.guard(item.name):
            writer.write(plan.name, _local_block(item, adapters, device=writer.block_device), offset + _row_offset(item, piece))


def _route(item: ExportItem) -> tuple[str, Piece | None]:
    """How :func:`_write_item` writes ``item`` (``gather``: rank 0 writes the gathered tensor;
    ``whole``: rank 0 writes an unsharded tensor; ``rows``: owners write their rows) and the
    piece this rank writes (None when it writes nothing)."""
    me, layout = comm.rank(), item.layout
    whole = Piece(shape=layout.shape, offset=(0,) * len(layout.shape))
    owners = layout.owners() if layout.is_sharded else {}
    if not all(piece.is_row_range(layout.shape) for piece in owners):
        return "gather", whole if me == 0 else None
    if not layout.is_sharded:
        return "whole", whole if me == 0 else None
    piece = layout.pieces[me]
    return "rows", piece if owners.get(piece) == me else None


def _block_nbytes(item: ExportItem) -> int:
    """Bytes of the block this rank writes for ``item`` (0 when none)."""
    piece = _route(item)[1]
    if piece is None:
        return 0
    return math.prod(piece.shape) * item.dtype.itemsize


def _gather_item(item: ExportItem, problems: comm.Problems, *, out: torch.Tensor | None = None) -> torch.Tensor | None:
    """Collective: call on all ranks. Returns ``item``'s whole tensor on rank 0 (CPU, in
    ``out`` when given, else new memory), None elsewhere."""
    adapters = _gather_adapters(item)  # collective for sharded adapters: every rank, same order
    block = None
    with problems.guard(item.name):
        block = _local_block(item, adapters, device=None)  # where the shard lives: the gather moves it once
    if block is None:  # still take part, so no rank waits; the problem is raised everywhere later
        block = torch.zeros(_my_piece(item.layout).shape, dtype=item.dtype)
    return gather_to_rank0(block, item.layout, transfer_device=comm.comm_device(None), on_error=problems, key=item.name, out=out)


def _row_offset(item: ExportItem, piece: Piece) -> int:
    """Byte offset of ``piece``'s first row within its tensor's data."""
    if not item.shape:
        return 0
    return piece.offset[0] * math.prod(item.shape[1:]) * item.dtype.itemsize


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _my_piece(layout: TensorLayout) -> Piece:
    if layout.pieces is None:
        return Piece(shape=layout.shape, offset=(0,) * len(layout.shape))
    return layout.pieces[comm.rank()]


@dataclass
class _Adapters:
    a: torch.Tensor  # whole lora_A
    b: torch.Tensor  # lora_B: this rank's rows of the base when ``b_is_local``, else whole
    b_is_local: bool


def _gather_adapters(item: ExportItem) -> _Adapters | None:
    """Collective when the adapters are DTensors: A whole, B whole unless its local rows are the
    base's local rows. Decided from the global layouts, so every rank makes the same calls.
    Gathered adapters are on the transfer device (CPU-offloaded ones are copied there first)."""
    if item.merge is None:
        return None
    a, b = item.merge.lora_a.tensor, item.merge.lora_b.tensor
    transfer_device = comm.comm_device(None)
    a_full = comm.full_tensor(a.detach(), transfer_device)
    if _rows_line_up(item.layout, layout_of(b, comm.world_size())):
        return _Adapters(a_full, _local(b).detach(), b_is_local=True)
    return _Adapters(a_full, comm.full_tensor(b.detach(), transfer_device), b_is_local=False)


def _rows_line_up(w: TensorLayout, b: TensorLayout) -> bool:
    """True when, on every rank, B's local rows (whole rows) are exactly W's local rows."""
    if w.pieces is None or b.pieces is None:
        return w.pieces is None and b.pieces is None
    return all(
        pb.is_row_range(b.shape) and (pw.offset[0], pw.shape[0]) == (pb.offset[0], pb.shape[0])
        for pw, pb in zip(w.pieces, b.pieces)
    )


def _local_block(item: ExportItem, adapters: _Adapters | None, *, device: str | None) -> torch.Tensor:
    """This rank's block of the written tensor: dequantized, merged, cast, moved to ``device``
    (``None``: where the shard lives); may be a view of the model's (or optimizer's) storage."""
    piece = _my_piece(item.layout)
    local = nf4.dequantize(_local(item.entry.tensor)).detach()
    if tuple(local.shape) != piece.shape:
        raise ValueError(f"local shard has shape {tuple(local.shape)}, expected {piece.shape} from its placement")
    if adapters is not None:
        rows, cols = piece.slices
        b = adapters.b if adapters.b_is_local else adapters.b[rows]
        local = merge_lora_weight(local, adapters.a[:, cols], b, scaling=item.merge.scaling)
    return local.to(device=device if device is not None else local.device, dtype=item.dtype)
