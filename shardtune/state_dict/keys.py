"""Key handling for state dicts: clean FQNs, adapter predicates, model entries.

A model entry's ``parts`` say when its tensor is stored as several file tensors (the N:1
key mapping of :mod:`~shardtune.state_dict.parts`), as its owning module declares; its ``keys``
are its names in the files. Both go through the same file-name prefixes (:func:`file_key`: the
text model of a multimodal checkpoint stores ``model.*`` as ``model.language_model.*``), given by
the format that reads or writes the files; without them a file key is the model's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn

from shardtune.state_dict.parts import Part, module_parts

# Wrappers that insert a level into module paths but not into the checkpoint's names.
_WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_fqn(name: str) -> str:
    """Strip activation-checkpoint, ``torch.compile`` and FSDP1 wrapper levels from a name."""
    for prefix in _WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def is_adapter_key(fqn: str) -> bool:
    """True for adapter weights (LoRA ``lora_A``/``lora_B``, DoRA ``magnitude``)."""
    return "lora" in fqn or "magnitude" in fqn


@dataclass
class ModelEntry:
    """One distinct tensor of a model's state dict and every name it is reachable under.

    Tied weights (one Parameter registered in several modules) form one entry with
    several ``names``; each name is a (clean FQN, owning module, attribute name) triple.
    """

    tensor: torch.Tensor
    is_buffer: bool
    names: list[tuple[str, nn.Module, str]] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # index of each name in state_dict() order
    parts: tuple[Part, ...] | None = None  # stored as these file tensors (None: as itself, under its names)
    keys: list[str] = field(default_factory=list)  # each name's file key (file prefixes applied)

    @property
    def fqn(self) -> str:
        return self.names[0][0]

    @property
    def fqns(self) -> list[str]:
        return [name[0] for name in self.names]


FilePrefixes = tuple[tuple[str, str], ...]  # (model name prefix, file name prefix) pairs


def file_key(name: str, prefixes: FilePrefixes) -> str:
    """``name`` as the files spell it: its first matching model prefix replaced by its file prefix."""
    for model_prefix, file_prefix in prefixes:
        if name.startswith(model_prefix):
            return file_prefix + name[len(model_prefix) :]
    return name


def model_entries(model: nn.Module, *, file_prefixes: FilePrefixes = ()) -> list[ModelEntry]:
    """The model's state-dict tensors in ``model.state_dict()`` order, aliases grouped, with their
    file keys and parts named through ``file_prefixes``.

    Persistent buffers are included, non-persistent ones are not, as in ``state_dict()``.
    FSDP2 modules are resharded first so their registered parameters are the sharded DTensors.
    """
    _reshard_fsdp_modules(model)
    by_id: dict[int, ModelEntry] = {}
    entries: list[ModelEntry] = []
    position = 0
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, tensor, is_buffer in _own_state(module):
            fqn = clean_fqn(f"{prefix}.{name}" if prefix else name)
            entry = by_id.get(id(tensor))
            if entry is None:
                parts = module_parts(module, clean_fqn(prefix), name, tuple(tensor.shape))
                if parts is not None and file_prefixes:
                    parts = tuple(replace(p, name=file_key(p.name, file_prefixes)) for p in parts)
                entry = ModelEntry(tensor=tensor, is_buffer=is_buffer, parts=parts)
                by_id[id(tensor)] = entry
                entries.append(entry)
            if fqn not in entry.fqns:
                entry.names.append((fqn, module, name))
                entry.positions.append(position)
                entry.keys.append(file_key(fqn, file_prefixes))
            position += 1
    return entries


def _own_state(module: nn.Module):
    for name, param in module._parameters.items():
        if param is not None:
            yield name, param, False
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield name, buf, True


def _reshard_fsdp_modules(model: nn.Module) -> None:
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def state_dict_order(entries: list[ModelEntry]) -> list[str]:
    """Every name of ``entries`` in ``model.state_dict()`` order."""
    named = [(pos, fqn) for e in entries for pos, fqn in zip(e.positions, e.fqns)]
    return [fqn for _, fqn in sorted(named)]
