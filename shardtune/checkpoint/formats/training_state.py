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

from shardtune.checkpoint.errors import CheckpointError, FingerprintMismatchError
from shardtune.checkpoint.layout import LEGACY_RNG_FILE, RNG_FILE, TRAINING_STATE
from shardtune.checkpoint.safety import checksums

RNG_PYTHON_KEY = "python_random"


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


# The fingerprint scheme: values are "<SCHEME>:<hash> <summary>". Checkpoints of older shardtunes
# hold bare hashes of another scheme (which hashed paths); those parts are not compared.
FINGERPRINT_SCHEME = "c1"

# What each part a recipe records identifies, and how to fix a mismatch.
FINGERPRINT_PARTS = {
    "model": (
        "the model architecture (config.json's fields)",
        "point checkpoint_dir at the base model it was trained from",
    ),
    "base_weights": (
        "the base weights (checkpoint_dir's safetensors: tensor table, sizes, sampled bytes)",
        "a LoRA adapter means what it learned only on its own base: point checkpoint_dir at that base (a moved copy is fine)",
    ),
    "teacher_weights": (
        "the teacher's weights (teacher_checkpoint_dir's safetensors)",
        "point teacher_checkpoint_dir at the teacher it was distilled from",
    ),
    "reference_weights": (
        "the DPO reference model's weights (reference_checkpoint_dir's, else checkpoint_dir's, safetensors)",
        "point reference_checkpoint_dir (or checkpoint_dir) at the reference it was trained against",
    ),
    "tokenizer": (
        "the tokenizer (its tokenizer.json content, special tokens, chat templates)",
        "use the tokenizer it was trained with (tokenizer=..., or checkpoint_dir's)",
    ),
    "dataset": (
        "the training samples (data records as tokenized: template, columns, max_seq_len, packing)",
        "resume with the same data and data settings (a moved copy of the files is fine)",
    ),
    "lora": ("the LoRA settings (lora.*)", "resume with the checkpoint's lora settings"),
}


def fingerprint(**parts: Any) -> dict[str, str]:
    """One ``"<scheme>:<hash> <summary>"`` string per named part, for resume checks.

    A value is hashed as canonical JSON; an :class:`~shardtune.checkpoint.resume.identity.Identity`
    by its ``value``, with its ``summary`` kept for messages. None parts are left out (a part a
    run does not have, e.g. ``lora`` of a full fine-tune).
    """
    out = {}
    for name, value in parts.items():
        if value is None:
            continue
        summary = getattr(value, "summary", "")
        data = getattr(value, "value", value)
        digest = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]
        out[name] = f"{FINGERPRINT_SCHEME}:{digest}" + (f" ({summary})" if summary else "")
    return out


def _scheme(value: str) -> str | None:
    head = value.split(" ", 1)[0]
    return head.split(":", 1)[0] if ":" in head else None


def _digest(value: str) -> str:
    return value.split(" ", 1)[0]


def check_fingerprint(saved: dict[str, str], current: dict[str, str], *, where: Path) -> list[str]:
    """Raise :class:`FingerprintMismatchError` naming every part that differs, what it
    identifies, the checkpoint's and this run's value and the fix.

    Parts recorded on one side only, or in another scheme (an older shardtune's), are not
    compared: returns one warning line for them (empty when everything was compared).
    """
    differ, unchecked = [], []
    for name in sorted(set(saved) | set(current)):
        old, new = saved.get(name), current.get(name)
        if old is None or new is None or _scheme(old) != _scheme(new):
            unchecked.append(name)
        elif _digest(old) != _digest(new):
            what, fix = FINGERPRINT_PARTS.get(name, (name, f"resume with the checkpoint's {name}"))
            differ.append(f"{name}: {what} differs: checkpoint {old}, this run {new}; {fix}")
    if differ:
        raise FingerprintMismatchError(
            f"Cannot resume from {where}: it was written for other inputs than this run's:\n  "
            + "\n  ".join(differ)
            + "\n  (or start a new run in another output_dir)"
        )
    if not unchecked:
        return []
    return [
        f"checkpoint {where} does not record {', '.join(unchecked)} the way this shardtune does (written by "
        "another version): not checked; make sure this run uses the checkpoint's base model, tokenizer and data"
    ]


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
    tensors: dict[str, torch.Tensor] = {name: state[name].contiguous() for name in ("torch", "cuda") if name in state}
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
