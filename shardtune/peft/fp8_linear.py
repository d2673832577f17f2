"""Frozen linears kept in a block-FP8 checkpoint's format under LoRA, dequantized per layer when used.

Rule: with LoRA ``quantize_base: block_fp8`` every linear whose weight the checkpoint stores in block FP8
(an FP8 tensor with its ``weight_scale_inv``: :func:`shardtune.checkpoint.formats.hf_load.fp8_linears`)
and that LoRA does not wrap becomes an :class:`Fp8Linear`: the representation of a block-FP8 LoRA base
(:mod:`shardtune.peft.fp8_base`: ``weight`` in ``float8_e4m3fn`` beside ``weight_scale_rows``), so a load
fills it as it fills those bases (by its FP8 weight and the scale rows beside it), FSDP2 shards it as it
shards them, and a save or stream writes it dequantized as it writes them; it computes through
:func:`shardtune.peft.fp8_base.linear`. So the whole frozen base the checkpoint ships in FP8 (LoRA bases,
routed experts, and these: shared experts, dense layers' MLPs, projections not targeted) stays in FP8.
Linears the checkpoint stores unquantized (the router, ``lm_head``, ``modules_to_not_convert``) stay as
they are. A merge makes them plain ``nn.Linear``\\ s again (:func:`dequantize_in_place`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
from torch import Tensor, nn

from shardtune.peft import fp8_base

__all__ = ["Fp8Linear", "dequantize_in_place", "keep_in_fp8"]


class Fp8Linear(nn.Module):
    """A frozen linear whose weight is a block-FP8 base: ``y = x @ W.T + bias``, ``W`` dequantized from
    ``weight`` and ``weight_scale_rows`` in ``x``'s dtype for each use."""

    weight: Tensor
    weight_scale_rows: Tensor
    bias: Tensor | None

    def __init__(self, linear: nn.Linear, block: tuple[int, int], *, name: str) -> None:
        """Stands for ``linear`` (on the meta device; its bias Parameter kept), filled by a load of the
        checkpoint whose ``weight_block_size`` is ``block``. ``name``: the module's, for errors."""
        super().__init__()
        if not linear.weight.is_meta:
            raise ValueError(
                f"{name}: a linear kept in block FP8 is filled by loading its checkpoint; build the model on the "
                "meta device, apply LoRA, then load the block-FP8 directory"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, scales = fp8_base.empty_base(self.out_features, self.in_features, block, name=name, device="meta")
        self.register_parameter(fp8_base.SCALE_ROWS, scales)
        bias = linear.bias  # the base's own Parameter (nn.Linear's stubs type it Tensor)
        self.register_parameter("bias", None if bias is None else cast(nn.Parameter, bias.requires_grad_(False)))
        self.fp8_block: tuple[int, int] | None = (block[0], block[1])

    def forward(self, x: Tensor) -> Tensor:
        out = fp8_base.linear(x, self.weight, self.weight_scale_rows, self.block_cols)
        return out if self.bias is None else out + self.bias

    @property
    def block_cols(self) -> int:
        return cast(tuple[int, int], self.fp8_block)[1]

    def dequantized(self, dtype: torch.dtype) -> nn.Linear:
        """A plain frozen ``nn.Linear`` holding this weight dequantized to ``dtype`` (the same bias Parameter)."""
        weight = fp8_base.dequantize(self.weight.detach(), self.weight_scale_rows.detach(), self.block_cols, dtype)
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight, requires_grad=False)
        if self.bias is not None:
            linear.bias = cast(nn.Parameter, self.bias)
        return linear

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"fp8_block={self.fp8_block}"
        )


def keep_in_fp8(model: nn.Module, names: Iterable[str], block: tuple[int, int]) -> None:
    """Replace each ``nn.Linear`` of ``model`` named in ``names`` (module names, on the meta device) by an empty
    :class:`Fp8Linear` for a load of the checkpoint to fill; ``block``: its ``weight_block_size``. A name that
    is no plain linear of ``model`` is refused naming it."""
    modules = dict(model.named_modules())
    for name in names:
        linear = modules.get(name)
        if type(linear) is not nn.Linear:
            kind = "no module" if linear is None else type(linear).__name__
            raise ValueError(
                f"{name}: asked to keep it in block FP8 as a frozen linear, but it is {kind} of this model; pass the "
                "names fp8_linears(model, model_dir) gives for the model before LoRA is applied"
            )
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, Fp8Linear(linear, block, name=name))


def dequantize_in_place(model: nn.Module, dtype: torch.dtype) -> None:
    """Make every :class:`Fp8Linear` of ``model`` a plain frozen ``nn.Linear`` holding its weight dequantized
    to ``dtype`` (a merge of the adapters into an unsharded model)."""
    for name, module in [(n, m) for n, m in model.named_modules() if isinstance(m, Fp8Linear)]:
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, module.dequantized(dtype))
