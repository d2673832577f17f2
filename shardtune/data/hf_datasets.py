"""Records from Hugging Face ``datasets``: directories written by ``save_to_disk``, and hub names.

The rule: a ``save_to_disk`` directory is read with ``pyarrow`` alone (its Arrow stream files,
listed in ``state.json``), so it needs no ``datasets`` package; a hub dataset name needs the
optional ``datasets`` package (``pip install shardtune[datasets]``) and goes through
``datasets.load_dataset``. Either way a split is chosen the same way: the ``split`` given, else
the only split there is; several splits and no ``split`` is an error listing them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

__all__ = ["is_dataset_dir", "looks_like_hub_name", "read_dataset_dir", "read_hub_dataset"]

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_FILE_SUFFIXES = (".json", ".jsonl", ".ndjson", ".parquet", ".arrow", ".csv")


def is_dataset_dir(path: Path) -> bool:
    """Whether ``path`` was written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def looks_like_hub_name(text: str) -> bool:
    """``owner/name`` or ``name``, not a file name."""
    return bool(_HUB_NAME.match(text)) and not text.lower().endswith(_FILE_SUFFIXES)


def _choose_split(splits: list[str], split: str | None, where: str) -> str:
    if split is None:
        if len(splits) == 1:
            return splits[0]
        raise ValueError(f"{where} has the splits {splits}; choose one with the dataset's split key (split=<name>)")
    if split not in splits:
        raise ValueError(f"{where} has no split {split!r}; its splits are {splits}")
    return split


def read_dataset_dir(path: Path, *, split: str | None) -> list[dict[str, Any]]:
    """The rows of a ``save_to_disk`` directory (of ``split`` for a ``DatasetDict``)."""
    dict_file = path / "dataset_dict.json"
    if dict_file.is_file():
        splits = list(_read_json(dict_file).get("splits", []))
        return read_dataset_dir(path / _choose_split(splits, split, str(path)), split=None)
    state = _read_json(path / "state.json")
    if split is not None and state.get("_split") not in (None, split):
        raise ValueError(f"{path} holds the split {state['_split']!r}, not {split!r}; fix split or the path")
    try:
        import pyarrow as pa
    except ImportError as e:
        raise ImportError(f"reading the dataset directory {path} needs pyarrow: pip install pyarrow") from e
    tables = []
    for entry in state.get("_data_files", []):
        with pa.memory_map(str(path / entry["filename"])) as source:
            tables.append(pa.ipc.open_stream(source).read_all())
    if not tables:
        return []
    return pa.concat_tables(tables).to_pylist()


def read_hub_dataset(name: str, *, split: str | None, subset: str | None) -> list[dict[str, Any]]:
    """The rows of a hub dataset's ``split`` (``subset``: its configuration name), via ``datasets``."""
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            f"dataset path {name!r} is not a local file or directory, and loading it as a Hugging Face hub "
            "dataset needs the optional datasets package: pip install shardtune[datasets]"
        ) from e
    try:
        loaded = datasets.load_dataset(name, subset, split=split)
    except Exception as e:  # datasets raises many kinds (not found, offline, bad config): add what was tried
        raise ValueError(
            f"dataset path {name!r} is not a local file or directory, and loading it as a Hugging Face hub dataset "
            f"(subset={subset!r}, split={split!r}) failed: {type(e).__name__}: {e}"
        ) from e
    if isinstance(loaded, datasets.DatasetDict):
        loaded = loaded[_choose_split(list(loaded), split, f"hub dataset {name!r}")]
    return loaded.to_list()


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} cannot be read as a save_to_disk file ({e}); write the dataset again") from e
    if isinstance(data, dict):
        return data
    raise ValueError(f"{path} is not a save_to_disk file (not a JSON object); write the dataset again")
