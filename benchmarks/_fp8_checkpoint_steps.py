"""Rank-side code of the block-FP8 checkpoint benchmark: the fixture, the timed load steps, their check.

:func:`write_fp8_dir` writes a Qwen3-MoE HF directory in DeepSeek-V3's block-FP8 format (every linear
weight but the router and ``lm_head`` as ``float8_e4m3fn`` + float32 ``weight_scale_inv`` per block,
``quantization_config`` in ``config.json``, an index beside the one safetensors file as DCP's reader
needs), quantized here with torch alone. :func:`run` is the per-rank entry point
(``benchmarks._fp8_checkpoint_steps:run``) started in fresh processes: each step ends with a sharded
bf16 model holding the dequantized weights, checked after the step against a reference dequantization
of the file by safetensors + torch (untimed).
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from benchmarks._fixtures import local_bytes, local_slices
from benchmarks._hf_models import MoeCheckpointShape
from benchmarks._measure import measure_step
from benchmarks._moe_checkpoint_steps import (
    CPU,
    DTYPE,
    Files,
    expert_files,
    fully_shard_layers,
    kernel_io,
    shardtune_model,
)

FP8 = torch.float8_e4m3fn
NOT_QUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")


# --------------------------------------------------------------------------- the checkpoint


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """The tensors DeepSeek-V3's releases store in FP8: linear weights but the router and ``lm_head``."""
    return len(shape) == 2 and not any(part in name for part in NOT_QUANTIZED)


def quantize(weight: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [R, C]`` -> (FP8, float32 scale_inv per ``block`` x ``block``): 448 / amax per block."""
    rows, cols = weight.shape
    w = weight.to(torch.float32)
    padded = torch.nn.functional.pad(w.abs(), (0, -cols % block, 0, -rows % block))
    amax = padded.unflatten(1, (-1, block)).unflatten(0, (-1, block)).amax(dim=(1, 3))
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    spread = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return (w * spread).clamp(-448.0, 448.0).to(FP8), 1.0 / scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The reference: ``weight.float() * scale_inv`` spread over each block, cast to bf16."""
    rows, cols = weight.shape[-2:]
    spread = scale.repeat_interleave(block, -2).repeat_interleave(block, -1)[..., :rows, :cols]
    return (weight.to(torch.float32) * spread).to(DTYPE)


def file_shapes(shape: MoeCheckpointShape, block: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every file tensor of the FP8 directory (per-expert layout): name -> (safetensors dtype, shape)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, s in shape.file_shapes(fused=False).items():
        if is_quantized(name, s):
            out[name] = ("F8_E4M3", s)
            out[f"{name}_scale_inv"] = ("F32", (-(-s[0] // block), -(-s[1] // block)))
        else:
            out[name] = (shape.stored_dtype(name), s)
    return out


def shard_names(count: int) -> list[str]:
    """The weight files of a ``count``-file directory as the hub names them (one: ``model.safetensors``)."""
    return (
        ["model.safetensors"]
        if count == 1
        else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    )


def split_by_bytes(tensors: dict[str, tuple[str, tuple[int, ...]]], count: int) -> list[list[str]]:
    """``tensors`` in order, cut into ``count`` runs of about equal bytes (a scale stays with its weight)."""
    sizes = [_SIZES[d] * math.prod(s) for d, s in tensors.values()]
    total, done, at = sum(sizes), 0, 0
    runs: list[list[str]] = [[] for _ in range(count)]
    for name, n in zip(tensors, sizes):
        if not name.endswith("_scale_inv"):  # a scale is written right after its weight, in its file
            at = min(done * count // max(total, 1), count - 1)
        runs[at].append(name)
        done += n
    return [r for r in runs if r]


_SIZES = {"F8_E4M3": 1, "F32": 4, "BF16": 2}


def write_fp8_dir(path: Path, shape: MoeCheckpointShape, block: int, *, shards: int = 1) -> Path:
    """The seeded FP8 directory of ``shape`` in ``shards`` files (written tensor by tensor once; reused
    when its config and file names match)."""
    quant = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [block] * 2}
    config = {**shape.hf_config(), "quantization_config": quant}
    tensors = file_shapes(shape, block)
    runs = split_by_bytes(tensors, shards)
    names = shard_names(len(runs))
    if (
        (path / "config.json").is_file()
        and json.loads((path / "config.json").read_text()) == config
        and all((path / n).is_file() for n in names)
    ):
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    for name, run in zip(names, runs):
        _write_file(path / name, {k: tensors[k] for k in run}, block, gen)
    weight_map = {k: name for name, run in zip(names, runs) for k in run}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _write_file(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], block: int, gen: torch.Generator) -> None:
    """One safetensors file of ``tensors`` (a weight's scale right after it), seeded values from ``gen``."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    pos = 0
    for name, (dtype, s) in tensors.items():
        n = math.prod(s) * _SIZES[dtype]
        meta[name] = {"dtype": dtype, "shape": list(s), "data_offsets": [pos, pos + n]}
        pos += n
    header = json.dumps(meta, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for name, (dtype, s) in tensors.items():
            if name.endswith("_scale_inv"):
                continue  # written with its weight
            value = torch.randn(s, generator=gen) * 0.02 + (1.0 if name.endswith("norm.weight") else 0.0)
            if dtype == "F8_E4M3":
                fp8, scale = quantize(value, block)
                f.write(fp8.view(torch.uint8).numpy().tobytes())
                f.write(scale.to(torch.float32).numpy().tobytes())
            else:
                stored = DTYPE if dtype == "BF16" else torch.float32
                f.write(value.to(stored).contiguous().view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)


# --------------------------------------------------------------------------- load steps


def _load_shardtune(model: nn.Module, hf_dir: str, *, shared: bool) -> nn.Module:
    from shardtune.checkpoint import load_hf_checkpoint

    load_hf_checkpoint(model, hf_dir, device=CPU, shared_filesystem=shared, strict=True)
    return model


def _load_dcp_quantized(model: nn.Module, hf_dir: str, *, block: int) -> nn.Module:
    """torchtitan's way: ``to_empty``, ``dcp.load`` with torch's ``QuantizedHuggingFaceStorageReader``
    (it dequantizes FP8 blocks) into the sharded params and this rank's per-expert tensors, then each
    layer's experts stacked (gate‖up concatenated) into the fused local shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import QuantizedHuggingFaceStorageReader

    model.to_empty(device=CPU)
    reader = QuantizedHuggingFaceStorageReader(hf_dir, target_dtype=DTYPE, block_size=block)
    state: dict[str, torch.Tensor] = {}
    stacks: list[tuple[DTensor, list[list[str]]]] = []
    for name, p in model.state_dict().items():
        fused = expert_files(name)
        if fused is None:
            state[name] = p
            continue
        if p.placements != (Shard(0),):
            raise ValueError(f"{name}: placement {p.placements}; this baseline stacks whole experts (Shard(0))")
        head, kind = fused
        per = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        keys = [[f"{head}.mlp.experts.{e}.{q}.weight" for q in per] for e in range(p.shape[0])[local_slices(p)[0]]]
        for group in keys:
            for key in group:
                state[key] = torch.empty(p.shape[1] // len(per), p.shape[2], dtype=p.dtype)
        stacks.append((p, keys))
    dcp.load(state, storage_reader=reader)
    for p, keys in stacks:
        local = p.to_local()
        for i, group in enumerate(keys):
            torch.cat([state.pop(k) for k in group], out=local[i])
    return model


def _load_transformers(hf_dir: str) -> nn.Module:
    """``from_pretrained`` on every rank (on CPU transformers dequantizes the FP8 weights to bf16), then FSDP2."""
    from transformers import AutoModelForCausalLM

    return fully_shard_layers(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=DTYPE))


# method -> step(meta model or None, directory, block size); the meta model is built untimed
LOAD_STEPS: dict[str, Callable[[nn.Module | None, str, int], nn.Module]] = {
    "shardtune_direct": lambda m, d, _: _load_shardtune(_given(m), d, shared=True),
    "shardtune_rank0": lambda m, d, _: _load_shardtune(_given(m), d, shared=False),
    "dcp_quantized_stack": lambda m, d, block: _load_dcp_quantized(_given(m), d, block=block),
    "transformers_fsdp2": lambda _, d, __: _load_transformers(d),
}


def _given(model: nn.Module | None) -> nn.Module:
    if model is None:
        raise ValueError("this method loads into shardtune's sharded meta model")
    return model


# --------------------------------------------------------------------------- verification


def _reference(files: Files, name: str, block: int) -> torch.Tensor:
    value = files.get(name)
    scale = f"{name}_scale_inv"
    return dequantize(value, files.get(scale), block) if scale in files else value.to(DTYPE)


def _expected_local(files: Files, name: str, param: DTensor, block: int) -> torch.Tensor:
    slices = local_slices(param)
    fused = expert_files(name)
    if fused is None:
        return _reference(files, name, block)[slices]
    head, kind = fused
    per = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    experts = range(param.shape[0])[slices[0]]
    ref = [torch.cat([_reference(files, f"{head}.mlp.experts.{e}.{p}.weight", block) for p in per]) for e in experts]
    return torch.stack(ref)[(slice(None), *slices[1:])]


def check_shards(model: nn.Module, hf_dir: str, block: int) -> str:
    """Every parameter is a materialized bf16 DTensor equal to the reference dequantization's cut."""
    files = Files(hf_dir)
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        if not isinstance(p, DTensor) or p.is_meta:
            return f"{name}: not a materialized DTensor"
        if p.dtype != DTYPE or not torch.equal(p.to_local(), _expected_local(files, name, p, block)):
            return f"{name}: local shard differs from the reference dequantization"
    return "ok"


# --------------------------------------------------------------------------- entry point


def own_reads(model: nn.Module, block: int) -> int:
    """The bytes this rank's share of the file is: its FP8 bytes and the scales covering them (whole
    experts: their files' scales), its other tensors as stored (bf16)."""
    total = 0
    for name, p in model.named_parameters():
        local = p.to_local()
        if expert_files(name) is not None:
            experts, rows, cols = local.shape
            parts = 2 if name.endswith("gate_up_proj") else 1
            total += local.numel() + experts * parts * 4 * -(-rows // parts // block) * -(-cols // block)
        elif is_quantized(name, tuple(p.shape)):
            (r0, c0), (rows, cols) = (s.start for s in local_slices(p)), local.shape
            total += local.numel() + 4 * (-(-(r0 + rows) // block) - r0 // block) * (
                -(-(c0 + cols) // block) - c0 // block
            )
        else:
            total += local.nbytes
    return total


def run(*, method: str, hf_dir: str, block: int) -> dict[str, Any]:
    """Measure one load of ``method`` on this rank, verify it; return this rank's record."""
    import torch.distributed.checkpoint.quantized_hf_storage  # noqa: F401
    import transformers  # noqa: F401

    import shardtune.checkpoint  # noqa: F401
    from shardtune.state_dict import stats

    step = LOAD_STEPS[method]
    meta = None if method == "transformers_fsdp2" else shardtune_model(hf_dir)
    stats.reset()
    before = kernel_io()
    model, measurement = measure_step(lambda: step(meta, hf_dir, block), barrier=dist.barrier)
    after = kernel_io()
    read = int(stats.bytes_read)
    try:
        verdict = check_shards(model, hf_dir, block)
    except Exception as e:  # a verification crash is a finding, not a harness failure
        verdict = f"verify raised {type(e).__name__}: {e}"
    counted = {"read": read, "received": int(stats.bytes_received), "sent": int(stats.bytes_sent)}
    dist.barrier()
    return {
        "rank": dist.get_rank(),
        "measurement": measurement.to_json(),
        "own_shard_bytes": local_bytes(model),
        "own_file_bytes": own_reads(model, block),
        "counted_bytes": counted if method.startswith("shardtune") else None,
        "kernel_io": {k: after[k] - before[k] for k in after},
        "verify": verdict,
    }
