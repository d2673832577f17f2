"""Benchmark of ``stream_weights`` against ``full_tensor()`` of every tensor (TRL's weight sync).

    python -m benchmarks.stream_weights --repeats 3            # ~0.5B Qwen2.5-shaped, bf16, 2 ranks
    python -m benchmarks.stream_weights --smoke                # tiny, 1 repeat, no BENCHMARKS.md

Each repeat is fresh rank processes per group that load the model once (bf16, FSDP2 over the
ranks; LoRA on every projection for ``lora``), then time each method once, in an order rotated
by one each repeat, the consumer dropping each tensor as it comes (an engine would copy it):

* ``full_tensor``: ``for name, p in model.state_dict().items(): p.full_tensor()``, every rank
  gathering every tensor, one collective per tensor (``full`` only: it cannot merge LoRA);
* ``stream_all``: ``stream_weights(model, to="all")``, every rank receiving every tensor;
* ``stream_rank0``: ``stream_weights(model, to="rank0")``, rank 0 alone receiving.

Per method: the slowest rank's time, each rank's peak anonymous memory above its level before the
method (:func:`benchmarks._measure.measure_step`), bytes each rank sent, and the tensors and
bytes a receiving rank got. Results print as a Markdown table and, unless
``--no-markdown``/``--smoke``, replace the ``stream-weights`` section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from benchmarks._driver import REPO_ROOT, Run, environment_lines, finish, progress, rotated, try_spawn
from benchmarks._hf_models import HALF_B, TINY, Shape, llama_dir
from benchmarks._measure import bench_device, measure_step
from benchmarks._report import fmt_bytes, fmt_ranks
from benchmarks._train_step import build_shardtune

MARKERS = ("<!-- stream-weights:begin -->", "<!-- stream-weights:end -->")
SMOKE = TINY
METHODS = {"full": ("full_tensor", "stream_all", "stream_rank0"), "lora": ("stream_all", "stream_rank0")}


def run(*, hf: str, group: str, methods: list[str], bucket_bytes: int) -> dict[str, Any]:
    """On this rank: load the model once, then measure each of ``methods`` once, in order."""
    from shardtune.state_dict import stats

    device = bench_device()
    torch.manual_seed(0)
    model = build_shardtune(group, hf, device, dtype=torch.bfloat16, activation_checkpointing=False).model
    out: dict[str, Any] = {}
    for method in methods:
        stats.reset()
        got, measurement = measure_step(lambda m=method: _METHODS[m](model, bucket_bytes), barrier=dist.barrier)
        count, nbytes, sent = got
        out[method] = {
            "measurement": measurement.to_json(),
            "tensors": count,
            "bytes": nbytes,
            "sent": stats.bytes_sent if sent is None else sent,
        }
    return out


def _full_tensor(model: torch.nn.Module, bucket_bytes: int) -> tuple[int, int, int]:
    """Every tensor gathered on every rank; sent: this rank's shards, to each other rank (all-gather)."""
    count = nbytes = sent = 0
    for tensor in model.state_dict().values():
        if isinstance(tensor, DTensor):
            sent += tensor.to_local().nbytes * (dist.get_world_size() - 1)
            tensor = tensor.full_tensor()
        count, nbytes = count + 1, nbytes + tensor.nbytes
        del tensor
    return count, nbytes, sent


def _stream(to: str):
    def method(model: torch.nn.Module, bucket_bytes: int) -> tuple[int, int, None]:
        from shardtune.checkpoint import stream_weights

        count = nbytes = 0
        with stream_weights(model, to=to, bucket_bytes=bucket_bytes) as stream:
            for _, tensor in stream:
                count, nbytes = count + 1, nbytes + tensor.nbytes
        return count, nbytes, None  # sent: counted by shardtune.state_dict.stats

    return method


_METHODS = {"full_tensor": _full_tensor, "stream_all": _stream("all"), "stream_rank0": _stream("rank0")}


# --------------------------------------------------------------------------- driver


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stream_weights", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--groups", default="full,lora", help="comma list of full,lora")
    p.add_argument("--bucket-mb", type=int, default=64)
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 repeat, no BENCHMARKS.md")
    p.add_argument("--bench-dir", type=Path, default=REPO_ROOT / "bench_out")
    p.add_argument("--markdown", type=Path, default=REPO_ROOT / "BENCHMARKS.md")
    p.add_argument("--no-markdown", action="store_true")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per group run")
    a = p.parse_args(argv)
    groups = [g for g in a.groups.split(",") if g]
    if unknown := set(groups) - set(METHODS):
        p.error(f"unknown groups {sorted(unknown)}")
    shape, repeats = (SMOKE, 1) if a.smoke else (HALF_B, a.repeats)
    bucket_bytes = (64 << 10) if a.smoke else a.bucket_mb << 20
    a.bench_dir.mkdir(parents=True, exist_ok=True)
    hf = str(llama_dir(a.bench_dir, shape))
    load_before = os.getloadavg()[0]
    runs: list[Run] = []
    for repeat in range(repeats):
        for group in groups:
            methods = rotated(list(METHODS[group]), repeat)
            ranks, error = try_spawn(
                "benchmarks.stream_weights:run",
                world=a.world,
                kwargs={"hf": hf, "group": group, "methods": methods, "bucket_bytes": bucket_bytes},
                timeout_s=120.0 if a.smoke else a.timeout,
            )
            for method in methods:
                one = Run(group, method, repeat, [{**r[method], "verify": "ok"} for r in ranks], error)
                runs.append(one)
                progress(one, total=repeats)
    command = "python -m benchmarks.stream_weights " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = environment_lines(command, load_avg=(load_before, os.getloadavg()[0]), libraries=("transformers",))
    section = "\n".join([*lines, "", *report(runs, shape=shape, bucket_bytes=bucket_bytes, world=a.world)])
    finish(section, markdown=None if (a.smoke or a.no_markdown) else a.markdown, markers=MARKERS)
    if any(r.error for r in runs):
        raise SystemExit(1)


def report(runs: list[Run], *, shape: Shape, bucket_bytes: int, world: int) -> list[str]:
    """The Markdown table: per group and method, medians over the repeats."""
    lines = [
        f"Model: Llama-shaped hidden {shape.hidden}, {shape.layers} layers, vocab {shape.vocab} "
        f"({shape.params() / 1e9:.2f}B parameters, bf16), FSDP2 over {world} CPU ranks; buckets of "
        f"{fmt_bytes(bucket_bytes)}. Time: the slowest rank; peak: anonymous memory above the level "
        "before the method, per rank; received: tensors and bytes on a receiving rank.",
        "",
        "| group | method | seconds | peak per rank | sent per rank | received |",
        "| --- | --- | ---: | --- | --- | --- |",
    ]
    for group, method in dict.fromkeys((r.group, r.method) for r in runs):
        done = [r for r in runs if (r.group, r.method) == (group, method) and not r.error]
        if not done:
            lines.append(f"| {group} | {method} | failed | | | |")
            continue
        seconds = statistics.median(max(rk["measurement"]["seconds"] for rk in r.ranks) for r in done)
        peaks = [statistics.median(r.ranks[i]["measurement"]["peak_anon_delta"] for r in done) for i in range(world)]
        sent = [statistics.median(r.ranks[i]["sent"] for r in done) for i in range(world)]
        r0 = done[0].ranks[0]
        lines.append(
            f"| {group} | `{method}` | {seconds:.2f} | {fmt_ranks(peaks)} | {fmt_ranks(sent)} | "
            f"{r0['tensors']} tensors, {fmt_bytes(r0['bytes'])} |"
        )
    return lines


if __name__ == "__main__":
    main()
