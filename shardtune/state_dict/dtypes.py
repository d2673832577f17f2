"""The safetensors dtype names and the torch dtypes they stand for: the one table every reader uses.

It lives in the state-dict core, which never imports :mod:`shardtune.checkpoint`, so the
optimizer loader (lazy safetensors values) and the safetensors reader and writer share it.
"""

from __future__ import annotations

import torch

__all__ = ["SAFETENSORS_DTYPES", "SAFETENSORS_NAMES"]

SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
SAFETENSORS_NAMES: dict[torch.dtype, str] = {v: k for k, v in SAFETENSORS_DTYPES.items()}
