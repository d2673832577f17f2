"""Tensors of a source HF checkpoint copied into a save unchanged: the towers of a multimodal checkpoint
that shardtune does not train (vision, multi-token prediction), beside the trained text tower.

Rule: a carried tensor is a :class:`~shardtune.checkpoint.storage.writer.WriteItem` whose source is the
tensor in the source files (read lazily, in its own dtype, so the bytes written are the bytes read) and
whose layout splits its rows evenly over the ranks: each rank copies only its share, straight from the
source file into the output file, as it writes its shards of the model (a sink that gathers has rank 0
copy it whole, as it writes everything). Which tensors are carried, and which towers must be there,
is the multimodal spec's (:mod:`shardtune.models.multimodal`).
"""

from __future__ import annotations

import math
import os

import torch

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.formats.hf_load import open_hf_checkpoint
from shardtune.checkpoint.storage.safetensors_io import TensorSlice
from shardtune.checkpoint.storage.writer import WriteItem
from shardtune.models.args import ModelArgs
from shardtune.models.multimodal import carried_keys, spec_of, tower_problems
from shardtune.state_dict.layout import Piece, TensorLayout

__all__ = ["carried_items", "row_shares"]


class CarriedTensor:
    """A tensor of the source files as a lazy tensor; each read opens, reads and closes its file, so
    a save plan holds no file descriptor."""

    def __init__(self, source: TensorSlice) -> None:
        self.source = source

    def get_shape(self) -> list[int]:
        return self.source.get_shape()

    def get_dtype(self) -> str:
        return self.source.get_dtype()

    def __getitem__(self, index: object) -> torch.Tensor:
        try:
            return self.source[index]
        finally:
            self.source.file.close()


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
    args: ModelArgs | None, source_dir: str | os.PathLike | None, *, world: int
) -> tuple[list[WriteItem], list[str]]:
    """The source tensors a save of the model of ``args`` carries through (none for a text model),
    in the source's name order, and the problems found (not raised): no ``source_dir``, unreadable
    files, a tower the config names that the files lack. Local: only headers are read."""
    if args is None or spec_of(args) is None:
        return [], []
    if source_dir is None:
        return [], [
            "the text tower of a multimodal checkpoint is saved with its other towers copied from the checkpoint "
            "it was loaded from; pass source_dir=<that HF model directory>"
        ]
    try:
        with open_hf_checkpoint(source_dir) as source:
            keys = sorted(source)
            problems = tower_problems(args, keys, os.fspath(source_dir))
            tensors = {key: source[key] for key in carried_keys(args, keys)}
    except CheckpointError as exc:
        return [], [f"source_dir: {exc}"]
    items = [
        WriteItem(key, CarriedTensor(tensor), tensor.dtype, row_shares(tensor.shape, world))
        for key, tensor in tensors.items()
    ]
    return items, problems
