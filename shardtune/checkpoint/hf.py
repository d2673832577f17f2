"""Hugging Face model checkpoints (``config.json`` + safetensors) to and from sharded models.

Loading: :func:`open_hf_checkpoint` validates a model directory (single ``model.safetensors``
or an index plus shards) and maps each tensor name to a lazy slice; given to
``load_from_full_model_state_dict`` on every rank, each rank reads only its own rows, and no
weights cross the network. :func:`load_hf_checkpoint` does that, or with
``shared_filesystem=False`` lets rank 0 read and scatter.

Saving: :func:`save_hf_checkpoint` writes the HF layout from a sharded model without
gathering it: every rank computes the same headers, rank 0 creates the files, each rank
writes its own rows in place (see :mod:`shardtune.checkpoint.hf_export`).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys
from tqdm import tqdm

from shardtune.checkpoint import checksums, hf_export
from shardtune.checkpoint.atomic import fsync_dir
from shardtune.checkpoint.safetensors_io import CheckpointError, SafetensorsFile, TensorSlice, parse_size
from shardtune.state_dict import comm, load_from_full_model_state_dict
from shardtune.state_dict.agreement import model_signature
from shardtune.state_dict.keys import format_problems, model_entries

__all__ = [
    "TOKENIZER_FILES",
    "CheckpointError",
    "HFCheckpoint",
    "load_hf_checkpoint",
    "open_hf_checkpoint",
    "save_hf_checkpoint",
    "stage_hf_checkpoint",
]

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",  # the chat template, when not inside tokenizer_config.json
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
)
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

    def set_read_callback(self, callback) -> None:
        """Call ``callback(nbytes)`` after every read (progress bars)."""
        for file in self.files.values():
            file.on_read = callback

    def close(self) -> None:
        for file in self.files.values():
            file.close()

    def __enter__(self) -> HFCheckpoint:
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
    single = os.path.join(model_dir, hf_export.SINGLE_FILE)
    index = os.path.join(model_dir, hf_export.INDEX_FILE)
    if os.path.isfile(single):
        file = SafetensorsFile(single)
        return HFCheckpoint(model_dir, {hf_export.SINGLE_FILE: file}, {k: hf_export.SINGLE_FILE for k in file.entries})
    if os.path.isfile(index):
        return _open_sharded(model_dir, index)
    if not os.path.isdir(model_dir):
        raise CheckpointError(f"{model_dir}: checkpoint directory not found")
    raise CheckpointError(
        f"{model_dir}: no {hf_export.SINGLE_FILE} or {hf_export.INDEX_FILE}; only safetensors HF checkpoints are "
        "supported (convert .bin weights with transformers' save_pretrained(safe_serialization=True))"
    )


def _open_sharded(model_dir: str, index_path: str) -> HFCheckpoint:
    weight_map = _read_weight_map(index_path)
    files: dict[str, SafetensorsFile] = {}
    problems: list[str] = []
    for file_name in sorted(set(weight_map.values())):
        path = os.path.join(model_dir, file_name)
        keys = sorted(k for k, f in weight_map.items() if f == file_name)
        if not os.path.isfile(path):
            problems.append(f"{path}: shard file missing (the index names it for {_few(keys)}); copy it into {model_dir}")
            continue
        try:
            files[file_name] = SafetensorsFile(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        absent = [k for k in keys if k not in files[file_name].entries]
        if absent:
            problems.append(f"{path}: the index names tensors {_few(absent)} that this file does not hold (stale index?)")
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
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
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
    model_dir = os.fspath(model_dir)
    start = time.perf_counter()
    checkpoint, problems = None, []
    if shared_filesystem or comm.rank() == 0:
        try:
            checkpoint = open_hf_checkpoint(model_dir)
        except CheckpointError as exc:
            problems.append(str(exc))
    try:
        comm.raise_on_every_rank(problems, header="Cannot load the HF checkpoint:", error=CheckpointError)
        total = _expected_reads(model, checkpoint, shared_filesystem) if checkpoint is not None else 0
        with _progress(total, desc="load") as bar:
            if checkpoint is not None:
                checkpoint.set_read_callback(bar.update)
            result = load_from_full_model_state_dict(
                model, checkpoint if checkpoint is not None else {}, device, strict=strict, cpu_offload=cpu_offload
            )
    finally:
        if checkpoint is not None:
            checkpoint.close()
    if comm.rank() == 0:
        _log_done("Loaded", model_dir, checkpoint.total_bytes if checkpoint is not None else 0, start)
    return result


def _expected_reads(model: nn.Module, checkpoint: HFCheckpoint, shared_filesystem: bool) -> int:
    """Bytes this rank will read: the rows of its own local tensors, or everything when it scatters."""
    if not shared_filesystem:
        return checkpoint.total_bytes
    total = 0
    for entry in model_entries(model):
        key = next((fqn for fqn in entry.fqns if fqn in checkpoint), None)
        if key is None:
            continue
        meta = checkpoint.files[checkpoint.weight_map[key]].entries[key]
        # A rank reads exactly its local block (NF4 included: quantized per shard from its rows).
        local = getattr(entry.tensor, "_local_tensor", entry.tensor)
        total += local.numel() * meta.dtype.itemsize
    return total


# --- writing ---------------------------------------------------------------------------------


@torch.no_grad()
def save_hf_checkpoint(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    merge_adapters: bool = True,
    config: Mapping[str, Any] | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    direct_io: bool = True,
    shared_filesystem: bool = True,
) -> list[str]:
    """Write ``model`` as an HF checkpoint directory loadable by ``AutoModelForCausalLM.from_pretrained``.

    Collective: call on all ranks. No rank gathers the model: with ``shared_filesystem``
    (``out_dir`` on a filesystem all ranks share) each rank writes its own rows in place;
    without it only rank 0 touches ``out_dir`` and writes one gathered tensor at a time. Writes ``config.json`` (from
    ``config`` or ``model.args``, with the saved dtype), ``model.safetensors`` or HF-named
    shards of at most ``max_shard_size`` plus ``model.safetensors.index.json``, and the
    tokenizer files found in ``tokenizer_dir``. Floating tensors are cast to ``dtype`` when
    given; NF4 bases are dequantized; with ``merge_adapters`` each LoRA linear is written as
    ``W + scaling * B @ A`` and its adapters are left out. A tied ``lm_head.weight`` is left
    out when the config says ``tie_word_embeddings``. With ``direct_io`` large ranges bypass
    the page cache (``O_DIRECT``, where the filesystem allows it; see
    :class:`~shardtune.checkpoint.safetensors_io.RangeWriter`). Returns, on every rank, the
    names of the config and weight files written (tokenizer files not included). Errors
    raise :class:`CheckpointError` with the same message on every rank.
    """
    out_dir = os.fspath(out_dir)
    start = time.perf_counter()
    files = _begin_save(
        model, out_dir, max_shard_size=max_shard_size, dtype=dtype, merge_adapters=merge_adapters, config=config,
        tokenizer_dir=tokenizer_dir,
    )
    total = sum(item.nbytes for plan in files for item in plan.items)
    with _progress(total, desc="save") as bar:
        problems = hf_export.write_data(
            out_dir, files, on_item=bar.update, fault="save:mid_tensor", direct_io=direct_io,
            rank0_writes=not shared_filesystem,
        )
    comm.raise_on_every_rank(problems, header=f"Writing the HF checkpoint in {out_dir} failed:", error=CheckpointError)
    if comm.rank() == 0:
        _log_done("Saved", out_dir, total, start)
    names = [f.name for f in files]
    return ["config.json", *names, *([hf_export.INDEX_FILE] if len(files) > 1 else [])]


@torch.no_grad()
def stage_hf_checkpoint(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    merge_adapters: bool = True,
    config: Mapping[str, Any] | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    direct_io: bool = True,
    staging_memory: hf_export.StagingMemory | None = None,
) -> hf_export.StagedWrites:
    """:func:`save_hf_checkpoint` in two halves, for saving in the background.

    Collective: call on all ranks. Writes everything but the tensors' data (config, tokenizer,
    sized files with their headers), copies this rank's rows to CPU memory (about its own
    shard's bytes, in one arena of exactly that size: ``staging_memory``'s, kept between
    saves, when given) and returns them; training may then change the model. The returned
    object's ``flush()`` writes and fsyncs the rows without collectives (so it can run in a
    thread) and returns this rank's problems; the checkpoint is complete once every rank's
    ``flush()`` has returned none. Errors before that raise the same CheckpointError on every rank.
    """
    plan = begin_hf_stage(
        model, out_dir, max_shard_size=max_shard_size, dtype=dtype, merge_adapters=merge_adapters, config=config,
        tokenizer_dir=tokenizer_dir, direct_io=direct_io,
    )
    (staged,), problems = hf_export.stage_data([plan], memory=staging_memory)
    comm.raise_on_every_rank(problems, header=f"Staging the HF checkpoint for {out_dir} failed:", error=CheckpointError)
    return staged


def begin_hf_stage(
    model: nn.Module,
    out_dir: str | os.PathLike,
    *,
    max_shard_size: int | str = "5GB",
    dtype: torch.dtype | None = None,
    merge_adapters: bool = True,
    config: Mapping[str, Any] | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    direct_io: bool = True,
) -> hf_export.StagePlan:
    """Collective: the first half of :func:`stage_hf_checkpoint` (the files' skeleton), for
    staging it with other files in one arena (:func:`hf_export.stage_data`)."""
    out_dir = os.fspath(out_dir)
    files = _begin_save(
        model, out_dir, max_shard_size=max_shard_size, dtype=dtype, merge_adapters=merge_adapters, config=config,
        tokenizer_dir=tokenizer_dir,
    )
    return hf_export.StagePlan(out_dir, files, fault="save:mid_tensor", direct_io=direct_io)


def _begin_save(
    model: nn.Module,
    out_dir: str,
    *,
    max_shard_size: int | str,
    dtype: torch.dtype | None,
    merge_adapters: bool,
    config: Mapping[str, Any] | None,
    tokenizer_dir: str | os.PathLike | None,
) -> list[hf_export.FilePlan]:
    """Collective: agree on the export plan, then rank 0 writes the skeleton (directory, sized
    files with headers, index, config, tokenizer); returns the plan of files on every rank."""
    problems: list[str] = []
    hf_config = _hf_config(model, config, problems)
    items, plan_problems = hf_export.plan_export(
        model, dtype=dtype, merge_adapters=merge_adapters, tie_word_embeddings=bool(hf_config.get("tie_word_embeddings"))
    )
    problems += plan_problems
    files = []
    try:
        files = hf_export.plan_files(items, parse_size(max_shard_size))
    except (ValueError, CheckpointError) as exc:
        problems.append(str(exc))
    _agree(problems, model, items, files)
    comm.raise_on_every_rank(
        _write_skeleton(out_dir, files, hf_config, hf_export.saved_dtype(items), tokenizer_dir) if comm.rank() == 0 else [],
        header=f"Cannot create the HF checkpoint in {out_dir}:",
        error=CheckpointError,
    )
    return files


def _hf_config(model: nn.Module, config: Mapping[str, Any] | None, problems: list[str]) -> dict[str, Any]:
    if config is not None:
        return dict(config)
    args = getattr(model, "args", None)
    if args is None:
        problems.append(f"{type(model).__name__} has no .args to build config.json from; pass config=<HF config dict>")
        return {}
    from shardtune.models import model_args_to_hf_config

    try:
        return model_args_to_hf_config(args)
    except ValueError as exc:
        problems.append(f"config.json: {exc}; pass config=<HF config dict>")
        return {}


def _agree(
    local_problems: list[str], model: nn.Module, items: list[hf_export.ExportItem], files: list[hf_export.FilePlan]
) -> None:
    """Collective: the same error on every rank when any rank found a problem or the ranks'
    plans differ (different models or arguments), before any file is touched."""
    digest = (model_signature(model_entries(model)), hf_export.plan_digest(items, files))
    comm.agree(
        digest,
        what="the tensors to write differ between ranks (different model, sharding or save arguments)",
        fix="call save_hf_checkpoint with the same model and arguments on every rank",
        header="Cannot save the HF checkpoint:",
        problems=local_problems,
        error=CheckpointError,
    )


def _write_skeleton(
    out_dir: str,
    files: list[hf_export.FilePlan],
    hf_config: dict[str, Any],
    dtype: torch.dtype | None,
    tokenizer_dir: str | os.PathLike | None,
) -> list[str]:
    """Rank 0: directory, sized weight files with headers, index, config and tokenizer files."""
    problems = comm.Problems()
    with problems.guard(out_dir):
        os.makedirs(out_dir, exist_ok=True)
        _remove_stale_weights(out_dir)
        hf_export.create_files(out_dir, files)
        if len(files) > 1:
            _write_json(os.path.join(out_dir, hf_export.INDEX_FILE), hf_export.index_json(files))
        if dtype is not None:
            name = str(dtype).removeprefix("torch.")
            hf_config = {**hf_config, "torch_dtype": name, "dtype": name}
        _write_json(os.path.join(out_dir, "config.json"), hf_config)
        if tokenizer_dir is not None:
            _copy_tokenizer(os.fspath(tokenizer_dir), out_dir)
        fsync_dir(Path(out_dir))
    return list(problems)


def _remove_stale_weights(out_dir: str) -> None:
    """Weights of an earlier save would confuse loaders (an old index beside a new single file)."""
    for name in os.listdir(out_dir):
        if name in (hf_export.SINGLE_FILE, hf_export.INDEX_FILE) or (
            name.startswith("model-") and name.endswith(".safetensors") and "-of-" in name
        ):
            os.remove(os.path.join(out_dir, name))


def _write_json(path: str, obj: object) -> None:
    checksums.write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode("utf-8"), fsync=True)


def _copy_tokenizer(tokenizer_dir: str, out_dir: str) -> None:
    if not os.path.isdir(tokenizer_dir):
        raise FileNotFoundError(f"tokenizer_dir {tokenizer_dir} is not a directory; pass the HF model directory")
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src) and os.path.abspath(src) != os.path.abspath(os.path.join(out_dir, name)):
            with open(src, "rb") as f:  # small files: checksummed from the bytes copied
                checksums.write_bytes(os.path.join(out_dir, name), f.read(), fsync=True)


# --- progress --------------------------------------------------------------------------------


@contextmanager
def _progress(total: int, *, desc: str):
    """A byte-counting tqdm bar on rank 0 that shows up only after a few seconds."""
    bar = tqdm(
        total=total,
        desc=f"{desc} HF checkpoint",
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        delay=PROGRESS_DELAY_S,
        disable=comm.rank() != 0,
        leave=False,
    )
    try:
        yield bar
    finally:
        bar.close()


def _log_done(what: str, where: str, nbytes: int, start: float) -> None:
    seconds = time.perf_counter() - start
    logger.info(
        "%s HF checkpoint %s: %.2f GB in %.1f s (%.2f GB/s)", what, where, nbytes / 1e9, seconds, nbytes / 1e9 / max(seconds, 1e-9)
    )
