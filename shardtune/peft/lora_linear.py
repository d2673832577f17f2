"""The LoRA linear: a frozen base linear plus a trainable low-rank update, one module.

Rule: ``LoRALinear`` keeps the frozen base at ``<module>.weight``/``<module>.bias`` (so HF keys load
unchanged) and the adapters at ``<module>.lora_A.weight``/``<module>.lora_B.weight`` (PEFT's names
without ``base_layer``/``.default``); ``y = base(x) + lora_B(lora_A(dropout(x))) * alpha / rank``. The
base is held one of three ways, and every reader of it goes through :meth:`LoRALinear.base_weight`
(or :meth:`~LoRALinear.base_forward`): as it is, as a torchao ``NF4Tensor`` (QLoRA,
:mod:`shardtune.peft.nf4`), or in a block-FP8 checkpoint's format (``fp8_block``,
:mod:`shardtune.peft.fp8_base`). Applying it to a model, merging and the rest: :mod:`shardtune.peft.lora`.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardtune.peft import fp8_base, nf4
from shardtune.peft.adapters import merge_lora_weight
from shardtune.peft.init import kaiming_uniform_whole_

__all__ = ["LoRALinear"]


class LoRALinear(nn.Module):
    """``y = base(x) + lora_B(lora_A(dropout(x))) * alpha / rank`` with a frozen base.

    ``lora_B`` starts at zero so a fresh adapter leaves the model unchanged.
    """

    weight: Tensor  # registered by _set_base (a Parameter; NF4 data when quantized, FP8 with fp8_block)
    bias: Tensor | None
    fp8_block: tuple[int, int] | None  # the checkpoint's weight_block_size when the base is block FP8
    weight_scale_rows: Tensor  # with fp8_block: the base's row-expanded scales (shardtune.peft.fp8_base)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        bias: bool = False,
        quantize_base: bool = False,
        block_size: int = nf4.DEFAULT_BLOCK_SIZE,
        scaler_block_size: int = nf4.DEFAULT_SCALER_BLOCK_SIZE,
        fp8_block: tuple[int, int] | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank
        self.alpha = alpha
        self.scaling = alpha / rank
        self.disabled = False  # True: behave as the base linear (e.g. a KD/DPO reference pass)
        base = nn.Linear(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._set_base(
            base.weight,
            base.bias,
            quantize=quantize_base,
            name="LoRALinear",
            block_size=block_size,
            scaler_block_size=scaler_block_size,
        )
        self.fp8_block = None
        if fp8_block is not None:
            self._set_fp8_base(fp8_block, quantize=quantize_base, name="LoRALinear", device=device)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=device, dtype=dtype)
        self.reset_lora_parameters()

    def _set_base(
        self,
        weight: Tensor,
        bias: Tensor | None,
        *,
        quantize: bool,
        name: str,
        block_size: int,
        scaler_block_size: int,
    ) -> None:
        """Install the frozen base parameters, NF4-quantizing the weight when asked."""
        if quantize:
            nf4.check_nf4_shape(name, tuple(weight.shape), block_size=block_size, scaler_block_size=scaler_block_size)
            quantized = nf4.to_nf4(weight.detach(), block_size=block_size, scaler_block_size=scaler_block_size)
            weight = nn.Parameter(quantized, requires_grad=False)
        self.weight = weight.requires_grad_(False)
        # The base's own Parameter (nn.Linear's stubs type it Tensor).
        self.register_parameter("bias", None if bias is None else cast(nn.Parameter, bias.requires_grad_(False)))
        self.quantize_base = quantize

    def _set_fp8_base(self, block: tuple[int, int], *, quantize: bool, name: str, device) -> None:
        """Replace the base weight by an empty block-FP8 base (FP8 weight and row-expanded scales) for a
        load of the checkpoint's values (:mod:`shardtune.peft.fp8_base`)."""
        if quantize:
            raise ValueError(f"{name}: a block-FP8 base cannot also be NF4-quantized; choose one quantize_base")
        self.weight, scales = fp8_base.empty_base(self.out_features, self.in_features, block, name=name, device=device)
        self.register_parameter(fp8_base.SCALE_ROWS, scales)
        self.fp8_block = (block[0], block[1])

    def base_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """The frozen base weight as a plain tensor (NF4 or block FP8 dequantized; ``dtype``: that of a
        block-FP8 base's result, the adapters' by default)."""
        weight = self.weight.detach()
        if self.fp8_block is None:
            return nf4.dequantize(weight)
        scales = self.weight_scale_rows.detach()
        return fp8_base.dequantize(weight, scales, self.fp8_block[1], dtype or self.lora_A.weight.dtype)

    @classmethod
    def from_linear(
        cls,
        linear: nn.Linear,
        *,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        quantize_base: bool = False,
        block_size: int = nf4.DEFAULT_BLOCK_SIZE,
        scaler_block_size: int = nf4.DEFAULT_SCALER_BLOCK_SIZE,
        fp8_block: tuple[int, int] | None = None,
        name: str = "linear",
    ) -> LoRALinear:
        """Wrap an existing linear, reusing its Parameter objects (no copy unless quantizing). With
        ``fp8_block`` the base becomes an empty block-FP8 base that a load of the checkpoint fills, so
        ``linear`` must be on the meta device."""
        weight = linear.weight
        if fp8_block is not None and not weight.is_meta:
            raise ValueError(
                f"{name}: a block-FP8 base is filled by loading its checkpoint; build the model on the meta "
                "device, apply LoRA, then load the block-FP8 directory"
            )
        # Built on meta so no throw-away base is allocated, then given the real parameters.
        new = cls(
            linear.in_features,
            linear.out_features,
            rank=rank,
            alpha=alpha,
            dropout=dropout,
            bias=linear.bias is not None,
            device="meta",
            dtype=weight.dtype,
        )
        new._set_base(
            weight,
            linear.bias,
            quantize=quantize_base,
            name=name,
            block_size=block_size,
            scaler_block_size=scaler_block_size,
        )
        if fp8_block is not None:
            new._set_fp8_base(fp8_block, quantize=quantize_base, name=name, device="meta")
        if weight.device.type != "meta":
            new.lora_A.to_empty(device=weight.device)
            new.lora_B.to_empty(device=weight.device)
            new.reset_lora_parameters()
        return new

    def reset_lora_parameters(self) -> None:
        """PEFT's default init: Kaiming-uniform ``lora_A``, zero ``lora_B``."""
        if self.lora_A.weight.is_meta:
            return
        kaiming_uniform_whole_(self.lora_A.weight)
        nn.init.zeros_(self.lora_B.weight)

    def base_forward(self, x: Tensor) -> Tensor:
        if self.fp8_block is not None:
            out = fp8_base.linear(x, self.weight, self.weight_scale_rows, self.fp8_block[1])
            return out if self.bias is None else out + self.bias
        if self.quantize_base:
            out = nf4.linear_nf4(x, self.weight)
            return out if self.bias is None else out + self.bias
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: Tensor) -> Tensor:
        out = self.base_forward(x)
        if self.disabled:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def merged_weight(self) -> Tensor:
        """``W + scaling * B @ A`` as a plain tensor in the base dtype (NF4 dequantized; a block-FP8
        base dequantized into the adapters' dtype)."""
        base = self.base_weight()
        return merge_lora_weight(base, self.lora_A.weight.detach(), self.lora_B.weight.detach(), scaling=self.scaling)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}, "
            f"alpha={self.alpha}, bias={self.bias is not None}, quantize_base={self.quantize_base}"
            + ("" if self.fp8_block is None else f", fp8_block={self.fp8_block}")
        )
