"""Optimizer state on disk: tensors in ``optimizer.safetensors``, the rest in ``optimizer.json``.

Both are FQN keyed, so a checkpoint written on N ranks loads on M. No rank gathers the state:
on save every rank writes its own rows in place, on load every rank reads only its own rows
(without a shared filesystem rank 0 does the file I/O, gathering each tensor while it writes
the previous ones).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtune.checkpoint import checksums, hf_export
from shardtune.checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from shardtune.state_dict import comm, load_from_full_optimizer_state_dict
from shardtune.state_dict.keys import ModelEntry
from shardtune.state_dict.layout import layout_of
from shardtune.state_dict.optim import param_group_fqns, hyperparameters

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
_SEP = "::"  # FQNs never contain it


def save_optimizer(model: nn.Module, opt: torch.optim.Optimizer, out_dir: Path, *, shared_filesystem: bool = True) -> None:
    """Write the optimizer's state without gathering it.

    Collective: call on all ranks. Tensors go to ``optimizer.safetensors`` (header computed
    from shapes; with ``shared_filesystem`` each rank ``pwrite``s its shard rows, as for model
    weights, otherwise rank 0 gathers each tensor and writes it in the background); hyper-parameters and
    scalars (``step``) go to ``optimizer.json``, written by rank 0. Errors raise the same
    CheckpointError on every rank.
    """
    files = _begin_save(model, opt, out_dir)
    written = hf_export.write_data(str(out_dir), files, rank0_writes=not shared_filesystem)
    comm.raise_on_every_rank(written, header=f"Writing the optimizer to {out_dir} failed:", error=CheckpointError)


def begin_optimizer_stage(model: nn.Module, opt: torch.optim.Optimizer, out_dir: Path) -> hf_export.StagePlan:
    """Collective: the first half of a background optimizer save (``optimizer.json`` and the
    sized file), for staging with the model's files in one arena (:func:`hf_export.stage_data`);
    the staged writes' ``flush()`` writes this rank's rows while the optimizer keeps stepping."""
    return hf_export.StagePlan(str(out_dir), _begin_save(model, opt, out_dir))


def _begin_save(model: nn.Module, opt: torch.optim.Optimizer, out_dir: Path) -> list[hf_export.FilePlan]:
    """Collective: plan the tensor file from the state's shapes (same on every rank), then rank 0
    creates it and writes ``optimizer.json``; returns the plan on every rank."""
    groups = param_group_fqns(model, opt)
    items, scalars = [], {}
    for fqns, group in zip(groups, opt.param_groups):
        for fqn, param in zip(fqns, group["params"]):
            for key, value in opt.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    items.append(_export_item(f"{fqn}{_SEP}{key}", value, len(items)))
                elif isinstance(value, torch.Tensor):
                    scalars.setdefault(fqn, {})[key] = {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
                else:
                    scalars.setdefault(fqn, {})[key] = {"value": value}
    files = hf_export.plan_files(items, max_shard_bytes=1 << 62)
    if files:
        files[0].name = OPTIMIZER_TENSORS
    comm.agree(
        hf_export.plan_digest(items, files),
        what="optimizer state differs between ranks",
        fix="every rank must step the same model",
        header=f"Cannot save the optimizer to {out_dir}:",
        error=CheckpointError,
    )
    created = comm.Problems()
    if comm.rank() == 0:
        with created.guard(str(out_dir)):
            out_dir.mkdir(parents=True, exist_ok=True)
            hf_export.create_files(str(out_dir), files)
            meta = {"param_groups": [{**hyperparameters(g), "params": list(f)} for f, g in zip(groups, opt.param_groups)], "scalars": scalars}
            checksums.write_bytes(out_dir / OPTIMIZER_META, json.dumps(meta, indent=1).encode())
    comm.raise_on_every_rank(created, header=f"Cannot save the optimizer to {out_dir}:", error=CheckpointError)
    return files


def _export_item(name: str, value: torch.Tensor, position: int) -> hf_export.ExportItem:
    entry = ModelEntry(tensor=value, is_buffer=False, names=[(name, None, name)], positions=[position])
    return hf_export.ExportItem(name=name, entry=entry, dtype=value.dtype, layout=layout_of(value, comm.world_size()))


def load_optimizer(
    model: nn.Module, opt: torch.optim.Optimizer, in_dir: Path, *, device: torch.device | str, shared_filesystem: bool = True
) -> None:
    """Load optimizer state written by :func:`save_optimizer`, on any number of ranks.

    Collective: call on all ranks. With ``shared_filesystem`` every rank reads the files (only
    its own rows of the tensors, straight from the file); without it only rank 0 reads and
    sends each rank its rows. A missing or corrupt file raises :class:`CheckpointError`
    naming it on every rank.
    """
    reads = shared_filesystem or comm.rank() == 0
    tensors, meta, problems = None, None, []
    if reads:
        try:
            meta = json.loads((in_dir / OPTIMIZER_META).read_text())
            tensors = SafetensorsFile(in_dir / OPTIMIZER_TENSORS)
            problems += [
                f"{tensors.path}: tensor {name!r} is not named '<param fqn>{_SEP}<state key>'"
                for name in tensors.entries
                if len(name.split(_SEP)) != 2
            ]
        except (OSError, ValueError, CheckpointError) as exc:  # json errors are ValueErrors
            problems.append(f"{in_dir}: {exc}")
    try:
        comm.raise_on_every_rank(problems, header=f"Cannot load the optimizer state from {in_dir}:", error=CheckpointError)
        full_sd = _full_state(meta, tensors, opt) if reads else {}  # {} elsewhere: the core's rank-0 mode
        load_from_full_optimizer_state_dict(model, opt, full_sd, device)
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
        fqn, key = name.split(_SEP)
        state.setdefault(fqn, {})[key] = tensors.slice(name)
    return {"state": state, "param_groups": meta["param_groups"]}


def _restore_tuples(saved_groups: list[dict[str, Any]], live_groups: list[dict[str, Any]]) -> None:
    """JSON turned tuples (e.g. Adam's betas) into lists; give them back the live optimizer's type."""
    for saved, live in zip(saved_groups, live_groups):
        for key, value in saved.items():
            if isinstance(live.get(key), tuple) and isinstance(value, list):
                saved[key] = tuple(value)
