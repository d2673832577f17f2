"""Optimizer state on disk: tensors in ``optimizer.safetensors``, the rest in ``optimizer.json``.

Rule: both are FQN keyed (``<param fqn>::<state key>``), so a checkpoint written on N ranks
loads on M, and no rank gathers the state: on save the tensors go through the same sharded
writer and sinks as model weights (:mod:`~shardtune.checkpoint.storage.writer`; experts split on dim 1
as one slice per expert, each rank its rows of each), on load every rank reads only its own
rows (without a shared filesystem rank 0 does the file I/O).

A torchao quantized state (AdamW8bit/4bit) is stored as it is held, never dequantized: its
codes and scales as ``<fqn>::<key>::codes`` and ``<fqn>::<key>::scale`` (the full tensors of
:mod:`~shardtune.state_dict.quantized`), its bits, block size, signedness, code table and
shape under ``"quantized"`` in ``optimizer.json``, the same files whatever the sharding.
Loading slices them for the current sharding; a world size that would cut a quantization
block between ranks (or, for experts split on dim 1, between experts) is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.layout import OPTIMIZER_META, OPTIMIZER_TENSORS
from shardtune.checkpoint.storage.plans import SavePlan, SmallFile, save
from shardtune.checkpoint.storage.safetensors_io import SafetensorsFile
from shardtune.checkpoint.storage.sinks import resolve_sink
from shardtune.checkpoint.storage.writer import Sink, WriteItem, plan_files, row_slices, whole_items
from shardtune.ranks import comm
from shardtune.state_dict import load_from_full_optimizer_state_dict, quantized
from shardtune.state_dict.layout import layout_of, local_tensor
from shardtune.state_dict.optim import hyperparameters, param_group_fqns, state_tensors

_SEP = "::"  # FQNs never contain it


def save_optimizer(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    out_dir: Path,
    *,
    shared_filesystem: bool = True,
    sink: Sink | None = None,
) -> None:
    """Write the optimizer's state without gathering it.

    Collective: call on all ranks. Tensors go to ``optimizer.safetensors`` (header computed
    from shapes; the bytes through ``sink``, by default as for model weights: with
    ``shared_filesystem`` each rank writes its shard rows in place, otherwise rank 0 gathers
    each tensor and writes it in the background); hyper-parameters and scalars (``step``) go
    to ``optimizer.json``, written by rank 0. Errors raise the same CheckpointError on every rank.
    """
    sink = resolve_sink(sink, shared_filesystem=shared_filesystem)
    save([plan_optimizer(model, opt, out_dir)], sink=sink)


def plan_optimizer(model: nn.Module, opt: torch.optim.Optimizer, out_dir: Path) -> SavePlan:
    """Collective: call on all ranks (the ranks agree on quantized states' specs). The files of
    :func:`save_optimizer`, described from the state's shapes alike on every rank (no file
    touched): the tensor file and ``optimizer.json``. Execute it with
    :func:`~shardtune.checkpoint.storage.plans.save` (or ``prepare`` and the writer)."""
    groups = param_group_fqns(model, opt)
    specs = quantized.agree_on_specs(state_tensors(groups, opt), header=f"Cannot save the optimizer to {out_dir}:")
    items: list[WriteItem] = []
    problems: list[str] = []
    scalars: dict[str, Any] = {}
    packed: dict[str, Any] = {}
    world = comm.world_size()
    for fqns, group in zip(groups, opt.param_groups):
        for fqn, param in zip(fqns, group["params"]):
            for key, value in opt.state.get(param, {}).items():
                spec = specs.get(f"{fqn}.{key}")
                problem = quantized.straddling(f"{fqn}.{key}", spec, layout_of(value, world)) if spec else None
                if problem is not None:
                    problems.append(problem)
                elif spec is not None:
                    items += _quantized_items(f"{fqn}{_SEP}{key}", value, spec, world)
                    packed.setdefault(fqn, {})[key] = {**dataclasses.asdict(spec), "shape": list(value.shape)}
                elif isinstance(value, torch.Tensor) and value.dim() > 0:
                    items += whole_items(f"{fqn}{_SEP}{key}", value, value.dtype, layout_of(value, world))
                elif isinstance(value, torch.Tensor):
                    scalars.setdefault(fqn, {})[key] = {
                        "tensor": value.item(),
                        "dtype": str(value.dtype).removeprefix("torch."),
                    }
                else:
                    scalars.setdefault(fqn, {})[key] = {"value": value}
    files = plan_files(items, str(out_dir), max_shard_bytes=1 << 62, name=lambda i, n: OPTIMIZER_TENSORS)
    meta = {
        "param_groups": [{**_encode(hyperparameters(g)), "params": list(f)} for f, g in zip(groups, opt.param_groups)],
        "scalars": scalars,
        "quantized": packed,
    }
    header = f"Cannot save the optimizer to {out_dir}:"
    return SavePlan(
        directory=str(out_dir),
        files=files,
        header=header,
        write_header=f"Writing the optimizer to {out_dir} failed:",
        what="optimizer state differs between ranks",
        fix="every rank must step the same model",
        small_files=[SmallFile(OPTIMIZER_META, json.dumps(meta, indent=1).encode())],
        problems=problems,
    )


def _quantized_items(name: str, value: torch.Tensor, spec: quantized.QuantSpec, world: int) -> list[WriteItem]:
    """The codes and scales of a quantized state, as this rank holds them, for the writer (seen
    as rows when the state is split on dim 1: written flat, each rank its range of every row)."""
    layout = layout_of(value, world)
    parts = quantized.local_parts(value, spec, layout)
    items = []
    for part, part_layout in quantized.part_layouts(spec, layout).items():
        local, file_shape = parts[part], _file_shape(spec, part, value)
        if part_layout.shape == file_shape:
            items += whole_items(f"{name}{_SEP}{part}", local, local.dtype, part_layout)
        else:
            items += row_slices(f"{name}{_SEP}{part}", local, local.dtype, part_layout, file_shape=file_shape)
    return items


def _file_shape(spec: quantized.QuantSpec, part: str, value: torch.Tensor) -> tuple[int, ...]:
    """A quantized state's part as stored: 8-bit codes shaped like the state, the rest flat."""
    if part == quantized.CODES and spec.bits == 8:
        return tuple(value.shape)
    return (value.numel() // (8 // spec.bits if part == quantized.CODES else spec.block_size),)


def _encode(hyper: dict[str, Any]) -> dict[str, Any]:
    """Hyper-parameters for JSON: tensors (torchao keeps ``lr`` as one) as ``{"tensor", "dtype"}``."""
    return {
        k: {"tensor": v.item(), "dtype": str(v.dtype).removeprefix("torch.")} if isinstance(v, torch.Tensor) else v
        for k, v in hyper.items()
    }


def load_optimizer(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    in_dir: Path,
    *,
    device: torch.device | str,
    shared_filesystem: bool = True,
) -> list[str]:
    """Load optimizer state written by :func:`save_optimizer`, on any number of ranks.

    Collective: call on all ranks. With ``shared_filesystem`` every rank reads the files (only
    its own rows of the tensors, straight from the file); without it only rank 0 reads and
    sends each rank its rows. A missing or corrupt file raises :class:`CheckpointError`
    naming it on every rank. Returns, on every rank, the note of params loaded into another
    param group than the files' (:func:`~shardtune.state_dict.optim.regroup`; ``[]`` if none).
    """
    reads = shared_filesystem or comm.rank() == 0
    tensors, meta, problems = None, None, []
    if reads:
        try:
            meta = json.loads((in_dir / OPTIMIZER_META).read_text())
            tensors = SafetensorsFile(in_dir / OPTIMIZER_TENSORS)
            problems += [
                f"{tensors.path}: tensor {name!r} is not named '<param fqn>{_SEP}<state key>'"
                f"[{_SEP}{quantized.CODES}|{_SEP}{quantized.SCALE}]"
                for name in tensors.entries
                if not _valid_name(name.split(_SEP), meta)
            ]
            problems += _meta_problems(meta, in_dir / OPTIMIZER_META) + _dtype_problems(tensors)
        except (OSError, ValueError, CheckpointError) as exc:  # json errors are ValueErrors
            problems.append(f"{in_dir}: {exc}")
    try:
        comm.raise_on_every_rank(
            problems, header=f"Cannot load the optimizer state from {in_dir}:", error=CheckpointError
        )
        full_sd = (
            _full_state(meta, tensors, opt) if reads and meta is not None and tensors is not None else {}
        )  # {} elsewhere: the core's rank-0 mode
        notes = load_from_full_optimizer_state_dict(model, opt, full_sd, device)
        comm.raise_on_every_rank(
            _value_problems(model, opt, in_dir / OPTIMIZER_TENSORS),
            header=f"Cannot load the optimizer state from {in_dir}:",
            error=CheckpointError,
        )
        return notes
    finally:
        if tensors is not None:
            tensors.close()


def _full_state(meta: dict[str, Any], tensors: SafetensorsFile, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The FQN-keyed full state dict of the files, tensors as lazy slices of ``tensors``."""
    _restore_tuples(meta["param_groups"], opt.param_groups)
    state: dict[str, dict[str, Any]] = {}
    for fqn, values in meta["scalars"].items():
        for key, item in values.items():
            state.setdefault(fqn, {})[key] = (
                torch.tensor(item["tensor"], dtype=getattr(torch, item["dtype"])) if "tensor" in item else item["value"]
            )
    for name in tensors.entries:
        fqn, key, *part = name.split(_SEP)
        if not part:
            state.setdefault(fqn, {})[key] = tensors.slice(name)
    for fqn, values in meta.get("quantized", {}).items():
        for key, item in values.items():
            spec = quantized.QuantSpec(item["bits"], item["block_size"], item["signed"], tuple(item["qmap"]))
            parts = {
                part: tensors.slice(f"{fqn}{_SEP}{key}{_SEP}{part}") for part in (quantized.CODES, quantized.SCALE)
            }
            state.setdefault(fqn, {})[key] = quantized.QuantizedState(spec, tuple(item["shape"]), **parts)
    return {"state": state, "param_groups": meta["param_groups"]}


def _valid_name(parts: list[str], meta: dict[str, Any]) -> bool:
    """``<fqn>::<key>``, or ``<fqn>::<key>::codes|scale`` of a state listed under ``"quantized"``."""
    if len(parts) == 2:
        return True
    listed = meta.get("quantized", {}).get(parts[0], {}) if len(parts) == 3 else {}
    return parts[1] in listed and parts[2] in (quantized.CODES, quantized.SCALE)


def _restore_tuples(saved_groups: list[dict[str, Any]], live_groups: list[dict[str, Any]]) -> None:
    """JSON turned tuples (e.g. Adam's betas) into lists and tensors into ``{"tensor", "dtype"}``
    (see :func:`_encode`); give them back their types."""
    for saved, live in zip(saved_groups, live_groups):
        for key, value in saved.items():
            if isinstance(live.get(key), tuple) and isinstance(value, list):
                saved[key] = tuple(value)
            elif isinstance(value, dict) and set(value) == {"tensor", "dtype"}:
                saved[key] = torch.tensor(value["tensor"], dtype=getattr(torch, value["dtype"]))


# Adam's second moments: a mean of squares, so never negative (a negative one makes the step's sqrt NaN)
_NON_NEGATIVE = ("exp_avg_sq", "max_exp_avg_sq")


def _meta_problems(meta: Any, path: Path) -> list[str]:
    """What in ``optimizer.json`` a load cannot use: its shape, and scalars that are not finite numbers."""
    if not isinstance(meta, dict) or not isinstance(meta.get("param_groups"), list):
        return [f"{path}: no 'param_groups' list; the file is not shardtune's optimizer state: resume without it"]
    if not all(isinstance(g, dict) for g in meta["param_groups"]):
        return [f"{path}: 'param_groups' holds an entry that is not an object"]
    scalars = meta.get("scalars", {})
    if not isinstance(scalars, dict) or not all(isinstance(v, dict) for v in scalars.values()):
        return [f"{path}: 'scalars' is not an object of objects"]
    problems = []
    for fqn, values in scalars.items():
        for key, item in values.items():
            value = item.get("tensor", item.get("value")) if isinstance(item, dict) else None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                problems.append(f"{path}: scalar {fqn}{_SEP}{key} is {item!r}, not a finite number")
            elif (
                isinstance(item, dict)
                and "tensor" in item
                and not isinstance(getattr(torch, str(item.get("dtype")), None), torch.dtype)
            ):
                problems.append(f"{path}: scalar {fqn}{_SEP}{key} has dtype {item.get('dtype')!r}, not a torch dtype")
    return problems


def _dtype_problems(tensors: SafetensorsFile) -> list[str]:
    """Plain state tensors must be floating point: an integer moment would be cast into the live state silently
    (quantized states keep their integer codes)."""
    return [
        f"{tensors.path}: tensor {name!r} is {entry.dtype}, an optimizer moment must be floating point; the file "
        "is damaged or not shardtune's: resume without its optimizer state"
        for name, entry in tensors.entries.items()
        if len(name.split(_SEP)) == 2 and not entry.dtype.is_floating_point
    ]


def _value_problems(model: nn.Module, opt: torch.optim.Optimizer, path: Path) -> list[str]:
    """This rank's loaded state that no step could use: non-finite values, negative second moments."""
    names: dict[torch.Tensor, str] = {p: n for n, p in model.named_parameters()}
    problems = []
    for param, state in opt.state.items():
        for key, value in state.items():
            local = local_tensor(value) if isinstance(value, torch.Tensor) else None
            if type(local) is not torch.Tensor or not local.is_floating_point():  # low-bit states: their own codes
                continue
            if not torch.isfinite(local).all():
                problems.append(f"{path}: {names.get(param, '?')}{_SEP}{key} holds NaN or inf")
            elif key in _NON_NEGATIVE and bool((local < 0).any()):
                problems.append(f"{path}: {names.get(param, '?')}{_SEP}{key} holds negative values (a mean of squares)")
    return problems
