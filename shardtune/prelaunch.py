"""What a run needs from the disk and the environment, checked before torchrun starts any rank.

Rule: ``shardtune run`` and ``shardtune validate`` call :func:`prelaunch_problems` on a config
that passed its schema (``shardtune inspect-data`` :func:`input_problems`, the part it reads);
it returns every problem at once, one line each naming the key and the fix, and the command
exits 2. Checked: each local dataset file exists and its first record
parses (hub dataset names are left to the ranks), every model directory holds a model
(``config.json`` and its safetensors weights) or is created by a tiny preset, the tokenizer
files, ``output_dir`` (writable, not locked by a running run, not another run's outputs under
``output_dir_policy: refuse``), the metric loggers' packages, and, given the process count,
the mesh degrees. Nothing here writes: ``output_dir`` is probed, never created, so a refused
run leaves nothing behind. Torch-free, so ``validate`` answers in well under a second.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from shardtune.checkpoint.errors import OutputDirError
from shardtune.checkpoint.layout import CONFIG_FILE, INDEX_FILE, SINGLE_FILE
from shardtune.checkpoint.safety import run_dir
from shardtune.choices import LOGGER_PACKAGES
from shardtune.data.hf_datasets import looks_like_hub_name
from shardtune.data.sources import ASSET_PREFIX, first_record
from shardtune.json_files import read_json
from shardtune.model_presets import TINY_PRESETS
from shardtune.run_errors import download_hint

__all__ = ["input_problems", "model_dir_problem", "prelaunch_problems"]

TOKENIZER_FILE = "tokenizer.json"
# (model directory key, the preset key that creates it when missing); the preset key None: never created.
MODEL_KEYS = (
    ("checkpoint_dir", "model"),
    ("teacher_checkpoint_dir", "teacher_model"),
    ("reference_checkpoint_dir", None),
)


def prelaunch_problems(cfg: Mapping[str, Any], *, world_size: int | None = None) -> list[str]:
    """Every problem a run of ``cfg`` (a validated config) would meet at start; [] when none.

    ``world_size`` (nproc_per_node x nnodes) adds the mesh check; None skips it."""
    problems = [*_data_problems(cfg), *_model_problems(cfg), *_output_dir_problems(cfg), *_logger_problems(cfg)]
    if world_size is not None:
        problems += _mesh_problems(cfg, world_size)
    return problems


def input_problems(cfg: Mapping[str, Any]) -> list[str]:
    """The problems of what reading a config's samples needs (``shardtune inspect-data``): its
    local dataset files and its tokenizer; [] when none."""
    return [*_data_problems(cfg), *_tokenizer_problems(cfg)]


def _datasets(cfg: Mapping[str, Any]) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(the key naming it, the entry) of every dataset entry: ``dataset``, ``dataset[1]``, ..."""
    for key in ("dataset", "validation_dataset"):
        value = cfg.get(key)
        entries = value if isinstance(value, list) else [value]
        for i, entry in enumerate(entries):
            if isinstance(entry, Mapping) and isinstance(entry.get("path"), str):
                yield (f"{key}[{i}]" if isinstance(value, list) else key), entry


def _data_problems(cfg: Mapping[str, Any]) -> list[str]:
    problems = []
    for key, entry in _datasets(cfg):
        path = entry["path"]
        if not path.startswith(ASSET_PREFIX) and not Path(path).expanduser().exists() and looks_like_hub_name(path):
            continue  # a hub dataset: the ranks download it
        try:
            first_record(path, split=entry.get("split"), subset=entry.get("subset"))
        except (OSError, ValueError, ImportError) as exc:
            problems.append(f"{key}.path: {exc}")
    return problems


def model_dir_problem(directory: str, *, key: str, preset: str | None) -> str | None:
    """What keeps ``directory`` from being the model a run starts from; None when it holds one or
    the tiny ``preset`` will create it there."""
    path = Path(directory).expanduser()
    if path.is_file():
        return (
            f"{key}={directory} is a file; set {key} to the HF model directory holding {CONFIG_FILE} and the "
            f"*.safetensors weights"
        )
    if not (path / CONFIG_FILE).is_file():
        if not path.exists() and directory.count("/") == 1 and looks_like_hub_name(directory):
            local = f"models/{directory.rsplit('/', 1)[1]}"
            also = (
                f" (a new directory for the {preset} base: write it as ./{directory})" if preset in TINY_PRESETS else ""
            )
            return (
                f"{key}={directory} looks like a Hugging Face hub id, not a local directory; download it with "
                f"{download_hint(directory, local)}, then set {key}={local}{also}"
            )
        if preset in TINY_PRESETS:
            return None  # the recipe creates the tiny base there
        return (
            f"{key}={directory} has no {CONFIG_FILE}; download the HF model there: {download_hint('<repo>', directory)}"
        )
    return _weights_problem(path, key=key)


def _weights_problem(path: Path, *, key: str) -> str | None:
    if (path / SINGLE_FILE).is_file():
        return None
    index = path / INDEX_FILE
    if not index.is_file():
        return (
            f"{key}={path} has {CONFIG_FILE} but no {SINGLE_FILE} or {INDEX_FILE}; download the weights too "
            f"({download_hint('<repo>', str(path))}); .bin weights must be converted to safetensors "
            "(transformers' save_pretrained(safe_serialization=True))"
        )
    try:
        weight_map = read_json(index, fix="download the index again").get("weight_map", {})
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
    except (OSError, ValueError, AttributeError) as exc:
        return f"{key}={path}: {INDEX_FILE} is unreadable ({exc})"
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        return (
            f"{key}={path}: {INDEX_FILE} names weight files that are not there ({shown}); finish the download "
            f"({download_hint('<repo>', str(path))} resumes it)"
        )
    return None


def _model_problems(cfg: Mapping[str, Any]) -> list[str]:
    problems = []
    for key, preset_key in MODEL_KEYS:
        preset = cfg.get(preset_key) if preset_key else None
        directory = cfg.get(key)
        if directory is None and key == "checkpoint_dir" and isinstance(preset, str):
            directory = str(Path(cfg["output_dir"]).parent / f"{preset}_base")  # as the recipes place it
        if isinstance(directory, str):
            problem = model_dir_problem(directory, key=key, preset=preset)
            problems += [problem] if problem else []
    if not any(p.startswith("checkpoint_dir=") for p in problems):
        problems += _tokenizer_problems(cfg)
    return problems


def _tokenizer_problems(cfg: Mapping[str, Any]) -> list[str]:
    spec = cfg.get("tokenizer")
    if spec == "byte":
        return []
    if spec is None:
        directory = cfg.get("checkpoint_dir")
        if directory is None or not (Path(directory).expanduser() / CONFIG_FILE).is_file():
            return []  # a tiny preset creates the base with its tokenizer
        if (Path(directory).expanduser() / TOKENIZER_FILE).is_file():
            return []
        return [
            f"tokenizer: null reads checkpoint_dir's {TOKENIZER_FILE}, but {directory} has none; download the "
            f"model's tokenizer files there, or set tokenizer=<dir or tokenizer.json> (tokenizer=byte: bytes)"
        ]
    path = Path(str(spec)).expanduser()
    if path.is_dir() and not (path / TOKENIZER_FILE).is_file():
        return [f"tokenizer={spec} is a directory without {TOKENIZER_FILE}; give the model directory that has it"]
    if not path.exists():
        return [f"tokenizer={spec} does not exist; set tokenizer=byte, a model directory or a tokenizer.json path"]
    return []


def _output_dir_problems(cfg: Mapping[str, Any]) -> list[str]:
    text = str(cfg["output_dir"])
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        return [f"output_dir={text} is a file; set output_dir to a directory (it is created if missing)"]
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return [f"output_dir={text}: {existing} is a file, so the directory cannot be created; set another output_dir"]
    if not os.access(existing, os.W_OK | os.X_OK):
        where = "" if existing == path else f" ({existing}, where it would be created)"
        return [f"output_dir={text} is not writable{where}; set output_dir to a directory you can write"]
    if existing != path:
        return []
    holder = run_dir.lock_holder(path)
    if holder is not None:
        return [
            f"output_dir={text} is in use by another run ({run_dir.describe(holder)}); wait for it to end or stop "
            "it, or set output_dir to another directory"
        ]
    resuming = bool(cfg.get("resume_from_checkpoint")) and run_dir.has_resumable(path)
    if cfg.get("output_dir_policy", "refuse") == "refuse":
        try:
            run_dir.place_run(path, policy="refuse", resuming=resuming)  # refuse only checks: it moves nothing
        except OutputDirError as exc:
            return [str(exc)]
    return []


def _logger_problems(cfg: Mapping[str, Any]) -> list[str]:
    problems = []
    for name in cfg.get("loggers") or ():
        package = LOGGER_PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            problems.append(
                f"loggers: {name} needs the {package} package, which is not installed; pip install {package}, "
                f"or remove {name} from loggers"
            )
    return problems


def _mesh_problems(cfg: Mapping[str, Any], world: int) -> list[str]:
    problems = []
    replicate = cfg.get("data_parallel_replicate", 1)
    if world % replicate:
        problems.append(
            f"data_parallel_replicate={replicate} does not divide the {world} ranks (nproc_per_node x nnodes); "
            "set it to a divisor (e.g. the number of nodes) or 1"
        )
    else:
        shard = world // replicate
        ep = cfg.get("expert_parallel", 1)
        if shard % ep:
            problems.append(
                f"expert_parallel={ep} does not divide the {shard} data-parallel shard ranks ({world} ranks / "
                f"data_parallel_replicate {replicate}); set it to a divisor of {shard}"
            )
    cp = cfg.get("context_parallel", 1)
    if world % cp:
        problems.append(
            f"context_parallel={cp} does not divide the {world} ranks (nproc_per_node x nnodes); set it to a "
            f"divisor of {world}"
        )
    return problems
