"""Optimizer state: sharded optimizer <-> full, FQN-keyed state dict on rank 0.

Full format (rank 0 only, ``{}`` elsewhere)::

    {"state": {fqn: {"step": t, "exp_avg": T, ...}},
     "param_groups": [{"lr": ..., ..., "params": [fqn, ...]}]}

Params follow ``opt.param_groups`` order. A state dict whose groups split the same params
otherwise (e.g. one group, written before the optimizer had two) loads by FQN into this
optimizer's groups (:func:`regroup`). State tensors shaped like their param are sharded
like it; other tensors (scalars such as ``step``) are small and travel with the metadata.
torchao's quantized states (AdamW8bit/4bit) are full ``OptimState8bit``/``OptimState4bit``
tensors in the full format and move as their codes and scales (:mod:`~.quantized`), exactly.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardtune.ranks import comm
from shardtune.ranks.errors import StateDictError
from shardtune.state_dict import quantized
from shardtune.state_dict.agreement import EVERY_RANK, RANK0, agree_on_mode
from shardtune.state_dict.blocks import SendBuffer, copy_block, scatter_dense
from shardtune.state_dict.gather import gather_to_rank0
from shardtune.state_dict.install import fillable
from shardtune.state_dict.keys import model_entries
from shardtune.state_dict.layout import TensorLayout, layout_of, local_tensor, refuse_expert_parallel
from shardtune.state_dict.lazy import is_lazy, lazy_dtype
from shardtune.state_dict.quantized import QuantizedState, QuantSpec


def _param_fqns(model: nn.Module) -> dict[int, str]:
    """id(param) -> its first clean FQN."""
    return {id(e.tensor): e.fqn for e in model_entries(model) if not e.is_buffer}


def param_group_fqns(model: nn.Module, opt: torch.optim.Optimizer) -> list[list[str]]:
    """The clean FQN of every param of every group of ``opt`` (raises if one is not the model's)."""
    names = _param_fqns(model)
    groups = []
    for i, group in enumerate(opt.param_groups):
        unknown = [tuple(p.shape) for p in group["params"] if id(p) not in names]
        if unknown:
            raise StateDictError(
                f"optimizer param group {i} holds {len(unknown)} tensors (shapes {unknown[:3]}) that are not "
                "parameters of the model; create the optimizer from model.parameters() after loading the model."
            )
        groups.append([names[id(p)] for p in group["params"]])
    return groups


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's settings (lr, betas, ...), without its params."""
    return {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}


def _refuse_low_bit_expert_parallel(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """torchao's low-bit states of expert-parallel params are not mapped yet; the optimizer's type is
    the same on every rank, so each raises alike."""
    if any(cls.__module__.startswith("torchao") for cls in type(opt).__mro__):  # shardtune's subclasses too
        refuse_expert_parallel(
            model.named_parameters(),
            what=f"{type(opt).__name__} state",
            fix="use optimizer.name=adamw or expert_parallel=1",
        )


def _value_kind(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    return ("value", type(value).__name__)


@torch.no_grad()
def get_full_optimizer_state_dict(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    is_rank_zero: bool,
    device: torch.device | str | None = None,
) -> dict[str, Any]:
    """Gather a (sharded) optimizer's state into a full, FQN-keyed state dict on rank 0.

    Collective: call on all ranks. Rank 0 returns ``{"state": {fqn: {...}}, "param_groups":
    [{..., "params": [fqn, ...]}]}`` with full, independent CPU tensors; other ranks ``{}``.
    Params without state (frozen, never stepped) are listed in ``params`` only. A torchao
    quantized state is a full ``OptimState8bit``/``OptimState4bit`` (its codes and scales, not
    dequantized). ``device`` is where CPU-offloaded state goes for the collectives (NCCL); gloo uses CPU.
    """
    _refuse_low_bit_expert_parallel(model, opt)
    device = comm.normalize_device(device)
    groups = param_group_fqns(model, opt)
    view = [
        [(fqn, [(k, _value_kind(v)) for k, v in opt.state.get(p, {}).items()]) for fqn, p in zip(fqns, g["params"])]
        for fqns, g in zip(groups, opt.param_groups)
    ]
    comm.agree(
        view,
        what="optimizer state differs between ranks (params, state keys or shapes)",
        fix="every rank must step the same model.",
        header="Cannot gather the optimizer state dict:",
        problems=comm.rank_zero_problems(is_rank_zero),
    )

    specs = quantized.agree_on_specs(state_tensors(groups, opt), header="Cannot gather the optimizer state dict:")
    transfer_device = comm.comm_device(device)
    errors = comm.Problems()
    state: dict[str, dict[str, Any]] = {}
    for fqns, group in zip(groups, opt.param_groups):
        for fqn, param in zip(fqns, group["params"]):
            if opt.state.get(param):
                state[fqn] = _gather_param_state(opt.state[param], fqn, specs, transfer_device, errors)
    comm.raise_on_every_rank(errors, header="Gathering the optimizer state dict failed:")
    if not is_rank_zero:
        return {}
    return {
        "state": state,
        "param_groups": [{**hyperparameters(g), "params": list(fqns)} for fqns, g in zip(groups, opt.param_groups)],
    }


def state_tensors(groups: list[list[str]], opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """``("<fqn>.<key>", tensor)`` for every tensor of the optimizer's state, in group order."""
    return [
        (f"{fqn}.{key}", value)
        for fqns, group in zip(groups, opt.param_groups)
        for fqn, param in zip(fqns, group["params"])
        for key, value in opt.state.get(param, {}).items()
        if isinstance(value, torch.Tensor)
    ]


def _gather_param_state(
    param_state: dict[str, Any], fqn: str, specs: dict[str, QuantSpec], transfer_device, errors
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in param_state.items():
        spec = specs.get(f"{fqn}.{key}")
        problem = quantized.straddling(f"{fqn}.{key}", spec, layout_of(value, comm.world_size())) if spec else None
        if problem is not None:  # the same on every rank (from the layout): none gathers it
            errors.append(problem)
        elif spec is not None:
            layout = layout_of(value, comm.world_size())
            parts = quantized.local_parts(value, spec, layout)
            full = {
                name: gather_to_rank0(
                    parts[name], part, transfer_device=transfer_device, on_error=errors, key=f"{fqn}.{key}.{name}"
                )
                for name, part in quantized.part_layouts(spec, layout).items()
            }
            codes, scale = full[quantized.CODES], full[quantized.SCALE]
            if comm.rank() == 0 and codes is not None and scale is not None:  # gathered on rank 0 only
                out[key] = quantized.rebuild(spec, tuple(value.shape), codes, scale)
        elif isinstance(value, torch.Tensor):
            out[key] = gather_to_rank0(
                value,
                layout_of(value, comm.world_size()),
                transfer_device=transfer_device,
                on_error=errors,
                key=f"{fqn}.{key}",
            )
        else:
            out[key] = copy.deepcopy(value)
    return out


@torch.no_grad()
def load_from_full_optimizer_state_dict(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    full_sd: Mapping[str, Any],
    device: torch.device | str,
) -> list[str]:
    """Load a full optimizer state dict into a (sharded) optimizer.

    Collective: call on all ranks. ``full_sd`` is FQN keyed (as returned by
    :func:`get_full_optimizer_state_dict`) or torch's native int-keyed format, given on every
    rank or on rank 0 only with ``{}`` elsewhere. Hyper-parameters (lr, betas, ...) are taken
    from it. State shaped like its param is sharded like the param (rank 0 scatters only each
    rank's block). A torchao quantized state (a full ``OptimState8bit``/``OptimState4bit``, or a
    :class:`~.quantized.QuantizedState` of lazy slices) becomes each rank's slice of its codes
    and scales; a sharding that would cut a quantization block between ranks is a problem.
    Problems raise :class:`StateDictError` on every rank before data moves. Groups that hold
    the optimizer's params split otherwise are mapped by FQN (:func:`regroup`); returns the
    note saying so (``[]`` when the groups match), the same on every rank.
    """
    _refuse_low_bit_expert_parallel(model, opt)
    device = comm.normalize_device(device)
    groups = param_group_fqns(model, opt)
    params = {fqn: p for fqns, g in zip(groups, opt.param_groups) for fqn, p in zip(fqns, g["params"])}
    local = _fqn_keyed(full_sd, groups) if full_sd else None
    desc = _describe(local) if isinstance(local, dict) else local
    descs = comm.all_gather_objects(desc)
    mode, problems = agree_on_mode([bool(d) for d in descs], "the optimizer full_sd")
    problems += [d for d in descs if isinstance(d, str)][:1]
    reference = descs[0] if isinstance(descs[0], dict) else None
    if mode == EVERY_RANK:
        problems += comm.disagreement(
            descs, what="the optimizer full_sd differs between ranks", fix="every rank must pass the same one."
        )
    hypers: list[dict[str, Any]] = []
    notes: list[str] = []
    if reference is not None and not problems:
        hypers, notes, mismatch = regroup(reference["groups"], reference["group_params"], groups)
        problems += mismatch or _check(reference, params)
    comm.raise_on_every_rank(problems, header="Cannot load the full optimizer state dict:")
    if reference is None:
        return []

    errors = comm.Problems()
    transfer_device = comm.comm_device(device)
    send_buffer = SendBuffer()
    native_state: dict[int, dict[str, Any]] = {}
    native_groups = []
    index = 0
    for fqns, saved in zip(groups, hypers):
        ids = []
        for fqn in fqns:
            if fqn in reference["state"]:
                native_state[index] = {
                    key: _load_value(
                        kind,
                        local,
                        fqn,
                        key,
                        params[fqn],
                        mode,
                        transfer_device,
                        errors,
                        opt.state.get(params[fqn], {}).get(key),
                        send_buffer,
                    )
                    for key, kind in reference["state"][fqn].items()
                }
            ids.append(index)
            index += 1
        native_groups.append({**saved, "params": ids})
    comm.raise_on_every_rank(errors, header="Loading the full optimizer state dict failed:")
    opt.load_state_dict({"state": native_state, "param_groups": native_groups})
    return notes


def regroup(
    saved: list[dict[str, Any]], saved_fqns: list[list[str]], fqns: list[list[str]]
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """The hyperparameters for an optimizer whose groups hold ``fqns``, from a state dict whose
    groups hold ``saved_fqns`` with ``saved`` hyperparameters: ``(hyperparameters per group,
    notes, problems)``. Groups holding the same params: the saved ones, no note. A one-group state
    (written before param groups existed) holding the same params: each group takes it, and a note
    says how many params are in a group of another index than in the state dict (none when no
    param is, e.g. LoRA adapters in group 0 and an empty group 1); the caller
    then puts back its own hyperparameters (:mod:`shardtune.checkpoint.resume.hyperparameters`).
    Other params, or several groups split otherwise (``optimizer.decay_norms_and_biases`` changed
    since the save, or a damaged state): a problem, never a silent regrouping."""
    if [set(f) for f in saved_fqns] == [set(f) for f in fqns]:
        return list(saved), [], []
    held = {fqn: i for i, group in enumerate(saved_fqns) for fqn in group}
    if set(held) != {fqn for group in fqns for fqn in group} or len(saved) != 1:
        return [], [], _group_mismatch(saved_fqns, fqns)
    moved = sorted(fqn for i, group in enumerate(fqns) for fqn in group if held[fqn] != i)
    note = (
        f"the optimizer state has {len(saved)} param group(s) of {[len(f) for f in saved_fqns]} params, this "
        f"optimizer {len(fqns)} of {[len(f) for f in fqns]}: each param's state is loaded by its name; "
        f"{len(moved)} params are in another param group than in the checkpoint (e.g. {moved[:3]}), with that "
        "group's hyperparameters"
    )
    return [copy.deepcopy(saved[0]) for _ in fqns], [note] if moved else [], []


def _group_mismatch(saved_fqns: list[list[str]], fqns: list[list[str]]) -> list[str]:
    if len(saved_fqns) != len(fqns):
        return [
            f"the optimizer full_sd has {len(saved_fqns)} param groups but the optimizer has {len(fqns)}; a "
            "checkpoint keeps the groups it was written with: resume with the optimizer.decay_norms_and_biases "
            "it was written with."
        ]
    return [
        f"param group {i}: params only in the checkpoint {sorted(set(a) - set(b))[:5]}, only in the "
        f"optimizer {sorted(set(b) - set(a))[:5]}; build the optimizer over the same params."
        for i, (a, b) in enumerate(zip(saved_fqns, fqns))
        if set(a) != set(b)
    ]


def _fqn_keyed(full_sd: Mapping[str, Any], groups: list[list[str]]) -> dict | str:
    """``full_sd`` with FQN keys (converting torch's native int keys by position), or a problem."""
    if "state" not in full_sd or "param_groups" not in full_sd:
        return f"the optimizer full_sd needs 'state' and 'param_groups' keys; got {sorted(full_sd)[:5]}."
    saved_groups = full_sd["param_groups"]
    ids = [pid for g in saved_groups for pid in g["params"]]
    if not ids or not isinstance(ids[0], int):
        return {"state": full_sd["state"], "param_groups": saved_groups}
    if len(saved_groups) != len(groups):  # torch's int keys are positions: they need the same groups
        return f"the optimizer full_sd has {len(saved_groups)} param groups but the optimizer has {len(groups)}."
    mapping: dict[Any, str] = {}
    for i, (saved, fqns) in enumerate(zip(saved_groups, groups)):
        if len(saved["params"]) != len(fqns):
            return (
                f"param group {i} of the optimizer full_sd has {len(saved['params'])} params; "
                f"the optimizer has {len(fqns)}."
            )
        mapping.update(zip(saved["params"], fqns))
    unknown = [k for k in full_sd["state"] if k not in mapping]
    if unknown:
        return f"the optimizer full_sd has state for param ids {unknown[:5]} not listed in its param_groups."
    return {
        "state": {mapping[k]: v for k, v in full_sd["state"].items()},
        "param_groups": [{**g, "params": list(fqns)} for g, fqns in zip(saved_groups, groups)],
    }


def _describe(full_sd: dict) -> dict:
    """What every rank must know: groups, and per state value its shape/dtype; scalars inline."""
    state: dict[str, Any] = {}
    for fqn, param_state in full_sd["state"].items():
        state[fqn] = {}
        for key, value in param_state.items():
            packed = quantized.as_quantized_state(value)
            if packed is not None:
                state[fqn][key] = ("quantized", tuple(packed.shape), packed.spec)
            elif isinstance(value, torch.Tensor) and value.dim() > 0:
                state[fqn][key] = ("tensor", tuple(value.shape), value.dtype)
            elif is_lazy(value):  # e.g. a safetensors slice: read later, by blocks
                state[fqn][key] = ("tensor", tuple(value.get_shape()), lazy_dtype(value) or torch.float32)
            else:
                state[fqn][key] = (
                    "inline",
                    value.detach().cpu().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value),
                )
    return {
        "groups": [hyperparameters(g) for g in full_sd["param_groups"]],
        "group_params": [list(g["params"]) for g in full_sd["param_groups"]],
        "state": state,
    }


def _check(desc: dict, params: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    for fqn, param_state in desc["state"].items():
        if fqn not in params:
            problems.append(f"{fqn}: has optimizer state but is not a parameter of this optimizer.")
            continue
        for key, kind in param_state.items():
            param = params[fqn]
            if kind[0] == "quantized" and kind[1] != tuple(param.shape):
                problems.append(
                    f"{fqn}.{key}: quantized state shape {kind[1]} does not match the param's "
                    f"{tuple(param.shape)}; the checkpoint was made for a different model."
                )
            elif kind[0] == "quantized":
                problems += _misaligned(f"{fqn}.{key}", kind[2], layout_of(param, comm.world_size()))
            elif kind[0] == "tensor" and kind[1] != tuple(param.shape) and isinstance(param, DTensor):
                problems.append(
                    f"{fqn}.{key}: state shape {kind[1]} does not match the param's {tuple(param.shape)}; "
                    "the checkpoint was made for a different model."
                )
    return problems


def _misaligned(name: str, spec: QuantSpec, layout: TensorLayout) -> list[str]:
    """A problem when this sharding would cut a quantization block of a state between ranks."""
    bad = quantized.misaligned(spec, layout)
    if not bad:
        return []
    return [
        (
            f"{name}: {spec.bits}-bit optimizer state is quantized in blocks of {spec.block_size} values, but on "
            f"{comm.world_size()} ranks the shards of ranks {bad} of this {list(layout.shape)} param start or end "
            "inside a block; resume on the world size the checkpoint was saved on (or one whose shards of every "
            "param hold whole blocks), or train with optimizer.name=adamw."
        )
    ]


def _load_value(kind, local, fqn, key, param, mode, transfer_device, errors, existing, send_buffer: SendBuffer) -> Any:
    """This rank's value of one state entry; written into ``existing`` (the optimizer's current
    tensor for it) when shapes and dtypes allow, so a load allocates nothing new."""
    if kind[0] == "inline":
        return kind[1]
    if kind[0] == "quantized":
        packed = quantized.as_quantized_state(local["state"][fqn][key]) if isinstance(local, dict) else None
        return _load_quantized(kind[2], packed, fqn, key, param, mode, transfer_device, errors, send_buffer)
    _, shape, dtype = kind
    if shape == tuple(param.shape):
        layout, dtype = layout_of(param, comm.world_size()), param.dtype
    else:
        layout = TensorLayout(shape=shape, pieces=None)
    value = local["state"][fqn][key] if isinstance(local, dict) else None
    target_device = local_tensor(param).device
    me = layout.piece(comm.rank())
    into = _reusable(existing, me.shape, dtype, target_device, sharded=layout.is_sharded)
    if mode == RANK0:
        block = scatter_dense(
            layout,
            value,
            dtype=dtype,
            device=target_device,
            transfer_device=transfer_device,
            on_error=errors,
            key=f"{fqn}.{key}",
            into=into,
            send_buffer=send_buffer,
        )
    else:
        block = None
        with errors.guard(f"{fqn}.{key}"):
            block = copy_block(value, (me.shape, me.slices), dtype=dtype, device=target_device, into=into)
    if block is None:
        return None
    if into is not None:
        return existing
    if not layout.is_sharded:
        return block
    return DTensor.from_local(
        block, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _load_quantized(
    spec: QuantSpec,
    packed: QuantizedState | None,
    fqn: str,
    key: str,
    param: torch.Tensor,
    mode: str,
    transfer_device: torch.device,
    errors: comm.Problems,
    send_buffer: SendBuffer,
) -> torch.Tensor | None:
    """This rank's quantized state for ``param``: its slices of the full codes and scales."""
    layout = layout_of(param, comm.world_size())
    device = local_tensor(param).device
    parts = {}
    for name, part in quantized.part_layouts(spec, layout).items():
        dtype = torch.uint8 if name == quantized.CODES else torch.float32
        value = quantized.as_rows(getattr(packed, name), part.shape) if packed is not None else None
        me = part.piece(comm.rank())
        if mode == RANK0:
            parts[name] = scatter_dense(
                part,
                value,
                dtype=dtype,
                device=device,
                transfer_device=transfer_device,
                on_error=errors,
                key=f"{fqn}.{key}.{name}",
                send_buffer=send_buffer,
            )
        else:
            parts[name] = None
            with errors.guard(f"{fqn}.{key}.{name}"):
                parts[name] = copy_block(value, (me.shape, me.slices), dtype=dtype, device=device)
    codes, scale = parts[quantized.CODES], parts[quantized.SCALE]
    if codes is None or scale is None:
        return None
    block = quantized.rebuild(spec, layout.piece(comm.rank()).shape, codes, scale)
    if not layout.is_sharded or not isinstance(param, DTensor):  # sharded params are DTensors
        return block
    return DTensor.from_local(
        block, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def _reusable(
    existing: Any, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *, sharded: bool
) -> torch.Tensor | None:
    """The local storage of the optimizer's current state tensor, if the loaded block fits it."""
    if not isinstance(existing, torch.Tensor) or isinstance(existing, DTensor) != sharded:
        return None
    local = local_tensor(existing)
    if type(local) is not torch.Tensor:  # a quantized state: its memory is not the loaded block's
        return None
    if tuple(local.shape) != tuple(block_shape) or local.dtype != dtype:
        return None
    return fillable(local, device=device)
