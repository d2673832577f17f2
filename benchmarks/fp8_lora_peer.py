"""Benchmark of a LoRA step over a block-FP8 checkpoint: shardtune against transformers + peft + FSDP2.

    python -m benchmarks.fp8_lora_peer --repeats 2
    python -m benchmarks.fp8_lora_peer --smoke        # tiny shape, 1 repeat, 1 step, no BENCHMARKS.md

The checkpoint, its shapes and the shardtune methods are :mod:`benchmarks.fp8_lora`'s (``fp8_base``: the
bases kept in FP8; ``bf16_base``: the same checkpoint loaded dequantized into bf16). The peer,
``transformers_peft``: ``from_pretrained`` of the same directory in bf16 (without a GPU transformers
dequantizes the block-FP8 weights on load), peft's LoRA (rank 8, alpha 16, no dropout) on
:data:`PEER_TARGETS`, the modules shardtune's Llama target names reach in DeepSeek-V3 (``q_proj`` ->
``q_b_proj``, ``k_proj``/``v_proj`` -> ``kv_b_proj``, ``o_proj``, the dense and shared MLPs'
projections; peft's transformers-4 renaming of MoE targets is turned off for this, since it would move
``gate_proj``/``up_proj``/``down_proj`` onto the routed experts; the trainable parameter counts are
checked equal), its experts by ``grouped_mm`` (as
``benchmarks.train_moe``'s peer), then ``checkpoint_wrapper`` and FSDP2
``fully_shard`` per decoder layer and on the root (:func:`benchmarks._train_step.build_transformers`),
its loss on the full logits, torch's AdamW. Every method is a fresh 2-rank run on the same tokens;
first losses agree within :data:`LOSS_RTOL`. Reported per method: parameters per rank, step peak RSS,
its peak above the step's start and tokens/s, and each as a ratio to the peer's. The section goes
between the ``fp8-lora-peer`` markers of BENCHMARKS.md.
"""

from __future__ import annotations

import os
import sys
from typing import Any
from unittest import mock

import torch

from benchmarks import _fp8_lora_steps as fp8_lora
from benchmarks._driver import finish
from benchmarks._train_step import build_transformers

MARKERS = ("<!-- fp8-lora-peer:begin -->", "<!-- fp8-lora-peer:end -->")
PEER = "transformers_peft"
METHODS = (*fp8_lora.METHODS, PEER)
PEER_TARGETS = ("q_b_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LOSS_RTOL = 1e-2  # bf16 through two stacks' kernels (fp8_lora's own methods agree within 1e-3)


def run(*, method: str, hf: str, rows: int, seq: int, vocab: int, steps: int) -> dict[str, Any]:
    """One rank's record of one method (:func:`benchmarks.fp8_lora.measured`'s)."""
    from benchmarks._measure import bench_device

    if method != PEER:
        return fp8_lora.run(method=method, hf=hf, rows=rows, seq=seq, vocab=vocab, steps=steps)
    import peft.utils.transformers_weight_conversion as v4_names

    device = bench_device()
    # peft rewrites gate_proj/up_proj/down_proj targets of a transformers-5 DeepSeek-V3 to its fused routed
    # experts' parameters (for adapters trained under transformers 4), dropping the dense and shared MLPs
    # these names mean here; without the rewrite peft adapts the very modules shardtune does
    with mock.patch.object(v4_names, "convert_peft_config_for_transformers", lambda *args, **kwargs: None):
        built = build_transformers(
            "lora", hf, device, dtype=torch.bfloat16, targets=PEER_TARGETS, experts_implementation="grouped_mm"
        )
    return fp8_lora.measured(built, device=device, rows=rows, seq=seq, vocab=vocab, steps=steps)


def _section(cfg, rows: dict[str, dict[str, float]], losses: dict[str, float], config, load_avg) -> str:
    mib = 1 << 20
    peer = rows[PEER]
    lora = f"LoRA rank 8 on {', '.join(PEER_TARGETS)}; "
    lines = [
        *fp8_lora.section_head("shardtune vs transformers + peft + FSDP2", cfg, config, losses, load_avg, lora=lora),
        "| method | params / rank (MiB) | step peak RSS (MiB) | above step start (MiB) | tokens/s "
        "| peak / peer's | above start / peer's | tokens/s / peer's |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, r in rows.items():
        lines.append(
            f"| {method} | {r['params'] / mib:.1f} | {r['peak'] / mib:.1f} | {r['delta'] / mib:.1f} | "
            f"{r['tokens_s']:.0f} | {r['peak'] / peer['peak']:.2f} | {r['delta'] / peer['delta']:.2f} | "
            f"{r['tokens_s'] / peer['tokens_s']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    cfg = fp8_lora.parse(argv)
    cfg.command = cfg.command.replace("benchmarks.fp8_lora ", "benchmarks.fp8_lora_peer ", 1)
    config = fp8_lora.SMOKE if cfg.smoke else fp8_lora.BENCH
    block = fp8_lora.SMOKE_BLOCK if cfg.smoke else fp8_lora.BLOCK
    hf = fp8_lora.fp8_dir(cfg.bench_dir.resolve(), config, block)
    kwargs = {"hf": str(hf), "rows": cfg.rows, "seq": cfg.seq, "vocab": config["vocab_size"], "steps": cfg.steps}
    load_before = os.getloadavg()[0]
    records = fp8_lora.run_methods("benchmarks.fp8_lora_peer:run", list(METHODS), cfg, kwargs)
    if records is None:
        return 1
    if any(r["verify"] != "ok" for reps in records.values() for ranks in reps for r in ranks):
        return 1
    losses = {m: records[m][0][0]["first_loss"] for m in METHODS}
    if any(abs(loss - losses[PEER]) > LOSS_RTOL * abs(losses[PEER]) for loss in losses.values()):
        print(f"the methods' first losses differ: {losses}", file=sys.stderr)
        return 1
    trainable = {m: sum(r["trainable_params"] for r in records[m][0]) for m in METHODS}
    if len(set(trainable.values())) != 1:
        print(f"trainable parameters differ (LoRA on different modules): {trainable}", file=sys.stderr)
        return 1
    rows = {m: fp8_lora.summary_row(m, records[m]) for m in METHODS}
    markdown = None if cfg.no_markdown else cfg.markdown
    section = _section(cfg, rows, losses, config, (load_before, os.getloadavg()[0]))
    finish(section, markdown=markdown, markers=MARKERS)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
