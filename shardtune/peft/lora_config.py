"""The LoRA settings ``apply_lora`` takes and records: one validated :class:`LoRAConfig`.

Rule: every combination of settings is checked here, before any module is touched, and refused naming
the setting and the fix; ``quantize_base`` is one name for how the frozen bases are held (``True`` or
``"nf4"``: QLoRA; ``"block_fp8"``: a block-FP8 checkpoint's weights kept in FP8, with its
``weight_block_size`` as ``fp8_block``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardtune.choices import LORA_TARGET_PARAMETERS, LORA_TARGETS, QUANTIZE_BASE
from shardtune.peft import nf4
from shardtune.peft.adapters import peft_adapter_config

__all__ = ["LoRAConfig"]


@dataclass
class LoRAConfig:
    """What ``apply_lora`` did; kept on the model as ``model.lora_config`` for export."""

    rank: int
    alpha: float
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=list)
    target_parameters: list[str] = field(default_factory=list)
    quantize_base: bool | str = False
    block_size: int = nf4.DEFAULT_BLOCK_SIZE
    scaler_block_size: int = nf4.DEFAULT_SCALER_BLOCK_SIZE
    fp8_block: tuple[int, int] | None = None  # with quantize_base="block_fp8": the checkpoint's weight_block_size

    def __post_init__(self) -> None:
        if self.quantize_base not in QUANTIZE_BASE:
            raise ValueError(
                f"LoRA quantize_base={self.quantize_base!r}: choose from {list(QUANTIZE_BASE)} "
                '(true means "nf4"; "block_fp8" keeps a block-FP8 checkpoint\'s base in FP8)'
            )
        if self.fp8_base != (self.fp8_block is not None):
            raise ValueError(
                f"LoRA quantize_base={self.quantize_base!r} with fp8_block={self.fp8_block!r}: a block-FP8 base "
                "needs the checkpoint's weight_block_size as fp8_block, and fp8_block needs "
                'quantize_base="block_fp8"'
            )
        if not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoRA rank must be a positive int, got {self.rank!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")
        unknown = sorted(set(self.target_modules) - set(LORA_TARGETS))
        if unknown:
            raise ValueError(f"unknown LoRA target_modules {unknown}; choose from {list(LORA_TARGETS)}")
        unknown = sorted(set(self.target_parameters) - set(LORA_TARGET_PARAMETERS))
        if unknown:
            raise ValueError(f"unknown LoRA target_parameters {unknown}; choose from {list(LORA_TARGET_PARAMETERS)}")
        if not self.target_modules and not self.target_parameters:
            raise ValueError(
                f"LoRA target_modules and target_parameters are both empty; choose modules from {list(LORA_TARGETS)}"
            )
        if self.target_parameters and self.dropout:
            raise ValueError(
                f"LoRA dropout {self.dropout} with target_parameters: PEFT's parameter adapters have no dropout "
                "(its ParamWrapper refuses lora_dropout != 0); set dropout=0"
            )
        self.target_modules = sorted(set(self.target_modules), key=LORA_TARGETS.index)
        self.target_parameters = sorted(set(self.target_parameters), key=LORA_TARGET_PARAMETERS.index)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def nf4_base(self) -> bool:
        """Whether the wrapped bases are NF4 (QLoRA)."""
        return self.quantize_base in (True, "nf4")

    @property
    def fp8_base(self) -> bool:
        """Whether the wrapped bases stay in the checkpoint's block FP8 (:mod:`shardtune.peft.fp8_base`)."""
        return self.quantize_base == "block_fp8"

    def to_peft_config(self, *, base_model_name_or_path: str | None = None) -> dict:
        """The matching PEFT ``adapter_config.json`` dict."""
        return peft_adapter_config(
            rank=self.rank,
            alpha=self.alpha,
            dropout=self.dropout,
            target_modules=self.target_modules,
            target_parameters=self.target_parameters,
            base_model_name_or_path=base_model_name_or_path,
        )
