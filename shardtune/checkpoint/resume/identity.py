"""What identifies a run's inputs by content, cheaply, for the resume fingerprint.

Rule: an identity depends on bytes and values, never on where they are (a moved or copied
directory has the same identity), and its cost is bounded whatever the size of the input:

* base weights (:func:`weights_identity`): every top-level ``*.safetensors`` file's size and
  tensor table (name, dtype, shape, data offsets), the CRC32C of the first
  :data:`SAMPLE_BYTES` of every tensor's data (so other weights of the same shapes differ),
  and the per-block checksums of the directory's shardtune manifest when it has one. Reads
  the headers and a few KiB per tensor, not the weights.
* samples (:func:`samples_identity`): the count and up to :data:`MAX_SAMPLES` evenly spaced
  items, first and last included (all of them for a small dataset), as canonical JSON. Edits to
  items between the sampled ones of a large dataset are not seen.

Each returns an :class:`Identity`: the value hashed and a short summary for messages.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardtune.checkpoint import layout
from shardtune.checkpoint.safety.checksums import crc32c
from shardtune.checkpoint.storage.safetensors_io import read_header

SAMPLE_BYTES = 4096
MAX_SAMPLES = 1024


@dataclass(frozen=True)
class Identity:
    """``value`` (JSON-able) is what is hashed; ``summary`` says in words what it identifies."""

    value: Any
    summary: str = ""


def weights_identity(directory: Path) -> Identity:
    """The base weights in ``directory`` (see the module docstring); raises ``CheckpointError``
    naming a file whose header cannot be read, FileNotFoundError when there is none."""
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise FileNotFoundError(f"{directory} holds no *.safetensors files; point checkpoint_dir at an HF model")
    described, tensors, total = {}, 0, 0
    for path in files:
        entries = read_header(path)
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            table = []
            for e in entries.values():
                f.seek(e.start)
                sample = crc32c(f.read(min(e.nbytes, SAMPLE_BYTES)))
                table.append([e.name, str(e.dtype).removeprefix("torch."), list(e.shape), e.start, e.nbytes, sample])
        described[path.name] = {"size": size, "tensors": table}
        tensors += len(table)
        total += size
    value = {"files": described, "manifest_checksums": _manifest_checksums(directory, list(described))}
    return Identity(value, f"{len(files)} safetensors file(s), {tensors} tensors, {total} bytes")


def _manifest_checksums(directory: Path, names: list[str]) -> dict[str, Any]:
    """The weight files' block checksums in ``directory``'s shardtune manifest ({} without one)."""
    try:
        manifest = json.loads((directory / layout.MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    recorded = manifest.get("checksums") if isinstance(manifest, dict) else None
    files = recorded.get("files") if isinstance(recorded, dict) else None
    return {name: files[name] for name in names if name in files} if isinstance(files, dict) else {}


def samples_identity(dataset: Sequence[Any]) -> Identity:
    """A dataset by its length and up to :data:`MAX_SAMPLES` evenly spaced items (see the module docstring)."""
    n = len(dataset)
    count = min(n, MAX_SAMPLES)
    indices = sorted({(n - 1) * i // max(count - 1, 1) for i in range(count)}) if n else []
    return Identity({"len": n, "samples": [[i, _plain(dataset[i])] for i in indices]}, f"{n} samples")


def _plain(value: Any) -> Any:
    """Items as JSON-able values (tensors as lists)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
