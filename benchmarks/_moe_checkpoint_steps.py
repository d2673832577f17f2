"""Rank-side code of the MoE checkpoint benchmark: the timed steps and their verification.

:func:`run` is the per-rank entry point (``benchmarks._moe_checkpoint_steps:run``) started by
:func:`benchmarks._measure.spawn_ranks`; every method runs in fresh processes. A load step starts
from shardtune's sharded meta model (built untimed: ``shard_model``'s FSDP2 setup is no checkpoint
I/O), or, for ``from_pretrained``, from nothing (building and ``fully_shard`` are part of its step),
and ends with a sharded model holding the checkpoint's weights; a save step starts from the same
loaded sharded model (untimed setup) and ends with the directory written and fsynced. The
``load_ep``/``save_ep`` groups run shardtune's own steps on a model whose experts are split over an
expert-parallel mesh (method ``shardtune_ep<d>``: ``make_mesh(expert_parallel=d)``). Every step also
records the kernel's I/O counts over it (:func:`kernel_io`), beside shardtune's own counters.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from benchmarks._fixtures import local_bytes, local_slices
from benchmarks._measure import measure_step

CPU = torch.device("cpu")
DTYPE = torch.bfloat16
PER_EXPERT = ("gate_proj", "up_proj", "down_proj")


# --------------------------------------------------------------------------- the checkpoint


class Files:
    """Every tensor of an HF directory (single file or index + shards), opened lazily with safetensors."""

    def __init__(self, directory: str) -> None:
        index = Path(directory, "model.safetensors.index.json")
        weight_map = json.loads(index.read_text())["weight_map"] if index.is_file() else None
        names = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {n: safe_open(os.path.join(directory, n), "pt") for n in names}
        self._where = weight_map or {k: names[0] for k in self._handles[names[0]].keys()}  # noqa: SIM118

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def shape(self, key: str) -> list[int]:
        return self._handles[self._where[key]].get_slice(key).get_shape()

    def get(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        part = self._handles[self._where[key]].get_slice(key)
        return part[index] if index is not None else part[:]


def expert_files(name: str) -> tuple[str, str] | None:
    """``(layer prefix, fused name)`` of a fused expert parameter's FQN, else None."""
    head, sep, tail = name.rpartition(".mlp.experts.")
    return (head, tail) if sep and tail in ("gate_up_proj", "down_proj") else None


def expected_local(files: Files, name: str, param: DTensor) -> torch.Tensor:
    """This rank's shard of ``name`` cut from the files by safetensors and torch alone (the
    reference): a fused expert tensor is stacked from the per-expert weights when the files hold those."""
    slices = local_slices(param)
    fused = expert_files(name)
    if fused is None or name in files._where:
        return files.get(name, slices)
    head, kind = fused
    experts = range(param.shape[0])[slices[0]]
    per = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    stacked = torch.stack([torch.cat([files.get(f"{head}.mlp.experts.{e}.{p}.weight") for p in per]) for e in experts])
    return stacked[(slice(None), *slices[1:])]


# --------------------------------------------------------------------------- models


def shardtune_model(hf_dir: str, *, expert_parallel: int = 1) -> nn.Module:
    """shardtune's model of ``hf_dir`` on meta, sharded with ``shard_model`` (experts Shard(0) here; split
    over ``expert_parallel`` ranks first on an expert-parallel mesh)."""
    from shardtune.models import from_hf_config
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model

    with torch.device("meta"):
        model = from_hf_config(hf_dir, dtype=DTYPE)
    return shard_model(model, mesh=make_mesh(expert_parallel=expert_parallel, device="cpu"))


def ep_degree(method: str) -> int:
    """The expert-parallel degree of an ``ep`` group's method (``shardtune_ep2``: 2)."""
    return int(method.removeprefix("shardtune_ep"))


def kernel_io() -> dict[str, int]:
    """The kernel's I/O counts: ``rchar`` of this thread (bytes its read syscalls returned: the step's
    file reads run here, while the memory sampler's and gloo's threads are left out) and ``write_bytes``
    of the process (file bytes it caused to be written, buffered or ``O_DIRECT``; not socket writes)."""

    def read(path: str) -> dict[str, int]:
        with open(path) as f:
            return {k: int(v) for k, _, v in (line.partition(": ") for line in f.read().splitlines())}

    return {"rchar": read("/proc/thread-self/io")["rchar"], "write_bytes": read("/proc/self/io")["write_bytes"]}


def fully_shard_layers(model: nn.Module) -> nn.Module:
    """FSDP2 as users write it for a transformers model: ``fully_shard`` per decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


# --------------------------------------------------------------------------- load steps


def _load_shardtune(model: nn.Module | None, hf_dir: str, *, shared: bool) -> nn.Module:
    from shardtune.checkpoint import load_hf_checkpoint

    model = model if model is not None else shardtune_model(hf_dir)
    load_hf_checkpoint(model, hf_dir, device=CPU, shared_filesystem=shared, strict=True)
    return model


def _load_transformers(_: nn.Module | None, hf_dir: str) -> nn.Module:
    """``from_pretrained`` on every rank (the whole model, experts converted to the fused layout), then FSDP2."""
    from transformers import AutoModelForCausalLM

    return fully_shard_layers(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=DTYPE))


def _load_dcp_stack(model: nn.Module | None, hf_dir: str) -> nn.Module:
    """torchtitan's way: ``to_empty``, ``dcp.load`` with the HF reader into the sharded params and
    into this rank's per-expert tensors (own experts, whole), then each layer's experts stacked
    (gate‖up concatenated) into the fused local shards. With fused files nothing is stacked."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    model = model if model is not None else shardtune_model(hf_dir)
    model.to_empty(device=CPU)
    reader = HuggingFaceStorageReader(hf_dir)
    fused_on_disk = any(k.endswith(".mlp.experts.gate_up_proj") for k in reader.read_metadata().state_dict_metadata)
    state: dict[str, torch.Tensor] = {}
    stacks: list[tuple[DTensor, list[list[str]]]] = []
    for name, p in model.state_dict().items():
        fused = expert_files(name)
        if fused is None or fused_on_disk:
            state[name] = p  # sharded DTensor sharing the param's storage: filled in place
            continue
        if p.placements != (Shard(0),):
            raise ValueError(f"{name}: placement {p.placements}; this baseline stacks whole experts (Shard(0))")
        head, kind = fused
        per = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
        experts = range(p.shape[0])[local_slices(p)[0]]
        keys = [[f"{head}.mlp.experts.{e}.{q}.weight" for q in per] for e in experts]
        rows = p.shape[1] // len(per)
        for group in keys:
            for key in group:
                state[key] = torch.empty(rows, p.shape[2], dtype=p.dtype)
        stacks.append((p, keys))
    dcp.load(state, storage_reader=reader)
    for p, keys in stacks:
        local = p.to_local()
        for i, group in enumerate(keys):
            torch.cat([state.pop(k) for k in group], out=local[i])
    return model


def _load_copy_floor(model: nn.Module | None, hf_dir: str) -> nn.Module:
    """The floor of every loader that copies the file into the model's memory: ``to_empty``, then
    each local shard populated in one ``madvise`` and filled by one ``preadv`` of its bytes. Only for
    a single fused file with every shard ``Shard(0)`` (then each rank's piece of a tensor is one
    contiguous byte range of the file): no parsing of layouts, no checks, no bookkeeping."""
    from shardtune.state_dict.fresh_memory import prefault

    model = model if model is not None else shardtune_model(hf_dir)
    model.to_empty(device=CPU)
    path = os.path.join(hf_dir, "model.safetensors")
    fd = os.open(path, os.O_RDONLY)
    try:
        header_len = int.from_bytes(os.pread(fd, 8, 0), "little")
        header = json.loads(os.pread(fd, header_len, 8))
        for name, p in model.state_dict().items():
            begin = header[name]["data_offsets"][0]
            local = p.to_local()
            if p.placements != (Shard(0),) or not local.is_contiguous():
                raise ValueError(f"{name}: placement {p.placements}; the copy floor reads whole rows (Shard(0))")
            if local.numel() == 0:
                continue
            row_bytes = local[0].nbytes if local.dim() > 1 else local.element_size()
            prefault(local)
            offset = 8 + header_len + begin + local_slices(p)[0].start * row_bytes
            os.preadv(fd, [local.view(-1).view(torch.uint8).numpy()], offset)
    finally:
        os.close(fd)
    return model


LOAD_STEPS: dict[str, Callable[[nn.Module | None, str], nn.Module]] = {
    "shardtune_direct": lambda m, d: _load_shardtune(m, d, shared=True),
    "shardtune_rank0": lambda m, d: _load_shardtune(m, d, shared=False),
    "transformers_fsdp2": _load_transformers,
    "dcp_hf_stack": _load_dcp_stack,
    "copy_floor": _load_copy_floor,
}


# --------------------------------------------------------------------------- save steps


def _fsync_tree(directory: str) -> None:
    for name in os.listdir(directory):
        fd = os.open(os.path.join(directory, name), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_shardtune(model: nn.Module, out_dir: str, *, shared: bool) -> None:
    from shardtune.checkpoint import save_hf_checkpoint

    save_hf_checkpoint(model, out_dir, shared_filesystem=shared)


def _save_dsd_pretrained(model: nn.Module, out_dir: str, hf_dir: str) -> None:
    """DSD's full state dict (gathered, CPU) into a meta transformers model on rank 0, then
    ``save_pretrained`` (its default: per-expert files), fsynced for parity with shardtune."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(hf_dir), dtype=DTYPE)
        hf.load_state_dict(full, assign=True, strict=True)
        hf.save_pretrained(out_dir)
        _fsync_tree(out_dir)
    del full


SAVE_STEPS: dict[str, Callable[[nn.Module, str, str], None]] = {
    "shardtune": lambda m, out, _: _save_shardtune(m, out, shared=True),
    "shardtune_rank0": lambda m, out, _: _save_shardtune(m, out, shared=False),
    "dsd_save_pretrained": _save_dsd_pretrained,
}


# --------------------------------------------------------------------------- verification


def _check_shards(model: nn.Module, hf_dir: str) -> str:
    """Every parameter is a materialized bf16 DTensor whose shard equals the reference cut of the files."""
    files = Files(hf_dir)
    for name, p in model.named_parameters():
        name = name.replace("_checkpoint_wrapped_module.", "")
        if not isinstance(p, DTensor) or p.is_meta:
            return f"{name}: not a materialized DTensor"
        if p.dtype != DTYPE or not torch.equal(p.to_local(), expected_local(files, name, p)):
            return f"{name}: local shard differs from the checkpoint"
    return "ok"


def _check_written(out_dir: str, hf_dir: str) -> str:
    """The written directory holds the input's keys and shapes and, for this rank's share of the
    keys, the same values (safetensors reads of both)."""
    dist.barrier()
    written, source = Files(out_dir), Files(hf_dir)
    if sorted(written.keys()) != sorted(source.keys()):
        only = sorted(set(written.keys()) ^ set(source.keys()))[:3]
        return f"key sets differ (e.g. {only})"
    keys = sorted(source.keys())[dist.get_rank() :: dist.get_world_size()]
    for key in keys:
        if written.shape(key) != source.shape(key) or not torch.equal(written.get(key), source.get(key)):
            return f"{key}: differs from the input checkpoint"
    return "ok"


def _verify(check: Callable[[], str]) -> str:
    try:
        return check()
    except Exception as e:  # a verification crash is a finding, not a harness failure
        return f"verify raised {type(e).__name__}: {e}"


# --------------------------------------------------------------------------- entry point


def _own_bytes(model: nn.Module) -> tuple[int, int]:
    """(this rank's parameter shard bytes, of which expert bytes)."""
    experts = sum(p.to_local().nbytes for n, p in model.named_parameters() if ".mlp.experts." in n)
    return local_bytes(model), experts


def run(*, group: str, method: str, hf_dir: str, out_dir: str) -> dict[str, Any]:
    """Measure one step of ``group``/``method`` on this rank, verify it; return this rank's record."""
    # every method's modules imported untimed (its step imports them lazily): no step pays an import
    import torch.distributed.checkpoint.state_dict  # noqa: F401
    import transformers  # noqa: F401

    import shardtune.checkpoint  # noqa: F401
    from shardtune.state_dict import stats

    ep = ep_degree(method) if group.endswith("_ep") else None
    if group.startswith("load"):
        meta = None if method == "transformers_fsdp2" else shardtune_model(hf_dir, expert_parallel=ep or 1)
        step = LOAD_STEPS["shardtune_direct" if ep else method]
        stats.reset()
        before = kernel_io()
        model, measurement = measure_step(lambda: step(meta, hf_dir), barrier=dist.barrier)
        after = kernel_io()
        read = int(stats.bytes_read)
        verdict = _verify(lambda: _check_shards(model, hf_dir))
    else:
        model = _load_shardtune(shardtune_model(hf_dir, expert_parallel=ep or 1), hf_dir, shared=True)
        save = SAVE_STEPS["shardtune" if ep else method]
        stats.reset()
        before = kernel_io()
        _, measurement = measure_step(lambda: save(model, out_dir, hf_dir), barrier=dist.barrier)
        after = kernel_io()
        read = int(stats.bytes_read)
        verdict = _verify(lambda: _check_written(out_dir, hf_dir))
    own, experts = _own_bytes(model)
    counted = {"read": read, "received": int(stats.bytes_received), "sent": int(stats.bytes_sent)}
    dist.barrier()
    return {
        "rank": dist.get_rank(),
        "measurement": measurement.to_json(),
        "own_shard_bytes": own,
        "own_expert_bytes": experts,
        "counted_bytes": counted if method.startswith("shardtune") else None,
        "kernel_io": {k: after[k] - before[k] for k in after},
        "verify": verdict,
    }
