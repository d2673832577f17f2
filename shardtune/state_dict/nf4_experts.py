"""NF4 experts (QLoRA on mixture-of-experts layers): a stack ``[E, R, C]`` of E NF4 weights, one per expert.

Rule: expert ``e`` is exactly torchao's ``to_nf4(W[e])`` of its own 2-D slice (its own scaler mean:
torchao's NF4 is 2-D only), stored as torchao's inner tensors stacked on a leading expert dim.
FSDP2 shards it on the expert dim alone (``Shard(0)``, whole experts per rank, no padding), so a
rank quantizes its own experts without talking to the others, and FSDP2's all-gather concatenates
the inner tensors expert-major (:meth:`NF4Experts.fsdp_pre_all_gather`). Dequantizing is torchao's
elementwise arithmetic over all experts at once, so it is bit-equal to torchao's per expert.
The few ops FSDP2 applies to a parameter (split, narrow, new_zeros, copy_, view, as_strided,
detach) are supported on the expert dim; any other op is refused by name rather than guessed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shardtune.state_dict.layout import TensorLayout
from shardtune.state_dict.nf4 import _ao, is_nf4_experts

__all__ = [
    "NF4Experts",
    "is_nf4_experts",
    "nf4_experts_layout_problem",
    "nf4_experts_shape_problem",
    "quantize_experts",
]

aten = torch.ops.aten
_INNER = ("codes", "scalers", "factors", "means")  # each with the expert dim first; ``lookup`` is shared


class NF4Experts(torch.Tensor):
    """``[E, R, C]`` frozen expert weights, each expert an NF4 quantization of its ``[R, C]`` slice.

    ``codes`` uint8 ``[E, R·C/2]`` (two 4-bit codes a byte), ``scalers`` int8 ``[E, R·C/block]``,
    ``factors`` ``[E, R·C/(block·scaler_block)]`` and ``means`` ``[E]`` in ``dtype`` (torchao's
    ``quantized_data``, ``quantized_scalers``, ``quantization_factor``, ``scaler_mean`` of each expert),
    ``lookup`` the 16 NF4 values.
    """

    codes: torch.Tensor
    scalers: torch.Tensor
    factors: torch.Tensor
    means: torch.Tensor
    lookup: torch.Tensor
    block_size: int
    scaler_block_size: int

    @staticmethod
    def __new__(cls, shape, dtype, inner: dict[str, torch.Tensor], block_size: int, scaler_block_size: int):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=inner["codes"].device)

    def __init__(self, shape, dtype, inner: dict[str, torch.Tensor], block_size: int, scaler_block_size: int) -> None:
        for name, tensor in inner.items():
            setattr(self, name, tensor)
        self.block_size, self.scaler_block_size = block_size, scaler_block_size

    # Plain tensor semantics for torch functions: every op reaches __torch_dispatch__, which refuses unknown ones.
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self, *, tensor_contents=None):  # torch.Tensor types it Any
        return f"NF4Experts(shape={tuple(self.shape)}, dtype={self.dtype}, block_size={self.block_size})"

    def __tensor_flatten__(self) -> tuple[list[str], tuple]:
        return [*_INNER, "lookup"], (self.dtype, self.block_size, self.scaler_block_size)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: tuple, outer_size, outer_stride) -> NF4Experts:
        dtype, block, group = meta
        return NF4Experts(outer_size, dtype, inner, block, group)

    @property
    def num_experts(self) -> int:
        return self.codes.shape[0]

    def _with(self, shape, **inner: torch.Tensor) -> NF4Experts:
        """The same quantization with ``shape`` and (some) inner tensors replaced."""
        parts = {name: inner.get(name, getattr(self, name)) for name in (*_INNER, "lookup")}
        return NF4Experts(torch.Size(shape), self.dtype, parts, self.block_size, self.scaler_block_size)

    def _map(self, shape, fn) -> NF4Experts:
        """``fn`` applied to every inner tensor that has the expert dim."""
        return self._with(shape, **{name: fn(getattr(self, name)) for name in _INNER})

    def get_original_weight(self) -> torch.Tensor:
        """The dequantized weight in ``dtype``: torchao's ``get_original_weight`` of every expert, at once."""
        e, block = self.num_experts, self.block_size
        groups = self.scalers.view(e, -1, self.scaler_block_size)
        scalers = (groups / self.factors.unsqueeze(-1)).reshape(e, -1).to(self.dtype) + self.means.unsqueeze(-1)
        repeated = scalers.unsqueeze(-1).expand(e, scalers.shape[1], block // 2).reshape(e, -1)
        first = self.lookup[(self.codes >> 4).to(torch.long)] * repeated
        second = self.lookup[(self.codes & 0b1111).to(torch.long)] * repeated
        return torch.stack([first, second], dim=-1).reshape(self.shape)

    # FSDP2's all-gather extension: each rank's inner tensors, concatenated on the expert dim.
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) -> tuple[tuple, Any]:
        return tuple(getattr(self, name) for name in _INNER), (tuple(outer_size), self.lookup)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out: torch.Tensor | None = None):
        shape, lookup = metadata
        if out is not None:  # FSDP2 refilled the storage of ``out``'s inner tensors in place
            return None
        parts = dict(zip(_INNER, outputs, strict=True))
        gathered = NF4Experts(torch.Size(shape), self.dtype, {**parts, "lookup": lookup}, *self._sizes())
        return gathered, tuple(outputs)

    def _sizes(self) -> tuple[int, int]:
        return self.block_size, self.scaler_block_size

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"{func} is not supported on NF4 expert weights (frozen QLoRA bases); dequantize them first "
                "(shardtune.state_dict.nf4.dequantize)"
            )
        return handler(func, *args, **kwargs)


def nf4_experts_shape_problem(
    name: str, shape: tuple[int, ...], *, block_size: int, scaler_block_size: int
) -> str | None:
    """Why experts of ``shape`` ``[E, R, C]`` cannot be NF4 with these block sizes (None: they can)."""
    group = block_size * scaler_block_size
    per_expert = math.prod(shape[1:])
    if len(shape) == 3 and per_expert % group == 0:
        return None
    return (
        f"cannot quantize {name} (shape {tuple(shape)}) to NF4 per expert: each expert's {tuple(shape[1:])} "
        f"slice has {per_expert} elements, not a multiple of block_size * scaler_block_size = "
        f"{block_size} * {scaler_block_size} = {group}; pass smaller NF4 block sizes (lora.block_size, lora.scaler_block_size), set quantize_base=false, or "
        "leave this parameter out of lora.target_parameters"
    )


def nf4_experts_layout_problem(fqn: str, layout: TensorLayout) -> str | None:
    """Why NF4 experts cannot be held in ``layout``: every rank must hold whole experts (None: fine)."""
    for rank, piece in enumerate(layout.pieces or ()):
        if piece.numel and not piece.is_row_range(layout.shape):
            return (
                f"{fqn}: NF4 experts must be sharded on the expert dim (whole experts per rank); rank {rank} holds "
                f"{piece.shape} of {tuple(layout.shape)}. Use a shard group size that divides the number of experts."
            )
    return None


@torch.no_grad()
def quantize_experts(weight: torch.Tensor, *, block_size: int, scaler_block_size: int) -> NF4Experts:
    """``weight [E, R, C]`` as NF4 experts: ``to_nf4`` of every expert's slice (on meta: shapes only)."""
    e, numel = weight.shape[0], math.prod(weight.shape[1:])
    if weight.is_meta or e == 0:
        device, dtype = weight.device, weight.dtype
        inner = {
            "codes": torch.empty(e, numel // 2, dtype=torch.uint8, device=device),
            "scalers": torch.empty(e, numel // block_size, dtype=torch.int8, device=device),
            "factors": torch.empty(e, numel // (block_size * scaler_block_size), dtype=dtype, device=device),
            "means": torch.empty(e, dtype=dtype, device=device),
            "lookup": torch.empty(16, dtype=dtype, device=device),
        }
        if not weight.is_meta:
            inner["lookup"] = _ao().to_nf4(torch.zeros(block_size * scaler_block_size, dtype=dtype, device=device)).nf4
        return NF4Experts(weight.shape, weight.dtype, inner, block_size, scaler_block_size)
    experts = [_ao().to_nf4(weight[i].contiguous(), block_size, scaler_block_size) for i in range(e)]
    inner = {
        "codes": torch.stack([q.quantized_data for q in experts]),
        "scalers": torch.stack([q.quantized_scalers for q in experts]),
        "factors": torch.stack([q.quantization_factor for q in experts]),
        "means": torch.stack([q.scaler_mean.reshape(()) for q in experts]),
        "lookup": experts[0].nf4,
    }
    return NF4Experts(weight.shape, weight.dtype, inner, block_size, scaler_block_size)


def _experts_of(size, numel_per_expert: int) -> int:
    total = math.prod(size)
    if total % numel_per_expert:
        raise NotImplementedError(
            f"NF4 experts of {numel_per_expert} elements each cannot take the shape {tuple(size)}"
        )
    return total // numel_per_expert


def _per_expert(t: NF4Experts) -> int:
    return math.prod(t.shape) // t.num_experts if t.num_experts else math.prod(t.shape[1:])


def _expert_dim(func, dim: int) -> None:
    if dim != 0:
        raise NotImplementedError(
            f"{func} on dim {dim} of NF4 experts: they are split on the expert dim only (Shard(0)); use a shard "
            "group size that divides the number of experts"
        )


def _split(func, t: NF4Experts, split_size: int, dim: int = 0):
    _expert_dim(func, dim)
    return [t._map((n, *t.shape[1:]), lambda x, s=s, n=n: x.narrow(0, s, n)) for s, n in _spans(t, split_size)]


def _spans(t: NF4Experts, split_size: int) -> list[tuple[int, int]]:
    e = t.shape[0]
    return [(s, min(split_size, e - s)) for s in range(0, e, split_size)] or [(0, 0)]


def _slice(func, t: NF4Experts, dim: int = 0, start: int | None = 0, end: int | None = None, step: int = 1):
    _expert_dim(func, dim)
    if step != 1:
        raise NotImplementedError(f"{func} with step {step} on NF4 experts")
    s, stop, _ = slice(start, end).indices(t.shape[0])
    n = max(stop - s, 0)
    return t._map((n, *t.shape[1:]), lambda x: x[s : s + n])


def _new_zeros(func, t: NF4Experts, size, **kwargs):
    e = _experts_of(size, _per_expert(t))
    return t._map(size, lambda x: x.new_zeros((e, *x.shape[1:])))


def _copy(func, dst: NF4Experts, src, non_blocking: bool = False):
    if not isinstance(src, NF4Experts) or tuple(src.shape) != tuple(dst.shape) or src._sizes() != dst._sizes():
        raise NotImplementedError(
            f"copy_ into NF4 experts {tuple(dst.shape)} from {type(src).__name__} {tuple(src.shape)}"
        )
    for name in (*_INNER, "lookup"):
        getattr(dst, name).copy_(getattr(src, name))
    return dst


def _view(func, t: NF4Experts, size, *rest):
    size = list(size)
    if -1 in size:
        known = math.prod(n for n in size if n != -1)
        size[size.index(-1)] = math.prod(t.shape) // known if known else 0
    if math.prod(size) != math.prod(t.shape):
        raise NotImplementedError(f"{func} of NF4 experts {tuple(t.shape)} as {tuple(size)}")
    return t._with(size)


def _as_strided(func, t: NF4Experts, size, stride, storage_offset=0):
    contiguous = torch.empty(size, device="meta").stride()
    if tuple(stride) != tuple(contiguous) or storage_offset or math.prod(size) != math.prod(t.shape):
        raise NotImplementedError(f"{func} of NF4 experts with size {tuple(size)}, stride {tuple(stride)}")
    return t._with(size)


def _detach(func, t: NF4Experts):
    return t._with(t.shape)


def _clone(func, t: NF4Experts, **kwargs):
    return t._with(t.shape, lookup=t.lookup.clone(), **{n: getattr(t, n).clone() for n in _INNER})


def _to_copy(func, t: NF4Experts, *, dtype=None, device=None, **kwargs):
    if dtype is not None and dtype != t.dtype:
        return t.get_original_weight().to(dtype=dtype, device=device)
    if device is None:
        return _clone(func, t)
    moved = {n: getattr(t, n).to(device) for n in (*_INNER, "lookup")}
    return NF4Experts(t.shape, t.dtype, moved, *t._sizes())


_OPS: dict[Any, Any] = {
    aten.split.Tensor: _split,
    aten.slice.Tensor: _slice,
    aten.new_zeros.default: _new_zeros,
    aten.copy_.default: _copy,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.as_strided.default: _as_strided,
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.clone.default: _clone,
    aten._to_copy.default: _to_copy,
    aten.is_pinned.default: lambda func, t, *a, **k: t.codes.is_pinned(),
}
