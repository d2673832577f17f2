"""Loading Hugging Face model directories (``config.json`` + safetensors) into sharded models.

Rule: no rank reads more than its own rows. :func:`open_hf_checkpoint` validates a model
directory (single ``model.safetensors`` or an index plus shards) and maps each tensor name to
a lazy slice; given to ``load_from_full_model_state_dict`` on every rank, each rank reads only
its own rows, and no weights cross the network. :func:`load_hf_checkpoint` does that, or with
``shared_filesystem=False`` lets rank 0 read and scatter. The text tower of a multimodal
checkpoint (``ModelArgs.multimodal``) reads its tensors under their file names
(``model.language_model.*``: :func:`hf_file_prefixes`); the other towers' tensors are left in the
files (saves carry them through), and a tower the config names but the files lack is refused.
Saving is :mod:`~shardtune.checkpoint.formats.hf_save`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Self

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from tqdm import tqdm

from shardtune.checkpoint.errors import CheckpointError, UnsafeFileNameError
from shardtune.checkpoint.formats import block_fp8, mxfp4
from shardtune.checkpoint.layout import INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES
from shardtune.checkpoint.safety.file_names import inside
from shardtune.checkpoint.storage.safetensors_io import SafetensorsFile, TensorSlice
from shardtune.models.args import ModelArgs
from shardtune.models.multimodal import carried_keys, file_prefixes, note_carried, tower_problems
from shardtune.ranks import comm
from shardtune.ranks.errors import format_problems
from shardtune.state_dict.gc_pause import collector_paused
from shardtune.state_dict.keys import FilePrefixes, ModelEntry, model_entries
from shardtune.state_dict.layout import local_tensor
from shardtune.state_dict.load import load_entries

__all__ = [
    "INDEX_FILE",
    "SINGLE_FILE",
    "TOKENIZER_FILES",
    "CheckpointError",
    "HFCheckpoint",
    "load_hf_checkpoint",
    "open_hf_checkpoint",
]

logger = logging.getLogger(__name__)

PROGRESS_DELAY_S = 3.0  # the bar appears only for saves/loads that take longer


# --- reading ---------------------------------------------------------------------------------


class HFCheckpoint(Mapping[str, TensorSlice]):
    """A validated HF model directory: tensor name -> lazy :class:`TensorSlice`.

    Nothing is read until a slice is indexed; then only the rows asked for. Close it (or use
    it as a context manager) to release the file descriptors.
    """

    def __init__(self, model_dir: str, files: dict[str, SafetensorsFile], weight_map: dict[str, str]) -> None:
        self.model_dir = model_dir
        self.files = files
        self.weight_map = weight_map

    def __getitem__(self, key: str) -> TensorSlice:
        return self.files[self.weight_map[key]].slice(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.weight_map)

    def __len__(self) -> int:
        return len(self.weight_map)

    @property
    def total_bytes(self) -> int:
        return sum(self.files[f].entries[k].nbytes for k, f in self.weight_map.items())

    def without(self, keys: list[str]) -> HFCheckpoint:
        """The same files, their tensors ``keys`` left out (closing either closes both)."""
        dropped = set(keys)
        return HFCheckpoint(self.model_dir, self.files, {k: f for k, f in self.weight_map.items() if k not in dropped})

    def set_read_callback(self, callback) -> None:
        """Call ``callback(nbytes)`` after every read (progress bars)."""
        for file in self.files.values():
            file.on_read = callback

    def close(self) -> None:
        for file in self.files.values():
            file.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_hf_checkpoint(model_dir: str | os.PathLike) -> HFCheckpoint:
    """Open and validate the safetensors weights of an HF model directory (local, not collective).

    Reads ``model.safetensors``, or ``model.safetensors.index.json`` and the shard files it
    names; only headers are read. Raises :class:`CheckpointError` naming the file and key when
    a file is missing, truncated or corrupt, or the index names a tensor its shard lacks.
    """
    model_dir = os.fspath(model_dir)
    single = os.path.join(model_dir, SINGLE_FILE)
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(single):
        file = SafetensorsFile(single)
        return HFCheckpoint(model_dir, {SINGLE_FILE: file}, {k: SINGLE_FILE for k in file.entries})
    if os.path.isfile(index):
        return _open_sharded(model_dir, index)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: checkpoint directory not found")
    raise CheckpointError(
        f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE}; only safetensors HF checkpoints are "
        "supported (convert .bin weights with transformers' save_pretrained(safe_serialization=True))"
    )


def _open_sharded(model_dir: str, index_path: str) -> HFCheckpoint:
    weight_map = _read_weight_map(index_path)
    files: dict[str, SafetensorsFile] = {}
    problems: list[str] = []
    by_file: dict[str, list[str]] = {}
    for key, name in weight_map.items():  # one pass: a scan per file would cost tensors x files
        by_file.setdefault(name, []).append(key)
    for file_name in sorted(by_file):
        keys = sorted(by_file[file_name])
        try:
            path = os.fspath(inside(model_dir, file_name, listed_in=index_path))
        except UnsafeFileNameError as exc:
            problems.append(f"{exc} (it names the shard of {_few(keys)})")
            continue
        if not os.path.isfile(path):
            problems.append(
                f"{path}: shard file missing (the index names it for {_few(keys)}); copy it into {model_dir}"
            )
            continue
        try:
            files[file_name] = SafetensorsFile(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        absent = [k for k in keys if k not in files[file_name].entries]
        if absent:
            problems.append(
                f"{path}: the index names tensors {_few(absent)} that this file does not hold (stale index?)"
            )
    if problems:
        for file in files.values():
            file.close()
        raise CheckpointError(format_problems(f"{index_path}: invalid sharded checkpoint:", problems))
    return HFCheckpoint(model_dir, files, weight_map)


def _read_weight_map(index_path: str) -> dict[str, str]:
    try:
        with open(index_path, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise CheckpointError(f"{index_path}: corrupt index JSON ({exc}); re-copy or re-save the checkpoint") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointError(f'{index_path}: "weight_map" must map tensor names to file names')
    return weight_map


def _few(keys: list[str], limit: int = 5) -> str:
    return str(keys[:limit])[:-1] + (f", ... {len(keys) - limit} more]" if len(keys) > limit else "]")


@torch.no_grad()
def load_hf_checkpoint(
    model: nn.Module,
    model_dir: str | os.PathLike,
    *,
    device: torch.device | str,
    shared_filesystem: bool = True,
    strict: bool = False,
    cpu_offload: bool = False,
) -> _IncompatibleKeys:
    """Load an HF safetensors checkpoint into a (possibly sharded, possibly meta) model.

    Collective: call on all ranks. With ``shared_filesystem=True`` every rank opens the files
    and reads only the rows of its own shards (no weights cross the network); with ``False``
    only rank 0 opens them and sends each rank its piece. Returns the same
    ``_IncompatibleKeys(missing, unexpected)`` on every rank. A missing, truncated or corrupt
    file raises :class:`CheckpointError` naming the file and key on every rank.
    """
    with collector_paused():
        return _load(
            model,
            os.fspath(model_dir),
            device=device,
            shared_filesystem=shared_filesystem,
            strict=strict,
            cpu_offload=cpu_offload,
        )


def _load(
    model: nn.Module,
    model_dir: str,
    *,
    device: torch.device | str,
    shared_filesystem: bool,
    strict: bool,
    cpu_offload: bool,
) -> _IncompatibleKeys:
    start = time.perf_counter()
    checkpoint, problems = None, []
    state: Mapping = {}
    fp8: block_fp8.BlockFp8Format | None = None
    carried = 0  # tensors of the files the model does not use, which its saves must copy
    args = model_args(model)
    entries = model_entries(model, file_prefixes=hf_file_prefixes(model))
    if shared_filesystem or comm.rank() == 0:
        try:
            checkpoint = open_hf_checkpoint(model_dir)
            if args is not None:  # the text tower of a multimodal checkpoint: the other towers stay in the files
                problems += tower_problems(args, list(checkpoint), model_dir)
                unused = carried_keys(args, list(checkpoint))
                checkpoint, carried = checkpoint.without(unused), len(unused)
            state = mxfp4.dequantizing(checkpoint)  # gpt-oss MXFP4 experts, dequantized per piece as read
            # block-FP8 weights, dequantized per piece as read (read raw where the model keeps them in FP8)
            quantization = block_fp8.read_quantization(model_dir)
            state, fp8 = block_fp8.dequantizing(
                state, quantization, where=model_dir, **_kept_in_fp8(model, entries, state)
            )
        except CheckpointError as exc:
            problems.append(str(exc))
    try:
        comm.raise_on_every_rank(problems, header="Cannot load the HF checkpoint:", error=CheckpointError)
        # the format read and the tensors carried, for the saves: every rank's (rank 0's where only it reads)
        fp8, carried = (fp8, carried) if shared_filesystem else comm.all_gather_objects((fp8, carried))[0]
        block_fp8.note_source(model, fp8)
        note_carried(model, carried)
        total = _expected_reads(entries, checkpoint, shared_filesystem) if checkpoint is not None else 0
        with progress_bar(total, desc="load") as bar:
            if checkpoint is not None:
                checkpoint.set_read_callback(bar.update)
            result = load_entries(entries, state, device, strict=strict, cpu_offload=cpu_offload)
    finally:
        if checkpoint is not None:
            checkpoint.close()
    if comm.rank() == 0:
        log_done("Loaded", model_dir, checkpoint.total_bytes if checkpoint is not None else 0, start)
        _warn_unused(model_dir, result.unexpected_keys)
    return result


def _kept_in_fp8(model: nn.Module, entries: list[ModelEntry], files: Mapping[str, Any]) -> dict[str, Any]:
    """The file names of the weights ``model`` keeps in block FP8 (LoRA bases, :mod:`shardtune.peft.fp8_base`;
    routed experts, :mod:`shardtune.models.blocks.fp8_experts`: the parts ``files`` holds them as) and the block
    they were built for (None when their modules disagree): :func:`~shardtune.checkpoint.formats.block_fp8.
    dequantizing`'s ``raw`` and ``block``; nothing for a model without FP8 tensors."""
    raw: set[str] = set()
    for e in entries:
        if local_tensor(e.tensor).dtype != block_fp8.FP8_DTYPE:
            continue
        parts = [p.name for p in e.parts or () if p.name in files]
        raw.update(parts if parts and not any(k in files for k in e.keys) else e.keys)
    if not raw:
        return {}
    blocks = {block for m in model.modules() if (block := getattr(m, "fp8_block", None)) is not None}
    return {"raw": frozenset(raw), "block": blocks.pop() if len(blocks) == 1 else None}


def block_fp8_format(model: nn.Module, model_dir: str) -> block_fp8.BlockFp8Format | None:
    """The block-FP8 format of ``model_dir`` as a load of ``model`` reads it, or None (local: headers and
    ``config.json`` only); a resumed model, never loaded from its base, saves in its base's format so."""
    with open_hf_checkpoint(model_dir) as checkpoint:
        args = model_args(model)
        files = checkpoint if args is None else checkpoint.without(carried_keys(args, list(checkpoint)))
        return block_fp8.dequantizing(files, block_fp8.read_quantization(model_dir), where=model_dir)[1]


def fp8_linears(model: nn.Module, model_dir: str | os.PathLike, *, shared_filesystem: bool = True) -> list[str]:
    """Collective: call on all ranks. The module names of ``model``'s linears (plain ``nn.Linear``\\ s, before
    LoRA is applied) whose weight the block-FP8 checkpoint ``model_dir`` stores in FP8 with its scales, for
    ``apply_lora(fp8_linears=...)``; every rank returns the same list (rank 0's, which alone reads headers
    and ``config.json`` where ``shared_filesystem`` is False). An invalid checkpoint is refused on every rank."""
    names: list[str] = []
    problems: list[str] = []
    if shared_filesystem or comm.rank() == 0:
        try:
            fmt = block_fp8_format(model, os.fspath(model_dir))
            stored = fmt.names if fmt is not None else frozenset()
            for entry in model_entries(model, file_prefixes=hf_file_prefixes(model)):
                if len(entry.names) != 1 or entry.parts is not None or entry.keys[0] not in stored:
                    continue  # tied, stored in parts, or not in FP8
                fqn, module, attr = entry.names[0]
                if type(module) is nn.Linear and attr == "weight":
                    names.append(fqn.removesuffix(".weight"))
        except CheckpointError as exc:
            problems.append(str(exc))
    comm.raise_on_every_rank(problems, header="Cannot read the block-FP8 checkpoint:", error=CheckpointError)
    return names if shared_filesystem else comm.all_gather_objects(names)[0]


def model_args(model: nn.Module) -> ModelArgs | None:
    """The architecture of a shardtune decoder (None for another module)."""
    args = getattr(model, "args", None)
    return args if isinstance(args, ModelArgs) else None


def hf_file_prefixes(model: nn.Module) -> FilePrefixes:
    """How ``model``'s tensor names are spelled in its HF files: (model prefix, file prefix) pairs,
    e.g. ``model.`` -> ``model.language_model.`` for the text tower of a multimodal checkpoint."""
    args = model_args(model)
    return () if args is None else file_prefixes(args)


# Buffers older transformers versions saved though no model reads them (RoPE is recomputed from the config).
_NEVER_USED_SUFFIXES = (".rotary_emb.inv_freq",)


def _warn_unused(model_dir: str, unexpected: list[str]) -> None:
    """Warn naming the checkpoint's tensors the model has no place for (a strict load already refused them)."""
    unused = sorted(k for k in unexpected if not k.endswith(_NEVER_USED_SUFFIXES))
    if unused:
        warnings.warn(
            f"{model_dir} holds {len(unused)} tensors this model does not use, which are not loaded: {_few(unused)}; "
            "check that config.json describes these weights (another architecture or a different number of "
            "layers?), or remove the tensors from the safetensors files",
            stacklevel=3,
        )


def _expected_reads(entries: list[ModelEntry], checkpoint: HFCheckpoint, shared_filesystem: bool) -> int:
    """Bytes this rank will read: the rows of its own local tensors (of each of their file tensors,
    for tensors stored as several: MoE experts per expert), or everything when it scatters."""
    if not shared_filesystem:
        return checkpoint.total_bytes
    total = 0
    for entry in entries:
        key = next((k for k in entry.keys if k in checkpoint), None)
        if key is None and entry.parts is not None:
            key = next((p.name for p in entry.parts if p.name in checkpoint), None)
        if key is None:
            continue
        meta = checkpoint.files[checkpoint.weight_map[key]].entries[key]
        # A rank reads exactly its local block (NF4 included: quantized per shard from its rows); the
        # parts of a tensor tile it, so its blocks of them add up to that block too.
        local = local_tensor(entry.tensor)
        total += local.numel() * meta.dtype.itemsize
    return total


# --- progress --------------------------------------------------------------------------------


@contextmanager
def progress_bar(total: int, *, desc: str):
    """A byte-counting tqdm bar on rank 0 that shows up only after a few seconds."""
    bar = tqdm(
        total=total,
        desc=f"{desc} HF checkpoint",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        delay=PROGRESS_DELAY_S,
        disable=comm.rank() != 0 or not sys.stderr.isatty(),  # no \r redraws in a log file
        leave=False,
    )
    try:
        yield bar
    finally:
        bar.close()


def log_done(what: str, where: str, nbytes: int, start: float) -> None:
    seconds = time.perf_counter() - start
    logger.info(
        "%s HF checkpoint %s: %.2f GB in %.1f s (%.2f GB/s)",
        what,
        where,
        nbytes / 1e9,
        seconds,
        nbytes / 1e9 / max(seconds, 1e-9),
    )
