"""Rank-side code of the state-dict benchmark: setup, the timed steps, verification.

:func:`run` is the per-rank entry point (``benchmarks._state_dict_steps:run``) started
by :func:`benchmarks._measure.spawn_ranks`; every method runs in fresh processes.
Setup (building the sharded model, materializing it for gather/optimizer groups,
one AdamW step) is not timed; verification runs after the measured step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from benchmarks._fixtures import (
    SIZES,
    build_sharded_meta_model,
    load_dsd_broadcast,
    load_torchtune,
    local_bytes,
    local_slices,
    materialize_from_file,
    read_metadata,
)
from benchmarks._measure import measure_step

CPU = torch.device("cpu")
_ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@dataclass
class Ctx:
    """What a step needs on this rank."""

    model: nn.Module
    rank: int
    model_path: str
    optim_path: str | None = None
    opt: torch.optim.Optimizer | None = None


# --------------------------------------------------------------------------- helpers


def _training() -> Any:
    from shardtune import training

    return training


def _byte_counter() -> Any | None:
    """``shardtune.state_dict.stats`` if the core exposes the byte counters."""
    try:
        from shardtune.state_dict import stats
    except ImportError:
        return None
    if all(hasattr(stats, a) for a in ("bytes_received", "bytes_sent", "reset")):
        return stats
    return None


def _stepped_adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW with state: one step with gradients of ones, gradients dropped afterwards."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def _full_optim_from_file(path: str, model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """FQN-keyed full AdamW state dict backed by the mmap'd optimizer fixture file."""
    meta = read_metadata(Path(path))
    tensors = load_file(path)
    fqns = [name for name, _ in model.named_parameters()]
    state = {
        fqn: {"step": torch.tensor(float(meta["step"]))} | {k: tensors[f"{fqn}.{k}"] for k in _ADAM_KEYS}
        for fqn in fqns
    }
    hyper = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    return {"state": state, "param_groups": [hyper | {"lr": float(meta["lr"]), "params": fqns}]}


# --------------------------------------------------------------------------- steps


def _load_shardtune_rank0(ctx: Ctx) -> Any:
    sd = load_file(ctx.model_path) if ctx.rank == 0 else {}
    return _training().load_from_full_model_state_dict(ctx.model, sd, CPU)


def _load_shardtune_all(ctx: Ctx) -> Any:
    return _training().load_from_full_model_state_dict(ctx.model, load_file(ctx.model_path), CPU)


def _load_dsd_broadcast(ctx: Ctx) -> Any:
    return load_dsd_broadcast(ctx.model, ctx.model_path, ctx.rank)


def _load_torchtune(ctx: Ctx) -> Any:
    return load_torchtune(ctx.model, ctx.model_path)


def _gather_shardtune(ctx: Ctx) -> dict:
    return _training().gather_cpu_state_dict(ctx.model, ctx.rank == 0)


def _gather_dsd(ctx: Ctx) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(ctx.model, options=options)


def _optim_get_shardtune(ctx: Ctx) -> dict:
    return _training().get_full_optimizer_state_dict(ctx.model, ctx.opt, ctx.rank == 0)


def _optim_get_dsd(ctx: Ctx) -> dict:
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(ctx.model, ctx.opt, options=options)


def _optim_load_shardtune(ctx: Ctx) -> None:
    full = _full_optim_from_file(ctx.optim_path, ctx.model, ctx.opt) if ctx.rank == 0 else {}
    _training().load_from_full_optimizer_state_dict(ctx.model, ctx.opt, full, CPU)


def _optim_load_dsd(ctx: Ctx) -> None:
    full = _full_optim_from_file(ctx.optim_path, ctx.model, ctx.opt) if ctx.rank == 0 else {}
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_optimizer_state_dict(ctx.model, ctx.opt, full, options=options)


STEPS: dict[str, dict[str, Callable[[Ctx], Any]]] = {
    "load": {
        "shardtune_rank0": _load_shardtune_rank0,
        "dsd_broadcast": _load_dsd_broadcast,
        "torchtune_distribute": _load_torchtune,
        "shardtune_all_ranks": _load_shardtune_all,
    },
    "gather": {"shardtune": _gather_shardtune, "dsd": _gather_dsd},
    "optim_get": {"shardtune": _optim_get_shardtune, "dsd": _optim_get_dsd},
    "optim_load": {"shardtune": _optim_load_shardtune, "dsd": _optim_load_dsd},
}


# --------------------------------------------------------------------------- verification


def _verify_sharded_params(ctx: Ctx) -> str:
    """Every parameter is a materialized DTensor whose shard equals its file slice."""
    with safe_open(ctx.model_path, "pt") as f:
        for name, p in ctx.model.named_parameters():
            if not isinstance(p, DTensor) or p.is_meta:
                return f"{name}: not a materialized DTensor ({type(p).__name__}, {p.device})"
            if not torch.equal(p.to_local(), f.get_slice(name)[local_slices(p)]):
                return f"{name}: local shard differs from the file"
    return "ok"


def _verify_full_model(ctx: Ctx, out: dict) -> str:
    """Rank 0 holds plain CPU copies equal to the file; other ranks hold nothing."""
    if ctx.rank != 0:
        return "ok" if not out else f"non-empty dict on rank {ctx.rank} ({len(out)} keys)"
    with safe_open(ctx.model_path, "pt") as f:
        if set(out) != set(f.keys()):
            return f"keys differ: missing {sorted(set(f.keys()) - set(out))[:3]}"
        for name, t in out.items():
            if isinstance(t, DTensor) or t.device != CPU or not torch.equal(t, f.get_tensor(name)):
                return f"{name}: not a CPU tensor equal to the file"
    return "ok"


def _verify_full_optim(ctx: Ctx, out: dict) -> str:
    """Rank 0's full AdamW state has full shapes and rank 0's rows equal its own shard."""
    if ctx.rank != 0:
        return "ok" if not out else f"non-empty dict on rank {ctx.rank}"
    fqns = [name for name, _ in ctx.model.named_parameters()]
    if out["param_groups"][0]["params"] != fqns or set(out["state"]) != set(fqns):
        return "FQN keys differ from model.named_parameters()"
    for fqn, p in ctx.model.named_parameters():
        for k in _ADAM_KEYS:
            full, local = out["state"][fqn][k], ctx.opt.state[p][k].to_local()
            if isinstance(full, DTensor) or full.shape != p.shape:
                return f"{fqn}.{k}: not a full plain tensor"
            if not torch.equal(full[local_slices(p)], local):
                return f"{fqn}.{k}: rank-0 rows differ from rank 0's shard"
    return "ok"


def _verify_loaded_optim(ctx: Ctx) -> str:
    """Each rank's AdamW shards, step and lr equal the optimizer fixture file."""
    meta = read_metadata(Path(ctx.optim_path))
    if ctx.opt.param_groups[0]["lr"] != float(meta["lr"]):
        return f"lr not restored: {ctx.opt.param_groups[0]['lr']}"
    with safe_open(ctx.optim_path, "pt") as f:
        for fqn, p in ctx.model.named_parameters():
            state = ctx.opt.state[p]
            if float(state["step"]) != float(meta["step"]):
                return f"{fqn}: step {float(state['step'])} != {meta['step']}"
            for k in _ADAM_KEYS:
                if not torch.equal(state[k].to_local(), f.get_slice(f"{fqn}.{k}")[local_slices(p)]):
                    return f"{fqn}.{k}: local shard differs from the file"
    return "ok"


def _verify(group: str, ctx: Ctx, out: Any) -> str:
    try:
        match group:
            case "load":
                return _verify_sharded_params(ctx)
            case "gather":
                return _verify_full_model(ctx, out)
            case "optim_get":
                return _verify_full_optim(ctx, out)
            case _:
                return _verify_loaded_optim(ctx)
    except Exception as e:  # a verification crash is a finding, not a harness failure
        return f"verify raised {type(e).__name__}: {e}"


# --------------------------------------------------------------------------- entry point


def _setup(group: str, size: str, model_path: str, optim_path: str | None) -> Ctx:
    model = build_sharded_meta_model(SIZES[size])
    ctx = Ctx(model=model, rank=dist.get_rank(), model_path=model_path, optim_path=optim_path)
    if group != "load":
        materialize_from_file(model, model_path)
    if group.startswith("optim"):
        ctx.opt = _stepped_adamw(model)
    return ctx


def run(*, group: str, method: str, size: str, model_path: str, optim_path: str | None) -> dict:
    """Set up, measure one step of ``group``/``method``, verify; return this rank's record."""
    ctx = _setup(group, size, model_path, optim_path)
    step = STEPS[group][method]
    counter = _byte_counter() if method.startswith("shardtune") else None
    own_bytes = local_bytes(ctx.model) * (len(_ADAM_KEYS) if group.startswith("optim") else 1)
    if counter is not None:
        counter.reset()
    out, measurement = measure_step(lambda: step(ctx), barrier=dist.barrier)
    counted = None
    if counter is not None:
        counted = {"received": int(counter.bytes_received), "sent": int(counter.bytes_sent)}
    verdict = _verify(group, ctx, out)
    dist.barrier()
    return {
        "rank": ctx.rank,
        "measurement": measurement.to_json(),
        "own_shard_bytes": own_bytes,
        "counted_bytes": counted,
        "verify": verdict,
    }


def run_many(*, items: list[dict[str, Any]]) -> list[dict]:
    """:func:`run` for each kwargs dict in ``items``, in these same processes (smoke runs only)."""
    return [run(**item) for item in items]
