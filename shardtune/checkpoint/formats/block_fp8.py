"""Block-FP8 checkpoints (DeepSeek-V3's format) on disk, dequantized per rank while reading.

Rule: a directory whose ``config.json`` declares ``quantization_config = {"quant_method": "fp8",
"weight_block_size": [b0, b1], ...}`` stores each quantized weight ``W [..., R, C]`` as
``float8_e4m3fn`` beside ``<W>_scale_inv`` (float32 ``[..., ceil(R / b0), ceil(C / b1)]``, edge
blocks partial), and ``W = W_fp8.float() * scale_inv`` per block. :func:`dequantizing` presents
each such pair as one lazy float32 tensor of ``W``'s shape: indexing it reads only the FP8 rows of
the piece and the scale rows and columns covering them, and dequantizes that piece alone (it may
start or end inside a block), so each rank dequantizes its own piece and rank 0 of a rank-0 load
sends each rank only its piece in the training dtype. Every inconsistency (a scale missing, of the
wrong shape or not finite, a block size that does not match the scales, FP8 tensors without a
``quantization_config``, an unknown ``quant_method``) is refused naming the tensor or key and the
fix: a weight is never read unscaled. A model that keeps a weight in block FP8 (a LoRA base,
:mod:`shardtune.peft.fp8_base`; frozen routed experts, :mod:`shardtune.models.blocks.fp8_experts`) reads it raw instead, beside its row-expanded scales
(``<W>_scale_rows``, :func:`row_scales`), both by rows as any tensor is. The format read is kept on the model
(:func:`note_source`), for a save in the same format
(:mod:`~shardtune.checkpoint.formats.block_fp8_save`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.layout import CONFIG_FILE
from shardtune.state_dict.fp8_blocks import FP8_DTYPE, FP8_MAX, ROWS_SUFFIX, dequantize_block_fp8, scale_blocks

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "BlockFp8Format",
    "BlockFp8Tensor",
    "dequantize_block_fp8",
    "dequantizing",
    "fp8_block_of",
    "note_source",
    "read_quantization",
    "row_scales",
    "scale_blocks",
    "scale_name",
    "source_of",
]

SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_KEY = "quantization_config"
# quant_methods another reader handles: gpt-oss's MXFP4 experts (shardtune.checkpoint.formats.mxfp4)
OTHER_METHODS = ("mxfp4",)
SOURCE_ATTR = "block_fp8_source"  # the model attribute a load of a block-FP8 directory sets


def scale_name(name: str) -> str:
    """The scale tensor of FP8 tensor ``name`` (``x.weight`` -> ``x.weight_scale_inv``)."""
    return name + SCALE_SUFFIX


@dataclass(frozen=True)
class BlockFp8Format:
    """A block-FP8 directory's format: its ``quantization_config``, the block, the FP8 file tensors."""

    config: dict[str, Any]
    block: tuple[int, int]
    names: frozenset[str]


def read_quantization(model_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The block-FP8 ``quantization_config`` of ``model_dir``'s ``config.json`` (validated), or None when
    it declares none (or one another reader handles); an unknown ``quant_method``, a scheme this reader
    cannot apply or a malformed ``weight_block_size`` is refused naming the key and the fix."""
    path = os.path.join(os.fspath(model_dir), CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupt JSON ({exc}); re-copy or re-save the checkpoint") from None
    quant = config.get(QUANTIZATION_KEY) if isinstance(config, dict) else None
    if quant is None:
        return None
    where = f"{path}: {QUANTIZATION_KEY}"
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method in OTHER_METHODS:
        return None
    if method != "fp8":
        raise CheckpointError(
            f'{where}.quant_method={method!r} is not supported: shardtune reads block-FP8 ("fp8") and gpt-oss '
            f'MXFP4 ("mxfp4") checkpoints; dequantize the weights with their own tool and save them without '
            f"{QUANTIZATION_KEY}"
        )
    block = quant.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(
            f"{where}.weight_block_size={block!r}: need two positive ints (the rows and columns of a block, "
            "e.g. [128, 128]); per-tensor FP8 scales are not supported"
        )
    if quant.get("fmt", "e4m3") != "e4m3" or quant.get("activation_scheme", "dynamic") != "dynamic":
        raise CheckpointError(
            f"{where}: fmt={quant.get('fmt')!r}, activation_scheme={quant.get('activation_scheme')!r}: only "
            "e4m3 weights with dynamic activation scales are supported"
        )
    return dict(quant)


def fp8_block_of(model_dir: str | os.PathLike, *, key: str) -> tuple[int, int]:
    """The ``weight_block_size`` of the block-FP8 checkpoint ``model_dir``, for the option ``key`` that needs
    one; refused naming ``key`` and the fix when ``model_dir`` is not a block-FP8 checkpoint."""
    quant = read_quantization(model_dir)
    if quant is None:
        raise CheckpointError(
            f'{key}="block_fp8" keeps a block-FP8 checkpoint\'s weights in FP8, but {os.fspath(model_dir)} declares no '
            f'block-FP8 {QUANTIZATION_KEY} in its {CONFIG_FILE}; set {key} to false (or "nf4") for this model'
        )
    block = quant["weight_block_size"]
    return block[0], block[1]


class BlockFp8Tensor:
    """One block-FP8 tensor of a checkpoint as a lazy float32 tensor (see the module docstring)."""

    def __init__(self, name: str, weight: Any, scale: Any, block: tuple[int, int]) -> None:
        self.name, self.weight, self.scale, self.block = name, weight, scale, block
        self.shape = tuple(weight.get_shape())

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index: Any) -> torch.Tensor:
        slices = _unit_slices(index, self.shape, self.name)
        (r0, r1, _), (c0, c1, _) = (s.indices(n) for s, n in zip(slices[-2:], self.shape[-2:]))
        b0, b1 = self.block
        covering = (slice(r0 // b0, -(-r1 // b0)), slice(c0 // b1, -(-c1 // b1)))
        if r1 <= r0 or c1 <= c0 or any(s.indices(n)[1] <= s.indices(n)[0] for s, n in zip(slices[:-2], self.shape)):
            return self.weight[slices].to(torch.float32)
        scale = self.scale[(*slices[:-2], *covering)]
        if not bool(torch.isfinite(scale).all()):
            raise CheckpointError(
                f"{scale_name(self.name)}: non-finite scales in blocks {covering[0].start}:{covering[0].stop} x "
                f"{covering[1].start}:{covering[1].stop}; the checkpoint is damaged, re-download or re-export it"
            )
        return dequantize_block_fp8(self.weight[slices], scale, self.block, (r0, c0))


def row_scales(scale_inv: torch.Tensor, first_row: int, rows: int, block_rows: int) -> torch.Tensor:
    """Rows ``[first_row, first_row + rows)`` (of dim -2) of a weight's row-expanded scales (float32
    ``[..., rows, ceil(C / b1)]``: each row the scales of the blocks it lies in), from its block scales
    ``scale_inv [..., r, c]``, which start at the block row covering ``first_row``."""
    index = torch.arange(first_row, first_row + rows) // block_rows - first_row // block_rows
    return scale_inv.to(torch.float32)[..., index.to(scale_inv.device), :]


class RowScales:
    """The row-expanded scales of a block-FP8 weight ``[..., R, C]`` of the checkpoint as a lazy float32
    tensor ``[..., R, ceil(C / b1)]``: a slice reads only the block rows covering it."""

    def __init__(self, name: str, scale: Any, rows: int, block: tuple[int, int]) -> None:
        self.name, self.scale, self.block = name, scale, block
        stored = tuple(scale.get_shape())
        self.shape = (*stored[:-2], rows, stored[-1])

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, index: Any) -> torch.Tensor:
        slices = _unit_slices(index, self.shape, self.name)
        lead, (rows, cols) = slices[:-2], (s.indices(n) for s, n in zip(slices[-2:], self.shape[-2:]))
        b0 = self.block[0]
        if rows[1] <= rows[0]:
            lead_shape = [len(range(*s.indices(n))) for s, n in zip(lead, self.shape)]
            return torch.empty(*lead_shape, 0, max(0, cols[1] - cols[0]), dtype=torch.float32)
        scale = self.scale[(*lead, slice(rows[0] // b0, -(-rows[1] // b0)), slice(cols[0], cols[1]))]
        if not bool(torch.isfinite(scale).all()):
            raise CheckpointError(
                f"{self.name}: non-finite scales in block rows {rows[0] // b0}:{-(-rows[1] // b0)}; the checkpoint "
                "is damaged, re-download or re-export it"
            )
        return row_scales(scale, rows[0], rows[1] - rows[0], b0)


def _unit_slices(index: Any, shape: tuple[int, ...], name: str) -> tuple[slice, ...]:
    index = index if isinstance(index, tuple) else (index,)
    if index == (Ellipsis,):
        index = ()
    if len(index) > len(shape) or not all(isinstance(s, slice) and s.step in (None, 1) for s in index):
        raise CheckpointError(f"{name}: block-FP8 tensors are read by unit-step slices, got {index!r}")
    return tuple(index) + (slice(None),) * (len(shape) - len(index))


class _Dequantizing(Mapping[str, Any]):
    """``checkpoint`` with each FP8 tensor shown dequantized and its scale tensor hidden."""

    def __init__(
        self, checkpoint: Mapping[str, Any], names: frozenset[str], block: tuple[int, int], raw: frozenset[str]
    ) -> None:
        self.checkpoint, self.names, self.block, self.raw = checkpoint, names, block, raw
        self.rows = {name + ROWS_SUFFIX: name for name in raw}
        kept = [k for k in checkpoint if not (k.endswith(SCALE_SUFFIX) and k.removesuffix(SCALE_SUFFIX) in names)]
        self.keys_ = kept + sorted(self.rows)

    def __getitem__(self, key: str) -> Any:
        if key in self.raw:
            return self.checkpoint[key]
        if key in self.rows:
            weight = self.rows[key]
            rows = tuple(self.checkpoint[weight].get_shape())[-2]
            return RowScales(scale_name(weight), self.checkpoint[scale_name(weight)], rows, self.block)
        if key in self.names:
            return BlockFp8Tensor(key, self.checkpoint[key], self.checkpoint[scale_name(key)], self.block)
        if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in self.names:
            raise KeyError(key)
        return self.checkpoint[key]

    def __contains__(self, key: object) -> bool:
        return key in self.names or key in self.rows or (key in self.checkpoint and not self._is_scale(key))

    def _is_scale(self, key: object) -> bool:
        return isinstance(key, str) and key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys_)

    def __len__(self) -> int:
        return len(self.keys_)


def dequantizing(
    checkpoint: Mapping[str, Any],
    quantization: dict[str, Any] | None,
    *,
    where: str,
    raw: frozenset[str] = frozenset(),
    block: tuple[int, int] | None = None,
) -> tuple[Mapping[str, Any], BlockFp8Format | None]:
    """``checkpoint`` itself, or a view dequantizing its block-FP8 tensors as they are read, and the format
    read (None when the directory ``where`` holds no FP8 tensors). ``quantization``: its validated
    ``quantization_config`` (:func:`read_quantization`). Every FP8 tensor must have a finite-shaped scale
    of the shape the block size gives, and every scale its FP8 tensor; refused naming them otherwise.
    ``raw``: the FP8 tensors the model keeps in FP8 (with ``block``, the block it was built for), shown as
    stored beside their row-expanded scales ``<name>_scale_rows``; each must be an FP8 tensor of the
    checkpoint in that block, refused naming it and the fix otherwise."""
    fp8 = sorted(k for k in checkpoint if _dtype(checkpoint[k]) == FP8_DTYPE)
    scales = sorted(k for k in checkpoint if k.endswith(SCALE_SUFFIX))
    if raw and (quantization is None or not fp8):
        raise CheckpointError(
            f'{where}: the model keeps {_few(sorted(raw))} in block FP8 (LoRA quantize_base="block_fp8"), but '
            "this is not a block-FP8 checkpoint; set lora.quantize_base to false (or nf4) for it"
        )
    if not fp8 and not scales:
        return checkpoint, None
    if quantization is None:
        raise CheckpointError(
            f"{where}: holds FP8 or scale tensors ({_few(fp8 or scales)}) but its {CONFIG_FILE} has no "
            f"{QUANTIZATION_KEY}: their scales cannot be applied; add the {QUANTIZATION_KEY} the checkpoint was "
            'published with (e.g. {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", '
            '"weight_block_size": [128, 128]})'
        )
    stored = (quantization["weight_block_size"][0], quantization["weight_block_size"][1])
    problems = [p for name in fp8 if (p := _scale_problem(checkpoint, name, stored)) is not None]
    names = frozenset(fp8)
    problems += [
        f"{key}: a scale tensor whose weight {key.removesuffix(SCALE_SUFFIX)} is not a float8_e4m3fn tensor of the "
        "checkpoint; remove it or re-export the checkpoint"
        for key in scales
        if key.removesuffix(SCALE_SUFFIX) not in names
    ]
    if problems:
        raise CheckpointError(f"{where}: invalid block-FP8 checkpoint: " + "; ".join(problems))
    unquantized = sorted(raw - names)
    if unquantized:
        raise CheckpointError(
            f"{where}: {_few(unquantized)} not stored in block FP8, but the model keeps them in FP8 (LoRA "
            'quantize_base="block_fp8"); leave those modules out of lora.target_modules or set '
            "lora.quantize_base to false"
        )
    if raw and block != stored:
        raise CheckpointError(
            f"{where}: weight_block_size {list(stored)}, but the model's block-FP8 LoRA bases were built for "
            f"{list(block or ())}; build them with the checkpoint's weight_block_size"
        )
    view = _Dequantizing(checkpoint, names, stored, raw)
    return view, BlockFp8Format(dict(quantization), stored, names)


def _scale_problem(checkpoint: Mapping[str, Any], name: str, block: tuple[int, int]) -> str | None:
    """Why ``name``'s scale tensor cannot dequantize it (None: it can)."""
    shape = tuple(checkpoint[name].get_shape())
    key = scale_name(name)
    if len(shape) < 2:
        return f"{name}: an FP8 tensor of shape {list(shape)}; block-FP8 tensors have at least 2 dims"
    if key not in checkpoint:
        return f"{name}: FP8 weight without its scale tensor {key}; re-download the checkpoint (a file missing?)"
    want = (*shape[:-2], -(-shape[-2] // block[0]), -(-shape[-1] // block[1]))
    got = tuple(checkpoint[key].get_shape())
    if got != want:
        return (
            f"{key}: shape {list(got)}, but {name} {list(shape)} in blocks of weight_block_size {list(block)} "
            f"needs {list(want)}; fix weight_block_size in config.json or re-export the checkpoint"
        )
    if _dtype(checkpoint[key]) not in (torch.float32, torch.bfloat16, None):
        return f"{key}: dtype {_dtype(checkpoint[key])}; block-FP8 scales are float32"
    return None


def _dtype(value: Any) -> torch.dtype | None:
    dtype = getattr(value, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _few(keys: list[str], limit: int = 3) -> str:
    return ", ".join(keys[:limit]) + (f", ... {len(keys) - limit} more" if len(keys) > limit else "")


def note_source(model: object, fmt: BlockFp8Format | None) -> None:
    """Record on ``model`` the block-FP8 format it was loaded from (None: a directory without one)."""
    setattr(model, SOURCE_ATTR, fmt)


def source_of(model: object) -> BlockFp8Format | None:
    """The block-FP8 format ``model`` was last loaded from, or None."""
    fmt = getattr(model, SOURCE_ATTR, None)
    return fmt if isinstance(fmt, BlockFp8Format) else None
