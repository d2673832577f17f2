"""Tensors of a source HF checkpoint copied into a save unchanged: the towers of a multimodal checkpoint
that shardtune does not train (vision, multi-token prediction), beside the trained text tower, and the layers
a family's checkpoints hold after the model's own (DeepSeek-V3's and GLM-4.5's multi-token prediction).

Rule: a carried tensor is a :class:`~shardtune.checkpoint.storage.writer.WriteItem` whose source is the
tensor in the source files (read lazily, in its own dtype, so the bytes written are the bytes read) and
whose layout splits its rows evenly over the ranks: each rank copies only its share, straight from the
source file into the output file, as it writes its shards of the model (a sink that gathers has rank 0
copy them whole, as it writes everything). Which tensors are carried comes from the source's headers
(:class:`CarriedSource`), read by every rank, or by rank 0 alone and shared when only it sees the files;
which tensors are the model's and which towers must be there is :mod:`shardtune.models.multimodal`'s.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.formats import block_fp8
from shardtune.checkpoint.formats.hf_load import open_hf_checkpoint
from shardtune.checkpoint.storage.safetensors_io import HeaderEntry, SafetensorsFile
from shardtune.checkpoint.storage.writer import WriteItem
from shardtune.models.args import ModelArgs
from shardtune.models.multimodal import carried_keys, carries, spec_of, tower_problems
from shardtune.ranks import comm
from shardtune.state_dict.layout import Piece, TensorLayout

__all__ = ["CarriedSource", "agree_on_carried", "carried_items", "read_carried", "row_shares"]


@dataclass(frozen=True)
class CarriedSource:
    """The tensors a save copies from ``directory``: each one's file and header entry, in name order,
    and the problems found reading them (a missing tower, unreadable files)."""

    directory: str
    tensors: tuple[tuple[str, HeaderEntry], ...] = ()  # (file name, its header's entry)
    problems: tuple[str, ...] = ()


def read_carried(
    args: ModelArgs | None, source_dir: str | os.PathLike | None, *, required: bool = True
) -> CarriedSource | None:
    """The source tensors a save of the model of ``args`` carries (None for a text model). Local: only
    headers are read; problems are recorded, not raised. Without ``source_dir`` that is a problem for the
    text tower of a multimodal checkpoint, and for another model when ``required`` (it was loaded from
    files holding tensors it does not use: a config may name layers transformers' own saves leave out)."""
    if args is None or not carries(args):
        return None
    if source_dir is None and spec_of(args) is None and not required:
        return None
    if source_dir is None:
        return CarriedSource(
            "",
            problems=(
                "the text tower of a multimodal checkpoint, or a model whose checkpoint holds layers it does not "
                "use (multi-token prediction), is saved with those tensors copied from the checkpoint it was "
                "loaded from; pass source_dir=<that HF model directory> (shardtune convert: --base-dir)",
            ),
        )
    directory = os.fspath(source_dir)
    try:
        with open_hf_checkpoint(directory) as source:
            keys = sorted(source)
            problems = tower_problems(args, keys, directory)
            tensors = tuple(
                (file, source.files[file].entries[key])
                for key in carried_keys(args, keys)
                for file in (source.weight_map[key],)
            )
    except CheckpointError as exc:
        return CarriedSource(directory, problems=(f"source_dir: {exc}",))
    return CarriedSource(directory, tensors, tuple(problems))


def agree_on_carried(
    args: ModelArgs | None, source_dir: str | os.PathLike | None, *, every_rank_reads: bool, required: bool = True
) -> CarriedSource | None:
    """Collective: call on all ranks. :func:`read_carried` on every rank, or, without
    ``every_rank_reads`` (the files only on rank 0's node), on rank 0, whose result every rank returns."""
    if every_rank_reads:
        return read_carried(args, source_dir, required=required)
    mine = read_carried(args, source_dir, required=required) if comm.rank() == 0 else None
    return comm.all_gather_objects(mine)[0]


class CarriedTensor:
    """A tensor of the source files as a lazy tensor; each read opens, reads and closes its file (a save
    plan holds no file descriptor), and nothing is read where nothing is asked for."""

    def __init__(self, path: str, entry: HeaderEntry) -> None:
        self.path = path
        self.entry = entry

    @property
    def dtype(self) -> torch.dtype:
        return self.entry.dtype

    def get_shape(self) -> list[int]:
        return list(self.entry.shape)

    def __getitem__(self, index: object) -> torch.Tensor:
        file = SafetensorsFile(self.path, entries={self.entry.name: self.entry})
        try:
            return file.slice(self.entry.name)[index]
        finally:
            file.close()


def row_shares(shape: tuple[int, ...], world: int) -> TensorLayout:
    """``shape``'s rows split evenly over ``world`` ranks (the first ones get one more; a scalar: rank 0 alone)."""
    if not shape:
        return TensorLayout(shape=shape, pieces=None)
    rows, rest = shape[0], tuple(shape[1:])
    per = math.ceil(rows / world)
    pieces = []
    for rank in range(world):
        start, stop = min(rows, rank * per), min(rows, (rank + 1) * per)
        pieces.append(Piece(shape=(stop - start, *rest), offset=(start, *(0,) * len(rest))))
    return TensorLayout(shape=shape, pieces=tuple(pieces))


def carried_items(
    source: CarriedSource | None, *, world: int, dequantize_to: torch.dtype | None = None
) -> tuple[list[WriteItem], list[str]]:
    """The write items of ``source``'s tensors (none for a text model) and its problems. With ``dequantize_to``
    (a save in a plain dtype), block-FP8 tensors among them are written dequantized in that dtype and their
    scale tensors left out, as the model's own are: a file without ``quantization_config`` holds no FP8 weight."""
    if source is None:
        return [], []
    lazy = {entry.name: CarriedTensor(os.path.join(source.directory, file), entry) for file, entry in source.tensors}
    tensors: Mapping[str, Any] = lazy
    problems = list(source.problems)
    # the hub's DeepSeek-V3 multi-token-prediction layer is block FP8 like the rest of its weights
    fp8 = any(entry.dtype == block_fp8.FP8_DTYPE for _, entry in source.tensors)
    if fp8 and dequantize_to is not None:
        try:
            tensors, _ = block_fp8.dequantizing(
                lazy, block_fp8.read_quantization(source.directory), where=source.directory
            )
        except CheckpointError as exc:
            problems.append(str(exc))
    items = []
    for name in tensors:
        value = tensors[name]
        dtype = value.entry.dtype if isinstance(value, CarriedTensor) else dequantize_to or torch.bfloat16
        items.append(WriteItem(name, value, dtype, row_shares(tuple(value.get_shape()), world)))
    return items, problems
