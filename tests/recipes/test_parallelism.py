"""The parallelism and precision config keys, end to end on CPU ranks: HSDP
(``data_parallel_replicate``) with ``reshard_after_forward=false``, ``mixed_precision`` (both on the 2026 families
too) and the refusal of ``fsdp_cpu_offload`` without a GPU. (CPU offload itself runs in tests/gpu.) The runs a test
compares run in-process (``recipe_pool``); a resume, a refusal and the compiled run are ``shardtune run`` jobs."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.recipes.conftest import losses, resume_copy, run_recipe
from tests.recipes.test_recipes import _ce_sum, _first_global_batch

pytestmark = pytest.mark.timeout(900)

RECIPE, CONFIG = "full_finetune_distributed", "tiny/full"


def _overrides(dirs, out, *extra: str, batch: int = 4) -> list[str]:
    return [
        f"output_dir={out}",
        f"checkpoint_dir={dirs['base']}",
        "epochs=2",
        "max_steps_per_epoch=2",
        f"batch_size={batch}",
        "log_every_n_steps=1",
        "keep_last_n=null",
        "lr_scheduler.warmup_steps=0",
        *extra,
    ]


@pytest.fixture(scope="module")
def plain(tiny_dirs, tmp_path_factory, recipe_pool):
    out = tmp_path_factory.mktemp("plain") / "run"
    recipe_pool.run(RECIPE, CONFIG, *_overrides(tiny_dirs, out))
    return out


def test_hsdp_without_reshard_on_four_ranks_trains_like_fsdp_on_two(plain, tiny_dirs, tmp_path, recipe_pool):
    out = tmp_path / "hsdp"
    # same global batch: 4 ranks x 2 samples = 2 ranks x 4 samples
    recipe_pool.run(
        RECIPE,
        CONFIG,
        *_overrides(tiny_dirs, out, "data_parallel_replicate=2", "reshard_after_forward=false", batch=2),
        nproc=4,
    )
    want, got = losses(plain), losses(out)
    assert sorted(got) == [1, 2, 3, 4]
    assert [got[s] for s in got] == pytest.approx([want[s] for s in got], rel=1e-5)


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_masters(plain, tiny_dirs, tmp_path, recipe_pool):
    import transformers

    out = tmp_path / "mixed"
    recipe_pool.run(RECIPE, CONFIG, *_overrides(tiny_dirs, out, "dtype=bf16", "mixed_precision=true"))
    # first step against transformers computing in bf16 from the same weights
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["base"], torch_dtype=torch.bfloat16).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in _first_global_batch(CONFIG, tiny_dirs["base"]):
            ce, n = _ce_sum(model(batch["tokens"]).logits, batch["labels"])
            total, tokens = total + ce, tokens + n
    got = losses(out)
    assert got[1] == pytest.approx(total / tokens, rel=1e-2)
    assert got[1] != losses(plain)[1]  # it did not compute in fp32
    # master weights (and so the checkpoint) and optimizer state stay fp32
    config = json.loads((out / "epoch_2" / "config.json").read_text())
    assert config.get("torch_dtype", config.get("dtype")) == "float32"
    saved = load_file(str(out / "epoch_2" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
    optim = load_file(str(out / "epoch_2" / "training_state" / "optimizer.safetensors"))
    assert optim and {t.dtype for t in optim.values() if t.numel() > 1} == {torch.float32}
    # and a resume continues bitwise
    resumed = resume_copy(out, "epoch_1", tmp_path / "resumed")
    run_recipe(
        RECIPE,
        CONFIG,
        *_overrides(tiny_dirs, resumed, "dtype=bf16", "mixed_precision=true"),
        "resume_from_checkpoint=true",
    )
    again = losses(resumed)
    assert sorted(again) == [3, 4] and [again[s] for s in again] == [got[s] for s in again]


def test_cpu_offload_without_a_gpu_is_refused_on_every_rank(tiny_dirs, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "shardtune.cli",
        "run",
        "--nproc_per_node",
        "2",
        RECIPE,
        "--config",
        CONFIG,
        *_overrides(tiny_dirs, tmp_path / "off", "fsdp_cpu_offload=true"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    # raised on both ranks, reported once (shardtune run's root cause, shardtune/run_errors.py)
    assert text.count("ValueError: fsdp_cpu_offload: true needs a GPU") == 1 and "Traceback" not in text
    assert "shardtune run: rank 0: ValueError: fsdp_cpu_offload: true needs a GPU" in text
    assert "shardtune run: the same error on rank 1\n" in text
    assert "set fsdp_cpu_offload=false" in text


def test_activation_offloading_on_cpu_is_refused_with_the_fix(tiny_dirs, tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "shardtune.cli",
        "run",
        "--nproc_per_node",
        "1",
        RECIPE,
        "--config",
        CONFIG,
        *_overrides(tiny_dirs, tmp_path / "off", "enable_activation_offloading=true"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode != 0
    assert "set enable_activation_offloading=false" in proc.stdout + proc.stderr


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="torch.compile on CPU needs a C++ compiler"
)
def test_compiled_layers_and_loss_train_like_eager(plain, tiny_dirs, tmp_path):
    out = tmp_path / "compiled"
    run_recipe(RECIPE, CONFIG, *_overrides(tiny_dirs, out, "compile=true"), timeout=600)
    want, got = losses(plain), losses(out)
    assert sorted(got) == sorted(want)
    assert [got[s] for s in got] == pytest.approx([want[s] for s in got], rel=1e-4)


@pytest.mark.parametrize("config", ["tiny/qwen3_5_lora", "tiny/gemma4_lora"])
def test_a_2026_family_trains_in_bf16_mixed_precision_on_an_hsdp_mesh(tmp_path, recipe_pool, config):
    """The Qwen3.5 hybrid (Gated DeltaNet in bf16) and Gemma 4 (per-layer inputs, shared keys) with bf16 compute
    over fp32 masters on a 2 x 1 (replicate, shard) mesh: 2 steps with finite losses and fp32 weights saved."""
    out = tmp_path / "run"
    recipe_pool.run(
        "lora_finetune_distributed", config, f"output_dir={out}", f"checkpoint_dir={tmp_path / 'base'}",
        "epochs=1", "max_steps_per_epoch=2", "log_every_n_steps=1", "dtype=bf16", "mixed_precision=true",
        "data_parallel_replicate=2",
    )  # fmt: skip
    got = losses(out)
    assert sorted(got) == [1, 2] and all(math.isfinite(loss) for loss in got.values()), got
    saved = load_file(str(out / "epoch_1" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}
