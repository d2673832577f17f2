"""gpt-oss MXFP4 experts read per piece, against transformers' ``convert_moe_packed_tensors`` of the whole file.

The test quantizes a tiny model itself: random FP4 bytes and exponents near the bias (every byte is
a valid pair of FP4 values) in transformers' ``*_blocks``/``*_scales`` layout. Every block a piece
asks for equals the same block of transformers' dequantization of the whole tensor; a piece cutting
a block of 32 is refused naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from shardtune.checkpoint import CheckpointError
from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint, open_hf_checkpoint
from shardtune.checkpoint.formats.mxfp4 import dequantizing
from shardtune.models import from_hf_config

# H = 96 (3 blocks), I = 64 (2 blocks), 2I = 128 != H
MXFP4_CHANGES = {"hidden_size": 96, "intermediate_size": 64}


def quantized_dir(directory: Path, **changes) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A tiny gpt-oss saved by transformers with its experts replaced by random MXFP4 ones: the file's
    tensors and transformers' dequantization of each quantized one (bf16, runtime layout)."""
    from tests.unit.test_models_gpt_oss import hf_gpt_oss

    hf = hf_gpt_oss(**{**MXFP4_CHANGES, **changes}).to(torch.bfloat16)
    hf.save_pretrained(directory)
    tensors = safetensors.torch.load_file(directory / "model.safetensors")
    gen = torch.Generator().manual_seed(3)
    expected = {}
    for name in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inner, outer = tensors.pop(name).shape  # runtime [E, in, out]; stored [E, out, in / 32, 16]
        blocks = torch.randint(0, 256, (experts, outer, inner // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 130, (experts, outer, inner // 32), generator=gen, dtype=torch.uint8)
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        expected[name] = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=torch.bfloat16)
    safetensors.torch.save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return tensors, expected


def test_pieces_equal_transformers_dequantization_of_the_whole_tensor(tmp_path):
    _, expected = quantized_dir(tmp_path)
    with open_hf_checkpoint(tmp_path) as checkpoint:
        view = dequantizing(checkpoint)
        assert set(expected) <= set(view) and not any(k.endswith(("_blocks", "_scales")) for k in view)
        for name, full in expected.items():
            lazy = view[name]
            assert lazy.get_shape() == list(full.shape)
            for index in [
                (slice(None),),
                (slice(2, 5),),
                (slice(1, 3), slice(32, 64)),
                (slice(0, 8), slice(None), slice(5, 9)),
            ]:
                assert torch.equal(lazy[index], full[index]), (name, index)


def test_a_piece_cutting_a_block_is_refused_naming_the_tensor(tmp_path):
    quantized_dir(tmp_path)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    with open_hf_checkpoint(tmp_path) as checkpoint:
        with pytest.raises(CheckpointError, match=rf"{name}: a piece of rows 0:48 of dim 1 cuts the MXFP4 blocks"):
            dequantizing(checkpoint)[name][:, :48]


def test_a_lonely_half_is_refused_naming_it(tmp_path):
    tensors, _ = quantized_dir(tmp_path)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    safetensors.torch.save_file(tensors, tmp_path / "model.safetensors")
    with open_hf_checkpoint(tmp_path) as checkpoint, pytest.raises(CheckpointError, match="down_proj_scales"):
        dequantizing(checkpoint)


def test_the_model_loads_the_dequantized_experts_in_one_process(tmp_path):
    tensors, expected = quantized_dir(tmp_path)
    model = from_hf_config(tmp_path, device="meta", dtype=torch.bfloat16)
    load_hf_checkpoint(model, tmp_path, device="cpu", strict=True)
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected.get(name, tensors.get(name))), name
