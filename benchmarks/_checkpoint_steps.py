"""Rank-side code of the checkpoint benchmark: setup, the timed steps, verification.

:func:`run` is the per-rank entry point (``benchmarks._checkpoint_steps:run``) started by
:func:`benchmarks._measure.spawn_ranks`; every method runs in fresh processes.
:func:`setup_resume` writes the two resume checkpoints once per benchmark invocation
(untimed). Setup (building the sharded meta model, materializing it for ``save``, the
optimizer for ``resume``) is not timed; verification runs after the measured step.

The model is ``shardtune.models.LlamaForCausalLM`` built on meta in bf16 from the
``benchmarks._fixtures`` shape and sharded with ``shardtune.ranks.sharding.shard_model``
(FSDP2 per decoder layer, then the root; 1-D mesh, ``Shard(0)``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from benchmarks._fixtures import (
    DTYPE,
    HF_WEIGHTS,
    SIZES,
    load_dsd_broadcast,
    load_torchtune,
    local_bytes,
    local_slices,
    materialize_from_file,
    model_args,
)
from benchmarks._measure import bench_device, measure_step

CPU = torch.device("cpu")
DEVICE = bench_device()  # where the model lives: CPU, or this rank's GPU under --device cuda
ADAM_KEYS = ("exp_avg", "exp_avg_sq")
OPTIM_SEP = "::"  # shardtune's optimizer.safetensors keys: f"{fqn}::{state key}"
RESUME_EPOCH_DIR = "epoch_1"  # what Checkpointer.save(step=1, epoch=1) publishes


def hf_storage_reader() -> type | None:
    """``HuggingFaceStorageReader`` of ``torch.distributed.checkpoint`` if this torch has it."""
    reader = getattr(dcp, "HuggingFaceStorageReader", None)
    if reader is None:
        try:
            from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader as reader
        except ImportError:
            return None
    return reader


@dataclass
class Ctx:
    """What a step needs on this rank."""

    model: nn.Module
    rank: int
    paths: dict[str, str]
    opt: torch.optim.Optimizer | None = None
    checkpointer: Any = None
    group: Any = None  # a gloo group of its own for DCP's background save
    staging: Any = None  # memory a background save keeps for the next one (``_2nd`` methods)


# --------------------------------------------------------------------------- model


def build_model(size: str) -> nn.Module:
    """shardtune ``LlamaForCausalLM`` on meta, bf16, sharded with ``shard_model`` (no memory)."""
    from shardtune.models import LlamaForCausalLM
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model

    with torch.device("meta"):
        model = LlamaForCausalLM(model_args(SIZES[size]), dtype=DTYPE)
    return shard_model(model, mesh=make_mesh(device=DEVICE.type))


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)


def _byte_counter() -> Any:
    from shardtune.state_dict import stats

    return stats


# --------------------------------------------------------------------------- load steps


def _load_shardtune_direct(ctx: Ctx) -> Any:
    from shardtune.checkpoint import load_hf_checkpoint

    return load_hf_checkpoint(ctx.model, ctx.paths["hf_dir"], device=DEVICE, shared_filesystem=True)


def _load_shardtune_rank0(ctx: Ctx) -> Any:
    from shardtune.checkpoint import load_hf_checkpoint

    return load_hf_checkpoint(ctx.model, ctx.paths["hf_dir"], device=DEVICE, shared_filesystem=False)


def _load_dsd_broadcast(ctx: Ctx) -> Any:
    return load_dsd_broadcast(ctx.model, os.path.join(ctx.paths["hf_dir"], HF_WEIGHTS), ctx.rank)


def _load_torchtune(ctx: Ctx) -> Any:
    return load_torchtune(ctx.model, os.path.join(ctx.paths["hf_dir"], HF_WEIGHTS), device=DEVICE)


def _load_dcp_hf(ctx: Ctx) -> Any:
    """``dcp.load`` with the HF safetensors reader into the materialized model (to_empty timed)."""
    reader = hf_storage_reader()
    ctx.model.to_empty(device=DEVICE)
    sd = ctx.model.state_dict()  # sharded DTensors sharing storage with the params: filled in place
    dcp.load(sd, storage_reader=reader(ctx.paths["hf_dir"]))
    return None


# --------------------------------------------------------------------------- save steps


def _save_shardtune(ctx: Ctx) -> Any:
    from shardtune.checkpoint import save_hf_checkpoint

    return save_hf_checkpoint(ctx.model, ctx.paths["out_dir"])


def _save_shardtune_rank0(ctx: Ctx) -> Any:
    """``shared_filesystem=False``: rank 0 gathers every tensor and writes it (in a background thread)."""
    from shardtune.checkpoint import save_hf_checkpoint

    return save_hf_checkpoint(ctx.model, ctx.paths["out_dir"], shared_filesystem=False)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_dsd(ctx: Ctx) -> Any:
    """Full CPU state dict on rank 0 (DSD), ``safetensors.torch.save_file``, config.json; fsynced."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(ctx.model, options=options)
    if ctx.rank == 0:
        from shardtune.models import model_args_to_hf_config

        out = ctx.paths["out_dir"]
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, HF_WEIGHTS)
        save_file(sd, path, metadata={"format": "pt"})
        _fsync_path(path)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(model_args_to_hf_config(ctx.model.args), f, indent=2)
            f.flush()
            os.fsync(f.fileno())
        _fsync_path(out)
    del sd
    return None


def _save_shardtune_async(ctx: Ctx) -> Callable[[], None]:
    """Blocking half of a background save (``save_hf_checkpoint`` with a ``StagedSink``: files
    sized, headers and config written, a CPU copy of this rank's rows, into ``ctx.staging`` when
    set); returns the background half (the sink's ``flush``)."""
    return _stage_shardtune(ctx, ctx.paths["out_dir"])


def _stage_shardtune(ctx: Ctx, out_dir: str) -> Callable[[], None]:
    from shardtune.checkpoint import StagedSink, save_hf_checkpoint

    staged = StagedSink(memory=ctx.staging)
    save_hf_checkpoint(ctx.model, out_dir, sink=staged)

    def write() -> None:
        problems = staged.flush()
        if problems:
            raise RuntimeError("; ".join(problems))

    return write


def _save_dcp_async(ctx: Ctx) -> Callable[[], None]:
    """Blocking half of torch's background save (``dcp.async_save`` of the sharded model state
    dict, DCP format; staged by ``ctx.staging`` when set); returns the background half."""
    return _stage_dcp(ctx, ctx.paths["out_dir"])


def _stage_dcp(ctx: Ctx, out_dir: str) -> Callable[[], None]:
    future = dcp.async_save(
        {"model": get_model_state_dict(ctx.model)},
        checkpoint_id=out_dir,
        process_group=ctx.group,
        async_stager=ctx.staging,
    )
    return lambda: future.result()


def _first_background_save(ctx: Ctx, method: str) -> None:
    """Untimed setup of a second (steady-state) background save: memory kept between saves
    (shardtune's ``StagingMemory``, DCP's caching ``DefaultStager`` as shardtune's Checkpointer
    configures it), one whole background save through it, its directory removed."""
    first_dir = ctx.paths["out_dir"] + ".first"
    if method.startswith("shardtune"):
        from shardtune.checkpoint import StagingMemory

        ctx.staging = StagingMemory()
        _stage_shardtune(ctx, first_dir)()
    else:
        ctx.staging = DefaultStager(
            StagingOptions(
                use_pinned_memory=False, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=False
            )
        )
        _stage_dcp(ctx, first_dir)()
    dist.barrier()
    if ctx.rank == 0:
        shutil.rmtree(first_dir)
        os.sync()
    dist.barrier()


# --------------------------------------------------------------------------- resume steps


def _resume_shardtune(ctx: Ctx) -> Any:
    progress = ctx.checkpointer.resume()
    return None if progress is None else progress.step


def _resume_dsd(ctx: Ctx) -> Any:
    """torchtitan-style: to_empty, get_state_dict (initializes AdamW state), dcp.load, set_state_dict."""
    ctx.model.to_empty(device=DEVICE)
    msd, osd = get_state_dict(ctx.model, ctx.opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ctx.paths["dcp_dir"])
    set_state_dict(ctx.model, ctx.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return None


STEPS: dict[str, dict[str, Callable[[Ctx], Any]]] = {
    "load": {
        "shardtune_direct": _load_shardtune_direct,
        "shardtune_rank0": _load_shardtune_rank0,
        "dsd_broadcast": _load_dsd_broadcast,
        "torchtune_distribute": _load_torchtune,
        "dcp_hf_reader": _load_dcp_hf,
    },
    "save": {
        "shardtune": _save_shardtune,
        "shardtune_rank0": _save_shardtune_rank0,
        "dsd": _save_dsd,
        "shardtune_async": _save_shardtune_async,
        "dcp_async": _save_dcp_async,
        "shardtune_async_2nd": _save_shardtune_async,
        "dcp_async_2nd": _save_dcp_async,
    },
    "resume": {"shardtune": _resume_shardtune, "dsd": _resume_dsd},
}


# --------------------------------------------------------------------------- verification


def _check_params(model: nn.Module, path: str) -> str:
    """Every parameter is a materialized DTensor whose local shard equals its rows in ``path``."""
    with safe_open(path, "pt") as f:
        keys = set(f.keys())
        names = [name for name, _ in model.named_parameters()]
        if keys != set(names):
            only_file, only_model = sorted(keys - set(names))[:3], sorted(set(names) - keys)[:3]
            return f"keys differ: only in file {only_file}, only in model {only_model}"
        for name, p in model.named_parameters():
            if not isinstance(p, DTensor) or p.is_meta or p.device != DEVICE:
                return f"{name}: not a materialized DTensor on {DEVICE} ({type(p).__name__}, {p.device})"
            if p.dtype != DTYPE:
                return f"{name}: dtype {p.dtype}"
            if not torch.equal(p.to_local().cpu(), f.get_slice(name)[local_slices(p)]):
                return f"{name}: local shard differs from {os.path.basename(path)}"
    return "ok"


def _check_optim(model: nn.Module, opt: torch.optim.Optimizer, path: str, step: float) -> str:
    """AdamW shards equal shardtune's saved ``optimizer.safetensors`` rows; step restored; params live."""
    params = list(model.parameters())
    if len(opt.param_groups[0]["params"]) != len(params) or any(
        a is not b for a, b in zip(opt.param_groups[0]["params"], params, strict=True)
    ):
        return "optimizer params are not the model's Parameter objects"
    with safe_open(path, "pt") as f:
        for fqn, p in model.named_parameters():
            state = opt.state.get(p)
            if not state:
                return f"{fqn}: no optimizer state"
            if float(state["step"]) != step:
                return f"{fqn}: step {float(state['step'])} != {step}"
            for key in ADAM_KEYS:
                value = state[key]
                if not isinstance(value, DTensor) or value.is_meta:
                    return f"{fqn}.{key}: not a materialized DTensor"
                if not torch.equal(value.to_local().cpu(), f.get_slice(f"{fqn}{OPTIM_SEP}{key}")[local_slices(p)]):
                    return f"{fqn}.{key}: local shard differs from optimizer.safetensors"
    return "ok"


def _check_dcp_model(model: nn.Module, path: str) -> str:
    """``dcp.load`` of the written checkpoint into zeroed shards equals the model's shards."""
    live = get_model_state_dict(model)
    state = {"model": {k: torch.zeros_like(v) for k, v in live.items()}}
    dcp.load(state, checkpoint_id=path)
    for key, value in live.items():
        if not torch.equal(state["model"][key].to_local(), value.to_local()):
            return f"{key}: local shard differs from the DCP checkpoint"
    return "ok"


def _verify(group: str, method: str, ctx: Ctx) -> str:
    try:
        match group:
            case "load":
                return _check_params(ctx.model, os.path.join(ctx.paths["hf_dir"], HF_WEIGHTS))
            case "save" if method.startswith("dcp_async"):
                dist.barrier()
                return _check_dcp_model(ctx.model, ctx.paths["out_dir"])
            case "save":
                # Every rank reads its own rows of the written file back with safetensors.
                dist.barrier()
                return _check_params(ctx.model, os.path.join(ctx.paths["out_dir"], HF_WEIGHTS))
            case _:
                epoch = Path(ctx.paths["resume_dir"]) / RESUME_EPOCH_DIR
                verdict = _check_params(ctx.model, str(epoch / HF_WEIGHTS))
                if verdict == "ok":
                    verdict = _check_optim(
                        ctx.model, ctx.opt, str(epoch / "training_state" / "optimizer.safetensors"), 1.0
                    )
                return verdict
    except Exception as e:  # a verification crash is a finding, not a harness failure
        return f"verify raised {type(e).__name__}: {e}"


# --------------------------------------------------------------------------- entry points


def _setup(group: str, method: str, size: str, paths: dict[str, str]) -> Ctx:
    if method.startswith("shardtune"):
        import shardtune.checkpoint  # noqa: F401 - imported untimed, as the baselines' modules are
    model = build_model(size)
    ctx = Ctx(model=model, rank=dist.get_rank(), paths=paths)
    if group == "save":
        materialize_from_file(model, os.path.join(paths["hf_dir"], HF_WEIGHTS), device=DEVICE)
        if method.startswith("dcp_async"):
            ctx.group = dist.new_group(backend="gloo")
        if method.endswith("_2nd"):
            _first_background_save(ctx, method)
    elif group == "resume":
        ctx.opt = adamw(model)  # on the meta params, before anything is loaded
        if method == "shardtune":
            from shardtune.checkpoint import Checkpointer, CheckpointOptions, CheckpointStates

            ctx.checkpointer = Checkpointer(
                states=CheckpointStates(model=model, optimizer=ctx.opt),
                options=CheckpointOptions(output_dir=paths["resume_dir"], base_dir=paths["hf_dir"], device=DEVICE),
            )
    return ctx


def run(*, group: str, method: str, size: str, paths: dict[str, str]) -> dict:
    """Set up, measure one step of ``group``/``method``, verify; return this rank's record."""
    ctx = _setup(group, method, size, paths)
    step = STEPS[group][method]
    own = local_bytes(ctx.model) * (1 + len(ADAM_KEYS) if group == "resume" else 1)
    counter = _byte_counter() if method.startswith("shardtune") else None
    if counter is not None:
        counter.reset()
    out, measurement = measure_step(lambda: step(ctx), barrier=dist.barrier)
    background_s = None
    if callable(out):  # a background save: its blocking half was timed; its writing half runs now
        start = time.perf_counter()
        out()
        background_s = time.perf_counter() - start
    counted = None
    if counter is not None:
        counted = {"received": int(counter.bytes_received), "sent": int(counter.bytes_sent)}
    verdict = _verify(group, method, ctx)
    if group == "resume" and method == "shardtune" and out != 1 and verdict == "ok":
        verdict = f"resume() returned step {out}, expected 1"
    dist.barrier()
    return {
        "rank": ctx.rank,
        "measurement": measurement.to_json(),
        "own_shard_bytes": own,
        "counted_bytes": counted,
        "verify": verdict,
        "background_s": background_s,
    }


def setup_resume(*, size: str, paths: dict[str, str]) -> dict:
    """Untimed setup of the ``resume`` group, once per invocation.

    Materialize the model from the HF fixture (per-rank slices), one AdamW step with gradients
    of ones, then write both checkpoints of that same state: shardtune ``Checkpointer.save(step=1,
    epoch=1)`` into ``resume_dir`` and ``dcp.save`` of DSD's ``get_state_dict`` into ``dcp_dir``.
    Checks that the shardtune files equal the live state (they are the resume reference).
    """
    from shardtune.checkpoint import Checkpointer, CheckpointOptions, CheckpointStates

    model = build_model(size)
    materialize_from_file(model, os.path.join(paths["hf_dir"], HF_WEIGHTS), device=DEVICE)
    opt = adamw(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    ckpt = Checkpointer(
        states=CheckpointStates(model=model, optimizer=opt),
        options=CheckpointOptions(output_dir=paths["resume_dir"], base_dir=paths["hf_dir"], device=DEVICE),
    )
    saved = ckpt.save(step=1, epoch=1)
    t1 = time.perf_counter()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=paths["dcp_dir"])
    t2 = time.perf_counter()
    del msd, osd
    dist.barrier()
    epoch = Path(saved)
    verdict = _check_params(model, str(epoch / HF_WEIGHTS))
    if verdict == "ok":
        verdict = _check_optim(model, opt, str(epoch / "training_state" / "optimizer.safetensors"), 1.0)
    return {
        "rank": dist.get_rank(),
        "checkpointer_save_s": t1 - t0,
        "dcp_save_s": t2 - t1,
        "verify": verdict,
        "saved": str(saved),
    }
