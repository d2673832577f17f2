"""Streaming a sharded model as Hugging Face tensors in bounded memory, for inference engines and RL refits.

Rule: a stream is an HF save delivered as memory instead of files. Its tensors are the save plan's
(:func:`~shardtune.checkpoint.formats.hf_save.hf_weight_items`, or the PEFT adapter's,
:func:`~shardtune.checkpoint.formats.peft_format.adapter_items`): the same names, dtypes, LoRA merges, NF4
dequantization and expert layouts, each block transformed where it lives, before anything moves. They
are cut, in file order, into buckets of whole tensors of at most ``bucket_bytes`` (a larger tensor
is a bucket of its own). Each bucket is one exchange (``batch_isend_irecv`` on the transfer device):
each distinct block goes once from its owner to each receiving rank that lacks it, straight into
its place in the bucket where it is contiguous there. A bucket is handed out only after every rank
has confirmed it (one small gather), so an error on any rank raises the same error on every rank
before a bad byte reaches a consumer. A rank holds one bucket (a receiver its tensors, a sender
its own blocks of them) plus one tensor's block being transformed.

The stream is collective and must be used as a context manager, so that leaving it early never
hangs the others: a rank that leaves before the end takes part in one more bucket, reporting why,
and every rank raises.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import torch
from torch import nn

from shardtune.checkpoint.formats.fp8_base_save import Fp8BaseBlocks
from shardtune.checkpoint.formats.hf_save import HFSaveOptions, ParamMerge, PartMerge, hf_weight_items
from shardtune.checkpoint.formats.peft_format import adapter_items
from shardtune.checkpoint.storage.writer import BlockFn, WriteItem, local_block
from shardtune.ranks import comm
from shardtune.ranks.errors import StateDictError
from shardtune.ranks.faults import fault_point
from shardtune.state_dict.agreement import model_signature
from shardtune.state_dict.keys import model_entries
from shardtune.state_dict.layout import Piece

__all__ = ["DEFAULT_BUCKET_BYTES", "TARGETS", "WeightStream", "stream_adapter_weights", "stream_weights"]

DEFAULT_BUCKET_BYTES = 256 << 20
TARGETS = ("rank0", "all")  # who receives the tensors
BUCKET_FAULT = "stream:bucket"  # reached on every rank before each bucket is filled
_ALIGN = 16  # byte alignment of each tensor in a bucket (any dtype's view, vector copies)


def stream_weights(
    model: nn.Module,
    *,
    to: str = "rank0",
    dtype: torch.dtype | None = None,
    merge_lora: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    expert_layout: str = "fused",
    config: Mapping[str, Any] | None = None,
) -> WeightStream:
    """The model's weights as HF-named full tensors, bucket by bucket: a :class:`WeightStream`.

    Collective: call on all ranks with the same arguments, enter it with ``with`` on every rank
    and iterate it to the end in the same order. Iterating yields ``(hf_name, tensor)`` pairs
    (:meth:`WeightStream.buckets`: one list per bucket): with ``to="all"`` on every rank, with
    ``to="rank0"`` on rank 0 only (other ranks yield no pair, and empty buckets). The tensors are
    those :func:`~shardtune.checkpoint.formats.hf_save.save_hf_checkpoint` writes with the same options:
    floating ones cast to ``dtype`` when given, NF4 bases dequantized, with ``merge_lora`` each LoRA
    base merged (``W + scaling * B @ A``, experts' parameter adapters too) and its adapters left
    out (without it, the adapters come under shardtune's names), experts ``fused`` (transformers
    5's runtime layout, ``load_state_dict`` into its model) or ``per_expert`` (its checkpoint
    names, e.g. for engines that load those) or ``auto`` (as read), a tied ``lm_head`` left out.
    They are contiguous views of the bucket's memory on the transfer device (CPU under gloo,
    the current accelerator under NCCL), fresh for each bucket: copy what you keep. Raises
    :class:`~shardtune.ranks.errors.StateDictError` with the same message on every rank for a
    bad argument (at ``with``), an error on any rank during a bucket, or a rank leaving early.
    """
    problems = _option_problems(to=to, dtype=dtype, bucket_bytes=bucket_bytes)
    options = HFSaveOptions(dtype=dtype, merge_adapters=merge_lora, config=config, expert_layout=expert_layout)
    items, item_problems = hf_weight_items(model, options=options)
    return WeightStream(model, items, to=to, bucket_bytes=bucket_bytes, problems=problems + item_problems)


def stream_adapter_weights(
    model: nn.Module,
    *,
    to: str = "rank0",
    dtype: torch.dtype | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> WeightStream:
    """The model's LoRA adapters as :func:`stream_weights` streams weights: PEFT's names and the
    tensors :func:`~shardtune.checkpoint.formats.peft_format.save_peft_adapter` writes (their own dtypes,
    or floating ones cast to ``dtype``), for ``peft.set_peft_model_state_dict`` or an engine's
    adapter loader. Collective, with the same rules; raises on every rank when the model has no
    LoRA adapters."""
    problems = _option_problems(to=to, dtype=dtype, bucket_bytes=bucket_bytes)
    items: list[WriteItem] = []
    try:
        items = adapter_items(model, dtype=dtype)
    except StateDictError as exc:
        problems.append(str(exc))
    return WeightStream(model, items, to=to, bucket_bytes=bucket_bytes, problems=problems)


def _option_problems(*, to: str, dtype: torch.dtype | None, bucket_bytes: int) -> list[str]:
    problems = []
    if to not in TARGETS:
        problems.append(f"to={to!r}: choose one of {', '.join(map(repr, TARGETS))}")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        problems.append(
            f"dtype={dtype!r}: pass a floating torch.dtype (e.g. torch.bfloat16), or None for each tensor's own"
        )
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        problems.append(f"bucket_bytes={bucket_bytes!r}: pass a positive number of bytes, e.g. {DEFAULT_BUCKET_BYTES}")
    return problems


# --- the plan: tensors, buckets, and who sends which block (local, alike on every rank) ---------


@dataclass
class _Tensor:
    """One streamed tensor: its items (one, or slices of it at byte offsets ``within``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    items: list[WriteItem] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def _tensors(items: list[WriteItem]) -> list[_Tensor]:
    tensors: list[_Tensor] = []
    for item in items:
        if not tensors or tensors[-1].name != item.name:
            tensors.append(_Tensor(item.name, item.dtype, item.file_shape or item.shape))
        tensors[-1].items.append(item)
    return tensors


def _buckets(tensors: list[_Tensor], limit: int) -> list[list[_Tensor]]:
    """Consecutive tensors, at most ``limit`` bytes per bucket (a larger tensor alone)."""
    buckets: list[list[_Tensor]] = []
    total = 0
    for tensor in tensors:
        if not buckets or total + tensor.nbytes > limit:
            buckets.append([])
            total = 0
        buckets[-1].append(tensor)
        total += tensor.nbytes
    return buckets


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class _Move:
    """One distinct block of one item: ``piece`` of item ``item``, ``nbytes`` long, at byte
    ``start`` of the bucket when it is contiguous there (None: sent packed, placed after)."""

    item: int
    piece: Piece
    start: int | None
    nbytes: int


@dataclass
class _Route:
    """This rank's part in one bucket: the pieces it fills itself, its sends and receives by peer."""

    fills: list[tuple[int, Piece]] = field(default_factory=list)
    sends: dict[int, list[_Move]] = field(default_factory=dict)
    recvs: dict[int, list[_Move]] = field(default_factory=dict)


def _contiguous_start(piece: Piece, shape: tuple[int, ...], base: int, itemsize: int) -> int | None:
    """Byte offset of ``piece`` in a row-major tensor of ``shape`` at ``base`` when the piece is one
    contiguous range there (after its first dim longer than one, every dim whole), else None."""
    dims = [d for d, n in enumerate(piece.shape) if n != 1]
    if dims and any(piece.shape[d] != shape[d] for d in range(dims[0] + 1, len(shape))):
        return None
    stride, offset = 1, 0
    for d in reversed(range(len(shape))):
        offset += piece.offset[d] * stride
        stride *= shape[d]
    return base + offset * itemsize


def _route(items: list[tuple[WriteItem, int]], targets: list[int], me: int, world: int) -> _Route:
    """Who fills, sends and receives which block of ``items`` (each with its byte offset in the
    bucket): a receiving rank that holds a block fills it itself, the others get it from its
    owner (the lowest rank holding it)."""
    route = _Route()
    receives = me in targets
    for i, (item, base) in enumerate(items):
        layout = item.layout
        if layout.pieces is None:  # a plain tensor: whole on every rank
            blocks = {layout.piece(0): (0, set(range(world)))}
        else:
            holders: dict[Piece, set[int]] = {}
            for r, piece in enumerate(layout.pieces):
                holders.setdefault(piece, set()).add(r)
            blocks = {piece: (owner, holders[piece]) for piece, owner in layout.owners().items()}
        for piece, (owner, holding) in blocks.items():
            if receives and me in holding:
                route.fills.append((i, piece))
            sends_to = [q for q in targets if q not in holding] if me == owner else []
            gets_it = receives and me not in holding
            if not sends_to and not gets_it:
                continue
            start = _contiguous_start(piece, item.shape, base, item.dtype.itemsize)
            move = _Move(i, piece, start, piece.numel * item.dtype.itemsize)
            if gets_it:
                route.recvs.setdefault(owner, []).append(move)
            for q in sends_to:
                route.sends.setdefault(q, []).append(move)
    return route


def _runs(moves: list[_Move]) -> list[list[_Move]]:
    """``moves`` in order, those that continue each other in the bucket joined into one transfer."""
    runs: list[list[_Move]] = []
    for move in moves:
        last = runs[-1][-1] if runs else None
        if last is not None and last.start is not None and move.start == last.start + last.nbytes:
            runs[-1].append(move)
        else:
            runs.append([move])
    return runs


def _digest(items: list[WriteItem]) -> str:
    text = repr(
        [(it.name, str(it.dtype), it.layout.pieces, it.within, it.file_shape, it.transform is not None) for it in items]
    )
    return hashlib.sha256(text.encode()).hexdigest()


# --- the stream -------------------------------------------------------------------------------


class WeightStream:
    """A collective iterator of HF tensors (see :func:`stream_weights`); use it in a ``with`` block.

    ``__enter__`` checks the arguments and that every rank streams the same tensors (one gather;
    the same error on every rank otherwise). Iterate the pairs or :meth:`buckets`, once, to the end,
    on every rank. Leaving the block before the end (``break``, an exception) makes this rank take
    part in the next bucket and report it, so every rank raises
    :class:`~shardtune.ranks.errors.StateDictError` naming the rank and why: no rank waits forever.
    """

    def __init__(self, model: nn.Module, items: list[WriteItem], *, to: str, bucket_bytes: int, problems: list[str]):
        self._model = model
        self._items = items
        self._to = to
        self._bucket_bytes = bucket_bytes
        self._problems = problems
        self._gen: Iterator[list[tuple[str, torch.Tensor]]] | None = None
        self._started = False
        self._done = False
        self._stopped: str | None = None
        self._uses: Counter[int] = Counter()
        self.num_buckets = 0
        self.largest_bucket_bytes = 0

    def __enter__(self) -> WeightStream:
        if self._gen is not None:
            raise RuntimeError("a WeightStream is entered once; call stream_weights again for another stream")
        comm.agree(
            (model_signature(model_entries(self._model)), _digest(self._items), self._to, self._bucket_bytes),
            what="the tensors to stream differ between ranks (different model, sharding or arguments)",
            fix="call stream_weights with the same model and arguments on every rank",
            header="Cannot stream the model's weights:",
            problems=self._problems,
        )
        buckets = _buckets(_tensors(self._items), self._bucket_bytes) if self._items else []
        self._uses = Counter(id(m) for m in map(_param_merge, self._items) if m is not None)
        self.num_buckets = len(buckets)
        self.largest_bucket_bytes = max((sum(_aligned(t.nbytes) for t in b) for b in buckets), default=0)
        self._gen = self._run(buckets)
        return self

    def _released(self, item: WriteItem) -> None:
        """After ``item``: an experts' adapter gathered whole for its merge is dropped once the
        last file tensor of its weight is done (the per-expert parts of one weight may span buckets)."""
        merge = _param_merge(item)
        if merge is not None:
            self._uses[id(merge)] -= 1
            if not self._uses[id(merge)]:
                merge.release()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._gen is None or self._done:
            return
        why = "left the stream before its end" if exc is None else f"left the stream on {type(exc).__name__}: {exc}"
        self._stopped = f"rank {comm.rank()} {why}; every rank must iterate the stream to its end"
        for _ in self._gen:  # the next bucket (or the final check) raises on every rank
            pass

    def buckets(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """One list of ``(hf_name, tensor)`` per bucket, on every rank (empty where this rank
        receives nothing); the same number of buckets on every rank."""
        if self._gen is None:
            raise RuntimeError("use the stream in a with block: `with stream_weights(model) as stream: ...`")
        if self._started:
            raise RuntimeError("a WeightStream is iterated once")
        self._started = True
        yield from _Pull(self._gen)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for bucket in self.buckets():
            yield from bucket

    def _run(self, buckets: list[list[_Tensor]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
        try:
            targets = list(range(comm.world_size())) if self._to == "all" else [0]
            for k, bucket in enumerate(buckets, start=1):
                problems = comm.Problems()
                named = _fill(bucket, targets, problems, label=f"bucket {k}", done=self._released)
                comm.raise_on_every_rank(
                    [*problems, *([self._stopped] if self._stopped else [])],
                    header=f"Streaming the model's weights failed (bucket {k} of {len(buckets)}):",
                )
                yield named
                del named  # this rank's hold on the bucket, before the next one is allocated
            comm.raise_on_every_rank(
                [self._stopped] if self._stopped else [], header="Streaming the model's weights failed:"
            )
        finally:
            self._done = True


class _Pull:
    """Iterates a generator without owning it: closing the caller's generator (a ``break`` then
    garbage collection) leaves the stream's generator open, for ``__exit__`` to finish."""

    def __init__(self, gen: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
        self._gen = gen

    def __iter__(self) -> _Pull:
        return self

    def __next__(self) -> list[tuple[str, torch.Tensor]]:
        return next(self._gen)


def _param_merge(item: WriteItem) -> ParamMerge | None:
    transform = item.transform
    if isinstance(transform, PartMerge):
        transform = transform.merge
    if isinstance(transform, Fp8BaseBlocks):  # experts kept in block FP8: dequantized, then merged
        transform = transform.merge
    return transform if isinstance(transform, ParamMerge) else None


def _fill(
    bucket: list[_Tensor],
    targets: list[int],
    problems: comm.Problems,
    *,
    label: str,
    done: Callable[[WriteItem], None],
) -> list[tuple[str, torch.Tensor]]:
    """Collective: call on all ranks. One bucket: every rank computes its blocks (transformed,
    cast) into the bucket (a receiver) or a send buffer (a sender only), then one exchange.
    Returns the bucket's tensors on receiving ranks, [] elsewhere; problems are recorded, never
    raised, so the collectives always complete. ``done(item)`` runs after each item's block."""
    me, world = comm.rank(), comm.world_size()
    device = comm.comm_device(None)
    with problems.guard(label):
        fault_point(BUCKET_FAULT)
    starts, total = [], 0
    for tensor in bucket:
        starts.append(total)
        total += _aligned(tensor.nbytes)
    items = [(item, start + item.within) for tensor, start in zip(bucket, starts) for item in tensor.items]
    route = _route(items, targets, me, world)
    out = torch.empty(total, dtype=torch.uint8, device=device) if me in targets else None
    packed: dict[_Move, int] = {}  # a sender only: where each of its blocks sits in its send buffer
    send_buffer = None
    if out is None:
        moves = [m for peer in sorted(route.sends) for m in route.sends[peer]]
        send_buffer = torch.empty(sum(m.nbytes for m in moves), dtype=torch.uint8, device=device)
        offset = 0
        for move in moves:
            packed[move] = offset
            offset += move.nbytes
    by_item: dict[int, list[_Move]] = {}
    for move in packed:
        by_item.setdefault(move.item, []).append(move)
    filled = {i for i, _ in route.fills}
    for i, (item, base) in enumerate(items):
        transform: BlockFn | None = None
        with problems.guard(item.name):
            transform = item.transform.prepare(item.layout) if item.transform is not None else None  # collective
        if i in filled or i in by_item:
            with problems.guard(item.name):
                block = local_block(item, transform, device=None)
                if out is not None:
                    _item_view(out, base, item)[item.layout.piece(me).slices].copy_(block)
                for move in by_item.get(i, ()):
                    assert send_buffer is not None
                    start = packed[move]
                    send_buffer[start : start + move.nbytes].view(item.dtype).view(move.piece.shape).copy_(block)
                del block
        del transform
        done(item)
    sends, recvs, staged = [], [], []
    for peer, moves in route.sends.items():
        for run in _runs(moves):
            if send_buffer is not None:
                start = packed[run[0]]
                sends.append((send_buffer[start : start + sum(m.nbytes for m in run)], peer))
            else:
                assert out is not None
                sends.append((_from_bucket(run, out, items), peer))
    for peer, moves in route.recvs.items():
        assert out is not None  # only receiving ranks receive
        for run in _runs(moves):
            if run[0].start is not None:
                recvs.append((out[run[0].start : run[0].start + sum(m.nbytes for m in run)], peer))
            else:
                tmp = torch.empty(run[0].nbytes, dtype=torch.uint8, device=device)
                recvs.append((tmp, peer))
                staged.append((run[0], tmp))
    comm.exchange(sends, recvs)
    del sends, send_buffer
    if out is None:
        return []
    for move, tmp in staged:
        item, base = items[move.item]
        _item_view(out, base, item)[move.piece.slices].copy_(tmp.view(item.dtype).view(move.piece.shape))
    return [(t.name, out[start : start + t.nbytes].view(t.dtype).view(t.shape)) for t, start in zip(bucket, starts)]


def _item_view(out: torch.Tensor, base: int, item: WriteItem) -> torch.Tensor:
    return out[base : base + item.nbytes].view(item.dtype).view(item.shape)


def _from_bucket(run: list[_Move], out: torch.Tensor, items: list[tuple[WriteItem, int]]) -> torch.Tensor:
    """The bytes of one transfer from where this rank filled them in the bucket (a packed copy for
    a block that is not contiguous there)."""
    first = run[0]
    if first.start is not None:
        return out[first.start : first.start + sum(m.nbytes for m in run)]
    item, base = items[first.item]
    return _item_view(out, base, item)[first.piece.slices].contiguous().view(-1).view(torch.uint8)
