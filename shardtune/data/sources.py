"""Reading records: local files (JSON list, JSON Lines, parquet), bundled assets, and Hugging Face
datasets (a ``save_to_disk`` directory, or a hub name; see ``hf_datasets``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from shardtune.data.hf_datasets import is_dataset_dir, looks_like_hub_name, read_dataset_dir, read_hub_dataset
from shardtune.json_files import read_json

__all__ = ["ASSETS_DIR", "asset_path", "first_record", "list_assets", "load_records", "resolve_data_path"]

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
ASSET_PREFIX = "asset:"


def list_assets() -> list[str]:
    """Names of the bundled data files."""
    return sorted(p.name for p in ASSETS_DIR.iterdir() if p.suffix in (".json", ".jsonl", ".parquet"))


def asset_path(name: str) -> Path:
    """Path of a bundled data file, e.g. ``asset_path("tiny_instruct.jsonl")``."""
    path = ASSETS_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"no bundled data file {name!r}; bundled: {list_assets()}")
    return path


def resolve_data_path(path: str | Path) -> Path:
    """A dataset ``path`` from a config: ``asset:<name>`` for a bundled file, else a local file or
    ``save_to_disk`` directory."""
    text = str(path)
    if text.startswith(ASSET_PREFIX):
        return asset_path(text.removeprefix(ASSET_PREFIX))
    resolved = Path(text).expanduser()
    if resolved.is_dir() and not is_dataset_dir(resolved):
        raise ValueError(
            f"dataset path {text} is a directory without state.json or dataset_dict.json, so not one written by "
            "datasets' save_to_disk; give that directory, or a .json/.jsonl/.parquet file"
        )
    if not resolved.is_file() and not resolved.is_dir():
        raise FileNotFoundError(
            f"dataset file {text} does not exist; give a local .json/.jsonl/.parquet path, a directory written by "
            f"datasets' save_to_disk, a hub dataset name, or asset:<name> for a bundled one ({', '.join(list_assets())})"
        )
    return resolved


def load_records(path: str | Path, *, split: str | None = None, subset: str | None = None) -> list[dict[str, Any]]:
    """All records of a ``.json`` (a list of objects), ``.jsonl`` or ``.parquet`` file, of a
    ``save_to_disk`` directory, or of a hub dataset (``split`` and ``subset`` choose among theirs)."""
    text = str(path)
    if not text.startswith(ASSET_PREFIX) and not Path(text).expanduser().exists() and looks_like_hub_name(text):
        return _checked(read_hub_dataset(text, split=split, subset=subset), text)
    path = resolve_data_path(path)
    if path.is_dir():
        if subset is not None:
            raise ValueError(f"dataset {path}: subset applies to hub datasets only; remove it")
        return _checked(read_dataset_dir(path, split=split), str(path))
    if split is not None or subset is not None:
        raise ValueError(f"dataset file {path}: split and subset apply to Hugging Face datasets only; remove them")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        records = _read_jsonl(path)
    elif suffix == ".json":
        records = _read_json(path)
    elif suffix == ".parquet":
        records = _read_parquet(path)
    else:
        raise ValueError(f"dataset file {path} has an unsupported extension; use .json, .jsonl or .parquet")
    return _checked(records, str(path))


def first_record(path: str | Path, *, split: str | None = None, subset: str | None = None) -> dict[str, Any]:
    """The first record of a local dataset (a file, a ``save_to_disk`` directory or ``asset:<name>``),
    read as :func:`load_records` reads it, without reading the rest of a JSON Lines or parquet file;
    raises as :func:`load_records` does, and ValueError for an empty one."""
    resolved = resolve_data_path(path)
    suffix = resolved.suffix.lower()
    if resolved.is_file() and split is None and subset is None and suffix in (".jsonl", ".ndjson", ".parquet"):
        records = _first_parquet_row(resolved) if suffix == ".parquet" else list(islice(_iter_jsonl(resolved), 1))
        records = _checked(records, str(resolved))
    else:
        records = load_records(path, split=split, subset=subset)
    if not records:
        raise ValueError(f"dataset {path} has no records; give a file with at least one")
    return records[0]


def _first_parquet_row(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    try:
        batch = next(pq.ParquetFile(path).iter_batches(batch_size=1), None)
    except Exception as e:  # pyarrow raises its own ArrowInvalid for a file that is not parquet
        raise ValueError(f"{path} is not a readable parquet file ({e}); check the file or export it again") from None
    return [] if batch is None else batch.to_pylist()


def _checked(records: list[Any], source: str) -> list[dict[str, Any]]:
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(f"{source} record {bad} is a {type(records[bad]).__name__}, not an object with named columns")
    return records


_UTF8_FIX = "re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8)"


def _read_jsonl(path: Path) -> list[Any]:
    return list(_iter_jsonl(path))


def _iter_jsonl(path: Path) -> Iterator[Any]:
    """The records of a JSON Lines file, one line at a time (blank lines skipped)."""
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{line_no} is not UTF-8 text (byte {raw[e.start : e.start + 1]!r} at column {e.start + 1}); "
                    f"{_UTF8_FIX}"
                ) from None
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no} is not valid JSON ({e.msg}); fix that line") from e


def _read_json(path: Path) -> list[Any]:
    data = read_json(path, fix="for one object per line use .jsonl", utf8_fix=_UTF8_FIX)
    if isinstance(data, list):
        return data
    raise ValueError(f"{path} must hold a JSON list of records, got a {type(data).__name__}")


def _read_parquet(path: Path) -> list[Any]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise ImportError(f"reading {path} needs pyarrow: pip install pyarrow") from e
    return pq.read_table(path).to_pylist()
