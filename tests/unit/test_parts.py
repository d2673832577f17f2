"""The N:1 key mapping's geometry (shardtune.state_dict.parts) and the lazy-tensor Protocol, by hand."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shardtune.checkpoint.storage.safetensors_io import SafetensorsFile
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


class _MixtralExperts(torch.nn.Module):
    """Mixtral's runtime experts (``mlp.experts``) whose files say ``block_sparse_moe.experts.{e}.w1/w3/w2``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(3, 4, 5))  # [E, 2I, H]: w1 rows, then w3
        self.down_proj = torch.nn.Parameter(torch.randn(3, 5, 2))  # [E, H, I]: w2

    def file_parts(self, prefix, name, shape):
        disk = prefix.replace(".mlp.", ".block_sparse_moe.")
        if name == "gate_up_proj":
            return stacked_parts(shape, lambda e, c: f"{disk}.{e}.{('w1', 'w3')[c]}.weight", chunks=2)
        return stacked_parts(shape, lambda e, c: f"{disk}.{e}.w2.weight")


def _mixtral():
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.layers[0].mlp = torch.nn.Module()
    model.layers[0].mlp.experts = _MixtralExperts()
    return model


def test_a_module_renames_its_file_tensors_and_a_single_process_round_trip_keeps_them(tmp_path):
    from safetensors.torch import load_file

    from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
    from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint

    model = _mixtral()
    experts = model.layers[0].mlp.experts
    save_hf_checkpoint(model, tmp_path, config={"model_type": "mixtral"})
    saved = load_file(str(tmp_path / "model.safetensors"))
    disk = "layers.0.block_sparse_moe.experts"
    expected = {}
    for e in range(3):
        expected[f"{disk}.{e}.w1.weight"] = experts.gate_up_proj[e, :2]
        expected[f"{disk}.{e}.w3.weight"] = experts.gate_up_proj[e, 2:]
        expected[f"{disk}.{e}.w2.weight"] = experts.down_proj[e]
    assert sorted(saved) == sorted(expected)
    assert all(torch.equal(saved[k], v.detach()) for k, v in expected.items())
    fresh = _mixtral()
    result = load_hf_checkpoint(fresh, tmp_path, device="cpu", strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for name, param in fresh.named_parameters():
        assert torch.equal(param, dict(model.named_parameters())[name]), name
