"""PEFT adapter checkpoints: ``adapter_model.safetensors`` + ``adapter_config.json``.

Rule: the layout ``peft.PeftModel.from_pretrained(base, dir)`` loads unchanged (PEFT's
``base_model.model.`` names, the adapters' own dtypes); the weights go through the sharded
writer and a sink like every other safetensors file (:mod:`~shardtune.checkpoint.storage.writer`).
Names follow transformers' modules (the text tower of a multimodal checkpoint:
``base_model.model.model.language_model.*``, as peft names them on the multimodal model, whatever its files say).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from shardtune.checkpoint.errors import CheckpointError
from shardtune.checkpoint.formats.hf_load import model_args
from shardtune.checkpoint.layout import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from shardtune.checkpoint.storage.plans import SavePlan, SmallFile, save
from shardtune.checkpoint.storage.sinks import resolve_sink
from shardtune.checkpoint.storage.writer import Sink, WriteItem, plan_files
from shardtune.choices import LORA_TARGETS
from shardtune.models.multimodal import module_prefixes
from shardtune.peft import from_peft_adapter_state_dict
from shardtune.peft.adapters import PEFT_PREFIX, is_adapter_key
from shardtune.peft.lora import lora_config_of
from shardtune.ranks import comm
from shardtune.ranks.errors import StateDictError
from shardtune.state_dict.keys import model_entries
from shardtune.state_dict.layout import layout_of
from shardtune.state_dict.load import load_entries


def save_peft_adapter(
    model: nn.Module,
    out_dir: Path,
    *,
    base_model_name_or_path: str | None = None,
    shared_filesystem: bool = True,
    sink: Sink | None = None,
) -> None:
    """Write the model's LoRA adapters in PEFT format to ``out_dir``.

    Collective: call on all ranks. The adapter weights go through ``sink`` as model weights do
    (by default, with ``shared_filesystem`` each rank writes its own rows; without it rank 0
    writes everything); rank 0 writes ``adapter_config.json``. Raises on every rank when the
    model has no LoRA adapters, and :class:`CheckpointError` with the same message on every
    rank when a write fails.
    """
    sink = resolve_sink(sink, shared_filesystem=shared_filesystem)
    save([plan_peft_adapter(model, out_dir, base_model_name_or_path=base_model_name_or_path)], sink=sink)


def plan_peft_adapter(model: nn.Module, out_dir: Path, *, base_model_name_or_path: str | None = None) -> SavePlan:
    """The files of :func:`save_peft_adapter`, described alike on every rank (local: no
    collective, no file touched): ``adapter_model.safetensors`` (PEFT names, the adapters'
    dtypes) and ``adapter_config.json``. Execute it with :func:`~shardtune.checkpoint.storage.plans.save`."""
    items = adapter_items(model)  # raises when the model has no adapters
    config = lora_config_of(model)
    assert config is not None
    files = plan_files(items, str(out_dir), max_shard_bytes=1 << 62, name=lambda i, n: ADAPTER_WEIGHTS)
    peft_config = config.to_peft_config(base_model_name_or_path=base_model_name_or_path)
    peft_config["target_modules"] = _peft_targets(peft_config["target_modules"], _peft_prefixes(model))
    return SavePlan(
        directory=str(out_dir),
        files=files,
        header=f"Cannot save the PEFT adapter to {out_dir}:",
        create_header=f"Writing the PEFT adapter to {out_dir} failed:",
        write_header=f"Writing the PEFT adapter to {out_dir} failed:",
        what="the adapters differ between ranks",
        fix="call save_peft_adapter with the same model on every rank",
        small_files=[SmallFile(ADAPTER_CONFIG, json.dumps(peft_config, indent=2).encode())],
    )


def _peft_prefixes(model: nn.Module) -> tuple[tuple[str, str], ...]:
    """How PEFT spells ``model``'s names: its modules' in transformers' (multimodal) class."""
    args = model_args(model)
    return () if args is None else module_prefixes(args)


def _peft_targets(targets: list[str], prefixes: tuple[tuple[str, str], ...]) -> list[str] | str:
    """PEFT's ``target_modules`` for the model the files hold: the names themselves for a text model; for the
    text tower of a multimodal checkpoint, a regular expression of those names under its module prefixes (and
    ``lm_head``), since the other towers reuse names such as ``q_proj`` on modules PEFT cannot adapt."""
    if not prefixes or targets == ["lm_head"]:
        return targets
    names = "|".join(re.escape(t) for t in targets if t != "lm_head")
    under = "|".join(re.escape(file) for _, file in prefixes)
    pattern = f"(?:{under}).*\\.(?:{names})"
    return f"{pattern}|lm_head" if "lm_head" in targets else pattern


def read_adapter_config(adapter_dir: Path) -> dict[str, Any]:
    """``adapter_config.json`` of a PEFT adapter directory, checked for what loading it needs (a positive integer
    ``r``, a finite number ``lora_alpha``, ``target_modules`` a list of names or a pattern, ``target_parameters``
    a list) and its weights in ``adapter_model.safetensors``; raises :class:`CheckpointError` naming the file,
    the key and the fix (a legacy pickled ``adapter_model.bin`` is never loaded: loading a pickle can run code)."""
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / ADAPTER_CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path} is missing: {adapter_dir} is not a PEFT adapter directory")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc}); save the adapter again with peft") from None
    problems = []
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} holds a {type(config).__name__}, not a JSON object")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        problems.append(f"'r' is {rank!r}, not a positive integer")
    alpha = config.get("lora_alpha")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        problems.append(f"'lora_alpha' is {alpha!r}, not a finite number")
    targets = config.get("target_modules")
    if (
        targets is not None
        and not isinstance(targets, str)
        and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets))
    ):
        problems.append(f"'target_modules' is {targets!r}, not a list of module names or a pattern")
    parameters = config.get("target_parameters")
    if parameters is not None and not (isinstance(parameters, list) and all(isinstance(t, str) for t in parameters)):
        problems.append(f"'target_parameters' is {parameters!r}, not a list of parameter names")
    if problems:
        raise CheckpointError(f"{path}: {'; '.join(problems)}; save the adapter again with peft")
    if not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise CheckpointError(_missing_weights(adapter_dir))
    return config


def _missing_weights(adapter_dir: Path) -> str:
    """Why an adapter directory without ``adapter_model.safetensors`` cannot load, and the fix."""
    legacy = adapter_dir / "adapter_model.bin"
    if legacy.is_file():
        return (
            f"{adapter_dir} holds {legacy.name}, a pickle, which shardtune never loads (loading one can run code); "
            f"write {ADAPTER_WEIGHTS} with peft: PeftModel.from_pretrained(base, dir).save_pretrained(dir)"
        )
    return f"{adapter_dir / ADAPTER_WEIGHTS} is missing: {adapter_dir} holds no adapter weights"


def peft_target_modules(adapter_dir: Path) -> list[str]:
    """The module names a PEFT adapter directory adapts: its ``adapter_config.json`` list, or, where that is a
    regular expression (a multimodal model's text tower), the names of the modules its weights adapt."""
    config = read_adapter_config(adapter_dir)
    targets = config.get("target_modules") or []
    if not isinstance(targets, str):
        return list(targets)
    from safetensors import safe_open

    with safe_open(str(Path(adapter_dir) / ADAPTER_WEIGHTS), "pt") as f:
        keys = list(f.keys())
    adapted = {k.split(".lora_A")[0].rsplit(".", 1)[-1] for k in keys if ".lora_A" in k}
    return [name for name in LORA_TARGETS if name in adapted]  # expert parameters' adapters are not modules


def adapter_items(model: nn.Module, *, dtype: torch.dtype | None = None) -> list[WriteItem]:
    """The adapter tensors :func:`save_peft_adapter` writes, in file order: PEFT's names, the
    adapters' own dtypes (floating ones cast to ``dtype`` when given), their global layouts;
    local, alike on every rank. Raises :class:`StateDictError` when the model has no LoRA adapters."""
    if lora_config_of(model) is None:
        raise StateDictError("the model has no LoRA adapters (model.lora_config is missing); apply_lora first")
    world = comm.world_size()
    entries = model_entries(model, file_prefixes=_peft_prefixes(model))
    named = sorted((pos, fqn, key, e.tensor) for e in entries for pos, fqn, key in zip(e.positions, e.fqns, e.keys))
    return [
        WriteItem(
            PEFT_PREFIX + key,
            tensor,
            dtype if dtype is not None and tensor.dtype.is_floating_point else tensor.dtype,
            layout_of(tensor, world),
        )
        for _, fqn, key, tensor in named
        if is_adapter_key(fqn)
    ]


def load_peft_adapter(
    model: nn.Module,
    adapter_dir: Path,
    *,
    device: torch.device | str,
    strict: bool = True,
    shared_filesystem: bool = True,
    cpu_offload: bool = False,
) -> None:
    """Load PEFT-format adapters into a (sharded) LoRA model.

    Collective: call on all ranks; every rank reads the (small) adapter file, or only rank 0
    without ``shared_filesystem`` (it then sends each rank its piece). With ``strict``, every
    adapter of the model must be in the file and the file must hold nothing else. With
    ``cpu_offload`` (a model sharded with it) the adapters' shards stay on CPU.
    """
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    reads = shared_filesystem or comm.rank() == 0
    missing_file = [_missing_weights(Path(adapter_dir))] if reads and not path.is_file() else []
    comm.raise_on_every_rank(missing_file, header=f"Cannot load the adapter from {adapter_dir}:", error=CheckpointError)
    adapters = from_peft_adapter_state_dict(load_file(str(path))) if reads else {}
    entries = model_entries(model, file_prefixes=_peft_prefixes(model))
    keys = load_entries(entries, adapters, device, cpu_offload=cpu_offload)
    missing = [k for k in keys.missing_keys if "lora" in k]
    if strict and (missing or keys.unexpected_keys):
        raise StateDictError(
            f"{path}: adapters missing from the file {missing[:10]}, unexpected {keys.unexpected_keys[:10]}; "
            "load adapters trained with the same LoRA targets and rank."
        )
