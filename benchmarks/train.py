"""Benchmark of one training step: shardtune against its peers, full, LoRA and QLoRA, fp32 and bf16.

    python -m benchmarks.train --shape both --dtypes fp32,bf16 --groups full --seq-lens 1024 --repeats 1 --steps 2
    python -m benchmarks.train --repeats 2      # the head-dominated shape, fp32, every kind, 1024 and 4096 tokens
    python -m benchmarks.train --smoke          # tiny model, short rows, 1 repeat, no BENCHMARKS.md

Shapes (``--shape``, :data:`benchmarks._train_step.SHAPES`, shared with ``benchmarks.profile_step``):
*head*-dominated (hidden 256, 4 layers, 128256-token vocabulary, 2 × 1024 tokens per rank) and *body*-dominated
(hidden 1024, 12 layers, 32000-token vocabulary, 1 × 1024 tokens per rank); each a seeded
``LlamaForCausalLM`` (untied head, fp32) written once with ``save_pretrained``, which every method
loads. ``--dtypes``: fp32 and bf16 rows; in bf16 every method builds or loads its model in bf16, so
parameters, gradients, AdamW state and compute are bf16 (no mixed-precision policy; the losses
upcast their logits to fp32). Groups are the kinds of fine-tuning (``full``, ``lora``, ``qlora``);
the methods:

* ``shardtune``: the model the recipes build (meta device, ``apply_lora`` for the adapters,
  ``quantize_base`` for QLoRA), ``shard_model`` with activation checkpointing, the base loaded
  by ``load_hf_checkpoint``, the recipes' ``next_token_loss`` (the chunked linear cross-entropy,
  gradients made in the forward: no full logits);
* ``transformers``: ``AutoModelForCausalLM.from_pretrained``; for LoRA peft's ``get_peft_model``;
  for QLoRA the same, then every adapted linear's base weight replaced by a torchao ``NF4Tensor``
  (bitsandbytes-free QLoRA); ``checkpoint_wrapper`` and ``fully_shard`` on each decoder layer,
  then ``fully_shard`` on the root; ``F.cross_entropy`` on the full logits;
* ``torchtune`` (full fine-tuning only, where torchtune 0.6.1 imports; else skipped with the reason):
  its ``full_finetune_distributed`` recipe's model, FSDP2 per layer + root, activation checkpointing
  and chunked cross-entropy (``CEWithChunkedOutputLoss``), as :mod:`benchmarks._torchtune_peer` builds it.

LoRA: rank 8, alpha 16, on every projection of attention and MLP. Each step is forward,
backward, ``AdamW.step()`` over the trainable parameters (shardtune: the recipes' ``optimizer.name=adamw``,
fused on CPU; the peers: torch's default AdamW, as their recipes build it) and ``zero_grad(set_to_none=True)``, on
seeded random tokens (the same for every method; each rank its own). Every run is fresh rank
processes: build and load, one untimed warm-up step (its loss, taken before any update, must
agree between the methods), then ``--steps`` timed steps, each measured by
:func:`benchmarks._measure.measure_step` (the first traced for the memory-over-time plots), then
on CPU one step under ``torch.profiler`` for the fraction of the matmul floor reached
(:mod:`benchmarks._step_profile`). Each repeat runs every case's methods back to back, their order
rotating between repeats. Results print as Markdown (every row against the best peer, then the
issue's targets) and, unless ``--no-markdown``/``--smoke``, replace the ``train`` section of
BENCHMARKS.md, with the plots in ``benchmarks/plots/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from benchmarks import _torchtune_peer
from benchmarks._driver import (
    Run,
    finish,
    parse_run_options,
    rotated,
    snapshot_sources,
    spawn_run,
)
from benchmarks._hf_models import Shape, llama_dir
from benchmarks._measure import bench_device
from benchmarks._train_report import (
    METHODS,
    TORCHTUNE,
    TrainOptions,
    case_label,
    methods_for,
    plot,
    report,
    rows_for,
    summarize,
)
from benchmarks._train_step import (
    DTYPES,
    SHAPES,
    Built,
    add_step_options,
    build_shardtune,
    build_transformers,
    measure_run,
)

MARKERS = {
    "cpu": ("<!-- train:begin -->", "<!-- train:end -->"),
    "cuda": ("<!-- train-cuda:begin -->", "<!-- train-cuda:end -->"),
}
GROUPS = ("full", "lora", "qlora")
PLOTS = Path("benchmarks") / "plots"  # next to the Markdown file the report goes to


# every LoRA target's NF4 scalers split evenly over 2 ranks (elements a multiple of 2 * 64 * 256)
SMOKE = Shape(hidden=256, layers=1, heads=4, kv_heads=4, ffn=256, vocab=512)
SMOKE_SHAPES = {"smoke": (SMOKE, 2, 32)}


# --------------------------------------------------------------------------- in the ranks


def run(*, group: str, method: str, hf: str, dtype: str, rows: int, seq: int, vocab: int, steps: int) -> dict[str, Any]:
    """One run on this rank: build, warm-up step, ``steps`` measured steps, on CPU one profiled step; its record."""
    device = bench_device()
    torch.manual_seed(0)
    torch_dtype = DTYPES[dtype]
    if method == "shardtune":
        built = build_shardtune(group, hf, device, dtype=torch_dtype)
    elif method == "transformers":
        built = build_transformers(group, hf, device, dtype=torch_dtype)
    else:
        built = Built(*_torchtune_peer.build(hf, device, dtype=torch_dtype))
    floor_dtype = torch_dtype if device.type == "cpu" else None
    return measure_run(built, device=device, rows=rows, seq=seq, vocab=vocab, steps=steps, floor_dtype=floor_dtype)


# --------------------------------------------------------------------------- main


def _add_options(p: argparse.ArgumentParser) -> None:
    add_step_options(p, seq_lens="1024,4096", steps=3, tokens_per_rank=None)
    p.add_argument(
        "--shape",
        choices=(*SHAPES, "both"),
        default="head",
        help="head: hidden 256, 4 layers, 128k vocabulary, 2 × 1024 tokens per rank; body: hidden 1024, 12 layers, "
        "32k vocabulary, 1 × 1024; both",
    )
    p.add_argument("--dtypes", default="fp32", help="comma list of " + ",".join(DTYPES) + " (params, compute, AdamW)")
    p.add_argument(
        "--from-runs",
        type=Path,
        nargs="+",
        default=(),
        help="render the report from the train_runs.json of earlier (possibly interrupted) runs, merged "
        "(e.g. 1024-token cases with more repeats than 4096-token ones); run nothing",
    )


def parse(argv: list[str] | None) -> TrainOptions:
    a, common = parse_run_options(
        argv,
        module="benchmarks.train",
        description=__doc__.split("\n")[0],
        groups=GROUPS,
        cold_help="(no effect: nothing is read during a step)",
        smoke_help="tiny model, 32/64-token rows, 1 repeat, 1 timed step, no BENCHMARKS.md (CI)",
        add_options=_add_options,
    )
    dtypes = tuple(d for d in a.dtypes.split(",") if d)
    if unknown := sorted(set(dtypes) - set(DTYPES)):
        raise SystemExit(f"--dtypes: unknown {unknown}; choose from {','.join(DTYPES)}")
    names = tuple(SHAPES) if a.shape == "both" else (a.shape,)
    return TrainOptions(
        **common,
        seq_lens=(32, 64) if a.smoke else tuple(int(s) for s in a.seq_lens.split(",") if s),
        tokens_per_rank=64 if a.smoke else a.tokens_per_rank,
        steps=1 if a.smoke else a.steps,
        device=a.device,
        shapes=SMOKE_SHAPES if a.smoke else {n: SHAPES[n] for n in names},
        dtypes=dtypes,
        from_runs=tuple(a.from_runs),
    )


def measure(cfg: TrainOptions, runs_path: Path, *, torchtune: bool) -> tuple[list[Run], tuple[float, float]]:
    """Every run, written to ``runs_path`` after each (an interrupted benchmark can still be
    reported with ``--from-runs``), and the load average before and after."""
    dirs = {name: llama_dir(cfg.bench_dir, shape) for name, (shape, _, _) in cfg.shapes.items()}
    root = snapshot_sources(cfg.bench_dir / "train_sources")
    load_before = os.getloadavg()[0]
    runs: list[Run] = []
    for repeat, (name, dtype, seq, group) in itertools.product(range(cfg.repeats), cfg.cases()):
        shape = cfg.shapes[name][0]
        for method in rotated(list(methods_for(group, torchtune=torchtune)), repeat):
            kwargs = {"group": group, "method": method, "hf": str(dirs[name]), "dtype": dtype, "seq": seq}
            kwargs |= {"rows": rows_for(seq, cfg.tokens_for(name)), "vocab": shape.vocab, "steps": cfg.steps}
            label = case_label(name, dtype, group, seq)
            runs.append(
                spawn_run("benchmarks.train:run", Run(label, method, repeat), cfg=cfg, kwargs=kwargs, root=root)
            )
            _save(runs_path, {"command": cfg.command, "load_avg": [load_before, os.getloadavg()[0]]}, runs)
    return runs, (load_before, os.getloadavg()[0])


def _save(path: Path, header: dict[str, Any], runs: list[Run]) -> None:
    """The runs so far with ``header``, to ``path`` (a stopped benchmark keeps the last whole file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**header, "runs": runs}, default=asdict, indent=1))
    tmp.replace(path)


def merge_saved_runs(paths: tuple[Path, ...]) -> tuple[list[Run], tuple[float, float], str]:
    """The runs of several saved benchmarks, the load average before the first and after the last,
    and their commands joined."""
    saved = [json.loads(p.read_text()) for p in paths]
    runs = [Run(**r) for s in saved for r in s["runs"]]
    load_avg = (saved[0]["load_avg"][0], saved[-1]["load_avg"][1])
    return runs, load_avg, "`, then `".join(s["command"] for s in saved)


def slow_bf16(cfg: TrainOptions) -> str | None:
    """Why bf16 rows cannot run on this CPU in reasonable time, or None (not asked for, a GPU, or bf16 GEMMs)."""
    if "bf16" not in cfg.dtypes or cfg.device != "cpu" or torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return (
        "--dtypes bf16: this CPU has no bf16 matrix instructions (torch.ops.mkldnn._is_mkldnn_bf16_supported() is "
        f"False; CPU capability {torch.backends.cpu.get_cpu_capability()}), so bf16 GEMMs fall back to a scalar "
        "loop some 200x slower than fp32 and one step takes hours: run bf16 rows with --device cuda or on a CPU "
        "with AVX512-BF16 or AMX, and --dtypes fp32 here"
    )


def _skipped(cfg: TrainOptions, runs: list[Run] | None) -> dict[str, str]:
    """Methods of the cases that do not run here, and why (``runs``: the saved runs of ``--from-runs``)."""
    if "full" not in cfg.groups:
        return {}
    if runs is not None:
        return {} if any(r.method == TORCHTUNE for r in runs) else {TORCHTUNE: "not in the saved runs"}
    why = _torchtune_peer.unavailable()
    return {} if why is None else {TORCHTUNE: why}


def _plots(cfg: TrainOptions, summaries: dict[tuple[str, str, str, int, str], Any]) -> dict[str, Path] | None:
    """One memory plot per shape, dtype and kind measured, or None where matplotlib does not import."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return None
    plot_dir = cfg.markdown.parent / PLOTS if cfg.markdown is not None else cfg.bench_dir / "train_plots"
    plots = {}
    for name in cfg.shapes:
        for dtype in cfg.dtypes:
            for group in cfg.groups:
                cases = {
                    seq: {k[-1]: v for k, v in summaries.items() if k[:-1] == (name, dtype, group, seq)}
                    for seq in cfg.seq_lens
                }
                cases = {seq: by_method for seq, by_method in cases.items() if by_method}
                if not cases:
                    continue
                title = f"{name}, {dtype}, {group}"
                suffix = "" if cfg.device == "cpu" else "_" + cfg.device
                plots[title] = plot_dir / f"train_memory_{name}_{dtype}_{group}{suffix}.png"
                plot(title, cases, plots[title])
    return plots


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or the stacks' losses disagree."""
    cfg = parse(argv)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    if cfg.from_runs:
        runs, load_avg, command = merge_saved_runs(cfg.from_runs)
        steps = next(len(r.ranks[0]["steps"]) for r in runs if r.ranks)
        cfg = dataclasses.replace(cfg, command=command, repeats=1 + max(r.repeat for r in runs), steps=steps)
        skipped = _skipped(cfg, runs)
    else:
        if slow := slow_bf16(cfg):
            raise SystemExit(slow)
        skipped = _skipped(cfg, None)
        runs, load_avg = measure(cfg, cfg.bench_dir / "train_runs.json", torchtune=TORCHTUNE not in skipped)
    summaries = {  # cases an interrupted benchmark did not reach are left out
        (name, dtype, group, seq, method): summarize(mine)
        for name, dtype, seq, group in cfg.cases()
        for method in (*METHODS, TORCHTUNE)
        if (mine := [r for r in runs if (r.group, r.method) == (case_label(name, dtype, group, seq), method)])
    }
    (cfg.bench_dir / "train_summary.json").write_text(
        json.dumps({"|".join(map(str, k)): v for k, v in summaries.items()}, default=str)
    )
    section, agree = report(cfg, summaries, load_avg=load_avg, plots=_plots(cfg, summaries), skipped=skipped)
    finish(section, markdown=cfg.markdown, markers=MARKERS[cfg.device])
    bad_verify = any(rk["verify"] != "ok" for r in runs for rk in r.ranks)
    return 0 if agree and not bad_verify and not any(r.error for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
