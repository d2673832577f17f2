"""Benchmark of shardtune's HF checkpoint I/O and resume against torch DSD/DCP and torchtune.

    python -m benchmarks.checkpoint --size {tiny,250m,1b} --world 2 --repeats 3 [--cold]
    python -m benchmarks.checkpoint --smoke          # tiny, 1 repeat, no BENCHMARKS.md
    python -m benchmarks.checkpoint --device cuda --world 1 --size 1b   # on GPUs (NCCL), own section

Groups and methods (each run = fresh processes; methods interleaved, their order rotated by
one each repeat):

* ``load``: HF checkpoint directory -> meta FSDP2 ``LlamaForCausalLM``. ``shardtune_direct``
  (``load_hf_checkpoint(shared_filesystem=True)``: every rank reads its own rows),
  ``shardtune_rank0`` (``shared_filesystem=False``: rank 0 reads and sends each rank its rows),
  ``dsd_broadcast`` (rank 0 ``load_file``, ``set_model_state_dict(broadcast_from_rank0)``),
  ``torchtune_distribute`` (torchtune 0.6.1: every rank ``load_file``, ``distribute_tensor``
  per param, ``load_state_dict(assign=True)``), ``dcp_hf_reader`` (``to_empty`` +
  ``dcp.load(model.state_dict(), HuggingFaceStorageReader)``).
* ``save``: materialized sharded model -> HF directory. ``shardtune`` (``save_hf_checkpoint``:
  every rank writes its rows, ``O_DIRECT``), ``shardtune_rank0`` (``shared_filesystem=False``:
  rank 0 gathers each tensor into a reused ring while a thread writes the previous ones) vs
  ``dsd`` (``get_model_state_dict(full_state_dict, cpu_offload)`` + ``safetensors.torch.save_file``
  on rank 0); both fsync their files. Background saves: ``shardtune_async``
  (``save_hf_checkpoint(..., sink=StagedSink())``) vs ``dcp_async`` (``dcp.async_save``), timed up
  to the point training could go on; the writing half is recorded apart. ``*_2nd``: the second
  background save of a process, into the memory the first one kept (untimed setup).
* ``resume``: model + AdamW state into a fresh meta model and fresh optimizer. ``shardtune``
  (``Checkpointer.resume()``) vs ``dsd`` (``to_empty``, ``get_state_dict``, ``dcp.load``,
  ``set_state_dict``); both checkpoints are written once, untimed, from the same state.

Results print as Markdown tables and, unless ``--no-markdown``/``--smoke``, replace the
``checkpoint`` section of BENCHMARKS.md at the repo root (other sections are kept). With
``--device cuda`` every rank holds its model on its own GPU (NCCL alone, one GPU per rank, so
``--world`` at most the GPU count), the CUDA peak above the pre-step allocation is recorded
too, and the results replace the ``checkpoint-cuda`` section instead.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks._checkpoint_report import Config, Group, render_group, render_report, render_targets, summarize
from benchmarks._checkpoint_steps import STEPS, hf_storage_reader
from benchmarks._driver import (
    Run,
    failed,
    files_under,
    finish,
    parse_run_options,
    progress,
    rotated,
    set_page_cache,
    sources_fingerprint,
    try_spawn,
    write_runs,
)
from benchmarks._fixtures import HF_WEIGHTS, hf_checkpoint_dir
from benchmarks._measure import spawn_ranks
from benchmarks._report import GIB, model_bytes

MARKERS = {
    "cpu": ("<!-- checkpoint:begin -->", "<!-- checkpoint:end -->"),
    "cuda": ("<!-- checkpoint-cuda:begin -->", "<!-- checkpoint-cuda:end -->"),
}
RESUME_MEMORY_LIMIT = 18 << 30  # all processes together


# --------------------------------------------------------------------------- setup


def parse_args(argv: list[str] | None = None) -> Config:
    """Parse the command line into a :class:`Config`."""
    a, common = parse_run_options(
        argv,
        module="benchmarks.checkpoint",
        description=__doc__.split("\n")[0],
        groups=STEPS,
        cold_help="posix_fadvise(DONTNEED) the files a run reads before it",
        smoke_help="tiny, 1 repeat, no BENCHMARKS.md (CI)",
        add_options=_add_options,
    )
    if a.device == "cuda" and a.world > torch.cuda.device_count():
        raise SystemExit(
            f"--device cuda --world {a.world}: this machine has {torch.cuda.device_count()} GPUs "
            "(one per rank); lower --world"
        )
    return Config(**common, load_rounds=1 if a.smoke else a.load_rounds, device=a.device)


def _add_options(p: Any) -> None:
    p.add_argument(
        "--load-rounds",
        type=int,
        default=2,
        help="times the load group runs in each repeat (its ~1 s runs swing most with the machine's slow spells)",
    )
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the ranks hold the model: cpu (gloo) or cuda (NCCL, one GPU per rank)",
    )


def resume_size(size: str) -> str:
    """Size for ``resume``: setup holds params + grads + 2 AdamW states (4x model, all ranks)."""
    return size if 4 * model_bytes(size) + (2 << 30) <= RESUME_MEMORY_LIMIT else "250m"


def shardtune_fingerprint() -> str:
    """Short sha256 of the shardtune sources the benchmark exercises, to detect edits mid-run."""
    return sources_fingerprint(("ranks", "state_dict", "checkpoint"))


def prepare(cfg: Config) -> tuple[dict[str, Group], list[str]]:
    """Fixture files per group, the resume checkpoints (untimed), and notes."""
    groups, notes = {}, []
    for group in cfg.groups:
        size = resume_size(cfg.size) if group == "resume" else cfg.size
        if size != cfg.size:
            notes.append(
                f"resume runs at {size}: at {cfg.size} params + grads + 2 AdamW states would need "
                f"~{(4 * model_bytes(cfg.size) + (2 << 30)) / GIB:.0f} GiB > {RESUME_MEMORY_LIMIT / GIB:.0f} GiB"
            )
        hf = hf_checkpoint_dir(cfg.bench_dir, size)
        paths = {"hf_dir": str(hf)}
        reads: dict[str, list[Path]] = {}
        if group == "load":
            reads = {m: [hf / HF_WEIGHTS] for m in STEPS[group]}
        elif group == "save":
            for m in STEPS[group]:
                paths[f"out_dir:{m}"] = str(cfg.bench_dir / f"save_{size}_{m}")
            reads = {m: [hf / HF_WEIGHTS] for m in STEPS[group]}  # read by the untimed setup only
        else:
            root = cfg.bench_dir / f"resume_{size}"
            paths |= {"resume_dir": str(root / "shardtune"), "dcp_dir": str(root / "dcp")}
            notes += setup_resume(cfg, size, paths)
            reads = {"shardtune": files_under(root / "shardtune"), "dsd": files_under(root / "dcp")}
        groups[group] = Group(size=size, paths=paths, reads=reads)
    return groups, notes


def setup_resume(cfg: Config, size: str, paths: dict[str, str]) -> list[str]:
    """Write both resume checkpoints from one stepped state (untimed); notes on what happened."""
    shutil.rmtree(Path(paths["resume_dir"]).parent, ignore_errors=True)
    start = time.perf_counter()
    ranks = spawn_ranks(
        "benchmarks._checkpoint_steps:setup_resume",
        world=cfg.world,
        kwargs={"size": size, "paths": paths},
        timeout_s=cfg.timeout_s,
        device=cfg.device,
    )
    bad = [f"r{r['rank']}: {r['verify']}" for r in ranks if r["verify"] != "ok"]
    print(
        f"resume setup ({size}): {time.perf_counter() - start:.1f} s, Checkpointer.save "
        f"{max(r['checkpointer_save_s'] for r in ranks):.2f} s, dcp.save {max(r['dcp_save_s'] for r in ranks):.2f} s",
        file=sys.stderr,
    )
    if bad:
        return [f"resume setup: shardtune's saved checkpoint differs from the live state ({'; '.join(bad)})"]
    return []


# --------------------------------------------------------------------------- running


def rounds_per_repeat(cfg: Config, group: str) -> int:
    return cfg.load_rounds if group == "load" else 1


def run_all(cfg: Config, groups: dict[str, Group]) -> list[Run]:
    """Every (group, method) once per round, ``rounds_per_repeat`` rounds of each group per
    repeat, groups interleaved, methods rotated each round (A B C, B C A, ...), in fresh processes."""
    runs = []
    done = dict.fromkeys(cfg.groups, 0)
    for _ in range(cfg.repeats):
        for group in cfg.groups:
            for _ in range(rounds_per_repeat(cfg, group)):
                runs += _run_round(cfg, groups[group], group, done[group])
                done[group] += 1
    return runs


def _run_round(cfg: Config, g: Group, group: str, index: int) -> list[Run]:
    """Round ``index`` of ``group``: each method once, in fresh processes, the order rotated by ``index``."""
    runs = []
    total = cfg.repeats * rounds_per_repeat(cfg, group)
    for method in rotated(list(STEPS[group]), index):
        run = Run(group, method, index)
        if group == "load" and method == "dcp_hf_reader" and hf_storage_reader() is None:
            run.error = "unavailable: torch.distributed.checkpoint has no HuggingFaceStorageReader"
            runs.append(run)
            continue
        paths = dict(g.paths)
        if group == "save":
            paths["out_dir"] = paths[f"out_dir:{method}"]
            shutil.rmtree(paths["out_dir"], ignore_errors=True)
        set_page_cache(g.reads[method], cold=cfg.cold and group != "save")
        os.sync()  # no dirty pages of earlier runs (or other work) left to write back during this one
        kwargs = {"group": group, "method": method, "size": g.size, "paths": paths}
        run.ranks, run.error = try_spawn(
            "benchmarks._checkpoint_steps:run",
            world=cfg.world,
            kwargs=kwargs,
            timeout_s=cfg.timeout_s,
            device=cfg.device,
        )
        progress(run, total=total)
        runs.append(run)
    return runs


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or a verification did not pass."""
    cfg = parse_args(argv)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    fingerprint_before, load_before = shardtune_fingerprint(), os.getloadavg()[0]
    groups, notes = prepare(cfg)
    runs = run_all(cfg, groups)
    load_avg, fingerprint = (load_before, os.getloadavg()[0]), shardtune_fingerprint()
    if fingerprint != fingerprint_before:
        notes.append(f"shardtune sources changed during the run ({fingerprint_before} -> {fingerprint}): rerun")
    write_runs(cfg.bench_dir / f"checkpoint_{cfg.size}_runs.json", runs)
    tables, rows = [], {}
    for group in cfg.groups:
        group_rows = []
        for method in STEPS[group]:
            mine = [r for r in runs if (r.group, r.method) == (group, method)]
            row = summarize(group, method, mine, groups[group].size, cfg.world)
            rows[(group, method)] = row
            group_rows.append(row)
            notes += [
                f"{group}/{method} failed: ```{e.strip()[-1500:]}```"
                for e in row["errors"][:1]
                if not e.startswith("unavailable")
            ]
        tables.append(render_group(group, group_rows))
    section = render_report(
        cfg, groups, tables, render_targets(rows), notes, load_avg=load_avg, fingerprint=fingerprint
    )
    finish(section, markdown=cfg.markdown, markers=MARKERS[cfg.device])
    return 1 if failed(runs, ignore=lambda error: error.startswith("unavailable")) else 0


if __name__ == "__main__":
    raise SystemExit(main())
