"""The MoE checkpoint benchmark's bookkeeping (no processes): its fixture's files are transformers'
save of the same shape in both layouts, and its report's ratios and targets; the expert-parallel table's
per-rank bytes and ratios, and its rank count's check."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open

from benchmarks._driver import Run
from benchmarks._moe_checkpoint_ep import report as ep_report
from benchmarks._moe_checkpoint_report import GROUPS, MoeCheckpointOptions, report
from benchmarks.moe_checkpoint import SMOKE, parse


def test_fixture_files_are_transformers_save_in_both_layouts(tmp_path):
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(**SMOKE.hf_config())
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    for fused in (False, True):
        out = tmp_path / str(fused)
        model.save_pretrained(out, save_original_format=not fused)
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
        assert saved == SMOKE.file_shapes(fused=fused)
    assert SMOKE.total_bytes() == sum(p.nbytes for p in model.parameters())


def _options(groups: tuple[str, ...]) -> MoeCheckpointOptions:
    return MoeCheckpointOptions(
        size="tiny",
        world=2,
        repeats=1,
        groups=groups,
        cold=False,
        bench_dir=Path("/tmp"),
        markdown=None,
        timeout_s=60.0,
        command="python -m benchmarks.moe_checkpoint",
        shape=SMOKE,
    )


def _run(group: str, method: str, seconds: float, peak: int, *, own: int = 64 << 20) -> Run:
    counted = {"read": own, "received": 0, "sent": 0} if method.startswith("shardtune") else None
    rank = {
        "measurement": {"seconds": seconds, "peak_anon_delta": peak, "peak_file": 0},
        "own_shard_bytes": own,
        "counted_bytes": counted,
        "verify": "ok",
    }
    return Run(group, method, 0, [rank, rank])


def test_report_ratios_to_the_best_peer_and_targets_met_or_not():
    one = SMOKE.largest_bytes(fused=False)
    times = {"shardtune_direct": 1.0, "shardtune_rank0": 1.5, "transformers_fsdp2": 4.0, "dcp_hf_stack": 2.5}
    runs = [_run("load", m, t, 64 << 20) for m, t in times.items()]
    runs += [_run("save", m, t, 0) for m, t in {"shardtune": 1.0, "shardtune_rank0": 2.0}.items()]
    runs.append(_run("save", "dsd_save_pretrained", 3.0, 0))
    section, met = report(_options(("load", "save")), runs, load_avg=(1.0, 1.0), core="abc")
    assert "| shardtune_direct | 1.00 (1.00) | 0.40 |" in section  # to dcp_hf_stack, the faster peer
    assert "| transformers_fsdp2 | 4.00 (4.00) | 1.60 |" in section
    assert "| dsd_save_pretrained | 3.00 (3.00) | 1.00 |" in section
    assert [ok for _, _, ok in met] == [True, True, False]  # save: 1.0 / 3.0 > 0.3
    assert "| **not met** |" in section and "dcp_hf_stack" in met[0][0]
    assert "= 0.40 |" in section  # one repeat: no per-repeat ratios
    over = [_run("load", m, t, 2 * ((64 << 20) + one)) for m, t in times.items()]
    assert not report(_options(("load",)), over, load_avg=(1.0, 1.0), core="abc")[1][1][2]


def test_a_failed_method_is_a_row_and_a_note_not_a_crash():
    runs = [_run("load", m, 1.0, 0) for m in GROUPS["load"] if m != "dcp_hf_stack"]
    runs.append(Run("load", "dcp_hf_stack", 0, [], "Traceback\nRuntimeError: out of memory"))
    section, met = report(_options(("load",)), runs, load_avg=(1.0, 1.0), core="abc")
    assert "| dcp_hf_stack | FAILED (1 runs) |" in section and "out of memory" in section
    assert "transformers_fsdp2" in met[0][0]  # the best peer that ran


# --------------------------------------------------------------------------- expert parallel


def test_expert_bytes_are_the_expert_tensors_of_the_files():
    shapes = SMOKE.file_shapes(fused=False)
    by_hand = sum(2 * math.prod(s) for k, s in shapes.items() if ".mlp.experts." in k)
    assert SMOKE.expert_bytes() == by_hand


def _ep_run(group: str, method: str, seconds: float, *, read: int, rchar: int, written: int) -> Run:
    rank = {
        "measurement": {"seconds": seconds, "peak_anon_delta": 5 << 20, "peak_file": 0},
        "own_shard_bytes": 8 << 20,
        "own_expert_bytes": 6 << 20,
        "counted_bytes": {"read": read, "received": 0, "sent": 0},
        "kernel_io": {"rchar": rchar, "write_bytes": written},
        "verify": "ok",
    }
    return Run(group, method, 0, [rank] * 4)


def test_expert_parallel_table_shows_each_ranks_bytes_and_ratios_to_degree_1():
    mib = 1 << 20
    runs = [
        _ep_run("load_ep", "shardtune_ep1", 2.0, read=8 * mib, rchar=9 * mib, written=0),
        _ep_run("load_ep", "shardtune_ep2", 1.0, read=8 * mib, rchar=9 * mib, written=0),
        _ep_run("save_ep", "shardtune_ep1", 1.0, read=0, rchar=0, written=8 * mib),
        Run("save_ep", "shardtune_ep2", 0, [], "Traceback\nRuntimeError: boom"),
    ]
    cfg = dataclasses.replace(_options(("load_ep", "save_ep")), repeats=1)
    section, rows = ep_report(cfg, runs, load_avg=(1.0, 1.0), core="abc")
    assert "| load | shardtune_ep2 | (efsdp 2, ep 2) | 1.00 (1.00) | 0.50 |" in section
    assert "8.0 MiB (6.0 MiB) / 8.0 MiB (6.0 MiB) / 8.0 MiB (6.0 MiB) / 8.0 MiB (6.0 MiB)" in section
    assert (
        "| 8.0 MiB / 8.0 MiB / 8.0 MiB / 8.0 MiB | 9.0 MiB / 9.0 MiB / 9.0 MiB / 9.0 MiB | 0 / 0 / 0 / 0 |" in section
    )
    assert "| save | shardtune_ep1 | shard 4 | 1.00 (1.00) | 1.00 |" in section
    assert "| save | shardtune_ep2 | (efsdp 2, ep 2) | FAILED (1 runs) |" in section and "boom" in section
    assert [r["method"] for r in rows] == ["shardtune_ep1", "shardtune_ep2"] * 2


def test_ep_world_must_split_the_experts_over_expert_parallel_2():
    assert parse(["--smoke"]).ep_world == 4
    with pytest.raises(SystemExit, match="--ep-world 3"):
        parse(["--smoke", "--ep-world", "3"])
    with pytest.raises(SystemExit, match="--ep-world 8"):
        parse(["--smoke", "--ep-world", "8"])  # 4 experts
    assert parse(["--smoke", "--ep-world", "8", "--groups", "load"]).ep_world == 8  # not used: no ep group
