"""Benchmark of loading and saving a DeepSeek-V3-shaped block-FP8 checkpoint with the real tensor count.

    python -m benchmarks.scale_checkpoint --layers 16,32,61 --worlds 2,4 --repeats 1
    python -m benchmarks.scale_checkpoint --smoke      # 2 layers, 8 experts, seconds; no BENCHMARKS.md

The checkpoint is DeepSeek-V3's tensor layout (:class:`benchmarks._hf_models.DeepseekV3CheckpointShape`):
latent attention, the first 3 layers dense, then 256 routed experts per layer stored per expert, a shared
expert, the router weight and its ``e_score_correction_bias``; every linear weight but the router and
``lm_head`` in block FP8 with its ``weight_scale_inv`` (:func:`benchmarks._fp8_checkpoint_steps.write_fp8_dir`).
At 61 layers that is ~90k file tensors, as the hub's, but with every width scaled down (hidden 64, expert
width 32, 16 x 16 blocks) so it fits a small machine; the files are as many per layer as the hub's (163 for
61 layers), with ``model.safetensors.index.json``.

Each run (fresh processes, gloo, ``--worlds`` ranks) measures on every rank one ``load_hf_checkpoint``
into shardtune's sharded meta model (experts sharded on the expert dim) and two ``save_hf_checkpoint``
(the training dtype, and ``weight_format="block_fp8"``): time, peak memory, files opened, bytes read or
written, collectives (calls and bytes) and the delay to the first data byte (the planning), then each
planning function alone (:mod:`benchmarks._scale_checkpoint_steps`). Run at several depths (``--layers``)
the rows show how planning grows with tensors and ranks; the section ends with a projection for the real
checkpoint on 64 GPUs (:mod:`benchmarks._scale_projection`). It goes between the ``scale-checkpoint``
markers of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks._driver import (
    Options,
    Run,
    environment_lines,
    failed,
    files_under,
    finish,
    parse_run_options,
    set_page_cache,
    snapshot_sources,
    sources_fingerprint,
    try_spawn,
)
from benchmarks._fp8_checkpoint_steps import file_shapes, split_by_bytes, write_fp8_dir
from benchmarks._hf_models import DeepseekV3CheckpointShape
from benchmarks._report import fmt_bytes
from benchmarks._scale_projection import projection_lines

MARKERS = ("<!-- scale-checkpoint:begin -->", "<!-- scale-checkpoint:end -->")
STEPS = ("load", "save_dtype", "save_block_fp8")
HUB_FILES, HUB_LAYERS = 163, 61  # DeepSeek-V3's release: 163 safetensors files for 61 layers
BLOCK, SMOKE_BLOCK = 16, 16
SIZES = {"F8_E4M3": 1, "F32": 4, "BF16": 2}


def shape(layers: int, *, experts: int = 256) -> DeepseekV3CheckpointShape:
    """DeepSeek-V3's tensor layout at ``layers`` layers (3 dense) and ``experts`` experts, widths scaled down
    (each about 1/100 of the release's; 2 * expert width != hidden, experts != ranks)."""
    return DeepseekV3CheckpointShape(
        hidden=64, layers=layers, heads=4, kv_heads=4, head_dim=8, experts=experts, top_k=8, expert_ffn=32,
        vocab=1024, dense_ffn=144, first_dense=min(3, layers - 1), shared_experts=1, q_lora_rank=48,
        kv_lora_rank=32, nope_head_dim=16, v_head_dim=16, n_group=8, topk_group=4,
    )  # fmt: skip


SMOKE = DeepseekV3CheckpointShape(
    hidden=64, layers=2, heads=4, kv_heads=4, head_dim=8, experts=8, top_k=2, expert_ffn=32, vocab=256,
    dense_ffn=144, first_dense=1, shared_experts=1, q_lora_rank=48, kv_lora_rank=32, nope_head_dim=16,
    v_head_dim=16, n_group=2, topk_group=1,
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class ScaleOptions(Options):
    """``python -m benchmarks.scale_checkpoint``'s options."""

    shapes: tuple[DeepseekV3CheckpointShape, ...]
    worlds: tuple[int, ...]
    block: int
    verify: bool


def hub_files(s: DeepseekV3CheckpointShape) -> int:
    """As many files per layer as the release (at least 2, so the index is used)."""
    return max(2, math.ceil(HUB_FILES * s.layers / HUB_LAYERS))


def file_stats(s: DeepseekV3CheckpointShape, block: int) -> dict[str, int]:
    """Tensor count, bytes, and the expert/other split of the FP8 directory of ``s``."""
    tensors = file_shapes(s, block)
    experts = sum(1 for k in tensors if ".mlp.experts." in k)
    total = sum(SIZES[d] * math.prod(t) for d, t in tensors.values())
    return {"tensors": len(tensors), "expert_tensors": experts, "other_tensors": len(tensors) - experts, "bytes": total}


def shard_bytes(s: DeepseekV3CheckpointShape, block: int) -> int:
    """The input's largest file: the saves' ``max_shard_size``, so they write about as many files."""
    tensors = file_shapes(s, block)
    runs = split_by_bytes(tensors, hub_files(s))
    return max(sum(SIZES[tensors[k][0]] * math.prod(tensors[k][1]) for k in run) for run in runs)


def source_dir(cfg: ScaleOptions, s: DeepseekV3CheckpointShape) -> Path:
    name = f"scale_ckpt_l{s.layers}_e{s.experts}_h{s.hidden}_i{s.expert_ffn}_b{cfg.block}_f{hub_files(s)}"
    return write_fp8_dir(cfg.bench_dir / name, s, cfg.block, shards=hub_files(s))


def run_all(cfg: ScaleOptions, root: Path) -> list[Run]:
    runs = []
    for s in cfg.shapes:
        source = source_dir(cfg, s)
        for world in cfg.worlds:
            for repeat in range(cfg.repeats):
                out = cfg.bench_dir / f"scale_out_l{s.layers}_w{world}"
                shutil.rmtree(out, ignore_errors=True)
                set_page_cache(files_under(source), cold=cfg.cold)
                run_ = Run(f"layers{s.layers}_experts{s.experts}", f"world{world}", repeat)
                kwargs = {"hf_dir": str(source), "out_dir": str(out), "block": cfg.block, "verify": cfg.verify}
                kwargs["shard_bytes"] = shard_bytes(s, cfg.block)
                run_.ranks, run_.error = try_spawn(
                    "benchmarks._scale_checkpoint_steps:run",
                    world=world,
                    kwargs=kwargs,
                    timeout_s=cfg.timeout_s,
                    root=root,
                )
                shutil.rmtree(out, ignore_errors=True)
                print(f"{run_.group}/{run_.method} [{repeat + 1}/{cfg.repeats}]: {one_line(run_)}", file=sys.stderr)
                runs.append(run_)
    return runs


def one_line(run: Run) -> str:
    if run.error:
        return "FAILED: " + run.error.strip().splitlines()[-1][:300]
    times = {step: max(r["steps"][step]["measurement"]["seconds"] for r in run.ranks) for step in STEPS}
    return (
        ", ".join(f"{k} {v:.2f} s" for k, v in times.items()) + ", verify " + ",".join(r["verify"] for r in run.ranks)
    )


# --------------------------------------------------------------------------- report


def step_row(runs: list[Run], step: str) -> dict[str, Any]:
    """One step of one (shape, world): medians over the runs of the slowest rank's time and first-byte delay,
    and the per-rank counts of the first run (they do not vary between runs)."""
    ranks = runs[0].ranks
    steps = [rk["steps"][step] for rk in ranks]

    def slowest(key: str) -> float:
        return statistics.median(max(rk["steps"][step]["probe" if key == "first_io_s" else "measurement"][key] or 0.0
                                     for rk in r.ranks) for r in runs)  # fmt: skip

    moved = [s["read"] if step == "load" else s["probe"]["written"] for s in steps]
    return {
        "seconds": slowest("seconds"),
        "first_io_s": slowest("first_io_s"),
        "peak": [s["measurement"]["peak_anon_delta"] for s in steps],
        "own": [rk["own_shard_bytes"] for rk in ranks],
        "files": [s["probe"]["files"] for s in steps],
        "opens": [s["probe"]["opens"] for s in steps],
        "moved": moved,
        "calls": [s["probe"]["collective_calls"] for s in steps],
        "kinds": steps[0]["probe"]["collectives"],
        "collective_bytes": [s["probe"]["collective_bytes"] for s in steps],
        "verify": sorted({s["verify"] for s in steps}),
    }


def planning_row(runs: list[Run]) -> dict[str, float]:
    """Per planning function, the slowest rank's seconds (median over the runs)."""
    keys = runs[0].ranks[0]["planning"]
    return {k: statistics.median(max(rk["planning"][k] for rk in r.ranks) for r in runs) for k in keys}


def _ints(values: list[int]) -> str:
    return " / ".join(f"{v:,}" for v in values)


def render(cfg: ScaleOptions, runs: list[Run], *, load_avg: tuple[float, float], core: str) -> str:
    others = [str(s.layers) for s in cfg.shapes[:-1]]
    also = f" (and the same at {', '.join(others)} layers)" if others else ""
    lines = [
        "## Scale by tensor count: a DeepSeek-V3-shaped block-FP8 checkpoint (`benchmarks/scale_checkpoint.py`)",
        "",
        *environment_lines(cfg.command, load_avg=load_avg, libraries=("safetensors",)),
        f"- Model: {cfg.shapes[-1].describe()}{also}; block FP8 ({cfg.block} x {cfg.block} blocks); files as many per layer as the release's (163 for "
        "61 layers) + `model.safetensors.index.json`; seeded random values quantized by the benchmark",
        f"- Ranks: {', '.join(map(str, cfg.worlds))} (gloo, every rank a process on this machine's cores), experts "
        f"sharded on the expert dim; {cfg.repeats} run(s) each in fresh processes; shardtune sources `{core}`",
        "- **Measured** on a machine shared with other jobs; with more ranks than cores the ranks also share cores.",
        "",
        "| layers | file tensors (in files) | ranks | step | wall s | to first data byte s | planning alone s "
        "| peak RssAnon Δ per rank (own shard) | files opened per rank (opens) | bytes read / written per rank "
        "| collectives per rank (calls, bytes given) | verify |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    for s in cfg.shapes:
        info = file_stats(s, cfg.block)
        for world in cfg.worlds:
            mine = [
                r for r in runs if r.group == f"layers{s.layers}_experts{s.experts}" and r.method == f"world{world}"
            ]
            ok = [r for r in mine if not r.error]
            if not ok:
                lines.append(
                    f"| {s.layers} | {info['tensors']:,} | {world} | all | FAILED ({len(mine)} runs) | | | | | | | |"
                )
                continue
            plan = planning_row(ok)
            rows[(s.layers, world)] = {"info": info, "plan": plan, "steps": {}}
            for step in STEPS:
                r = step_row(ok, step)
                rows[(s.layers, world)]["steps"][step] = r
                alone = plan["load_headers"] + plan["load_entries"] if step == "load" else plan[f"{step}_plan"]
                kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items()))
                lines.append(
                    f"| {s.layers} | {info['tensors']:,} ({hub_files(s)}) | {world} | {step} | {r['seconds']:.2f} "
                    f"| {r['first_io_s']:.2f} | {alone:.2f} | {' / '.join(fmt_bytes(p) for p in r['peak'])} "
                    f"({' / '.join(fmt_bytes(o) for o in r['own'])}) "
                    f"| {_ints(r['files'])} ({_ints(r['opens'])}) | {' / '.join(fmt_bytes(m) for m in r['moved'])} "
                    f"| {_ints(r['calls'])} ({kinds}; {_ints(r['collective_bytes'])} B) "
                    f"| {'; '.join(r['verify'])} |"
                )
    lines += [
        "",
        "How to read it:",
        "- *wall s*: the slowest rank's time between two barriers (median over runs); *to first data byte*: from "
        "the call to the rank's first `preadv` of tensor data (load) or first tensor write (save), the slowest "
        "rank's: the planning (headers, keys, layouts, agreement) before any data moves; *planning alone*: the "
        "slowest rank's time of the planning functions called alone after the steps (load: opening the directory, "
        "every header, and wrapping it for dequantization + the model's entries; save: `plan_hf_checkpoint`). A block-FP8 save writes its first byte after its amax pass (each rank's "
        "block amaxes of its rows of every quantized tensor, then one all-reduce), so its first-byte delay holds "
        "that data work too.",
        "- *peak RssAnon Δ*: a 2 ms `/proc/self/status` sampler's peak above the pre-step baseline; the load's "
        "baseline is the empty meta model, a save's the loaded model; *own shard*: the rank's bf16 parameter bytes after the load (what a peak above it holds besides: the headers, plans and buffers, which grow with the tensor count, not the ranks). *files opened*: distinct files under the "
        "checkpoint (load) or output (save) directory, counted by a `sys.audit` hook on `open` (Python's `open` "
        "and `os.open`); *opens*: the calls. *bytes read*: shardtune's count of its `preadv`s; *written*: the "
        "bytes its writer reported. *collectives*: the outermost `torch.distributed` collective calls (by kind) "
        "and the bytes given to them (objects pickled). *verify*: the load's shards equal a reference "
        "dequantization of the files; each save's index has the input's keys (without scales in the training dtype).",
    ]
    lines += growth_lines(cfg, rows)
    lines += projection_lines(rows, real=file_stats(shape(HUB_LAYERS), cfg.block))
    notes = [f"{r.group}/{r.method} failed: ```{r.error.strip()[-1200:]}```" for r in runs if r.error]
    lines += ["", "Notes:", *(f"- {n}" for n in notes)] if notes else []
    return "\n".join(lines)


def growth_lines(cfg: ScaleOptions, rows: dict[tuple[int, int], dict[str, Any]]) -> list[str]:
    """Per world, the planning's growth between the smallest and the largest depth: seconds per 1,000 file
    tensors of each planning function and of the delay to the first byte, and the collective calls at both."""
    depths = sorted({layers for layers, _ in rows})
    if len(depths) < 2:
        return []
    lo, hi = depths[0], depths[-1]
    lines = [
        "",
        f"**Growth** ({lo} → {hi} layers): seconds per 1,000 more file tensors (slope between the two depths), and "
        "the collective calls per rank at each depth (the same at both: none per tensor)",
        "",
        "| ranks | load headers | load entries | load: to first byte | save_dtype plan | save_dtype: to first byte "
        "| save_block_fp8 plan | save_block_fp8: to first byte | collective calls (load, saves) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for world in cfg.worlds:
        if (lo, world) not in rows or (hi, world) not in rows:
            continue
        a, b = rows[(lo, world)], rows[(hi, world)]
        per = 1000 / (b["info"]["tensors"] - a["info"]["tensors"])

        def slope(get: Any, a: dict[str, Any] = a, b: dict[str, Any] = b, per: float = per) -> str:
            return f"{(get(b) - get(a)) * per:.3f}"

        calls = "; ".join(
            f"{step} {max(a['steps'][step]['calls'])} → {max(b['steps'][step]['calls'])}" for step in STEPS
        )
        lines.append(
            f"| {world} | {slope(lambda r: r['plan']['load_headers'])} | {slope(lambda r: r['plan']['load_entries'])} "
            f"| {slope(lambda r: r['steps']['load']['first_io_s'])} | {slope(lambda r: r['plan']['save_dtype_plan'])} "
            f"| {slope(lambda r: r['steps']['save_dtype']['first_io_s'])} "
            f"| {slope(lambda r: r['plan']['save_block_fp8_plan'])} "
            f"| {slope(lambda r: r['steps']['save_block_fp8']['first_io_s'])} | {calls} |"
        )
    return lines


# --------------------------------------------------------------------------- main


def _add_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", default="16,32,61", help="comma list of depths (the first 3 layers dense)")
    p.add_argument("--experts", type=int, default=256, help="routed experts per sparse layer")
    p.add_argument("--worlds", default="2,4", help="comma list of rank counts")
    p.add_argument("--no-verify", action="store_true", help="skip the untimed check of the loaded shards")


def parse(argv: list[str] | None) -> ScaleOptions:
    a, common = parse_run_options(
        argv,
        module="benchmarks.scale_checkpoint",
        description=__doc__.split("\n")[0],
        groups=("scale",),
        cold_help="posix_fadvise(DONTNEED) the checkpoint's files before each run",
        smoke_help="2 layers, 8 experts, 2 ranks, 1 repeat, no BENCHMARKS.md",
        add_options=_add_options,
    )
    if a.smoke:
        shapes: tuple[DeepseekV3CheckpointShape, ...] = (SMOKE,)
        worlds: tuple[int, ...] = (2,)
    else:
        depths = [int(x) for x in a.layers.split(",") if x]
        if not depths or min(depths) < 2:
            raise SystemExit(f"--layers {a.layers!r}: give depths of at least 2, e.g. --layers 16,32,61")
        shapes = tuple(shape(n, experts=a.experts) for n in sorted(depths))
        worlds = tuple(int(x) for x in a.worlds.split(",") if x)
    return ScaleOptions(
        **common, shapes=shapes, worlds=worlds, block=SMOKE_BLOCK if a.smoke else BLOCK, verify=not a.no_verify
    )


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or a verification did not pass."""
    cfg = parse(argv)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    core = sources_fingerprint(("ranks", "state_dict", "checkpoint"))
    root = snapshot_sources(cfg.bench_dir / "scale_checkpoint_sources")
    load_before = os.getloadavg()[0]
    runs = run_all(cfg, root)
    (cfg.bench_dir / "scale_checkpoint_runs.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    finish(
        render(cfg, runs, load_avg=(load_before, os.getloadavg()[0]), core=core), markdown=cfg.markdown, markers=MARKERS
    )
    return 1 if failed(runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
