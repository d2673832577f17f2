"""The training benchmark's peers, shapes and targets (one process): torchtune's model and chunked loss on
mapped HF weights against transformers, the head/body shapes and dtypes the command line selects, and every
ratio and verdict taken against the best peer by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import _torchtune_peer
from benchmarks._driver import Run
from benchmarks._train_report import report, rows_for, summarize
from benchmarks.train import SMOKE, parse

MIB = 1 << 20


def _rank(rank: int, *, seconds: float, peak: int, loss: float, floor_s: float | None = None) -> dict:
    steps = [
        {"seconds": seconds, "peak_anon_delta": peak, "baseline_anon": 1000 * MIB, "cuda_peak_delta": None, "trace": []}
    ] * 2
    return {
        "rank": rank, "first_loss": loss, "steps": steps, "tokens": 1024, "trainable_params": 10, "verify": "ok",
        "floor_s": floor_s,
    }  # fmt: skip


def test_shape_option_selects_the_head_and_body_steps_and_the_dtypes(tmp_path: Path):
    cfg = parse(["--shape", "both", "--dtypes", "fp32,bf16", "--seq-lens", "1024", "--bench-dir", str(tmp_path)])
    assert list(cfg.shapes) == ["head", "body"] and cfg.dtypes == ("fp32", "bf16")
    head, body = cfg.shapes["head"][0], cfg.shapes["body"][0]
    assert (head.hidden, head.layers, head.vocab) == (256, 4, 128256)
    assert (body.hidden, body.layers, body.vocab) == (1024, 12, 32000)
    # 2 × 1024 tokens per rank on the head-dominated shape, 1 × 1024 on the body-dominated one
    assert [rows_for(1024, cfg.tokens_for(n)) for n in cfg.shapes] == [2, 1]
    assert len(cfg.cases()) == 2 * 2 * 3  # shapes × dtypes × kinds
    assert list(parse(["--bench-dir", str(tmp_path)]).shapes) == ["head"]
    with pytest.raises(SystemExit, match="--dtypes: unknown \\['fp16'\\]"):
        parse(["--dtypes", "fp16", "--bench-dir", str(tmp_path)])


def _options(tmp_path: Path):
    return parse(["--shape", "body", "--groups", "full", "--seq-lens", "1024", "--bench-dir", str(tmp_path)])


def test_ratios_and_targets_against_the_fastest_and_the_leanest_peer(tmp_path: Path):
    """transformers is the fastest peer, torchtune the leanest: speed is judged against one, memory the other."""
    runs = {
        "shardtune": [_rank(k, seconds=1.0, peak=300 * MIB, loss=10.0, floor_s=0.65) for k in (0, 1)],
        "transformers": [_rank(k, seconds=1.25, peak=900 * MIB, loss=10.0) for k in (0, 1)],
        "torchtune": [_rank(0, seconds=2.0, peak=400 * MIB, loss=10.0), _rank(1, seconds=4.0, peak=250 * MIB, loss=10.0)],
    }  # fmt: skip
    summaries = {("body", "fp32", "full", 1024, m): summarize([Run("x", m, 0, ranks=r)]) for m, r in runs.items()}
    section, agree = report(_options(tmp_path), summaries, load_avg=(0.0, 0.0), plots={})
    assert agree
    # 1024 tokens over 1 s; fastest peer 1024 / 1.25 s; leanest peer's larger rank 400 MiB
    assert "| body | fp32 | full | 1 × 1024 | shardtune | 1024 | 1.25 | 300.0 MiB / 300.0 MiB | 0.75 |" in section
    assert "| body | fp32 | full | 1 × 1024 | torchtune | 256 | 0.31 |" in section  # slowest rank: 4 s
    assert "| 65% |" in section  # rank 0's floor over the slowest rank's step
    assert "| body | fp32 | 1 × 1024 | 1.25× transformers (met) | 0.75× torchtune (met) | 65% (met) |" in section


def test_a_missed_target_and_a_failed_peer(tmp_path: Path):
    runs = {
        "shardtune": [_rank(k, seconds=1.0, peak=300 * MIB, loss=10.0, floor_s=0.5) for k in (0, 1)],
        "transformers": [_rank(k, seconds=1.1, peak=200 * MIB, loss=10.0) for k in (0, 1)],
    }
    summaries = {("body", "fp32", "full", 1024, m): summarize([Run("x", m, 0, ranks=r)]) for m, r in runs.items()}
    summaries[("body", "fp32", "full", 1024, "torchtune")] = None
    section, agree = report(_options(tmp_path), summaries, load_avg=(0.0, 0.0), plots=None)
    assert not agree  # a failed run
    assert "| torchtune | FAILED |" in section
    assert "| 1.10× transformers (NOT met) | 1.50× transformers (NOT met) | 50% (NOT met) |" in section
    assert "Memory plots not drawn: matplotlib does not import" in section


def test_torchtune_that_does_not_import_is_skipped_with_the_reason(tmp_path: Path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtune", None)  # import torchtune raises ImportError
    why = _torchtune_peer.unavailable()
    assert why is not None and why.startswith("torchtune 0.6.1 does not import here")
    runs = {m: [_rank(k, seconds=1.0, peak=MIB, loss=10.0) for k in (0, 1)] for m in ("shardtune", "transformers")}
    summaries = {("body", "fp32", "full", 1024, m): summarize([Run("x", m, 0, ranks=r)]) for m, r in runs.items()}
    section, agree = report(_options(tmp_path), summaries, load_avg=(0.0, 0.0), plots={}, skipped={"torchtune": why})
    assert agree and f"- torchtune: not run: {why}" in section
    assert "| torchtune |" not in section


@pytest.mark.skipif(_torchtune_peer.unavailable() is not None, reason=str(_torchtune_peer.unavailable()))
def test_torchtune_model_on_mapped_hf_weights_has_transformers_loss(tmp_path: Path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**SMOKE.hf_config(), "num_key_value_heads": 2, "rope_theta": 5e5}))
    hf.save_pretrained(tmp_path)
    tune = _torchtune_peer.build_model(tmp_path, dtype=torch.float32, device="cpu")
    tune.load_state_dict(_torchtune_peer.tune_state_dict(tmp_path), strict=True)
    tokens = torch.randint(SMOKE.vocab, (2, 48), generator=torch.Generator().manual_seed(1))
    got = _torchtune_peer.chunked_loss(tune)(tokens)
    labels = F.pad(tokens[:, 1:], (0, 1), value=-100)
    want = F.cross_entropy(hf(input_ids=tokens).logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
