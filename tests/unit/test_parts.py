"""The N:1 key mapping's geometry (shardtune.state_dict.parts) and the lazy-tensor Protocol, by hand."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardtune.checkpoint.safetensors_io import SafetensorsFile
from shardtune.state_dict.layout import Piece, TensorLayout
from shardtune.state_dict.lazy import BlockReader, is_lazy, lazy_dtype
from shardtune.state_dict.parts import part_block, part_layout, stacked_parts, tiling_problem

SHAPE = (2, 6, 4)  # [E, 2I, H], I = 3


def _parts():
    return stacked_parts(SHAPE, lambda e, c: f"{e}.{('gate', 'up')[c]}", chunks=2)


def test_stacked_parts_cut_experts_then_chunks():
    parts = _parts()
    assert [p.name for p in parts] == ["0.gate", "0.up", "1.gate", "1.up"]
    assert [p.region.offset for p in parts] == [(0, 0, 0), (0, 3, 0), (1, 0, 0), (1, 3, 0)]
    assert all(p.shape == (3, 4) for p in parts)
    assert tiling_problem("w", SHAPE, tuple(parts)) is None
    assert "do not tile" in tiling_problem("w", SHAPE, tuple(parts[:3]))


def test_a_row_piece_that_crosses_a_chunk_boundary_meets_both_chunks_as_row_ranges():
    full = torch.arange(48.0).reshape(SHAPE)
    piece = Piece(shape=(2, 2, 4), offset=(0, 2, 0))  # rows 2..3 of every expert: gate row 2, up row 0
    local = full[:, 2:4]
    layout = TensorLayout(shape=SHAPE, pieces=(piece, Piece(shape=(2, 4, 4), offset=(0, 0, 0))))
    for part in _parts():
        e, chunk = int(part.name[0]), part.name[2:]
        expected = full[e, 2:3] if chunk == "gate" else full[e, 3:4]
        assert torch.equal(part_block(part, piece, local), expected)
        block = part_layout(part, layout).pieces[0]
        assert block == Piece(shape=(1, 4), offset=(2, 0) if chunk == "gate" else (0, 0))
        assert block.is_row_range(part.shape)


def test_a_piece_that_misses_a_part_gives_an_empty_block():
    piece = Piece(shape=(1, 6, 4), offset=(1, 0, 0))  # expert 1 only
    gate0 = _parts()[0]
    assert part_block(gate0, piece, torch.zeros(1, 6, 4)).numel() == 0
    assert part_layout(gate0, TensorLayout(shape=SHAPE, pieces=(piece,))).pieces[0].numel == 0


def test_safetensors_slices_and_ours_are_lazy_tensors(tmp_path):
    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.zeros(2, 3, dtype=torch.bfloat16)}, path)
    with safe_open(path, "pt") as f:
        theirs = f.get_slice("w")
        assert is_lazy(theirs) and lazy_dtype(theirs) == torch.bfloat16
    file = SafetensorsFile(path)
    try:
        ours = file.slice("w")
        assert is_lazy(ours) and isinstance(ours, BlockReader) and lazy_dtype(ours) == torch.bfloat16
    finally:
        file.close()
    assert not is_lazy(torch.zeros(1)) and not is_lazy([1, 2])
