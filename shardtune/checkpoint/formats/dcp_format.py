"""Fast intermediate checkpoints in ``torch.distributed.checkpoint`` (DCP) format.

Each rank writes its own shards (optionally in the background with ``dcp.async_save``); DCP
reshards on load, so a resume may use another world size. Frozen params (a LoRA model's
base, which is reloaded from the base model) are left out. ``convert_dcp_to_hf`` turns such
a checkpoint into an HF model directory.

Rule: DCP's ``.metadata`` is a pickle, so it is read by a restricted unpickler that builds only
the classes DCP metadata holds (:data:`_METADATA_CLASSES`, torch dtypes); anything else, or a
shard file name leaving the checkpoint, raises CheckpointError naming the file on every rank
before DCP reads a byte. Values in the shards are read with ``weights_only=True``: tensors by
DCP's reader, and the other values (optimizer hyperparameters), which torch's default planner
unpickles without restriction, by :class:`_WeightsOnlyPlanner`.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.formats.training_state import load_data_only
from shardtune.checkpoint.layout import CONFIG_FILE, DCP_DIR, DCP_LORA_FILE, DCP_METADATA_FILE, MANIFEST
from shardtune.checkpoint.safety import checksums
from shardtune.checkpoint.safety.file_names import inside
from shardtune.peft.lora import lora_config_of
from shardtune.ranks import comm
from shardtune.ranks.errors import format_problems
from shardtune.state_dict.install import materialize_meta
from shardtune.state_dict.optim import hyperparameters, regroup

if TYPE_CHECKING:
    from shardtune.models.args import ModelArgs

_OPTIONS = StateDictOptions(ignore_frozen_params=True)
# dcp.load already fails on any trainable key the checkpoint lacks; frozen params are loaded
# from the base model, so setting the state must not ask for them.
_LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)
_GROUP_KEY = re.compile(r"optim\.param_groups\.(\d+)\.(\w+)$")
# What find_class is asked for when torch 2.13 unpickles the .metadata of a model + AdamW state
# dict (tests/unit/test_hostile_files.py lists it from a real save); each only builds plain data.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # a layout by name: torch.strided, ...
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it asks to build {module}.{name}, which DCP metadata never holds")


def read_dcp_metadata(path: Path) -> Metadata:
    """DCP's metadata file ``path``, unpickled admitting only DCP's metadata classes, its shard
    names checked to stay in its directory; CheckpointError naming ``path`` otherwise."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}, not DCP's Metadata")
        for info in metadata.storage_data.values():
            if not isinstance(info, _StorageInfo):
                raise pickle.UnpicklingError(f"its storage data holds a {type(info).__name__}")
            inside(path.parent, info.relative_path, listed_in=path)
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError, ImportError) as exc:
        raise CheckpointError(
            f"{path}: refused to read this DCP metadata ({exc}); it is not what torch.distributed.checkpoint "
            "writes (damaged or planted). Resume from a checkpoint you trust, or delete this one"
        ) from None
    return metadata


class _RestrictedReader(FileSystemReader):
    """DCP's file reader with the metadata read by :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]  # set just above
        return metadata


class _WeightsOnlyPlanner(DefaultLoadPlanner):
    """DCP's load planner, with non-tensor values unpickled by ``torch.load(weights_only=True)``."""

    def __init__(self, where: Path) -> None:
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        loaded = load_data_only(value, what=f"{self.where}: the value of {fqn!r}")
        if self.flatten_state_dict:  # as torch's planner stores it
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def _state(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict:
    if opt is None:
        model_sd, _ = get_state_dict(model, [], options=_OPTIONS)
        return {"model": model_sd}
    model_sd, optim_sd = get_state_dict(model, opt, options=_OPTIONS)
    return {"model": model_sd, "optim": optim_sd}


def save_dcp(
    model: nn.Module,
    opt: torch.optim.Optimizer | None,
    path: Path,
    *,
    async_save: bool,
    group: dist.ProcessGroup | None = None,
    stager: AsyncStager | None = None,
) -> Future | None:
    """Write the trainable params (and optimizer state) under ``path``.

    Collective: call on all ranks. With ``async_save`` the shards are staged in CPU memory (by
    ``stager`` when given, e.g. one that keeps its buffers between saves) and written by a
    background thread: returns a Future that each rank must wait on before the checkpoint is
    published; otherwise returns None after writing.
    """
    state = _state(model, opt)
    if async_save:
        # An AsyncSaveResponse comes only from a stager whose stage() returns a Future; ours stage in place.
        return dcp.async_save(state, checkpoint_id=str(path), process_group=group, async_stager=stager)  # type: ignore[return-value]
    dcp.save(state, checkpoint_id=str(path))
    return None


def load_dcp(
    model: nn.Module, opt: torch.optim.Optimizer | None, path: Path, *, device: torch.device | str
) -> list[str]:
    """Load a checkpoint written by :func:`save_dcp` (any world size). Collective.

    Params still on the meta device get storage first; frozen params must already be loaded.
    Optimizer state whose param groups split the params otherwise (a one-group checkpoint)
    loads by FQN into this optimizer's groups; returns that note on every rank (``[]`` if none),
    as :func:`~shardtune.state_dict.optim.regroup` words it.
    """
    problems = comm.Problems()
    metadata = None
    with problems.guard("DCP checkpoint"):
        metadata = read_dcp_metadata(path / DCP_METADATA_FILE)  # every rank reads it; refuse it on every rank alike
    comm.raise_on_every_rank(problems, header=f"Cannot load {path}:", error=CheckpointError)
    materialize_meta(model, device)
    state = _state(model, opt)
    ours = [list(g["params"]) for g in state["optim"]["param_groups"]] if opt is not None else []
    if opt is not None and metadata is not None:
        saved = _saved_group_keys(metadata)
        if saved and [sorted(k for k in g if k != "params") for g in state["optim"]["param_groups"]] != saved:
            # read the checkpoint's groups as they are (values filled in by the load), regrouped below
            state["optim"]["param_groups"] = [dict.fromkeys([*keys, "params"]) for keys in saved]
    try:
        dcp.load(state, storage_reader=_RestrictedReader(path), planner=_WeightsOnlyPlanner(path))
    except CheckpointException as exc:  # DCP gathers every rank's failure and raises it on every rank
        lines = sorted({f"{type(e).__name__}: {e}" for e, _ in exc.failures.values()})
        raise CheckpointError(format_problems(f"Cannot load {path}:", lines)) from None
    if opt is None:
        set_state_dict(model, [], model_state_dict=state["model"], optim_state_dict={}, options=_LOAD_OPTIONS)
        return []
    loaded = state["optim"]["param_groups"]
    hypers, notes, mismatch = regroup([hyperparameters(g) for g in loaded], [list(g["params"]) for g in loaded], ours)
    comm.raise_on_every_rank(mismatch, header=f"Cannot load {path}:", error=CheckpointError)  # alike on every rank
    state["optim"]["param_groups"] = [{**h, "params": fqns} for h, fqns in zip(hypers, ours)]
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"], options=_LOAD_OPTIONS)
    return notes


def _saved_group_keys(metadata: Metadata) -> list[list[str]]:
    """The hyperparameter names of each optimizer param group the checkpoint holds (from its
    ``optim.param_groups.<i>.<name>`` keys)."""
    found: dict[int, list[str]] = {}
    for key in metadata.state_dict_metadata:
        if (m := _GROUP_KEY.match(key)) and m.group(2) != "params":
            found.setdefault(int(m.group(1)), []).append(m.group(2))
    return [sorted(found.get(i, [])) for i in range(max(found) + 1)] if found else []


def write_model_description(model: nn.Module, directory: Path, base_dir: Path | None) -> None:
    """What :func:`convert_dcp_to_hf` needs to rebuild the model: its config (and LoRA settings)."""
    from shardtune.models import model_args_to_hf_config

    directory.mkdir(parents=True, exist_ok=True)
    checksums.write_bytes(
        directory / CONFIG_FILE, json.dumps(model_args_to_hf_config(cast("ModelArgs", model.args)), indent=2).encode()
    )
    lora = lora_config_of(model)
    if lora is not None:
        info = {
            "rank": lora.rank,
            "alpha": lora.alpha,
            "dropout": lora.dropout,
            "target_modules": list(lora.target_modules),
            "target_parameters": list(lora.target_parameters),
            "quantize_base": lora.quantize_base,
            "block_size": lora.block_size,
            "scaler_block_size": lora.scaler_block_size,
            "fp8_block": None if lora.fp8_block is None else list(lora.fp8_block),
            "base_dir": str(base_dir) if base_dir else None,
        }
        checksums.write_bytes(directory / DCP_LORA_FILE, json.dumps(info, indent=2).encode())


def convert_dcp_to_hf(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    base_dir: str | os.PathLike | None = None,
    overwrite: bool = False,
    weight_format: str = "dtype",
) -> Path:
    """Turn a shardtune checkpoint holding ``dcp/`` into an HF model directory (merged LoRA).

    Runs in one process (the full model is held in CPU memory) or, under torchrun, sharded
    over the ranks. LoRA checkpoints need the base model (``base_dir``, default: the one
    recorded at save time). ``out_dir`` must be new or empty (``overwrite``: or any directory but a
    checkpoint), never the checkpoint, a published checkpoint or a folder inside one.
    ``weight_format``: as :func:`~shardtune.checkpoint.formats.hf_save.save_hf_checkpoint`'s
    (``"block_fp8"``: the tensors the base stores in block FP8 written in that format again).
    """
    from shardtune.checkpoint.formats.hf_load import fp8_linears, load_hf_checkpoint
    from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
    from shardtune.models import llama_from_hf_config
    from shardtune.peft import apply_lora

    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / DCP_DIR).is_dir():
        raise FileNotFoundError(f"{checkpoint_dir} has no {DCP_DIR}/ folder; it is not a DCP checkpoint of shardtune")
    _check_out_dir(Path(out_dir), checkpoint_dir, overwrite=overwrite)
    sharded = dist.is_initialized() and dist.get_world_size() > 1
    with torch.device("meta"):
        model = llama_from_hf_config(checkpoint_dir / CONFIG_FILE)
    lora_file = checkpoint_dir / DCP_LORA_FILE
    lora = json.loads(lora_file.read_text()) if lora_file.is_file() else None
    base = base_dir or (lora or {}).get("base_dir")
    if lora is not None:
        fp8_block = None if lora.get("fp8_block") is None else tuple(lora["fp8_block"])
        kept = fp8_linears(model, base) if fp8_block is not None and base is not None else []
        with torch.device("meta"):
            apply_lora(
                model,
                rank=lora["rank"],
                alpha=lora["alpha"],
                dropout=lora["dropout"],
                target_modules=lora["target_modules"],
                target_parameters=lora.get("target_parameters", []),
                quantize_base=lora["quantize_base"],
                fp8_block=fp8_block,
                fp8_linears=kept,
                # written since NF4 block sizes became options; older files used the defaults
                **{key: lora[key] for key in ("block_size", "scaler_block_size") if key in lora},
            )
    if sharded:
        from shardtune.ranks.sharding import shard_model

        shard_model(model, frozen=True)
    if lora is not None:
        if base is None:
            raise ValueError(f"{checkpoint_dir} holds LoRA adapters only; pass base_dir=<the HF base model>")
        load_hf_checkpoint(model, base, device="cpu")
    load_dcp(model, None, checkpoint_dir / DCP_DIR, device="cpu")
    tokenizer_dir = base if base is not None and (Path(base) / "tokenizer.json").is_file() else checkpoint_dir
    save_hf_checkpoint(
        model, out_dir, merge_adapters=True, tokenizer_dir=tokenizer_dir, source_dir=base, weight_format=weight_format
    )
    return Path(out_dir)


def _check_out_dir(out_dir: Path, checkpoint_dir: Path, *, overwrite: bool) -> None:
    """Raise :class:`CheckpointError` for an ``out_dir`` a conversion would damage: the checkpoint itself, a
    folder that is or lies inside a published checkpoint (one with a manifest: a resume or ``verify`` would
    then find it changed), or a non-empty directory without ``overwrite``."""
    out, source = out_dir.resolve(), checkpoint_dir.resolve()
    if out == source or source in out.parents or out in source.parents:
        raise CheckpointError(
            f"the output {out_dir} is the checkpoint {checkpoint_dir}, inside it or holds it; "
            "write the HF directory somewhere else"
        )
    published = next((p for p in (out, *out.parents) if (p / MANIFEST).is_file()), None)
    if published is not None:
        raise CheckpointError(
            f"the output {out_dir} is inside the published checkpoint {published}; writing there "
            "would change a checkpoint that resume and verify read: write the HF directory somewhere else"
        )
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(
            f"the output {out_dir} is a directory that is not empty; give a new or empty one, or "
            "pass --overwrite to write the HF model files into it"
        )
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"the output {out_dir} is a file; give a directory path")
