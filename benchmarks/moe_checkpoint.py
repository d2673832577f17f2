"""Benchmark of HF checkpoint load and save of a mixture-of-experts model with thousands of expert tensors.

    python -m benchmarks.moe_checkpoint --repeats 3
    python -m benchmarks.moe_checkpoint --smoke        # tiny shape, 1 repeat, no BENCHMARKS.md
    python -m benchmarks.moe_checkpoint --groups load_ep,save_ep --repeats 3   # expert parallel, 4 ranks
    python -m benchmarks.moe_checkpoint --family qwen3_5_moe --repeats 3     # Qwen3.5-MoE, its own section

The checkpoint is a Qwen3-MoE HF directory (``config.json`` + ``model.safetensors``, seeded random
bf16) in transformers' default ``save_pretrained`` layout, every expert's ``gate_proj``/``up_proj``/
``down_proj`` its own tensor (:data:`BENCH`: 64 experts x 16 layers = 3,072 expert tensors), and, for
the ``load_fused`` group, the same shape in the fused layout (``save_original_format=False``).
``--family qwen3_5_moe`` runs every group on a Qwen3.5-MoE model of the same width, depth and experts
(Gated DeltaNet and gated attention layers, a gated shared expert; its hub checkpoints ship the fused
layout) instead; the families are the rows of :data:`benchmarks._moe_checkpoint_families.FAMILIES`.

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
between the ``moe-checkpoint-ep`` markers (each written only when its groups ran); Qwen3.5-MoE's between
``moe-checkpoint-qwen3_5`` and ``moe-checkpoint-qwen3_5-ep``.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

from benchmarks import _moe_checkpoint_ep
from benchmarks._driver import (
    Run,
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
from benchmarks._fixtures import write_random_safetensors
from benchmarks._hf_models import MoeCheckpointShape
from benchmarks._moe_checkpoint_families import FAMILIES, QWEN3_MOE
from benchmarks._moe_checkpoint_report import GROUPS, MoeCheckpointOptions, report

MARKERS = QWEN3_MOE.markers
ALL_GROUPS = GROUPS | _moe_checkpoint_ep.GROUPS
BENCH, SMOKE = QWEN3_MOE.bench, QWEN3_MOE.smoke


def hf_dir(bench_dir: Path, shape: MoeCheckpointShape, *, fused: bool) -> Path:
    """The seeded HF directory of ``shape`` in one layout (written tensor by tensor once, reused)."""
    kind = shape.hf_config()["model_type"]
    name = f"moe_ckpt_{kind}_h{shape.hidden}_l{shape.layers}_e{shape.experts}_i{shape.expert_ffn}_v{shape.vocab}"
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


# --------------------------------------------------------------------------- main


def _add_options(p) -> None:
    p.add_argument("--ep-world", type=int, default=4, help="ranks of the load_ep/save_ep groups (expert parallel 2)")
    p.add_argument("--family", choices=sorted(FAMILIES), default=QWEN3_MOE.name, help="the model's family")


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
    family = FAMILIES[a.family]
    shape = family.smoke if a.smoke else family.bench
    ep_groups = set(common["groups"]) & set(_moe_checkpoint_ep.GROUPS)
    if ep_groups and (a.ep_world % 2 or shape.experts % a.ep_world):
        raise SystemExit(
            f"--ep-world {a.ep_world}: the {','.join(sorted(ep_groups))} groups split {shape.experts} experts over "
            "expert_parallel=2 and the ranks; give an even --ep-world dividing the experts (e.g. 4)"
        )
    return MoeCheckpointOptions(**common, shape=shape, ep_world=a.ep_world, family=family)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; exit status 1 if a run failed or a verification did not pass (a missed target is
    reported, not an error)."""
    cfg = parse(argv)
    cfg.bench_dir.mkdir(parents=True, exist_ok=True)
    dirs = {
        "per_expert": hf_dir(cfg.bench_dir, cfg.shape, fused=False),
        "fused": hf_dir(cfg.bench_dir, cfg.shape, fused=True),
    }
    core = sources_fingerprint(("ranks", "state_dict", "checkpoint"))
    root = snapshot_sources(cfg.bench_dir / "moe_checkpoint_sources")
    load_before = os.getloadavg()[0]
    runs = run_all(cfg, dirs, root=root)
    (cfg.bench_dir / "moe_checkpoint_runs.json").write_text(json.dumps([asdict(r) for r in runs], indent=1))
    load_avg = (load_before, os.getloadavg()[0])
    if set(cfg.groups) & set(GROUPS):
        section, _ = report(cfg, runs, load_avg=load_avg, core=core)
        finish(section, markdown=cfg.markdown, markers=cfg.family.markers)
    if set(cfg.groups) & set(_moe_checkpoint_ep.GROUPS):
        section, _ = _moe_checkpoint_ep.report(cfg, runs, load_avg=load_avg, core=core)
        finish(section, markdown=cfg.markdown, markers=cfg.family.ep_markers)
    return 1 if failed(runs) else 0


if __name__ == "__main__":
    raise SystemExit(main())
