"""Benchmark of loading a block-FP8 mixture-of-experts HF checkpoint with thousands of expert tensors.

    python -m benchmarks.fp8_checkpoint --repeats 3
    python -m benchmarks.fp8_checkpoint --smoke        # tiny shape, 1 repeat, no BENCHMARKS.md

The checkpoint is the MoE checkpoint benchmark's Qwen3-MoE shape (64 experts x 16 layers = 3,072 per-expert
weights) in DeepSeek-V3's block-FP8 format: every linear weight but the router and ``lm_head`` as
``float8_e4m3fn`` with a float32 ``weight_scale_inv`` per 128 x 128 block (as many scale tensors again),
``quantization_config`` in ``config.json`` (:func:`benchmarks._fp8_checkpoint_steps.write_fp8_dir`).

Methods (each run = fresh processes on 2 ranks, gloo; their order rotated by one each repeat), each
ending with a sharded bf16 model holding the dequantized weights:

* ``shardtune_direct``: ``load_hf_checkpoint`` into the meta model ``shard_model`` made (untimed): each
  rank reads and dequantizes only its own FP8 rows and the scales covering them;
* ``shardtune_rank0``: the same with ``shared_filesystem=False`` (rank 0 reads, sends each rank its piece);
* ``dcp_quantized_stack``: torchtitan's way: ``to_empty``, ``dcp.load`` with torch's
  ``QuantizedHuggingFaceStorageReader`` into the sharded params and this rank's per-expert tensors, then
  stacking them into the fused expert params;
* ``transformers_fsdp2``: ``AutoModelForCausalLM.from_pretrained`` on every rank (on CPU it dequantizes the
  FP8 weights to bf16), then FSDP2 ``fully_shard`` per layer and the root, all timed.

After each step (untimed) every rank's shards are compared with a reference dequantization of the file by
safetensors + torch. The section goes between the ``fp8-checkpoint`` markers of BENCHMARKS.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks._driver import (
    MEMORY_COLUMNS,
    Options,
    Run,
    environment_lines,
    failed,
    finish,
    parse_run_options,
    progress,
    rotated,
    set_page_cache,
    snapshot_sources,
    sources_fingerprint,
    try_spawn,
)
from benchmarks._fp8_checkpoint_steps import file_shapes, write_fp8_dir
from benchmarks._hf_models import MoeCheckpointShape
from benchmarks._moe_checkpoint_families import QWEN3_MOE
from benchmarks._report import CONTRACT_MIN_BYTES, finished_row, fmt_bytes, fmt_ranks, per_rank_median

MARKERS = ("<!-- fp8-checkpoint:begin -->", "<!-- fp8-checkpoint:end -->")
GROUPS = {"load": ("shardtune_direct", "shardtune_rank0", "dcp_quantized_stack", "transformers_fsdp2")}
PEERS = ("dcp_quantized_stack", "transformers_fsdp2")
BLOCK, SMOKE_BLOCK = 128, 16
LOAD_TARGET, MEMORY_SLACK = 0.5, 1.1
BENCH, SMOKE = QWEN3_MOE.bench, QWEN3_MOE.smoke


@dataclass(frozen=True, kw_only=True)
class Fp8CheckpointOptions(Options):
    """``python -m benchmarks.fp8_checkpoint``'s options."""

    shape: MoeCheckpointShape
    block: int


def fp8_dir(cfg: Fp8CheckpointOptions) -> Path:
    s = cfg.shape
    name = f"fp8_ckpt_h{s.hidden}_l{s.layers}_e{s.experts}_i{s.expert_ffn}_v{s.vocab}_b{cfg.block}"
    return write_fp8_dir(cfg.bench_dir / name, s, cfg.block)


def run_all(cfg: Fp8CheckpointOptions, source: Path, *, root: Path) -> list[Run]:
    runs = []
    for repeat in range(cfg.repeats):
        for method in rotated(list(GROUPS["load"]), repeat):
            set_page_cache([source / "model.safetensors"], cold=cfg.cold)
            run_ = Run("load", method, repeat)
            run_.ranks, run_.error = try_spawn(
                "benchmarks._fp8_checkpoint_steps:run",
                world=cfg.world,
                kwargs={"method": method, "hf_dir": str(source), "block": cfg.block},
                timeout_s=cfg.timeout_s,
                root=root,
            )
            progress(run_, total=cfg.repeats)
            runs.append(run_)
    return runs


# --------------------------------------------------------------------------- report


def file_sizes(cfg: Fp8CheckpointOptions) -> tuple[int, int, int]:
    """(bytes of the file's tensors, tensor count, bytes of its largest tensor dequantized to bf16)."""
    sizes = {"F8_E4M3": 1, "F32": 4, "BF16": 2}
    tensors = file_shapes(cfg.shape, cfg.block)
    total = sum(sizes[d] * _numel(s) for d, s in tensors.values())
    largest = max(2 * _numel(s) for d, s in tensors.values())
    return total, len(tensors), largest


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def summarize(method: str, runs: list[Run], total: int) -> dict[str, Any]:
    row, ok = finished_row("load", method, runs)
    if ok:
        ranks = ok[0].ranks
        row["peak_file"] = per_rank_median(ok, "peak_file")
        row["share"] = [rk["own_file_bytes"] for rk in ranks]
        if ranks[0]["counted_bytes"] is not None:
            row["read"], row["how"] = [rk["counted_bytes"]["read"] for rk in ranks], "counted"
        elif method == "transformers_fsdp2":
            row["read"], row["how"] = [total] * len(ranks), "asked for"
        else:
            row["read"], row["how"] = row["share"], "asked for"
    return row


def render(cfg: Fp8CheckpointOptions, runs: list[Run], *, load_avg: tuple[float, float], core: str) -> str:
    total, count, one = file_sizes(cfg)
    rows = [summarize(m, [r for r in runs if r.method == m], total) for m in GROUPS["load"]]
    peers = [r for r in rows if r["method"] in PEERS and "seconds" in r]
    best = min(peers, key=lambda r: r["seconds"]) if peers else None
    s = cfg.shape
    lines = [
        "## Block-FP8 MoE checkpoint load (`benchmarks/fp8_checkpoint.py`)",
        "",
        *environment_lines(cfg.command, load_avg=load_avg, libraries=("transformers", "safetensors")),
        f"- Model: {s.describe()}; block FP8 ({cfg.block} x {cfg.block} blocks): {fmt_bytes(total)} on disk, "
        f"{count:,} file tensors ({s.expert_tensors():,} per-expert FP8 weights and their scales), one "
        "`model.safetensors` + index, seeded random values quantized by the benchmark",
        f"- World {cfg.world} (gloo), experts `Shard(0)`; {cfg.repeats} repeats, methods interleaved and rotated, "
        f"every run in fresh processes; shardtune sources `{core}`",
        "- **The machine was shared with other jobs running tests and benchmarks**: times vary between repeats.",
        "",
        f"| method | median s (runs) | × best peer | peak RssAnon Δ | own shard | own + one tensor ({fmt_bytes(one)}) "
        "| bytes read per rank | its share of the file | verify |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "seconds" not in r:
            lines.append(f"| {r['method']} | FAILED ({r['runs']} runs) | | | | | | | see notes |")
            continue
        ratio = "—" if best is None else f"{r['seconds'] / best['seconds']:.2f}"
        bound = [o + one for o in r["own"]]
        lines.append(
            f"| {r['method']} | {r['seconds']:.2f} ({', '.join(f'{t:.2f}' for t in r['times'])}) | {ratio} "
            f"| {fmt_ranks(r['peak'])} | {fmt_ranks(r['own'])} | {fmt_ranks(bound)} "
            f"| {fmt_ranks(r['read'])} ({r['how']}) | {fmt_ranks(r['share'])} | {'; '.join(r['verify'])} |"
        )
    mine = next((r for r in rows if r["method"] == "shardtune_direct" and "seconds" in r), None)
    lines += ["", "**Targets** (issue 42)", "", "| target | measured | result |", "|---|---|---|"]
    if mine is not None and best is not None:
        ratio = mine["seconds"] / best["seconds"]
        met = "met" if ratio <= LOAD_TARGET else "**not met**"
        lines.append(
            f"| time ≤ {LOAD_TARGET} × best peer (shardtune_direct / {best['method']}) "
            f"| {mine['seconds']:.2f} s / {best['seconds']:.2f} s = {ratio:.2f} | {met} |"
        )
    if mine is not None:
        bounds = [MEMORY_SLACK * (o + one) for o in mine["own"]]
        ok = all(p <= b for p, b in zip(mine["peak"], bounds))
        verdict = "n/a (tiny shape)" if max(bounds) < CONTRACT_MIN_BYTES else ("met" if ok else "**not met**")
        measured = "; ".join(
            f"r{i} {fmt_bytes(p)} vs {fmt_bytes(b)}" for i, (p, b) in enumerate(zip(mine["peak"], bounds))
        )
        lines.append(f"| every rank's peak ≤ {MEMORY_SLACK} × (own shard + one tensor) | {measured} | {verdict} |")
        exact = mine["read"] == mine["share"]
        lines.append(
            f"| bytes read per rank = its share (FP8 rows + covering scales + other tensors) | "
            f"{fmt_ranks(mine['read'])} vs {fmt_ranks(mine['share'])} | {'met' if exact else '**not met**'} |"
        )
    lines += [
        "",
        "How to read it:",
        "- *median s (runs)*: per run the slowest rank's time between two barriers, then the median; shardtune "
        "and DCP load into the same sharded meta model (built untimed; DCP's `to_empty` is timed); "
        "`transformers_fsdp2` starts from nothing (building, dequantizing and `fully_shard` are timed).",
        MEMORY_COLUMNS,
        "- *own shard*: this rank's bf16 parameter bytes after the step; *one tensor*: the largest file tensor "
        "dequantized to bf16. *bytes read per rank*: counted by `shardtune.state_dict.stats` for shardtune; for the "
        "peers what they ask for (`from_pretrained` the whole file on every rank, DCP each rank's share); *its share "
        "of the file*: its FP8 rows, the scale blocks covering them and its other tensors' bytes.",
        "- *verify*: every rank's shards equal a reference dequantization of the file (safetensors + torch: "
        "`fp8.float() * scale_inv` per block, cast to bf16).",
    ]
    notes = [f"{r['method']} failed: ```{r['errors'][0].strip()[-1200:]}```" for r in rows if r["errors"]]
    lines += ["", "Notes:", *(f"- {n}" for n in notes)] if notes else []
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def parse(argv: list[str] | None) -> Fp8CheckpointOptions:
    a, common = parse_run_options(
        argv,
        module="benchmarks.fp8_checkpoint",
        description=__doc__.split("\n")[0],
        groups=GROUPS,
        cold_help="posix_fadvise(DONTNEED) the checkpoint before each run",
        smoke_help="tiny shape, 1 repeat, no BENCHMARKS.md",
    )
    return Fp8CheckpointOptions(**common, shape=SMOKE if a.smoke else BENCH, block=SMOKE_BLOCK if a.smoke else BLOCK)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or a verification did not pass."""
    cfg = parse(argv)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    source = fp8_dir(cfg)
    core = sources_fingerprint(("ranks", "state_dict", "checkpoint"))
    root = snapshot_sources(cfg.bench_dir / "fp8_checkpoint_sources")
    load_before = os.getloadavg()[0]
    runs = run_all(cfg, source, root=root)
    (cfg.bench_dir / "fp8_checkpoint_runs.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    section = render(cfg, runs, load_avg=(load_before, os.getloadavg()[0]), core=core)
    finish(section, markdown=cfg.markdown, markers=MARKERS)
    return 1 if failed(runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
