"""Installing loaded tensors into a model without breaking the references callers hold.

A load never replaces a Parameter object: new values are written into the existing storage
when it fits (materialized, same shape, dtype and device), and otherwise swapped into the
existing Parameter, so an optimizer built before the load and tied weights keep pointing at
the model's tensors. Local to each rank: no collectives here.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from shardtune.state_dict import nf4
from shardtune.state_dict.keys import ModelEntry, model_entries
from shardtune.state_dict.layout import local_tensor


def fillable(local: torch.Tensor | None, *, device: torch.device) -> torch.Tensor | None:
    """``local`` when new values can be written straight into it (materialized, contiguous, on ``device``)."""
    if local is None or local.is_meta or nf4.is_quantized(local) or not local.is_contiguous() or local.device != device:
        return None
    return local


def install(entry: ModelEntry, new_local: torch.Tensor | None, *, run_hooks: bool = True) -> bool:
    """Put ``new_local`` into the model, keeping the Parameter objects the caller holds.

    Materialized tensors of the same shape/dtype/device are filled in place. Otherwise
    (meta, NF4 or NF4 experts, another dtype or device) the new tensor is swapped into the existing
    Parameter object, so an optimizer created before the load still holds the model's
    params and tied weights stay tied; assignment is the fallback when a swap is refused.
    ``None`` (a failed read) and the param's own storage (already written in place) are no-ops.
    Returns True when it swapped: the owners' post-load hooks then run here, or, with
    ``run_hooks=False``, once per module when the caller passes them to :func:`run_load_hooks`.
    """
    current = entry.tensor
    if new_local is None or new_local is local_tensor(current):
        return False
    if _can_fill_in_place(local_tensor(current), new_local):
        local_tensor(current).copy_(new_local)
        return False
    new = _like(current, new_local, is_buffer=entry.is_buffer)
    try:
        torch.utils.swap_tensors(current, new)
    except RuntimeError:
        for _, module, name in entry.names:  # one object for every alias keeps ties
            module.load_state_dict({name: new}, strict=False, assign=True)
        entry.tensor = new
        return False
    if run_hooks:
        run_load_hooks(module for _, module, _ in entry.names)
    return True


def run_load_hooks(modules: Iterable[nn.Module]) -> None:
    """Run the load hooks of each module once: FSDP2 re-registers (and re-pads) its sharded
    params there after their tensors were swapped."""
    for module in modules:
        module.load_state_dict({}, strict=False)


def _like(current: torch.Tensor, new_local: torch.Tensor, *, is_buffer: bool) -> torch.Tensor:
    """``new_local`` as what ``current`` is: a DTensor of its mesh, placements, shape and stride
    when it is one, a Parameter (of its ``requires_grad``) unless it is a buffer."""
    if not isinstance(current, DTensor):
        return new_local if is_buffer else nn.Parameter(new_local, requires_grad=current.requires_grad)
    # DTensor's constructor, not from_local + nn.Parameter: a new leaf needs no autograd
    # function, and a load installs hundreds (their cost was a MoE load's largest after its reads).
    spec = DTensorSpec(
        current.device_mesh,
        current.placements,
        tensor_meta=TensorMeta(current.shape, current.stride(), new_local.dtype),
    )
    new = DTensor(new_local, spec, requires_grad=not is_buffer and current.requires_grad)
    if not is_buffer:
        new._is_param = True  # what nn.Parameter(...) marks a tensor subclass with
    return new


def _can_fill_in_place(current: torch.Tensor, new_local: torch.Tensor) -> bool:
    return (
        not current.is_meta
        and not nf4.is_quantized(current)
        and not nf4.is_quantized(new_local)
        and current.shape == new_local.shape
        and current.dtype == new_local.dtype
        and current.device == new_local.device
    )


@torch.no_grad()
def materialize_meta(model: nn.Module, device: torch.device | str) -> list[str]:
    """Give every meta-device param and persistent buffer uninitialized local storage on ``device``.

    Local to each rank (no collectives). The storage is swapped into the existing Parameter
    objects, as a load does, for readers that fill tensors in place (e.g. DCP). NF4 params
    (NF4 experts too) are skipped (they need values to be quantized). Returns the names materialized.
    """
    done = []
    for entry in model_entries(model):
        local = local_tensor(entry.tensor)
        if local.is_meta and not nf4.is_quantized(local):
            install(entry, torch.empty(local.shape, dtype=local.dtype, device=device))
            done.extend(entry.fqns)
    return done
