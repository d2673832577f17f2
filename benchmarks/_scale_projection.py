"""The scale benchmark's written projection: the real DeepSeek-V3 checkpoint on 64 GPUs, from measured costs.

Rule: a projected time is (per-rank planning) + (per-rank execution's per-tensor cost) x (tensors a rank
touches) + (bytes a node moves) / (an assumed per-node bandwidth). The first two are measured here (the
planning's growth per file tensor between two depths, taken as O(tensors) at every rank count: an upper
bound if it shrinks with ranks; the execution's cost per touched tensor: its rows of every non-expert
tensor, its own experts' tensors); the bandwidths are assumptions, stated beside the result. Everything
projected is labelled so, next to the numbers users publish.
"""

from __future__ import annotations

from typing import Any

REAL_RANKS, REAL_NODES = 64, 8
REAL_FP8_BYTES = 700e9  # DeepSeek-V3's release: ~163 files, ~700 GB in block FP8
REAL_BF16_BYTES = 671e9 * 2  # 671B parameters in bf16
REAL_BLOCK = 128  # the release's weight_block_size
BANDWIDTHS_GBS = (2.0, 10.0)  # per node, read and write: a network filesystem client; local NVMe RAID
PUBLISHED = "saves of 1,500–10,480 s reported by users for 671B-class checkpoints; under 2 min the best published"
STEP_BYTES = {"load": REAL_FP8_BYTES, "save_dtype": REAL_BF16_BYTES, "save_block_fp8": REAL_FP8_BYTES}


def touched(info: dict[str, int], ranks: int) -> float:
    """File tensors a rank reads or writes rows of: every non-expert one, its own experts' ones."""
    return info["other_tensors"] + info["expert_tensors"] / ranks


def fitted(rows: dict[tuple[int, int], dict[str, Any]], world: int, step: str) -> tuple[float, float, float]:
    """(planning seconds at zero tensors, planning seconds per file tensor, execution seconds per touched
    tensor) of ``step`` at ``world`` ranks: the first-byte delay fitted through the smallest and largest
    depth (through zero with one depth), the rest of the step's time divided by the tensors it touched at
    the largest depth."""
    depths = sorted(layers for layers, w in rows if w == world)
    lo, hi = rows[(depths[0], world)], rows[(depths[-1], world)]
    t_lo, t_hi = lo["info"]["tensors"], hi["info"]["tensors"]
    p_lo, p_hi = lo["steps"][step]["first_io_s"], hi["steps"][step]["first_io_s"]
    per = (p_hi - p_lo) / (t_hi - t_lo) if t_hi > t_lo else p_hi / t_hi
    base = max(p_hi - per * t_hi, 0.0)
    execution = max(hi["steps"][step]["seconds"] - p_hi, 0.0) / touched(hi["info"], world)
    return base, per, execution


def projection_lines(rows: dict[tuple[int, int], dict[str, Any]], *, real: dict[str, int]) -> list[str]:
    """The projection section for the real checkpoint, from the largest rank count measured; ``real``: the
    file statistics of the real layout (its tensor counts: they do not depend on the widths)."""
    if not rows:
        return []
    world = max(w for _, w in rows)
    lines = [
        "",
        f"**Projection for the real checkpoint** (DeepSeek-V3 671B: ~{real['tensors']:,} file tensors without the "
        f"multi-token-prediction layer (~1.6k more with it), 163 files, ~700 GB in block FP8; {REAL_RANKS} GPUs on "
        f"{REAL_NODES} nodes). **Projected, not measured**: planning = the measured first-byte delay at {world} "
        "ranks, fitted as a + b × file tensors (b taken at every rank count, an upper bound if planning shrinks "
        "with ranks); execution = the measured time after the first byte per tensor a rank touches (its rows of "
        f"every non-expert tensor, its own experts': {touched(real, REAL_RANKS):,.0f} tensors per rank at "
        f"{REAL_RANKS} ranks) + the bytes each node moves ({REAL_RANKS // REAL_NODES} ranks' shares) at an assumed "
        "per-node bandwidth, the filesystem delivering it to all nodes at once. Host-to-GPU copies and "
        "dequantization on the GPU are left out (both far faster than the disk).",
        "",
        "| step | planning per rank (a + b × tensors) | execution per-tensor part | bytes per node "
        + "".join(f"| total at {bw:g} GB/s per node " for bw in BANDWIDTHS_GBS)
        + "|",
        "|---|---|---|---" + "|---" * len(BANDWIDTHS_GBS) + "|",
    ]
    for step, total_bytes in STEP_BYTES.items():
        base, per, execution = fitted(rows, world, step)
        planning = base + per * real["tensors"]
        fixed = planning + execution * touched(real, REAL_RANKS)
        node_bytes = total_bytes / REAL_NODES
        totals = "".join(f"| {fixed + node_bytes / (bw * 1e9):,.0f} s " for bw in BANDWIDTHS_GBS)
        lines.append(
            f"| {step} | {planning:.1f} s ({base:.2f} s + {per * 1e6:.1f} µs × {real['tensors']:,}) "
            f"| {execution * touched(real, REAL_RANKS):.1f} s ({execution * 1e6:.0f} µs × "
            f"{touched(real, REAL_RANKS):,.0f}) | {node_bytes / 1e9:,.0f} GB {totals}|"
        )
    amax_bytes = REAL_FP8_BYTES / REAL_BLOCK**2 * 4
    lines += [
        "",
        "What grows with what, per rank (from the code; the counts above check the collectives): every rank "
        "opens every file and reads every header (O(tensors): 163 files per rank, ~10k opens on 64 ranks); the "
        "load's agreement gathers one digest per rank (the bytes given do not grow with tensors); the load reads "
        "its rows of every non-expert tensor and its own experts' (O(other tensors + expert tensors / ranks)); a "
        "save plans every file on every rank (O(tensors), no collective per tensor); a block-FP8 save all-reduces "
        "the amax grids of every quantized tensor in one call (O(weights / block²) per rank: "
        f"~{amax_bytes / 1e6:,.0f} MB of float32 at 128 × 128 blocks for the real checkpoint, the expert grids "
        "included although no expert block is split between ranks when experts are sharded on the expert dim).",
        "",
        f"Published, for comparison (not measured here): {PUBLISHED}. The projection's per-tensor parts come from "
        "this machine's CPU cores, shared with other jobs; on a training node's cores they are likely smaller. "
        "Its byte parts are only as good as the bandwidth assumed: at the projected rates the disk or network, "
        "not planning, bounds the time once the per-tensor parts are a small share of it.",
    ]
    return lines
