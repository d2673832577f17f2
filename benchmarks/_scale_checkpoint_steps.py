"""Rank-side code of the scale-by-tensor-count benchmark: one load and two saves of a block-FP8
DeepSeek-V3-shaped checkpoint, each measured on this rank, then the planning functions timed alone.

:func:`run` is the per-rank entry point (``benchmarks._scale_checkpoint_steps:run``), started in fresh
processes. It builds shardtune's sharded meta model of the directory (untimed), then measures
(:func:`benchmarks._measure.measure_step`, with :func:`benchmarks._io_probe.probing` around the step):

* ``load``: ``load_hf_checkpoint`` into it (each rank reads its own FP8 rows and their scales);
* ``save_dtype``: ``save_hf_checkpoint`` in the training dtype (bf16);
* ``save_block_fp8``: ``save_hf_checkpoint(weight_format="block_fp8")``, the input's format.

The saves use the input's shard size (so as many files), into ``out_dir``. After the load every
parameter is checked against a reference dequantization of the files (safetensors + torch, untimed);
after each save, the written index's keys against the input's. Then, alone and untimed as steps, the
planning each rank does before its first byte: for the load, opening the directory (every header) and
wrapping it for dequantization, and the model's entries; for a save, ``plan_hf_checkpoint`` (local).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from benchmarks._fixtures import local_bytes
from benchmarks._fp8_checkpoint_steps import check_shards
from benchmarks._io_probe import Probe, probing
from benchmarks._measure import measure_step
from benchmarks._moe_checkpoint_steps import CPU, kernel_io, shardtune_model

SAVES = {"save_dtype": "dtype", "save_block_fp8": "block_fp8"}
SCALE_SUFFIX = "_scale_inv"


def _load(model: nn.Module, hf_dir: str) -> None:
    from shardtune.checkpoint import load_hf_checkpoint

    load_hf_checkpoint(model, hf_dir, device=CPU, strict=True)


def _save(model: nn.Module, out: str, *, weight_format: str, shard_bytes: int) -> None:
    from shardtune.checkpoint import save_hf_checkpoint

    save_hf_checkpoint(model, out, max_shard_size=shard_bytes, weight_format=weight_format)


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def planning_alone(model: nn.Module, hf_dir: str, out_dir: str, *, shard_bytes: int) -> dict[str, float]:
    """Seconds of each planning function on this rank, called alone (local: no collective)."""
    from shardtune.checkpoint.formats import block_fp8
    from shardtune.checkpoint.formats.hf_load import hf_file_prefixes, open_hf_checkpoint
    from shardtune.checkpoint.formats.hf_save import HFSaveOptions, plan_hf_checkpoint
    from shardtune.state_dict.keys import model_entries

    def open_headers() -> None:
        checkpoint = open_hf_checkpoint(hf_dir)
        block_fp8.dequantizing(checkpoint, block_fp8.read_quantization(hf_dir), where=hf_dir)
        checkpoint.close()

    times = {
        "load_headers": _timed(open_headers),
        "load_entries": _timed(lambda: model_entries(model, file_prefixes=hf_file_prefixes(model))),
    }
    for step, fmt in SAVES.items():
        options = HFSaveOptions(max_shard_size=shard_bytes, weight_format=fmt)
        times[f"{step}_plan"] = _timed(lambda o=options: plan_hf_checkpoint(model, out_dir, options=o))
    return times


def saved_keys_problem(out: str, source_keys: set[str], *, keep_scales: bool) -> str:
    """``ok``, or how the saved index's keys differ from the input's (without scales unless ``keep_scales``)."""
    want = source_keys if keep_scales else {k for k in source_keys if not k.endswith(SCALE_SUFFIX)}
    index = Path(out, "model.safetensors.index.json")
    if not index.is_file():
        return "no model.safetensors.index.json written"
    got = set(json.loads(index.read_text())["weight_map"])
    if got == want:
        return "ok"
    return f"saved keys differ: {len(want - got)} missing (e.g. {sorted(want - got)[:2]}), {len(got - want)} extra"


def _measured(step: Callable[[], None], root: str) -> dict[str, Any]:
    """``step`` measured on this rank, its probe (:func:`probing` of ``root``) and byte counts."""
    from shardtune.state_dict import stats

    holder: list[Probe] = []

    def probed() -> None:
        with probing(root) as probe:
            holder.append(probe)
            step()

    stats.reset()
    before = kernel_io()
    _, measurement = measure_step(probed, barrier=dist.barrier)
    after = kernel_io()
    return {
        "measurement": measurement.to_json(),
        "probe": holder[0].to_json(),
        "read": int(stats.bytes_read),
        "kernel_io": {k: after[k] - before[k] for k in after},
    }


def run(*, hf_dir: str, out_dir: str, block: int, shard_bytes: int, verify: bool = True) -> dict[str, Any]:
    """Measure this rank's load and two saves of ``hf_dir``; return its record (one entry per step)."""
    import shardtune.checkpoint  # noqa: F401  (imports out of the timed steps)

    start = time.perf_counter()
    model = shardtune_model(hf_dir)
    build_s = time.perf_counter() - start
    source_keys = set(json.loads(Path(hf_dir, "model.safetensors.index.json").read_text())["weight_map"])
    steps: dict[str, Any] = {}
    steps["load"] = _measured(lambda: _load(model, hf_dir), hf_dir)
    steps["load"]["verify"] = check_shards(model, hf_dir, block) if verify else "not checked"
    for step, fmt in SAVES.items():
        out = os.path.join(out_dir, step)
        steps[step] = _measured(lambda o=out, f=fmt: _save(model, o, weight_format=f, shard_bytes=shard_bytes), out)
        dist.barrier()
        steps[step]["verify"] = saved_keys_problem(out, source_keys, keep_scales=fmt == "block_fp8")
    dist.barrier()
    return {
        "rank": dist.get_rank(),
        "build_s": build_s,
        "own_shard_bytes": local_bytes(model),
        "params": sum(1 for _ in model.parameters()),
        "steps": steps,
        "planning": planning_alone(model, hf_dir, os.path.join(out_dir, "plan_only"), shard_bytes=shard_bytes),
        "verify": "ok" if all(s["verify"] in ("ok", "not checked") for s in steps.values()) else "failed",
    }
