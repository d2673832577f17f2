"""Everything NF4-specific: detection, quantization with a parameter's block sizes,
row slicing of a quantized tensor, packing for transfer, and dequantization.

A sharded NF4 parameter is a DTensor whose local tensor is a torchao ``NF4Tensor`` holding
whole rows of the full weight. Shards are slices of ONE quantization of the full tensor, so
they share its ``scaler_mean`` and FSDP's all-gather of the inner tensors reassembles it.
"""

from __future__ import annotations

import math
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, TypeGuard

import torch

from shardtune.state_dict.layout import TensorLayout

if TYPE_CHECKING:
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor

    from shardtune.state_dict.nf4_experts import NF4Experts

__all__ = ["dequantize", "is_nf4", "is_nf4_experts", "is_quantized", "nf4_layout_problem", "nf4_rows", "quantize_like"]


@cache
def _ao() -> ModuleType:
    """torchao's NF4 module, imported on first use: plain models never pay for (or hear) it."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    return nf4_tensor


def is_nf4(tensor: object) -> TypeGuard[NF4Tensor]:
    """True for a torchao ``NF4Tensor`` (by class name, so torchao need not be imported)."""
    return any(cls.__name__ == "NF4Tensor" for cls in type(tensor).__mro__)


def is_nf4_experts(tensor: object) -> TypeGuard[NF4Experts]:
    """True for NF4 expert weights (:class:`shardtune.state_dict.nf4_experts.NF4Experts`, one NF4 per expert)."""
    return type(tensor).__name__ == "NF4Experts"


def is_quantized(tensor: object) -> bool:
    """True for an NF4 tensor or NF4 experts: values that must be quantized, not copied, into place."""
    return is_nf4(tensor) or is_nf4_experts(tensor)


def block_sizes(tensor: NF4Tensor) -> tuple[int, int]:
    return tensor.block_size, tensor.scaler_block_size


def nf4_layout_problem(fqn: str, layout: TensorLayout, block_size: int, scaler_block_size: int) -> str | None:
    """Why a tensor of ``layout`` cannot be stored as NF4 with these block sizes, or None."""
    numel = math.prod(layout.shape)
    group = block_size * scaler_block_size
    if len(layout.shape) > 2 or numel % group:
        return (
            f"{fqn}: NF4 needs a 1-D/2-D tensor whose numel is a multiple of block_size*scaler_block_size "
            f"= {block_size}*{scaler_block_size} = {group}; got shape {tuple(layout.shape)}. "
            "Use smaller NF4 block sizes or do not quantize this module."
        )
    for rank, piece in enumerate(layout.pieces or ()):
        if not piece.is_row_range(layout.shape):
            return f"{fqn}: NF4 shards must be whole rows (Shard(0) or Replicate); rank {rank} holds {piece.shape}."
        if piece.numel % group:
            return (
                f"{fqn}: rank {rank}'s NF4 shard has {piece.numel} elements, not a multiple of "
                f"{group}; NF4 sharding needs numel/{block_size}/{scaler_block_size} = {numel // group} "
                "to be divisible by the number of shards. Choose a world size that divides it."
            )
    return None


def quantize_like(full: torch.Tensor, like: NF4Tensor, *, device: torch.device) -> NF4Tensor:
    """Quantize a full tensor (plain or NF4 with other block sizes) to NF4 with ``like``'s dtype and block sizes."""
    if is_nf4(full):
        if block_sizes(full) == block_sizes(like) and full.dtype == like.dtype:
            return full.to(device)
        full = full.get_original_weight()
    plain = full.to(device=device, dtype=like.dtype).contiguous()
    return _ao().to_nf4(plain, like.block_size, like.scaler_block_size)


def block_scalers(rows: torch.Tensor, like: NF4Tensor) -> torch.Tensor:
    """First-level NF4 scalers (absmax of every ``block_size`` block) of a shard's rows."""
    return _ao().get_block_absmax(rows.flatten(), like.block_size)


def quantize_shard(rows: torch.Tensor, like: NF4Tensor, *, scaler_mean: torch.Tensor) -> NF4Tensor:
    """NF4-quantize one shard's rows exactly as ``to_nf4`` quantizes them inside the full tensor.

    Only the mean of the first-level scalers is global; given it (from every shard's
    :func:`block_scalers`), the blocks and scaler blocks a shard owns quantize on their own.
    The steps mirror torchao's ``NF4Tensor.from_tensor`` so the result is bit-identical.
    """
    flat = rows.contiguous().flatten()
    block, group = like.block_size, like.scaler_block_size
    lookup = _ao().to_nf4(torch.zeros(block * group, dtype=like.dtype, device=flat.device), block, group).nf4
    scalers = _ao().get_block_absmax(flat, block) - scaler_mean
    n_groups = scalers.numel() // group
    factor = 256 / (2 * _ao().get_block_absmax(scalers, group).unsqueeze(-1).expand(n_groups, group))
    quantized_scalers = (scalers.view(n_groups, group) * factor).round().clamp(-128, 127).flatten().to(torch.int8)
    data = _ao().NF4Tensor.convert_to_norm_float_weight(flat, flat.numel() // block, block, lookup)
    return _nf4_from_parts(
        shape=tuple(rows.shape),
        like=like,
        quantized_data=data,
        quantized_scalers=quantized_scalers,
        # A fresh 1-D tensor: a (1,)-shaped column view keeps stride 256, which FSDP cannot view as bytes.
        quantization_factor=torch.empty(n_groups, dtype=factor.dtype, device=factor.device).copy_(factor[:, 0]),
        scaler_mean=scaler_mean,
        nf4=lookup,
    )


def nf4_rows(q: NF4Tensor, start: int, rows: int) -> NF4Tensor:
    """Rows ``[start, start + rows)`` of a quantized 2-D (or 1-D) NF4 tensor, sharing its scaler mean."""
    row_numel = q.numel() // q.shape[0] if q.shape[0] else 0
    first, count = start * row_numel, rows * row_numel
    block, group = q.block_size, q.block_size * q.scaler_block_size
    shape = (rows, *q.shape[1:])
    return _nf4_from_parts(
        shape=shape,
        like=q,
        # Copies, so the full quantized tensor can be freed once every piece is cut.
        quantized_data=q.quantized_data[first // 2 : (first + count) // 2].clone(),
        quantized_scalers=q.quantized_scalers[first // block : (first + count) // block].clone(),
        quantization_factor=q.quantization_factor[first // group : (first + count) // group].clone(),
        scaler_mean=q.scaler_mean,
        nf4=q.nf4,
    )


def packed_numel(numel: int, block_size: int, scaler_block_size: int, dtype: torch.dtype) -> int:
    """Bytes of an NF4 piece of ``numel`` elements as packed by :func:`pack`."""
    floats = numel // (block_size * scaler_block_size) + 1 + 16  # factors, mean, lookup table
    return floats * dtype.itemsize + numel // block_size + numel // 2


def pack(q: NF4Tensor, out: torch.Tensor) -> None:
    """Write ``q``'s inner tensors into the flat uint8 ``out`` (floats first, so views stay aligned)."""
    parts = [q.quantization_factor, q.scaler_mean.reshape(1), q.nf4, q.quantized_scalers, q.quantized_data]
    pos = 0
    for part in parts:
        raw = part.contiguous().view(-1).view(torch.uint8)
        out[pos : pos + raw.numel()].copy_(raw)
        pos += raw.numel()


def unpack(buf: torch.Tensor, shape: tuple[int, ...], like: NF4Tensor, *, device: torch.device) -> NF4Tensor:
    """Inverse of :func:`pack`: an NF4 tensor of ``shape`` with ``like``'s dtype and block sizes."""
    numel = math.prod(shape)
    buf = buf.to(device)
    sizes = [
        (numel // (like.block_size * like.scaler_block_size), like.dtype),
        (1, like.dtype),
        (16, like.dtype),
        (numel // like.block_size, torch.int8),
        (numel // 2, torch.uint8),
    ]
    parts, pos = [], 0
    for count, dtype in sizes:
        nbytes = count * dtype.itemsize
        parts.append(buf[pos : pos + nbytes].view(dtype).clone())
        pos += nbytes
    factor, mean, lookup, scalers, data = parts
    return _nf4_from_parts(
        shape=shape,
        like=like,
        quantized_data=data,
        quantized_scalers=scalers,
        quantization_factor=factor,
        scaler_mean=mean.reshape(()),
        nf4=lookup,
    )


def dequantize(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor in the original dtype for an NF4 tensor or NF4 experts; other tensors unchanged."""
    if is_nf4(tensor) or is_nf4_experts(tensor):
        return tensor.get_original_weight()
    return tensor


def _nf4_from_parts(
    *,
    shape: tuple[int, ...],
    like: NF4Tensor,
    quantized_data: torch.Tensor,
    quantized_scalers: torch.Tensor,
    quantization_factor: torch.Tensor,
    scaler_mean: torch.Tensor,
    nf4: torch.Tensor,
) -> NF4Tensor:
    shape = torch.Size(shape)
    meta = _ao().SubclassTensorArgs(
        shape,
        torch.empty(shape, device="meta").stride(),
        0,
        like.dtype,
        quantized_data.device,
        False,
    )
    return _ao().NF4Tensor(
        meta,
        like.block_size,
        shape.numel() // like.block_size,
        like.scaler_block_size,
        quantized_scalers,
        quantization_factor,
        scaler_mean,
        quantized_data,
        nf4,
    )
