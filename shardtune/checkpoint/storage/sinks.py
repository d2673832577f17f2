"""How a checkpoint's bytes reach its files: the three sinks of :func:`~shardtune.checkpoint.storage.writer.write_files`.

Rule: a sink receives blocks (a tensor, its file, its byte offset) and nothing about formats;
each rank's files are fsynced before a sink reports its writes done. Pick one with
:func:`sink_for`:

* :class:`DirectSink` — every rank writes its own blocks in place, at once (``out_dir`` on a
  filesystem all ranks share);
* :class:`StagedSink` — every rank copies its blocks into CPU memory (one arena, see
  :mod:`~shardtune.checkpoint.storage.staging_memory`) and returns; :meth:`StagedSink.flush` writes
  them later, without collectives, so a background thread can while training goes on;
* :class:`Rank0Sink` — ``shared_filesystem=False``: every sharded tensor is gathered to rank 0,
  which writes it from a background thread while the next one is gathered (see
  :mod:`~shardtune.checkpoint.storage.rank0_writes`).
"""

from __future__ import annotations

import torch

from shardtune.checkpoint.storage.rank0_writes import BackgroundWrites, ByteRing
from shardtune.checkpoint.storage.safetensors_io import RangeWriter
from shardtune.checkpoint.storage.staging_memory import StagingMemory, aligned
from shardtune.checkpoint.storage.writer import FilePlan, Sink, WriteItem
from shardtune.ranks import comm
from shardtune.ranks.faults import fault_point


class FileWriter:
    """This rank's writes into already created files, fsynced by :meth:`close`.

    Reaches a file's ``fault`` point once, after the first block written into such a file."""

    def __init__(self, problems: comm.Problems, *, direct_io: bool = True) -> None:
        self.problems = problems
        self.ranges = RangeWriter(direct_io=direct_io)
        self._fault_reached = False

    def write(self, file: FilePlan, tensor: torch.Tensor, offset: int) -> None:
        try:
            self.ranges.write(file.path, tensor, offset)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{file.path} does not exist on rank {comm.rank()}; rank 0 created it, so out_dir must be on a "
                "filesystem shared by all ranks"
            ) from None
        if file.fault is not None and not self._fault_reached:
            self._fault_reached = True
            fault_point(file.fault)

    def close(self) -> None:
        for path in self.ranges.paths:
            with self.problems.guard(path):
                self.ranges.close(path)
        self.ranges.release()


class RunWriter:
    """Writes through a :class:`FileWriter`, joining blocks that continue each other both in one
    file and in memory into one range: a rank's experts stored per expert (thousands of small
    file tensors, laid out in the file as in its fused shard) go out as a few large writes
    (``O_DIRECT``) rather than thousands of small buffered ones. A block stays referenced until
    its range is written (:meth:`flush`); a failed range is recorded in the writer's problems
    under its file and bytes."""

    def __init__(self, writer: FileWriter) -> None:
        self.writer = writer
        self._run: list[torch.Tensor] = []
        self._file: FilePlan | None = None
        self._start = self._end = self._next_ptr = 0

    def write(self, file: FilePlan, tensor: torch.Tensor, offset: int) -> None:
        joinable = tensor.device.type == "cpu" and tensor.is_contiguous()
        if joinable and self._continues(file, tensor, offset):
            self._run.append(tensor)
            self._end += tensor.nbytes
            self._next_ptr += tensor.nbytes
            return
        self.flush()
        if not joinable:
            self.writer.write(file, tensor, offset)
            return
        self._file, self._run = file, [tensor]
        self._start, self._end, self._next_ptr = offset, offset + tensor.nbytes, tensor.data_ptr() + tensor.nbytes

    def _continues(self, file: FilePlan, tensor: torch.Tensor, offset: int) -> bool:
        return (
            bool(self._run)
            and file is self._file
            and offset == self._end
            and tensor.data_ptr() == self._next_ptr
            and tensor.untyped_storage().data_ptr() == self._run[0].untyped_storage().data_ptr()
        )

    def flush(self) -> None:
        """Write the pending range."""
        if not self._run or self._file is None:
            return
        run, file, self._run, self._file = self._run, self._file, [], None
        data = run[0]
        if len(run) > 1:  # one byte view over the run: its blocks are adjacent in one storage
            storage = data.untyped_storage()
            start = data.data_ptr() - storage.data_ptr()
            data = torch.empty(0, dtype=torch.uint8).set_(storage, start, (self._end - self._start,), (1,))
        with self.writer.problems.guard(f"{file.path} bytes [{self._start}, {self._end})"):
            self.writer.write(file, data, self._start)


class DirectSink:
    """Every rank writes its blocks in place as they come (``O_DIRECT`` for large ranges where
    the filesystem allows it, see :class:`~shardtune.checkpoint.storage.safetensors_io.RangeWriter`)."""

    gathers_sharded = False
    block_device: str | None = "cpu"  # written at once, straight from CPU views

    def __init__(self, *, direct_io: bool = True) -> None:
        self.direct_io = direct_io
        self._writer: RunWriter | None = None

    def begin(self, blocks: list[tuple[WriteItem, int]], problems: comm.Problems) -> None:
        self._writer = RunWriter(FileWriter(problems, direct_io=self.direct_io))

    def buffer(self, item: WriteItem) -> torch.Tensor | None:
        return None

    def write(self, file: FilePlan, tensor: torch.Tensor, offset: int, *, buffered: bool = False) -> None:
        # The blocks are the model's own memory, unchanged until the save returns: a block joined
        # to the pending range is written by a later call or by finish().
        assert self._writer is not None, "begin() first"
        self._writer.write(file, tensor, offset)

    def finish(self) -> None:
        assert self._writer is not None, "begin() first"
        try:
            self._writer.flush()
        finally:
            self._writer.writer.close()


class StagedSink:
    """Every rank copies its blocks into CPU memory; :meth:`flush` writes them into the files.

    The copies go into one arena of exactly their size (``memory``'s, kept for the next save
    of that size, when given; else one that goes with this sink). The model and optimizer may
    change once the write has returned: the files get the state at staging time."""

    gathers_sharded = False
    block_device: str | None = None  # blocks stay where the shards live until copied into the arena

    def __init__(self, *, memory: StagingMemory | None = None, direct_io: bool = True) -> None:
        self.memory = memory if memory is not None else StagingMemory()
        self.direct_io = direct_io
        self.blocks: list[tuple[FilePlan, torch.Tensor, int]] = []

    def begin(self, blocks: list[tuple[WriteItem, int]], problems: comm.Problems) -> None:
        on_accelerator = any(item.device.type != "cpu" for item, _ in blocks)
        self.memory.reserve(sum(aligned(nbytes) for _, nbytes in blocks), pinned=on_accelerator)

    def buffer(self, item: WriteItem) -> torch.Tensor | None:
        return None

    def write(self, file: FilePlan, tensor: torch.Tensor, offset: int, *, buffered: bool = False) -> None:
        # A copy, never a view: the model and optimizer keep training while it waits.
        copy = self.memory.take(tensor)  # the slice begin() reserved for this block
        copy.copy_(tensor)
        self.blocks.append((file, copy, offset))

    def finish(self) -> None:
        pass

    @property
    def nbytes(self) -> int:
        """Bytes staged and not yet flushed."""
        return sum(t.nbytes for _, t, _ in self.blocks)

    def flush(self) -> list[str]:
        """Write every staged block and fsync the files; returns this rank's problems. No
        collectives: it may run in a background thread. The checkpoint is complete once every
        rank's flush has returned none."""
        problems = comm.Problems()
        writer = RunWriter(FileWriter(problems, direct_io=self.direct_io))
        blocks, self.blocks = self.blocks, []
        for file, tensor, offset in blocks:
            with problems.guard(file.path):
                writer.write(file, tensor, offset)
        writer.flush()
        writer.writer.close()
        return list(problems)


class Rank0Sink:
    """Rank 0 alone writes (``out_dir`` only on its filesystem): every sharded tensor is gathered
    to it into a reused :class:`~shardtune.checkpoint.storage.rank0_writes.ByteRing` (the largest
    tensor's size) and written by a background thread while the next one is gathered; the
    other ranks only send. Rank 0's write problems are raised on every rank by the caller."""

    gathers_sharded = True
    block_device: str | None = "cpu"  # queued as CPU tensors

    def __init__(self, *, direct_io: bool = True) -> None:
        self.direct_io = direct_io
        self._ring: ByteRing | None = None
        self._background: BackgroundWrites | None = None
        self._writer: FileWriter | None = None

    def begin(self, blocks: list[tuple[WriteItem, int]], problems: comm.Problems) -> None:
        if comm.rank() != 0:
            return
        self._ring = ByteRing(max((item.nbytes for item, _ in blocks if item.layout.is_sharded), default=0))
        self._writer = FileWriter(problems, direct_io=self.direct_io)
        self._background = BackgroundWrites(self._writer, problems)

    def buffer(self, item: WriteItem) -> torch.Tensor | None:
        return self._ring.take(item.shape, item.dtype) if self._ring is not None else None

    def write(self, file: FilePlan, tensor: torch.Tensor, offset: int, *, buffered: bool = False) -> None:
        # Unbuffered blocks are the model's own memory: the save waits for their write (finish).
        assert self._background is not None and self._ring is not None, "begin() first"
        self._background.write(file, tensor, offset, done=self._ring.release_oldest if buffered else None)

    def finish(self) -> None:
        if self._background is not None and self._writer is not None:  # begin() sets both
            self._background.close()
            self._writer.close()


def sink_for(*, shared_filesystem: bool, direct_io: bool = True) -> DirectSink | Rank0Sink:
    """The synchronous sink for ``out_dir`` on a filesystem all ranks share (each rank writes
    its blocks) or only on rank 0's (rank 0 writes everything)."""
    return DirectSink(direct_io=direct_io) if shared_filesystem else Rank0Sink(direct_io=direct_io)


def resolve_sink(sink: Sink | None, *, shared_filesystem: bool) -> Sink:
    """``sink``, or :func:`sink_for` when None; a sink that writes on every rank is refused
    without a shared filesystem (only rank 0 can reach ``out_dir`` then)."""
    if sink is None:
        return sink_for(shared_filesystem=shared_filesystem)
    if not shared_filesystem and not sink.gathers_sharded:
        raise ValueError(
            f"shared_filesystem=False needs a sink that gathers to rank 0 (Rank0Sink), not {type(sink).__name__}"
        )
    return sink
