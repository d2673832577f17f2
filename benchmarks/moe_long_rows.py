"""Benchmark of long rows on a mixture-of-experts model: expert parallel alone against expert x context parallel.

    python -m benchmarks.moe_long_rows --world 4 --budget-mib 512
    python -m benchmarks.moe_long_rows --smoke     # tiny shape, short rows, no BENCHMARKS.md

On ``--world`` ranks, shardtune trains full fine-tuning steps (activation checkpointing per layer, AdamW, the
recipes' ``next_token_loss`` with the load-balancing loss) of one seeded Qwen3-MoE saved once as an HF
directory, its experts over ``--expert-parallel`` ranks:

* ``ep E``: every rank its own whole row (``world`` rows a step);
* ``ep E x cp C``: every row split over a ``cp`` group of ``C`` ranks (``world / C`` rows a step), the tokens
  each rank routes sent to their experts' ranks whichever group they come from.

For each, the row doubles from ``--start-seq`` while a step's peak memory on every rank stays in the budget
(anonymous RSS above the step start on CPU, ``max_memory_allocated`` on CUDA); the table gives the longest
row that fit, its tokens/s (all ranks, median of ``--steps`` timed steps after a warm-up) and the peaks,
then the ratios the issue asks for: the longest row at ep x cp over ep's, and tokens/s at each one's
longest row. Each probe runs in fresh rank processes. The section goes between the ``moe-long-rows``
markers of BENCHMARKS.md (``moe-long-rows-cuda`` on a GPU).
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any

import torch

from benchmarks._driver import REPO_ROOT, environment_lines, finish
from benchmarks._hf_models import MoeShape, saved_once
from benchmarks._measure import bench_device, row_probe, rows_in_budget, timed_row_steps
from benchmarks._report import fmt_bytes

MARKERS = {
    "cpu": ("<!-- moe-long-rows:begin -->", "<!-- moe-long-rows:end -->"),
    "cuda": ("<!-- moe-long-rows-cuda:begin -->", "<!-- moe-long-rows-cuda:end -->"),
}
MIB = 1 << 20
SHAPE = MoeShape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, experts=8, top_k=2, expert_ffn=96, vocab=1024)
SMOKE = MoeShape(hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2, expert_ffn=48, vocab=256)


def hf_dir(bench_dir: Path, shape: MoeShape) -> Path:
    """The seeded HF Qwen3-MoE directory every probe loads (saved once per shape), positions for any row."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(**(shape.hf_config() | {"max_position_embeddings": 1 << 20}))
    path = bench_dir / f"moe_long_rows_h{shape.hidden}_l{shape.layers}_e{shape.experts}_v{shape.vocab}"
    return saved_once(path, lambda: AutoModelForCausalLM.from_config(config), save_original_format=False)


def probe(*, hf: str, ep: int, cp: int, seq: int, vocab: int, steps: int) -> dict[str, Any]:
    """This rank's part of ``steps`` timed full fine-tuning steps on rows of ``seq`` tokens (after a warm-up)."""
    from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
    from shardtune.losses.next_token import next_token_loss
    from shardtune.models import llama_from_hf_config
    from shardtune.models.context_parallel import context_group
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model

    device = bench_device()
    with torch.device("meta"):
        model = llama_from_hf_config(hf, dtype=torch.float32)
    shard_model(model, mesh=make_mesh(expert_parallel=ep, device=device.type), activation_checkpointing=True)
    load_hf_checkpoint(model, hf, device=device)
    model.init_buffers(device)
    model.train()
    group = context_group(cp, device=device.type) if cp > 1 else None
    loss_fn = next_token_loss(model, group=group, device=device)
    return timed_row_steps(model, loss_fn, cp=cp, vocab=vocab, seq=seq, steps=steps)


def _measure(a: argparse.Namespace, hf: Path, cp: int, seq: int) -> dict[str, Any] | None:
    """Tokens/s and per-rank peaks of one probe in fresh ranks; None when a rank failed (out of memory)."""
    kwargs = {"hf": str(hf), "ep": a.expert_parallel, "cp": cp, "seq": seq, "vocab": a.shape.vocab, "steps": a.steps}
    label = f"ep {a.expert_parallel} cp {cp}"
    result = row_probe(
        "benchmarks.moe_long_rows:probe", label=label, world=a.world, cp=cp, seq=seq, kwargs=kwargs,
        timeout_s=a.timeout, device=a.device,
    )  # fmt: skip
    if result is not None:
        print(f"  {label} seq {seq}: {result['tokens_s']:.0f} tokens/s, peak {fmt_bytes(max(result['peaks']))}")
    return result


def longest(a: argparse.Namespace, hf: Path, cp: int) -> dict[str, Any] | None:
    """The probe of the longest row from ``--start-seq`` doubling whose peak fits the budget (None: not even the
    first)."""
    budget = a.budget_mib * MIB
    probes = rows_in_budget(partial(_measure, a, hf, cp), start=a.start_seq, stop=a.max_seq, budget=budget)
    fits = [p for p in probes if max(p["peaks"]) <= budget]
    return fits[-1] if fits else None


def report(a: argparse.Namespace, results: dict[int, dict[str, Any] | None], load: tuple[float, float]) -> str:
    shape, ep = a.shape, a.expert_parallel
    lines = [
        f"### Long MoE rows: expert parallel {ep} with and without context parallel, "
        f"{fmt_bytes(a.budget_mib * MIB)} per rank ({a.device}, {a.world} ranks)",
        "",
        *environment_lines(
            " ".join(["python -m benchmarks.moe_long_rows", *a.argv]), load_avg=load, libraries=("transformers",)
        ),
        f"- Model: Qwen3-MoE, hidden {shape.hidden}, {shape.layers} layers (all sparse), {shape.heads} heads "
        f"({shape.kv_heads} kv), {shape.experts} experts of width {shape.expert_ffn}, top-{shape.top_k}, vocab "
        f"{shape.vocab}; fp32, full fine-tuning, activation checkpointing per layer, AdamW, the load-balancing "
        "loss of the whole rows; one row per rank (ep alone) or per cp group a step",
        "",
        "| layout | longest row (tokens) | tokens/s (all ranks) | peak per rank |",
        "|---|---:|---:|---|",
    ]
    names = {cp: f"ep {ep}" if cp == 1 else f"ep {ep} x cp {cp}" for cp in results}
    for cp, fit in results.items():
        if fit is None:
            lines.append(f"| {names[cp]} | — | — | — |")
            continue
        peaks = " / ".join(fmt_bytes(p) for p in fit["peaks"])
        lines.append(f"| {names[cp]} | {fit['seq']} | {fit['tokens_s']:.0f} | {peaks} |")
    alone = results.get(1)
    for cp, fit in results.items():
        if cp > 1 and fit and alone:
            lines += [
                "",
                f"{names[cp]} against {names[1]}: longest row {fit['seq'] / alone['seq']:.1f}x, tokens/s at each "
                f"one's longest row {fit['tokens_s'] / alone['tokens_s']:.2f}x.",
            ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_long_rows", description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--expert-parallel", type=int, default=2)
    p.add_argument("--context-parallel", default="2", help="comma list of cp degrees compared with cp 1")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--budget-mib", type=int, default=512, help="per-rank memory a step may use above its start")
    p.add_argument("--start-seq", type=int, default=1024)
    p.add_argument("--max-seq", type=int, default=1 << 20)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per probe")
    p.add_argument("--mmap-threshold", type=int, default=1 << 16, help="glibc MALLOC_MMAP_THRESHOLD_ of every rank")
    p.add_argument("--bench-dir", type=Path, default=REPO_ROOT / "bench_out")
    p.add_argument("--markdown", type=Path, default=REPO_ROOT / "BENCHMARKS.md")
    p.add_argument("--smoke", action="store_true", help="tiny shape, rows of 64 to 256 tokens, no BENCHMARKS.md")
    a = p.parse_args(argv)
    a.argv = sys.argv[1:] if argv is None else argv
    a.shape = SHAPE
    if a.smoke:
        a.shape, a.start_seq, a.max_seq, a.steps, a.timeout, a.markdown = SMOKE, 64, 256, 1, 300.0, None
    degrees = [int(c) for c in a.context_parallel.split(",") if c]
    if a.world % a.expert_parallel or any(cp < 2 or a.world % cp for cp in degrees):
        raise SystemExit(f"--expert-parallel and every --context-parallel (> 1) must divide --world {a.world}")
    a.bench_dir.mkdir(parents=True, exist_ok=True)
    if a.mmap_threshold and a.device == "cpu":  # freed large blocks leave RSS (see benchmarks.context_parallel)
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    hf = hf_dir(a.bench_dir, a.shape)
    load_before = os.getloadavg()[0]
    results = {cp: longest(a, hf, cp) for cp in [1, *degrees]}
    finish(report(a, results, (load_before, os.getloadavg()[0])), markdown=a.markdown, markers=MARKERS[a.device])
    return 0


if __name__ == "__main__":
    sys.exit(main())
