"""Benchmark of context parallel on linear-attention (Gated DeltaNet) layers: step time and memory against cp 1.

    python -m benchmarks.context_parallel_linear --world 2 --seq 2048 8192
    python -m benchmarks.context_parallel_linear --smoke     # tiny shape, one short row

On ``--world`` ranks, full fine-tuning steps (AdamW, fp32, FSDP2 over every rank, the recipes'
``next_token_loss``) of one seeded Qwen3.5-shaped stack of ``--layers`` Gated DeltaNet layers (no attention
layer, so the numbers are the linear layers'): at cp 1 each rank trains its own whole row (``world`` rows a
step), at cp N each group of N ranks splits one row (its layers trading tokens for heads with all-to-alls).
For every row length the table gives tokens/s (all ranks, median of ``--steps`` timed steps after one
warm-up), the step time and the peak per rank (anonymous RSS above the step start on CPU, with glibc's mmap
threshold fixed at 64 KiB as in :mod:`benchmarks.context_parallel`; the allocator's peak on CUDA). Each probe
runs in fresh rank processes. It prints the table; nothing is written.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from benchmarks._driver import environment_lines
from benchmarks._measure import bench_device, row_probe, timed_row_steps
from benchmarks._report import fmt_bytes


def _config(a: dict[str, Any]) -> dict[str, Any]:
    """transformers' ``qwen3_5_text`` config of the benchmarked stack."""
    return {
        "model_type": "qwen3_5_text",
        "vocab_size": a["vocab"],
        "hidden_size": a["hidden"],
        "intermediate_size": 3 * a["hidden"],
        "num_hidden_layers": a["layers"],
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "layer_types": ["linear_attention"] * a["layers"],
        "linear_num_key_heads": a["key_heads"],
        "linear_num_value_heads": 2 * a["key_heads"],
        "linear_key_head_dim": a["head_dim"],
        "linear_value_head_dim": a["head_dim"],
        "max_position_embeddings": 1 << 20,
    }


def probe(*, shape: dict[str, Any], cp: int, seq: int, steps: int) -> dict[str, Any]:
    """This rank's median step time and peak over ``steps`` timed steps on rows of ``seq`` tokens."""
    from shardtune.losses.next_token import next_token_loss
    from shardtune.models import from_hf_config
    from shardtune.models.context_parallel import context_group
    from shardtune.ranks.mesh import make_mesh
    from shardtune.ranks.sharding import shard_model

    device = bench_device()
    torch.manual_seed(0)  # every rank builds the same weights
    model = from_hf_config(_config(shape)).to(device).train()
    shard_model(model, mesh=make_mesh())
    group = context_group(cp, device=device.type) if cp > 1 else None
    loss_fn = next_token_loss(model, group=group, device=device)
    return timed_row_steps(model, loss_fn, cp=cp, vocab=shape["vocab"], seq=seq, steps=steps)


def measure(a: argparse.Namespace, shape: dict[str, Any], cp: int, seq: int) -> dict[str, Any] | None:
    """One probe in fresh ranks; None when a rank failed."""
    kwargs = {"shape": shape, "cp": cp, "seq": seq, "steps": a.steps}
    result = row_probe(
        "benchmarks.context_parallel_linear:probe", label=f"cp {cp}", world=a.world, cp=cp, seq=seq, kwargs=kwargs,
        timeout_s=a.timeout, device=a.device,
    )  # fmt: skip
    if result is not None:
        result["peak"] = max(result["peaks"])
        print(
            f"  cp {cp} seq {seq}: {result['tokens_s']:.0f} tokens/s, peak {fmt_bytes(result['peak'])}", file=sys.stderr
        )
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.context_parallel_linear", description=__doc__.splitlines()[0]
    )
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--key-heads", type=int, default=4, help="linear key heads (value heads: twice as many)")
    p.add_argument("--head-dim", type=int, default=64, help="linear key and value head dim")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per probe")
    p.add_argument("--smoke", action="store_true", help="tiny shape, one row of 256 tokens, one step")
    a = p.parse_args(argv)
    argv_text = " ".join(sys.argv[1:] if argv is None else argv)
    if a.smoke:
        a.hidden, a.layers, a.key_heads, a.head_dim, a.vocab, a.seq, a.steps = 64, 1, 2, 16, 128, [256], 1
    shape = {"hidden": a.hidden, "layers": a.layers, "key_heads": a.key_heads, "head_dim": a.head_dim, "vocab": a.vocab}
    # as benchmarks.context_parallel: freed large blocks go back to the kernel, so RSS peaks are the step's
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
    degrees = [cp for cp in (1, 2, 4) if cp <= a.world and a.world % cp == 0 and a.key_heads % cp == 0]
    load_before = os.getloadavg()[0]
    results = {(seq, cp): measure(a, shape, cp, seq) for seq in a.seq for cp in degrees}
    lines = [
        f"### Context parallel on Gated DeltaNet layers ({a.device}, {a.world} ranks)",
        "",
        *environment_lines(
            f"python -m benchmarks.context_parallel_linear {argv_text}".strip(),
            load_avg=(load_before, os.getloadavg()[0]),
            libraries=(),
        ),
        f"- Model: {a.layers} Gated DeltaNet layers, hidden {a.hidden}, {a.key_heads} key / {2 * a.key_heads} value "
        f"heads of {a.head_dim}, vocab {a.vocab}, fp32, full fine-tuning, AdamW; cp 1: a row per rank, cp N: a row "
        "per N ranks",
        "",
        "| row (tokens) | cp | tokens/s (all ranks) | step (s) | peak per rank |",
        "|---:|---:|---:|---:|---:|",
    ]
    for (seq, cp), r in results.items():
        cells = ("—", "—", "—") if r is None else (f"{r['tokens_s']:.0f}", f"{r['seconds']:.2f}", fmt_bytes(r["peak"]))
        lines.append(f"| {seq} | {cp} | {' | '.join(cells)} |")
    print("\n".join(lines))
    return 0 if all(r is not None for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
