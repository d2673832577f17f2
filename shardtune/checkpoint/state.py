"""Training state that is not weights: progress, schedulers, data position, RNG, fingerprint.

Rule: all of it is stored as data (JSON, safetensors), never pickle: reading a checkpoint runs no code.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any, Protocol

import safetensors
import safetensors.torch
import torch

from shardtune.checkpoint import checksums
from shardtune.checkpoint.safetensors_io import CheckpointError

TRAINING_STATE = "training_state.json"
RNG_DIR = "rng"
RNG_FILE = "rank_{rank}.safetensors"  # per rank; RNG_PYTHON_KEY in its metadata
LEGACY_RNG_FILE = "rank_{rank}.pt"  # older checkpoints (torch.save), read with weights_only=True
RNG_PYTHON_KEY = "python_random"


class FingerprintMismatchError(RuntimeError):
    """The checkpoint was written for another model, tokenizer or dataset configuration."""


class Stateful(Protocol):
    """What a checkpoint saves of a registered object other than the model (sampler, scheduler)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainingProgress:
    """Where training stands; JSON-serialisable. The loop updates the one registered with the
    Checkpointer; ``sampler``, ``lr_scheduler``, ``world_size`` and ``fingerprint`` are filled
    in by the save."""

    step: int = 0  # optimizer steps taken
    epoch: int = 0  # epochs completed
    batches_in_epoch: int = 0  # batches of the current epoch consumed (mid-epoch resume)
    world_size: int = 1
    lr_scheduler: dict[str, Any] = field(default_factory=dict)
    sampler: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, default=_json_default)

    @classmethod
    def from_json(cls, text: str) -> TrainingProgress:
        return cls(**json.loads(text))

    def update(self, other: TrainingProgress) -> None:
        """Take every field of ``other`` (in place: whoever holds this object sees the change)."""
        for f in fields(self):
            setattr(self, f.name, getattr(other, f.name))


def _json_default(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    raise TypeError(f"cannot store {type(value).__name__} in {TRAINING_STATE}")


def fingerprint(**parts: Any) -> dict[str, str]:
    """A short hash per named part (model config, tokenizer, dataset, ...) for resume checks.

    Values may be dicts/lists (hashed as canonical JSON) or paths to files (hashed by content).
    """
    out = {}
    for name, value in parts.items():
        if isinstance(value, Path):
            data = value.read_bytes() if value.is_file() else b"<absent>"
        else:
            data = json.dumps(value, sort_keys=True, default=str).encode()
        out[name] = hashlib.sha256(data).hexdigest()[:16]
    return out


def check_fingerprint(saved: dict[str, str], current: dict[str, str], *, where: Path) -> None:
    """Raise :class:`FingerprintMismatchError` naming every part that differs."""
    differ = sorted(k for k in set(saved) | set(current) if saved.get(k) != current.get(k))
    if differ:
        raise FingerprintMismatchError(
            f"checkpoint {where} was written for a different {', '.join(differ)} than this run's; "
            "resume with the same model/tokenizer/dataset config, or start a new output_dir."
        )


def rng_state() -> dict[str, Any]:
    """This process's RNG states (torch CPU and accelerator, Python)."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def reseed(seed: int, *, step: int) -> None:
    """Deterministic RNG for a resume on another world size, derived from (seed, step).

    The same on every rank, as at a fresh start (every rank seeds alike): random choices that
    must agree across ranks, such as layer-dropout decisions under FSDP, stay in step.
    """
    derived = int.from_bytes(hashlib.sha256(f"{seed}:{step}".encode()).digest()[:8], "little")
    torch.manual_seed(derived)
    random.seed(derived)


def save_rng(directory: Path, rank: int, state: dict[str, Any] | None = None) -> None:
    """Write ``rank``'s RNG state (this process's when ``state`` is None) as data, never pickle:
    the generator states as uint8 tensors of a safetensors file, Python's in its JSON metadata."""
    state = state if state is not None else rng_state()
    version, internal, gauss_next = state["python"]
    python = {"version": version, "internal": list(internal), "gauss_next": gauss_next}
    tensors = {name: state[name].contiguous() for name in ("torch", "cuda") if name in state}
    directory.mkdir(parents=True, exist_ok=True)
    data = safetensors.torch.save(tensors, metadata={RNG_PYTHON_KEY: json.dumps(python)})
    checksums.write_bytes(directory / RNG_FILE.format(rank=rank), data)


def load_rng(directory: Path, rank: int) -> dict[str, Any] | None:
    """``rank``'s saved RNG state, or None when it has none. Reads the safetensors file, or the
    ``rank_<n>.pt`` of older checkpoints with ``weights_only=True`` (tensors and plain values
    only, so a planted object cannot run code); anything else raises CheckpointError naming the file."""
    path = directory / RNG_FILE.format(rank=rank)
    if path.is_file():
        return _read_rng_safetensors(path)
    legacy = directory / LEGACY_RNG_FILE.format(rank=rank)
    if legacy.is_file():
        return _read_rng_legacy(legacy)
    return None


def _read_rng_safetensors(path: Path) -> dict[str, Any]:
    try:
        with safetensors.safe_open(str(path), framework="pt") as f:
            state: dict[str, Any] = {name: f.get_tensor(name) for name in f.keys()}
            python = json.loads((f.metadata() or {})[RNG_PYTHON_KEY])
        state["python"] = (int(python["version"]), tuple(int(x) for x in python["internal"]), python["gauss_next"])
    except (OSError, ValueError, KeyError, TypeError, safetensors.SafetensorError) as exc:
        raise CheckpointError(f"{path}: unreadable RNG state ({type(exc).__name__}: {exc})") from None
    return _checked_rng(state, path)


def _read_rng_legacy(path: Path) -> dict[str, Any]:
    return _checked_rng(load_data_only(path, what=f"{path}: this RNG state"), path)


def load_data_only(source: str | os.PathLike | IO[bytes], *, what: str) -> Any:
    """``torch.load(source, weights_only=True)``: tensors and plain values only, so a planted
    object cannot run code. A refusal raises CheckpointError naming ``what`` and the global refused."""
    try:
        return torch.load(source, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ...
        lines = str(exc).splitlines() or [""]
        reason = next((line.strip() for line in lines if "unsupported global" in line.lower()), lines[0][:80])
        raise CheckpointError(
            f"{what} was refused ({type(exc).__name__}: {reason[:200]}): it holds more than the tensors and plain "
            "values shardtune writes (planted or damaged). Resume from a checkpoint you trust"
        ) from None


def _checked_rng(state: object, path: Path) -> dict[str, Any]:
    """``state`` if :func:`set_rng_state` takes it (tried on scratch generators, so a bad file
    fails here, inside the caller's collective guard), else CheckpointError naming ``path``."""
    try:
        if not isinstance(state, dict) or not all(
            isinstance(state.get(name), torch.Tensor) and state[name].dtype == torch.uint8
            for name in ("torch", *(["cuda"] if "cuda" in state else []))
        ):
            raise TypeError("expected uint8 tensors 'torch' (and 'cuda') and Python's random state")
        torch.Generator().set_state(state["torch"])
        random.Random().setstate(state["python"])
        if not isinstance(state["python"][2], float | None):
            raise TypeError(f"Python's gauss_next is {state['python'][2]!r}, not a float or None")
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not an RNG state shardtune can restore ({exc})") from None
    return state
