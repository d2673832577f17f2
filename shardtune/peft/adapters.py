"""Adapter state dicts: selection, merging into base weights, and PEFT naming/config.

Our adapter keys are ``<module fqn>.lora_A.weight`` / ``.lora_B.weight``; PEFT's saved
``adapter_model.safetensors`` uses ``base_model.model.<module fqn>.lora_A.weight``. Converting
between them is a prefix change only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from shardtune.peft import nf4
from shardtune.state_dict.fp8_blocks import ROWS_SUFFIX
from shardtune.state_dict.keys import is_adapter_key

__all__ = [
    "PEFT_PREFIX",
    "from_peft_adapter_state_dict",
    "get_adapter_state_dict",
    "get_merged_state_dict",
    "is_adapter_key",
    "peft_adapter_config",
    "to_peft_adapter_state_dict",
]

PEFT_PREFIX = "base_model.model."
_LORA_A, _LORA_B = ".lora_A.weight", ".lora_B.weight"
_FP8_SCALES = ".weight_scale_rows"  # a block-FP8 base's scales (shardtune.peft.fp8_base.SCALE_ROWS)


def get_adapter_state_dict(model_or_state_dict: nn.Module | Mapping[str, Any]) -> dict[str, Any]:
    """The adapter entries of a model's ``state_dict()`` or of a given state dict (values not copied)."""
    sd = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, nn.Module) else model_or_state_dict
    return {k: v for k, v in sd.items() if is_adapter_key(k)}


def merge_lora_weight(base: Tensor, lora_a: Tensor, lora_b: Tensor, *, scaling: float) -> Tensor:
    """``base + scaling * lora_b @ lora_a`` in fp32, returned in ``base``'s dtype and device: the one LoRA merge
    formula (merged models, merged state dicts, merged HF exports).

    ``base`` is a plain tensor (dequantize NF4 first). A block of the base merges with the matching rows of
    ``lora_b`` and columns of ``lora_a``. The product is taken on ``lora_b``'s device.
    """
    delta = lora_b.float() @ lora_a.to(device=lora_b.device, dtype=torch.float32)
    # in place on the fresh product: one block-sized temporary (a stream's memory bound), same values
    delta = delta.to(base.device).mul_(scaling).add_(base.float())
    return delta.to(base.dtype)


def get_merged_state_dict(
    state_dict: Mapping[str, Tensor], *, alpha: float, rank: int | None = None
) -> dict[str, Tensor]:
    """A new state dict with every LoRA folded into its base: ``W + alpha / rank * B @ A``.

    Keys come out as plain HF names (no adapter keys); NF4 bases are dequantized; untouched
    entries are the input's own tensors. ``rank`` defaults to ``lora_A``'s first dim.
    """
    dora = sorted(k for k in state_dict if "magnitude" in k)
    if dora:
        raise ValueError(f"DoRA magnitude keys {dora[:3]} cannot be merged here; only plain LoRA is supported")
    merged = {k: v for k, v in state_dict.items() if not is_adapter_key(k)}
    for key, lora_a in state_dict.items():
        if not key.endswith(_LORA_A):
            continue
        prefix = key[: -len(_LORA_A)]
        if prefix.endswith((".mlp.experts", ".base_layer")):
            raise ValueError(
                f"{key} adapts fused expert weights (lora.target_parameters), which this merge of linear adapters "
                "cannot fold; use merge_lora(model) or save_hf_checkpoint (merged export) instead"
            )
        for needed in (prefix + _LORA_B, prefix + ".weight"):
            if needed not in state_dict:
                raise KeyError(f"{key} has no matching {needed!r}; pass the full state dict (base and both adapters)")
        r = lora_a.shape[0]
        if rank is not None and rank != r:
            raise ValueError(f"{key} has rank {r} but rank={rank} was passed; pass the rank used for training")
        if prefix + _FP8_SCALES in state_dict or state_dict[prefix + ".weight"].dtype == torch.float8_e4m3fn:
            raise ValueError(
                f'{prefix}.weight is a block-FP8 base (LoRA quantize_base="block_fp8"), whose column block this '
                "state dict does not record; merge the model instead: merge_lora(model) or save_hf_checkpoint"
            )
        base = nf4.dequantize(state_dict[prefix + ".weight"])
        merged[prefix + ".weight"] = merge_lora_weight(base, lora_a, state_dict[prefix + _LORA_B], scaling=alpha / r)
    fp8 = sorted(k for k in merged if k.endswith(ROWS_SUFFIX))  # frozen experts and linears kept in block FP8
    if fp8:
        raise ValueError(
            f'{fp8[0].removesuffix(ROWS_SUFFIX)} is kept in block FP8 (LoRA quantize_base="block_fp8"), whose column '
            "block this state dict does not record; merge the model instead: merge_lora(model) or save_hf_checkpoint"
        )
    leftover = sorted(k for k in state_dict if is_adapter_key(k) and not k.endswith((_LORA_A, _LORA_B)))
    if leftover:
        raise ValueError(f"unrecognized adapter keys {leftover[:3]}; expected only '*.lora_A.weight'/'*.lora_B.weight'")
    return merged


def to_peft_adapter_state_dict(adapter_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Our adapter keys -> PEFT's (``base_model.model.`` prefix); values are not copied."""
    bad = [k for k in adapter_state_dict if not is_adapter_key(k)]
    if bad:
        raise ValueError(f"keys {bad[:3]} are not adapter keys; pass get_adapter_state_dict(...) output")
    return {PEFT_PREFIX + k: v for k, v in adapter_state_dict.items()}


def from_peft_adapter_state_dict(peft_state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """PEFT adapter keys -> ours. Accepts saved (``lora_A.weight``) and in-memory (``lora_A.default.weight``) forms."""
    out: dict[str, Any] = {}
    for key, value in peft_state_dict.items():
        if not key.startswith(PEFT_PREFIX):
            raise ValueError(f"PEFT adapter key {key!r} does not start with {PEFT_PREFIX!r}")
        if not is_adapter_key(key):
            continue  # base weights of a full PEFT state dict are not adapter entries
        name = key[len(PEFT_PREFIX) :]
        for part in ("lora_A", "lora_B"):
            # Drop PEFT's adapter-name level, e.g. lora_A.default.weight -> lora_A.weight.
            head, sep, tail = name.partition(f".{part}.")
            if sep and tail.count(".") == 1:
                name = f"{head}.{part}.{tail.split('.', 1)[1]}"
        out[name] = value
    return out


def peft_adapter_config(
    *,
    rank: int,
    alpha: float,
    target_modules: Iterable[str],
    target_parameters: Iterable[str] = (),
    dropout: float = 0.0,
    base_model_name_or_path: str | None = None,
) -> dict[str, Any]:
    """``adapter_config.json`` contents that ``peft.PeftModel.from_pretrained`` accepts."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": sorted(set(target_modules)),
        "target_parameters": sorted(set(target_parameters)) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }
