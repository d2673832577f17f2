"""Optimizer state on disk: tensors in ``optimizer.safetensors``, the rest in ``optimizer.json``.

Rule: both are FQN keyed (``<param fqn>::<state key>``), so a checkpoint written on N ranks
loads on M, and no rank gathers the state: on save the tensors go through the same sharded
writer and sinks as model weights (:mod:`~shardtune.checkpoint.writer`), on load every rank
reads only its own rows (without a shared filesystem rank 0 does the file I/O).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardtune.checkpoint import checksums
from shardtune.checkpoint.safetensors_io import CheckpointError, SafetensorsFile
from shardtune.checkpoint.sinks import sink_for
from shardtune.checkpoint.writer import FilePlan, Sink, WriteItem, create_files, plan_digest, plan_files, write_files
from shardtune.state_dict import comm, load_from_full_optimizer_state_dict
from shardtune.state_dict.layout import layout_of
from shardtune.state_dict.optim import hyperparameters, param_group_fqns

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
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
    if sink is None:
        sink = sink_for(shared_filesystem=shared_filesystem)
    elif not shared_filesystem and not sink.gathers_sharded:
        raise ValueError(
            f"shared_filesystem=False needs a sink that gathers to rank 0 (Rank0Sink), not {type(sink).__name__}"
        )
    written = write_files(plan_optimizer(model, opt, out_dir), sink=sink)
    comm.raise_on_every_rank(written, header=f"Writing the optimizer to {out_dir} failed:", error=CheckpointError)


def plan_optimizer(model: nn.Module, opt: torch.optim.Optimizer, out_dir: Path) -> list[FilePlan]:
    """Collective: call on all ranks. The tensor file of :func:`save_optimizer`, planned from the
    state's shapes alike on every rank; rank 0 has created it and written ``optimizer.json``.
    Hand the plan to :func:`~shardtune.checkpoint.writer.write_files`."""
    groups = param_group_fqns(model, opt)
    items, scalars = [], {}
    world = comm.world_size()
    for fqns, group in zip(groups, opt.param_groups):
        for fqn, param in zip(fqns, group["params"]):
            for key, value in opt.state.get(param, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    items.append(WriteItem(f"{fqn}{_SEP}{key}", value, value.dtype, layout_of(value, world)))
                elif isinstance(value, torch.Tensor):
                    scalars.setdefault(fqn, {})[key] = {
                        "tensor": value.item(),
                        "dtype": str(value.dtype).removeprefix("torch."),
                    }
                else:
                    scalars.setdefault(fqn, {})[key] = {"value": value}
    files = plan_files(items, str(out_dir), max_shard_bytes=1 << 62, name=lambda i, n: OPTIMIZER_TENSORS)
    comm.agree(
        plan_digest(files),
        what="optimizer state differs between ranks",
        fix="every rank must step the same model",
        header=f"Cannot save the optimizer to {out_dir}:",
        error=CheckpointError,
    )
    created = comm.Problems()
    if comm.rank() == 0:
        with created.guard(str(out_dir)):
            out_dir.mkdir(parents=True, exist_ok=True)
            create_files(files)
            meta = {
                "param_groups": [{**hyperparameters(g), "params": list(f)} for f, g in zip(groups, opt.param_groups)],
                "scalars": scalars,
            }
            checksums.write_bytes(out_dir / OPTIMIZER_META, json.dumps(meta, indent=1).encode())
    comm.raise_on_every_rank(created, header=f"Cannot save the optimizer to {out_dir}:", error=CheckpointError)
    return files


def load_optimizer(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    in_dir: Path,
    *,
    device: torch.device | str,
    shared_filesystem: bool = True,
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
        comm.raise_on_every_rank(
            problems, header=f"Cannot load the optimizer state from {in_dir}:", error=CheckpointError
        )
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
