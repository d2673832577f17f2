"""PEFT adapter checkpoints: ``adapter_model.safetensors`` + ``adapter_config.json``.

The layout ``peft.PeftModel.from_pretrained(base, dir)`` loads unchanged. Adapters are small,
so they are gathered to rank 0 (filtered before anything moves) and written by it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import nn

from shardtune.checkpoint import checksums
from shardtune.checkpoint.safetensors_io import CheckpointError
from shardtune.peft import from_peft_adapter_state_dict, to_peft_adapter_state_dict
from shardtune.state_dict import comm, gather_cpu_state_dict, load_from_full_model_state_dict
from shardtune.state_dict.keys import StateDictError

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def save_peft_adapter(model: nn.Module, out_dir: Path, *, base_model_name_or_path: str | None = None) -> None:
    """Write the model's LoRA adapters in PEFT format to ``out_dir`` (rank 0 writes).

    Collective: call on all ranks. Raises on every rank when the model has no LoRA adapters, and
    :class:`CheckpointError` with the same message on every rank when rank 0 cannot write.
    """
    config = getattr(model, "lora_config", None)
    if config is None:
        raise StateDictError("the model has no LoRA adapters (model.lora_config is missing); apply_lora first")
    adapters = gather_cpu_state_dict(model, comm.rank() == 0, adapter_weights_only=True)
    problems = comm.Problems()
    if comm.rank() == 0:
        with problems.guard(str(out_dir)):
            out_dir.mkdir(parents=True, exist_ok=True)
            weights = save(to_peft_adapter_state_dict(adapters), metadata={"format": "pt"})  # small: bytes in memory
            checksums.write_bytes(out_dir / ADAPTER_WEIGHTS, weights)
            peft_config = config.to_peft_config(base_model_name_or_path=base_model_name_or_path)
            checksums.write_bytes(out_dir / ADAPTER_CONFIG, json.dumps(peft_config, indent=2).encode())
    comm.raise_on_every_rank(problems, header=f"Writing the PEFT adapter to {out_dir} failed:", error=CheckpointError)


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
    adapters = from_peft_adapter_state_dict(load_file(str(path))) if reads and path.is_file() else {}
    keys = load_from_full_model_state_dict(model, adapters, device, cpu_offload=cpu_offload)
    missing = [k for k in keys.missing_keys if "lora" in k]
    if strict and (missing or keys.unexpected_keys):
        raise StateDictError(
            f"{path}: adapters missing from the file {missing[:10]}, unexpected {keys.unexpected_keys[:10]}; "
            "load adapters trained with the same LoRA targets and rank."
        )
