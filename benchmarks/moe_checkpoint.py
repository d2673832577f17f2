"""Benchmark of HF checkpoint load and save of a mixture-of-experts model with thousands of expert tensors.

    python -m benchmarks.moe_checkpoint --repeats 3
    python -m benchmarks.moe_checkpoint --smoke        # tiny shape, 1 repeat, no BENCHMARKS.md
    python -m benchmarks.moe_checkpoint --groups load_ep,save_ep --repeats 3   # expert parallel, 4 ranks

The checkpoint is a Qwen3-MoE HF directory (``config.json`` + ``model.safetensors``, seeded random
bf16) in transformers' default ``save_pretrained`` layout, every expert's ``gate_proj``/``up_proj``/
``down_proj`` its own tensor (:data:`BENCH`: 64 experts x 16 layers = 3,072 expert tensors), and, for
the ``load_fused`` group, the same shape in the fused layout (``save_original_format=False``).

Groups and methods (each run = fresh processes on 2 ranks, gloo; methods interleaved, their order
rotated by one each repeat):

* ``load`` / ``load_fused``: -> a sharded model holding the weights. ``shardtune_direct``
  (``load_hf_checkpoint`` into the meta model ``shard_model`` made, untimed: each rank reads its own
  bytes of every expert), ``shardtune_rank0`` (``shared_filesystem=False``), ``transformers_fsdp2``
  (from nothing: ``AutoModelForCausalLM.from_pretrained`` on every rank, then FSDP2 ``fully_shard``
  per layer and the root, all timed), ``dcp_hf_stack`` (torchtitan's way: ``to_empty``,
  ``dcp.load`` with ``HuggingFaceStorageReader`` into the sharded params and this rank's per-expert
  tensors, then stacking them into the fused params; with fused files nothing to stack);
  ``copy_floor`` (fused files only: ``to_empty``, then one ``madvise`` populate and one ``preadv`` per
  local shard, no parsing or checks: the floor of any loader that copies the file into the model).
* ``save``: the sharded model (loaded untimed) -> an HF directory, fsynced. ``shardtune``
  (``save_hf_checkpoint``: every rank writes its own bytes of every expert file tensor),
  ``shardtune_rank0`` (``shared_filesystem=False``) vs ``dsd_save_pretrained``
  (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``, rank 0 puts it in a meta
  transformers model, ``save_pretrained``).

* ``load_ep`` / ``save_ep`` (on ``--ep-world`` ranks, 4 by default): shardtune's direct load and save of
  the per-expert files with the experts split over an expert-parallel mesh (``shardtune_ep2``) and
  without (``shardtune_ep1``); the bytes every rank read and wrote, counted by shardtune and by the
  kernel (:mod:`benchmarks._moe_checkpoint_ep`).

The section goes between the ``moe-checkpoint`` markers of BENCHMARKS.md, the expert-parallel one
between the ``moe-checkpoint-ep`` markers (each written only when its groups ran).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import _moe_checkpoint_ep
from benchmarks._fixtures import write_random_safetensors
from benchmarks._report import CONTRACT_MIN_BYTES, finished_row, fmt_bytes, fmt_ranks, per_rank_median
from benchmarks.driver import (
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
from benchmarks.train_moe import MoeShape

MARKERS = ("<!-- moe-checkpoint:begin -->", "<!-- moe-checkpoint:end -->")
GROUPS = {
    "load": ("shardtune_direct", "shardtune_rank0", "transformers_fsdp2", "dcp_hf_stack"),
    "load_fused": ("shardtune_direct", "transformers_fsdp2", "dcp_hf_stack", "copy_floor"),
    "save": ("shardtune", "shardtune_rank0", "dsd_save_pretrained"),
}
ALL_GROUPS = GROUPS | _moe_checkpoint_ep.GROUPS
LOAD_PEERS = ("transformers_fsdp2", "dcp_hf_stack")
LOAD_TARGET, SAVE_TARGET, MEMORY_SLACK = 0.5, 0.3, 1.1
BF16 = 2


@dataclass(frozen=True, kw_only=True)
class MoeCheckpointShape(MoeShape):
    """The MoE training benchmark's Qwen3-MoE shape (every layer sparse), as an HF directory."""

    def hf_config(self) -> dict[str, Any]:
        """``config.json``: the model's config with its model type and saved dtype."""
        named = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "bfloat16"}
        return {**super().hf_config(), **named}

    def file_shapes(self, *, fused: bool) -> dict[str, tuple[int, ...]]:
        """HF key -> shape as transformers' ``save_pretrained`` writes it (``fused``:
        ``save_original_format=False``)."""
        h, i, e = self.hidden, self.expert_ffn, self.experts
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            shapes |= {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (self.head_dim,),
                p + "self_attn.k_norm.weight": (self.head_dim,),
                p + "mlp.gate.weight": (e, h),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
            if fused:
                shapes |= {p + "mlp.experts.gate_up_proj": (e, 2 * i, h), p + "mlp.experts.down_proj": (e, h, i)}
                continue
            for x in range(e):
                shapes |= {
                    f"{p}mlp.experts.{x}.gate_proj.weight": (i, h),
                    f"{p}mlp.experts.{x}.up_proj.weight": (i, h),
                    f"{p}mlp.experts.{x}.down_proj.weight": (h, i),
                }
        shapes |= {"model.norm.weight": (h,), "lm_head.weight": (self.vocab, h)}
        return shapes

    def expert_tensors(self) -> int:
        return 3 * self.experts * self.layers

    def expert_bytes(self) -> int:
        return self.expert_tensors() * self.hidden * self.expert_ffn * BF16

    def total_bytes(self) -> int:
        return sum(math.prod(s) for s in self.file_shapes(fused=True).values()) * BF16

    def largest_bytes(self, *, fused: bool) -> int:
        return max(math.prod(s) for s in self.file_shapes(fused=fused).values()) * BF16


BENCH = MoeCheckpointShape(
    hidden=512, layers=16, heads=8, kv_heads=2, head_dim=64, experts=64, top_k=2, expert_ffn=128, vocab=16384
)
SMOKE = MoeCheckpointShape(
    hidden=32, layers=2, heads=2, kv_heads=1, head_dim=16, experts=4, top_k=2, expert_ffn=16, vocab=128
)


@dataclass(frozen=True, kw_only=True)
class MoeCheckpointOptions(Options):
    shape: MoeCheckpointShape
    ep_world: int = 4  # ranks of the expert-parallel groups


def hf_dir(bench_dir: Path, shape: MoeCheckpointShape, *, fused: bool) -> Path:
    """The seeded HF directory of ``shape`` in one layout (written tensor by tensor once, reused)."""
    name = f"moe_ckpt_h{shape.hidden}_l{shape.layers}_e{shape.experts}_i{shape.expert_ffn}_v{shape.vocab}"
    path = bench_dir / (name + ("_fused" if fused else "_per_expert"))
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(shape.hf_config(), indent=2))
    write_random_safetensors(path / "model.safetensors", shape.file_shapes(fused=fused), metadata={"format": "pt"})
    return path


# --------------------------------------------------------------------------- running


def run_all(cfg: MoeCheckpointOptions, dirs: dict[str, Path], *, root: Path) -> list[Run]:
    """Every group's methods once per repeat, in fresh processes, their order rotated each repeat."""
    runs = []
    for repeat in range(cfg.repeats):
        for group in rotated(list(cfg.groups), repeat):
            source = dirs["fused" if group == "load_fused" else "per_expert"]
            world = cfg.ep_world if group in _moe_checkpoint_ep.GROUPS else cfg.world
            for method in rotated(list(ALL_GROUPS[group]), repeat):
                out = cfg.bench_dir / "moe_ckpt_out"
                shutil.rmtree(out, ignore_errors=True)
                os.sync()  # no earlier run's dirty pages are written back during this one
                set_page_cache([source / "model.safetensors"], cold=cfg.cold)
                run_ = Run(group, method, repeat)
                run_.ranks, run_.error = try_spawn(
                    "benchmarks._moe_checkpoint_steps:run",
                    world=world,
                    kwargs={"group": group, "method": method, "hf_dir": str(source), "out_dir": str(out)},
                    timeout_s=cfg.timeout_s,
                    root=root,
                )
                progress(run_, total=cfg.repeats)
                runs.append(run_)
    return runs


# --------------------------------------------------------------------------- report


def bytes_read(group: str, method: str, row_ranks: list[dict[str, Any]], shape: MoeCheckpointShape) -> list[int]:
    """Checkpoint bytes each rank read: counted by shardtune; for the peers, from what they ask for:
    ``from_pretrained`` the whole file on every rank, DCP each rank's own shards (= its params)."""
    counted = row_ranks[0]["counted_bytes"]
    if counted is not None:
        return [rk["counted_bytes"]["read"] for rk in row_ranks]
    if method == "transformers_fsdp2":
        return [shape.total_bytes()] * len(row_ranks)
    if method in ("dcp_hf_stack", "copy_floor"):
        return [rk["own_shard_bytes"] for rk in row_ranks]
    return [0] * len(row_ranks)


def summarize(group: str, method: str, runs: list[Run], shape: MoeCheckpointShape) -> dict[str, Any]:
    """Medians over the repeats that did not fail; time is the slowest rank of each repeat."""
    row, ok = finished_row(group, method, runs)
    if ok:
        row["peak_file"] = per_rank_median(ok, "peak_file")
        row["read"] = bytes_read(group, method, ok[0].ranks, shape)
        row["counted"] = ok[0].ranks[0]["counted_bytes"] is not None
    return row


def _ratio(row: dict[str, Any] | None, base: dict[str, Any] | None) -> float | None:
    if not row or not base or "seconds" not in row or "seconds" not in base:
        return None
    return row["seconds"] / base["seconds"]


def render_group(group: str, rows: list[dict[str, Any]], shape: MoeCheckpointShape) -> str:
    """One Markdown table; the ratio is to the group's best peer (load) or to DSD + save_pretrained (save)."""
    base = best_peer(rows) if group.startswith("load") else _row(rows, "dsd_save_pretrained")
    fused = group == "load_fused"
    title = {"load": "Load, per-expert files", "load_fused": "Load, fused files", "save": "Save (per-expert files)"}
    lines = [
        f"**{title[group]}** (one tensor: the largest file tensor, {fmt_bytes(shape.largest_bytes(fused=fused))})",
        "",
        "| method | median s (runs) | × best peer | peak RssAnon Δ (r0 / r1) | own shard | own + one tensor "
        "| peak RssFile | bytes read per rank | verify |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    if group == "save":
        lines[2] = lines[2].replace("× best peer", "× DSD + save_pretrained")
    for r in rows:
        if "seconds" not in r:
            lines.append(f"| {r['method']} | FAILED ({r['runs']} runs) | | | | | | | see notes |")
            continue
        ratio = _ratio(r, base)
        bound = [o + shape.largest_bytes(fused=fused) for o in r["own"]]
        read = fmt_ranks(r["read"]) + (" (counted)" if r["counted"] else " (asked for)")
        lines.append(
            f"| {r['method']} | {r['seconds']:.2f} ({', '.join(f'{t:.2f}' for t in r['times'])}) "
            f"| {'—' if ratio is None else f'{ratio:.2f}'} | {fmt_ranks(r['peak'])} | {fmt_ranks(r['own'])} "
            f"| {fmt_ranks(bound)} | {fmt_ranks(r['peak_file'])} | {read} | {'; '.join(r['verify'])} |"
        )
    return "\n".join(lines)


def _row(rows: list[dict[str, Any]], method: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["method"] == method and "seconds" in r), None)


def best_peer(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest of the load peers that ran."""
    peers = [r for r in rows if r["method"] in LOAD_PEERS and "seconds" in r]
    return min(peers, key=lambda r: r["seconds"]) if peers else None


def _per_round(mine: dict[str, Any], base: dict[str, Any]) -> str:
    """The ratio within each repeat and its median (both methods ran back to back, so a slow spell
    of the shared machine tends to hit both), when every repeat of both succeeded."""
    if len(mine["times"]) != len(base["times"]) or len(mine["times"]) < 2:
        return ""
    rounds = [a / b for a, b in zip(mine["times"], base["times"], strict=True)]
    return f" (per repeat: {', '.join(f'{r:.2f}' for r in rounds)}; median {statistics.median(rounds):.2f})"


def targets(tables: dict[str, list[dict[str, Any]]], shape: MoeCheckpointShape) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for the issue's targets, from the rows of the groups that ran (met None:
    a memory bound too small to judge, allocator noise decides it)."""
    out = []
    for group in ("load", "load_fused"):
        rows = tables.get(group)
        mine, peer = (_row(rows, "shardtune_direct"), best_peer(rows)) if rows else (None, None)
        if mine is None or peer is None:
            continue
        ratio = mine["seconds"] / peer["seconds"]
        floor = _row(rows, "copy_floor")
        below = (
            "" if floor is None else f"; copy floor {floor['seconds']:.2f} s = {floor['seconds'] / peer['seconds']:.2f}"
        )
        out.append(
            (
                f"{group}: time ≤ {LOAD_TARGET} × best peer (shardtune_direct / {peer['method']})",
                f"{mine['seconds']:.2f} s / {peer['seconds']:.2f} s = {ratio:.2f}{_per_round(mine, peer)}{below}",
                ratio <= LOAD_TARGET,
            )
        )
        one = shape.largest_bytes(fused=group == "load_fused")
        bounds = [MEMORY_SLACK * (o + one) for o in mine["own"]]
        out.append(
            (
                f"{group}: every rank's peak ≤ {MEMORY_SLACK} × (own shard + one tensor) (shardtune_direct)",
                "; ".join(
                    f"r{i} {fmt_bytes(p)} vs {fmt_bytes(b)}" for i, (p, b) in enumerate(zip(mine["peak"], bounds))
                ),
                None if max(bounds) < CONTRACT_MIN_BYTES else all(p <= b for p, b in zip(mine["peak"], bounds)),
            )
        )
    rows = tables.get("save")
    mine, dsd = (_row(rows, "shardtune"), _row(rows, "dsd_save_pretrained")) if rows else (None, None)
    if mine is not None and dsd is not None:
        ratio = mine["seconds"] / dsd["seconds"]
        out.append(
            (
                f"save: time ≤ {SAVE_TARGET} × DSD full-state gather + save_pretrained "
                "(shardtune / dsd_save_pretrained)",
                f"{mine['seconds']:.2f} s / {dsd['seconds']:.2f} s = {ratio:.2f}{_per_round(mine, dsd)}",
                ratio <= SAVE_TARGET,
            )
        )
    return out


def report(
    cfg: MoeCheckpointOptions, runs: list[Run], *, load_avg: tuple[float, float], core: str
) -> tuple[str, list[tuple[str, str, bool | None]]]:
    """The Markdown section (without markers) and the targets with whether each was met."""
    shape = cfg.shape
    tables = {
        g: [summarize(g, m, [r for r in runs if (r.group, r.method) == (g, m)], shape) for m in GROUPS[g]]
        for g in cfg.groups
        if g in GROUPS
    }
    met = targets(tables, shape)
    notes = [
        f"{r['group']}/{r['method']} failed: ```{r['errors'][0].strip()[-1200:]}```"
        for rs in tables.values()
        for r in rs
        if r["errors"]
    ]
    cold_or_warm = (
        "cold (POSIX_FADV_DONTNEED before each run)"
        if cfg.cold
        else "warm (the file is read just before each run, untimed)"
    )
    lines = [
        "## MoE HF checkpoint load and save (`benchmarks/moe_checkpoint.py`)",
        "",
        *environment_lines(cfg.command, load_avg=load_avg, libraries=("transformers", "safetensors")),
        (
            f"- Model: Qwen3-MoE, hidden {shape.hidden}, {shape.layers} layers (all sparse), {shape.experts} experts "
            f"of width {shape.expert_ffn}, {shape.heads} heads ({shape.kv_heads} kv, head_dim {shape.head_dim}), "
            f"vocabulary {shape.vocab}: {fmt_bytes(shape.total_bytes())} bf16; per-expert files hold "
            f"{shape.expert_tensors():,} expert tensors ({len(shape.file_shapes(fused=False)):,} tensors in all), "
            f"fused files {len(shape.file_shapes(fused=True))}; one `model.safetensors` each, seeded random values"
        ),
        (
            f"- World {cfg.world} (gloo), experts `Shard(0)` ({shape.experts // cfg.world} whole experts per rank); "
            f"{cfg.repeats} repeats, "
            "groups and methods interleaved, their order rotated by one each repeat, every run in fresh processes; "
            f"page cache {cold_or_warm}; "
            f"the output directory is removed and `os.sync()` called before each run. shardtune sources: sha256 of "
            f"`shardtune/{{state_dict,checkpoint}}/*.py` = `{core}`, copied before the first run"
        ),
        "- **The machine is shared with 3 other sessions running tests and benchmarks**: times vary between repeats "
        "(each run's time is listed); the ratios compare methods run back to back.",
        "",
    ]
    for group, rows in tables.items():
        lines += [render_group(group, rows, shape), ""]
    lines += [
        "**Targets** (from issue 24; measured in this run)",
        "",
        "| target | measured | result |",
        "|---|---|---|",
    ]
    verdicts = {True: "met", False: "**not met**", None: "n/a (tiny shape)"}
    lines += [f"| {t} | {m} | {verdicts[ok]} |" for t, m, ok in met]
    lines += [
        "",
        "How to read it:",
        "- *median s (runs)*: per run the slowest rank's `perf_counter` time between two barriers, then the median. "
        "shardtune and DCP load into the same sharded meta model (`from_hf_config` on meta + `shard_model`, built "
        "untimed; DCP's `to_empty` is timed); `transformers_fsdp2` starts from nothing, so its time includes building "
        "the model and `fully_shard` (that is how it is used: there is no meta model to load into).",
        MEMORY_COLUMNS,
        "- *own shard*: this rank's parameter bytes after the step; *own + one tensor*: that plus the largest file "
        "tensor (the memory contract). `transformers_fsdp2` holds the whole model on every rank before `fully_shard`.",
        "- *bytes read per rank*: counted by `shardtune.state_dict.stats` for shardtune (safetensors bytes it read); "
        "for "
        "the peers what they ask for (their reads go through `safe_open`'s mmap, which no counter sees): "
        "`from_pretrained` the whole file on every rank, DCP each rank's own shards and own experts. *peak RssFile*: "
        "file pages mapped at the peak (the mmap readers' footprint).",
        "- Targets are judged on the ratio of the medians; the ratio within each repeat is given beside it.",
        "- *verify*: after the step (untimed) every rank's shards equal a reference cut of the file by safetensors + "
        "`torch.cat`/`torch.stack` (load), or the written directory's keys, shapes and values equal the input's "
        "(save).",
        "- `save` setup (untimed): `load_hf_checkpoint` of the per-expert directory, so shardtune writes per expert "
        "(the "
        "layout it read), as `save_pretrained` does by default; both fsync their files.",
        *(["", "Notes:", *(f"- {n}" for n in notes)] if notes else []),
    ]
    return "\n".join(lines), met


# --------------------------------------------------------------------------- main


def _add_options(p) -> None:
    p.add_argument("--ep-world", type=int, default=4, help="ranks of the load_ep/save_ep groups (expert parallel 2)")


def parse(argv: list[str] | None) -> MoeCheckpointOptions:
    a, common = parse_run_options(
        argv,
        module="benchmarks.moe_checkpoint",
        description=__doc__.split("\n")[0],
        groups=ALL_GROUPS,
        cold_help="posix_fadvise(DONTNEED) the checkpoint before each run",
        smoke_help="tiny shape, 1 repeat, no BENCHMARKS.md",
        add_options=_add_options,
    )
    shape = SMOKE if a.smoke else BENCH
    ep_groups = set(common["groups"]) & set(_moe_checkpoint_ep.GROUPS)
    if ep_groups and (a.ep_world % 2 or shape.experts % a.ep_world):
        raise SystemExit(
            f"--ep-world {a.ep_world}: the {','.join(sorted(ep_groups))} groups split {shape.experts} experts over "
            "expert_parallel=2 and the ranks; give an even --ep-world dividing the experts (e.g. 4)"
        )
    return MoeCheckpointOptions(**common, shape=shape, ep_world=a.ep_world)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or a verification did not pass (a missed target is
    reported, not an error)."""
    cfg = parse(argv)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    dirs = {
        "per_expert": hf_dir(cfg.bench_dir, cfg.shape, fused=False),
        "fused": hf_dir(cfg.bench_dir, cfg.shape, fused=True),
    }
    core = sources_fingerprint(("state_dict", "checkpoint"))
    root = snapshot_sources(cfg.bench_dir / "moe_checkpoint_sources")
    load_before = os.getloadavg()[0]
    runs = run_all(cfg, dirs, root=root)
    (cfg.bench_dir / "moe_checkpoint_runs.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    load_avg = (load_before, os.getloadavg()[0])
    if set(cfg.groups) & set(GROUPS):
        section, _ = report(cfg, runs, load_avg=load_avg, core=core)
        finish(section, markdown=cfg.markdown, markers=MARKERS)
    if set(cfg.groups) & set(_moe_checkpoint_ep.GROUPS):
        section, _ = _moe_checkpoint_ep.report(cfg, runs, load_avg=load_avg, core=core)
        finish(section, markdown=cfg.markdown, markers=_moe_checkpoint_ep.MARKERS)
    return 1 if failed(runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
