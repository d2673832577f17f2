"""The MoE checkpoint benchmark's expert-parallel table: shardtune's HF load and save on ``--ep-world``
ranks with the experts split over ``ep`` (``shardtune_ep2``) against the same ranks without
(``shardtune_ep1``, experts FSDP2-sharded over all of them).

Rule: a table is made from the runs' records alone. Each row shows what every rank read and wrote
next to what it holds: shardtune's count of the safetensors bytes it read, and the kernel's own counts
over the step (``rchar`` of the step's thread, ``write_bytes`` of the process:
:func:`benchmarks._moe_checkpoint_steps.kernel_io`), so a rank that read or wrote more than its own
experts shows it without trusting shardtune's bookkeeping. Ratios are to ``shardtune_ep1`` of the same run.
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks._driver import MEMORY_COLUMNS, Run, environment_lines
from benchmarks._hf_models import MoeCheckpointShape
from benchmarks._moe_checkpoint_report import MoeCheckpointOptions, family_option
from benchmarks._report import finished_row, fmt_bytes, fmt_ranks

GROUPS = {"load_ep": ("shardtune_ep1", "shardtune_ep2"), "save_ep": ("shardtune_ep1", "shardtune_ep2")}
BASE = "shardtune_ep1"


def _per_rank(runs: list[Run], get) -> list[float]:
    return [statistics.median(get(r.ranks[k]) for r in runs) for k in range(len(runs[0].ranks))]


def summarize(group: str, method: str, runs: list[Run]) -> dict[str, Any]:
    """Medians over the repeats that finished: time (slowest rank), per rank peak, own bytes, bytes read
    (counted and kernel) and written (kernel)."""
    row, ok = finished_row(group, method, runs)
    if ok:
        row["own_experts"] = [rk["own_expert_bytes"] for rk in ok[0].ranks]
        row["counted_read"] = _per_rank(ok, lambda rk: rk["counted_bytes"]["read"])
        row["rchar"] = _per_rank(ok, lambda rk: rk["kernel_io"]["rchar"])
        row["written"] = _per_rank(ok, lambda rk: rk["kernel_io"]["write_bytes"])
    return row


def render(cfg: MoeCheckpointOptions, rows: list[dict[str, Any]]) -> list[str]:
    """The table's lines: one row per group and method."""
    lines = [
        "| step | method | mesh | median s (runs) | × EP 1 | peak RssAnon Δ per rank | own shard per rank "
        "(of which experts) | read per rank: counted by shardtune | read: kernel rchar | written: kernel "
        "write_bytes | verify |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        degree = int(r["method"].removeprefix("shardtune_ep"))
        mesh = f"shard {cfg.ep_world}" if degree == 1 else f"(efsdp {cfg.ep_world // degree}, ep {degree})"
        step = r["group"].removesuffix("_ep")
        if "seconds" not in r:
            lines.append(f"| {step} | {r['method']} | {mesh} | FAILED ({r['runs']} runs) | | | | | | | see notes |")
            continue
        base = next((b for b in rows if b["group"] == r["group"] and b["method"] == BASE and "seconds" in b), None)
        ratio = "—" if base is None else f"{r['seconds'] / base['seconds']:.2f}"
        own = " / ".join(f"{fmt_bytes(o)} ({fmt_bytes(e)})" for o, e in zip(r["own"], r["own_experts"], strict=True))
        lines.append(
            f"| {step} | {r['method']} | {mesh} | {r['seconds']:.2f} ({', '.join(f'{t:.2f}' for t in r['times'])}) "
            f"| {ratio} | {fmt_ranks(r['peak'])} | {own} | {fmt_ranks(r['counted_read'])} | {fmt_ranks(r['rchar'])} "
            f"| {fmt_ranks(r['written'])} | {'; '.join(r['verify'])} |"
        )
    return lines


def report(
    cfg: MoeCheckpointOptions, runs: list[Run], *, load_avg: tuple[float, float], core: str
) -> tuple[str, list[dict[str, Any]]]:
    """The Markdown section (without markers) of the expert-parallel groups that ran, and its rows."""
    shape: MoeCheckpointShape = cfg.shape
    rows = [
        summarize(g, m, [r for r in runs if (r.group, r.method) == (g, m)])
        for g in GROUPS
        if g in cfg.groups
        for m in GROUPS[g]
    ]
    notes = [f"{r['group']}/{r['method']} failed: ```{r['errors'][0].strip()[-1200:]}```" for r in rows if r["errors"]]
    expert_bytes = shape.expert_bytes()
    lines = [
        f"## {cfg.family.heading} HF checkpoint load and save with expert parallel on {cfg.ep_world} ranks "
        f"(`benchmarks/moe_checkpoint.py{family_option(cfg)}`, groups `load_ep`, `save_ep`)",
        "",
        *environment_lines(cfg.command, load_avg=load_avg, libraries=("transformers", "safetensors")),
        (
            f"- Model and files: the {cfg.family.heading} checkpoint table's ({shape.model_name}, {shape.experts} "
            f"experts × {shape.layers} layers, per-expert files: {shape.expert_tensors():,} expert tensors; {fmt_bytes(shape.total_bytes())} "
            f"bf16, of which experts {fmt_bytes(expert_bytes)}: {fmt_bytes(shape.total_bytes() / cfg.ep_world)} "
            f"and {fmt_bytes(expert_bytes / cfg.ep_world)} per rank's share of {cfg.ep_world})"
        ),
        (
            f"- `shardtune_ep<d>`: `shard_model(mesh=make_mesh(expert_parallel=d))` on {cfg.ep_world} gloo ranks "
            "(built untimed on meta), then `load_hf_checkpoint` (load) or, after an untimed load, `save_hf_checkpoint` "
            "(save, per-expert files, fsynced); at d = 1 the experts are FSDP2-sharded over all ranks, at d > 1 split "
            f"over `ep` first, so each rank holds {shape.experts // cfg.ep_world} whole experts either way. "
            f"{cfg.repeats} repeats, methods interleaved, page cache "
            f"{'cold' if cfg.cold else 'warm'}; shardtune sources `{core}` (as in the MoE checkpoint table)"
        ),
        "",
        *render(cfg, rows),
        "",
        MEMORY_COLUMNS,
        "- *own shard*: this rank's parameter bytes after the step (its experts' bytes in brackets).",
        "- *read: counted by shardtune*: the safetensors bytes shardtune read (`shardtune.state_dict.stats`); "
        "*read: kernel rchar*: `/proc/thread-self/io` `rchar` of the step's thread over the step (every read "
        "syscall's bytes, the file's header and `config.json` included; the memory sampler's and gloo's threads "
        "left out); *written: kernel write_bytes*: `/proc/self/io` `write_bytes` over the step (file bytes the "
        "rank dirtied or wrote with `O_DIRECT`, page granular; socket writes are not in it). Each rank reading and "
        "writing only its own experts shows as read ≈ written ≈ own shard.",
        "- *verify*: after the step (untimed) every rank's shards equal a reference cut of the file by safetensors "
        "(load), or the written directory's keys, shapes and values equal the input's (save).",
        *(["", "Notes:", *(f"- {n}" for n in notes)] if notes else []),
    ]
    return "\n".join(lines), rows
