"""The MoE checkpoint benchmark's bookkeeping (no processes): its fixture's files are transformers'
save of the same shape in both layouts, and its report's ratios and targets."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors import safe_open

from benchmarks.driver import Run
from benchmarks.moe_checkpoint import GROUPS, SMOKE, MoeCheckpointOptions, report


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
