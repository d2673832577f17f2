"""Benchmark of a LoRA step over a block-FP8 checkpoint: the base kept in FP8 against the base loaded in bf16.

    python -m benchmarks.fp8_lora --repeats 3
    python -m benchmarks.fp8_lora --smoke        # tiny shape, 1 repeat, 1 step, no BENCHMARKS.md

The checkpoint: a DeepSeek-V3-shaped model scaled to the machine (:data:`BENCH`: hidden 1024, 6 layers of
latent attention, the first dense, then 8 routed experts of 512 + 1 shared, 32000-token vocabulary;
``--smoke``: :data:`SMOKE`, hidden 64) written once by transformers (seeded), then every linear weight but the
router and ``lm_head`` quantized to DeepSeek-V3's block FP8 (128 x 128 blocks; ``--smoke`` 16 x 16,
``quantization_config`` in ``config.json``). LoRA (rank 8, alpha 16) on every projection by its Llama name
(the latent attention's ``q_a_proj``/``q_b_proj``/``kv_a_proj_with_mqa``/``kv_b_proj``/``o_proj``, the dense
and shared MLPs' projections); the routed experts are not LoRA targets: with ``block_fp8`` they stay in FP8
too (frozen, dequantized per layer inside an activation checkpoint), in bf16 otherwise. Methods, each a fresh 2-rank run (gloo; NCCL with
``--device cuda``) of :func:`benchmarks._train_step.build_shardtune` and
:func:`benchmarks._train_step.measure_run` (bf16 params and compute, activation checkpointing, the recipes'
loss and AdamW):

* ``fp8_base``: ``lora.quantize_base: block_fp8``: the bases and the routed experts stay FP8 (+ float32 row
  scales), dequantized per layer in forward and backward;
* ``bf16_base``: the same checkpoint loaded dequantized into bf16 bases (plain LoRA).

Both compute with the same bf16 weights, so their first losses agree (checked). Reported per method: the
bytes of each rank's parameters (the resident model) and of its routed experts among them, the step's peak RSS and its peak above the step's
start, and tokens/s. The section goes between the ``fp8-lora`` markers of BENCHMARKS.md.
"""

from __future__ import annotations

import os
import sys

from benchmarks._driver import finish
from benchmarks._fp8_lora_steps import (
    BENCH,
    BLOCK,
    LOSS_RTOL,
    MARKERS,
    METHODS,
    SMOKE,
    SMOKE_BLOCK,
    fp8_dir,
    fp8_lora_section,
    parse,
    run_methods,
    summary_row,
)

__all__ = ["SMOKE", "SMOKE_BLOCK", "fp8_dir", "main", "parse"]


def main(argv: list[str] | None = None) -> int:
    cfg = parse(argv)
    config = SMOKE if cfg.smoke else BENCH
    hf = fp8_dir(cfg.bench_dir.resolve(), config, SMOKE_BLOCK if cfg.smoke else BLOCK)
    kwargs = {"hf": str(hf), "rows": cfg.rows, "seq": cfg.seq, "vocab": config["vocab_size"], "steps": cfg.steps}
    load_before = os.getloadavg()[0]
    records = run_methods("benchmarks._fp8_lora_steps:run", list(METHODS), cfg, kwargs)
    if records is None:
        return 1
    losses = {m: records[m][0][0]["first_loss"] for m in METHODS}
    if abs(losses["fp8_base"] - losses["bf16_base"]) > LOSS_RTOL * abs(losses["bf16_base"]):
        print(f"the methods' first losses differ: {losses}", file=sys.stderr)
        return 1
    if any(r["verify"] != "ok" for reps in records.values() for ranks in reps for r in ranks):
        return 1
    held = {m: sum(r["fp8_bytes"] for r in records[m][0]) for m in METHODS}
    if not held["fp8_base"] or held["bf16_base"]:
        print(f"FP8 bytes held: {held}; only fp8_base holds its bases in FP8", file=sys.stderr)
        return 1
    rows = {m: summary_row(m, records[m]) for m in METHODS}
    markdown = None if cfg.no_markdown else cfg.markdown
    text = fp8_lora_section(cfg, rows, losses, config, (load_before, os.getloadavg()[0]))
    finish(text, markdown=markdown, markers=MARKERS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
