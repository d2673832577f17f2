"""Optimizer state on disk: tensors in ``optimizer.safetensors``, the rest in ``optimizer.json``.

Both are FQN keyed, so a checkpoint written on N ranks loads on M: on load every rank opens
the file lazily and reads only the rows of its own shards.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from shardtune.state_dict import get_full_optimizer_state_dict, load_from_full_optimizer_state_dict
from shardtune.state_dict.comm import rank

OPTIMIZER_TENSORS = "optimizer.safetensors"
OPTIMIZER_META = "optimizer.json"
_SEP = "::"  # FQNs never contain it


def save_optimizer(model: nn.Module, opt: torch.optim.Optimizer, out_dir: Path) -> None:
    """Write the optimizer's full state (rank 0 writes).

    Collective: call on all ranks.
    """
    full = get_full_optimizer_state_dict(model, opt, rank() == 0)
    if rank() != 0:
        return
    tensors, scalars = {}, {}
    for fqn, param_state in full["state"].items():
        for key, value in param_state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                tensors[f"{fqn}{_SEP}{key}"] = value
            elif isinstance(value, torch.Tensor):
                scalars.setdefault(fqn, {})[key] = {"tensor": value.item(), "dtype": str(value.dtype).removeprefix("torch.")}
            else:
                scalars.setdefault(fqn, {})[key] = {"value": value}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / OPTIMIZER_TENSORS), metadata={"format": "pt"})
    meta = {"param_groups": full["param_groups"], "scalars": scalars}
    (out_dir / OPTIMIZER_META).write_text(json.dumps(meta, indent=1))


def load_optimizer(model: nn.Module, opt: torch.optim.Optimizer, in_dir: Path, *, device: torch.device | str) -> None:
    """Load optimizer state written by :func:`save_optimizer`, on any number of ranks.

    Collective: call on all ranks; every rank reads the files (only its own rows of the tensors).
    """
    meta = json.loads((in_dir / OPTIMIZER_META).read_text())
    _restore_tuples(meta["param_groups"], opt.param_groups)
    state: dict[str, dict[str, Any]] = {}
    for fqn, values in meta["scalars"].items():
        for key, item in values.items():
            state.setdefault(fqn, {})[key] = (
                torch.tensor(item["tensor"], dtype=getattr(torch, item["dtype"])) if "tensor" in item else item["value"]
            )
    with safe_open(str(in_dir / OPTIMIZER_TENSORS), framework="pt") as f:
        for name in f.keys():
            fqn, key = name.split(_SEP)
            state.setdefault(fqn, {})[key] = f.get_slice(name)
        load_from_full_optimizer_state_dict(model, opt, {"state": state, "param_groups": meta["param_groups"]}, device)


def _restore_tuples(saved_groups: list[dict[str, Any]], live_groups: list[dict[str, Any]]) -> None:
    """JSON turned tuples (e.g. Adam's betas) into lists; give them back the live optimizer's type."""
    for saved, live in zip(saved_groups, live_groups):
        for key, value in saved.items():
            if isinstance(live.get(key), tuple) and isinstance(value, list):
                saved[key] = tuple(value)
