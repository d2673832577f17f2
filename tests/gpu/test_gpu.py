"""On CUDA with NCCL alone: the state-dict core, async-save staging, the loop's host syncs,
mixture-of-experts kernels and the recipes. Skipped without a GPU; the two-rank tests need two.

    python -m pytest tests/gpu -q -p no:cacheprovider
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardtune.checkpoint.formats.tiny_base import create_tiny_base
from tests.distributed.pool import RankPool
from tests.gpu import checks
from tests.recipes.conftest import losses, resume_copy

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
RECIPE_WITH_SYNC_COUNTS = str(Path(__file__).with_name("sync_counting_recipe.py"))
ROOT = Path(__file__).resolve().parents[2]  # the code under test, also for the recipe processes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU"),
    pytest.mark.timeout(600),
]
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs two CUDA GPUs")


@pytest.fixture(scope="module")
def nccl1():
    pool = RankPool(1, backend="nccl")
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def nccl2():
    pool = RankPool(2, backend="nccl")
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    return create_tiny_base(tmp_path_factory.mktemp("models") / "tiny_base")


def _check_model_round_trip(res: list[dict], *, cpu_offload: bool, qlora: bool) -> None:
    found = res[0]
    assert found["keys_match"] and found["mismatched"] == []
    assert found["out_devices"] == {"cpu"}
    assert all(r["where"] == ({"cpu"} if cpu_offload else {"cuda"}) for r in res)
    if qlora:
        assert found["nf4_types"] == {"NF4Tensor"}
    assert all(r["out"] == {} for r in res[1:])


MODEL_CASES = [  # dtype, qlora, cpu_offload
    ("bf16", False, False),
    ("fp32", True, False),
    ("bf16", False, True),
    ("fp32", True, True),
]


@pytest.mark.parametrize("dtype,qlora,cpu_offload", MODEL_CASES)
def test_model_round_trip_is_exact_on_one_gpu(nccl1, dtype, qlora, cpu_offload):
    res = nccl1.run_ok(checks.model_round_trip, "cuda", dtype, qlora, cpu_offload, True)
    _check_model_round_trip(res, cpu_offload=cpu_offload, qlora=qlora)


@pytest.mark.parametrize(
    "dtype,lora,cpu_offload", [("fp32", False, False), ("bf16", True, False), ("fp32", False, True)]
)
def test_optimizer_round_trip_is_exact_on_one_gpu(nccl1, dtype, lora, cpu_offload):
    found = nccl1.run_ok(checks.optimizer_round_trip, "cuda", dtype, lora, cpu_offload)[0]
    assert found["n_states"] > 0 and found["same_keys"]
    assert found["bit_identical"] and found["groups_equal"] and found["same_losses"]
    assert found["relative_error_vs_reference"] < (2e-2 if dtype == "bf16" else 1e-4)


def test_async_save_staging_is_one_exact_pinned_allocation(nccl1, tiny_base, tmp_path):
    found = nccl1.run_ok(checks.staging_size, "cuda", str(tiny_base), str(tmp_path / "out"))[0]
    written = found["written"]
    assert written[0] == written[1] > 0
    # exactly this rank's bytes of model and optimizer, block starts aligned to at most 64 bytes
    assert written[0] <= found["staged"] < written[0] + 64 * found["tensors"]
    assert found["arenas"] in (None, 1)  # one allocation for both saves
    # no power-of-two rounding by the caching host allocator; the second save reuses the memory
    assert 0 <= found["pinned_growth"] <= written[0] and found["pinned_allocs"] <= 1
    assert found["second_growth"] == 0 and found["second_allocs"] == 0


def test_background_save_is_published_by_poll_and_keeps_the_cuda_rng(nccl1, tiny_base, tmp_path):
    found = nccl1.run_ok(checks.background_poll_and_cuda_rng, "cuda", str(tiny_base), str(tmp_path / "out"))[0]
    assert found.get("error") is None, found
    assert found["published_by_poll"] and found["polls"] >= 1
    assert "cuda" in found["saved_keys"] and "torch" in found["saved_keys"]
    assert found["replayed"]


def _run(
    recipe: str, config: str, *overrides: str, nproc: int = 1, timeout: float = 300
) -> subprocess.CompletedProcess:
    """``shardtune run --nproc_per_node N RECIPE --config CONFIG overrides`` (the code under test on PYTHONPATH)."""
    cmd = [
        sys.executable,
        "-m",
        "shardtune.cli",
        "run",
        "--nproc_per_node",
        str(nproc),
        recipe,
        "--config",
        config,
        *overrides,
    ]
    env = {
        **os.environ,
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def _falls(by_step: dict[int, float]) -> bool:
    values = [by_step[s] for s in sorted(by_step)]
    return len(values) >= 6 and sum(values[-3:]) < sum(values[:3])


@pytest.mark.parametrize("config", ["tiny/lora", "tiny/qlora"])
def test_tiny_recipe_trains_with_a_falling_loss(tiny_base, tmp_path, config):
    out = tmp_path / "out"
    _run(
        "lora_finetune_distributed",
        config,
        f"output_dir={out}",
        f"checkpoint_dir={tiny_base}",
        "epochs=1",
        "log_every_n_steps=1",
    )
    assert _falls(losses(out)), losses(out)
    assert (out / "epoch_1" / "adapter" / "adapter_model.safetensors").is_file()


def test_at_most_one_host_sync_per_optimizer_step(tiny_base, tmp_path):
    out = tmp_path / "out"
    _run(
        RECIPE_WITH_SYNC_COUNTS,
        "tiny/lora",
        f"output_dir={out}",
        f"checkpoint_dir={tiny_base}",
        "epochs=1",
        "max_steps_per_epoch=12",
        "log_every_n_steps=1",
        "clip_grad_norm=1.0",
    )
    per_step = json.loads((out / "syncs.json").read_text())["per_step"]
    assert len(per_step) >= 5 and max(per_step) <= 1, per_step


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_moe_grouped_gemm_experts_equal_the_fp32_loop_without_host_syncs(dtype):
    """The experts' grouped GEMMs on CUDA (``torch._grouped_mm``) against the exact loop in fp32 on the CPU:
    loss with the aux loss, every gradient; no host synchronization in forward or backward."""
    found = checks.moe_grouped_vs_loop("cuda", dtype)
    assert found["kernel"] == "grouped_experts", found
    checks.assert_moe_matches_loop(found, dtype)
    assert found["syncs"] == [], found["syncs"]


@pytest.mark.parametrize("kernel", ["torch", "fla"])
def test_qwen3_5_hybrid_on_cuda_equals_transformers_on_the_cpu(kernel, monkeypatch):
    """A packed row through the Qwen3.5 hybrid on CUDA (the Gated DeltaNet rule in PyTorch, or
    flash-linear-attention's Triton kernel when installed) against transformers' model on the CPU:
    loss and every gradient, fp32."""
    from shardtune.models.gated_delta_kernels import KERNEL_ENV, fla_rule

    if kernel == "fla" and fla_rule() is None:
        pytest.skip("flash-linear-attention is not installed (pip install flash-linear-attention)")
    monkeypatch.setenv(KERNEL_ENV, "torch" if kernel == "torch" else "auto")
    found = checks.qwen3_5_packed_on("cuda")
    assert found["loss"] <= 1e-4 and found["grad"] <= 2e-3, found


def _check_moe_hf_round_trip(res: list[dict], layout: str) -> None:
    found = res[0]
    assert found["same_keys"] and found["differ"] == [], found
    assert found["expert_files"] == (3 * 8 * 2 if layout == "per_expert" else 2 * 2), found  # 2 sparse layers
    for r in res:
        assert r["wrong"] == [] and r["where"] == {"cuda"}, r
        assert r["read"] == r["own"], r  # each rank read its own bytes of every file tensor, no more


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_moe_hf_checkpoint_loads_and_saves_as_transformers_on_one_gpu(nccl1, tmp_path, layout):
    """A tiny Qwen3-MoE in either of transformers' layouts, loaded onto the GPU and saved back: the
    layout it came in, exactly transformers' files."""
    from tests.unit.test_moe_checkpoint import hf_dirs

    _, dirs = hf_dirs("qwen3_moe", tmp_path)
    res = nccl1.run_ok(checks.moe_hf_round_trip, "cuda", str(dirs[layout]), str(tmp_path / "out"))
    _check_moe_hf_round_trip(res, layout)


def test_qlora_moe_first_step_loss_equals_peft_over_torchao_nf4_experts_on_one_gpu(nccl1, tmp_path):
    """NF4 experts on the GPU (QLoRA on a tiny Qwen3-MoE, E = 8, top-2): each expert quantized on the device
    as torchao's ``to_nf4`` of its slice, and the first-step loss (with the aux loss) equal to transformers +
    peft's over those NF4 experts, computed in fp32 on the CPU (tests/distributed/test_qlora_moe_sharded.py)."""
    from tests.distributed.test_qlora_moe_sharded import _hf, _peft, nf4_experts_reference
    from tests.unit.test_models_moe import batch

    hf = _hf()
    hf.save_pretrained(tmp_path / "per_expert")
    ref = nf4_experts_reference(hf)
    pm = _peft(ref)
    pm.save_pretrained(tmp_path / "peft")
    tokens, mask, labels = batch()
    with torch.no_grad():
        expected = pm(tokens, attention_mask=mask, labels=labels, output_router_logits=True).loss.item()
    reference = ref.model.layers[0].mlp.experts.gate_up_proj.detach()
    args = (str(tmp_path / "per_expert"), str(tmp_path / "peft"), reference)
    found = nccl1.run_ok(checks.qlora_moe_first_step, "cuda", *args)[0]
    assert found["type"] == "NF4Experts" and found["where"] == "cuda", found
    assert found["experts_diff"] < 1e-6, found  # the device's NF4 of each expert is torchao's (CPU)
    assert abs(found["loss"] - expected) < 1e-4, (found, expected)


def test_tiny_moe_recipe_trains_on_one_gpu(tmp_path):
    """``tiny/moe_full`` creates its base and trains in bf16 compute (grouped GEMMs) with fp32 masters and
    activation checkpointing: a falling loss, a logged ``aux_loss`` and FLOPs, fused experts saved."""
    out = tmp_path / "out"
    _run(
        "full_finetune_distributed",
        "tiny/moe_full",
        f"output_dir={out}",
        f"checkpoint_dir={tmp_path / 'tiny_moe_base'}",
        "dtype=bf16",
        "mixed_precision=true",
        "enable_activation_checkpointing=true",
        "max_steps_per_epoch=10",
        "log_every_n_steps=1",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert _falls(losses(out)), losses(out)
    assert all(r["aux_loss"] is not None and r["aux_loss"] > 0 and r["tflops_per_device"] > 0 for r in rows), rows
    from safetensors import safe_open

    with safe_open(out / "epoch_1" / "model.safetensors", "pt") as saved:
        assert saved.get_slice("model.layers.0.mlp.experts.gate_up_proj").get_shape() == [8, 128, 96]


@two_gpus
@pytest.mark.parametrize("dtype,qlora,cpu_offload", MODEL_CASES)
def test_rank0_load_and_gather_on_two_gpus(nccl2, dtype, qlora, cpu_offload):
    res = nccl2.run_ok(checks.model_round_trip, "cuda", dtype, qlora, cpu_offload, True)
    _check_model_round_trip(res, cpu_offload=cpu_offload, qlora=qlora)


@two_gpus
def test_moe_hf_checkpoint_each_gpu_reads_its_experts(nccl2, tmp_path):
    """Per-expert files on two GPUs (8 experts: 4 whole experts each): each rank reads only its own
    bytes of the 48 expert file tensors, and the save writes transformers' files back."""
    from tests.unit.test_moe_checkpoint import hf_dirs

    _, dirs = hf_dirs("qwen3_moe", tmp_path)
    res = nccl2.run_ok(checks.moe_hf_round_trip, "cuda", str(dirs["per_expert"]), str(tmp_path / "out"))
    _check_moe_hf_round_trip(res, "per_expert")


@two_gpus
def test_optimizer_round_trip_on_two_gpus(nccl2):
    res = nccl2.run_ok(checks.optimizer_round_trip, "cuda", "fp32", True, False)
    assert res[0]["bit_identical"] and res[0]["groups_equal"] and res[0]["same_keys"]
    assert all(r["same_losses"] for r in res) and res[1]["full"] == {}
    assert res[0]["relative_error_vs_reference"] < 1e-4


@two_gpus
def test_two_rank_recipe_resumes_exactly(tiny_base, tmp_path):
    first = tmp_path / "first"
    common = [f"checkpoint_dir={tiny_base}", "epochs=2", "max_steps_per_epoch=6", "log_every_n_steps=1"]
    _run("lora_finetune_distributed", "tiny/lora", f"output_dir={first}", *common, nproc=2)
    second = resume_copy(first, "epoch_1", tmp_path / "second")
    _run(
        "lora_finetune_distributed",
        "tiny/lora",
        f"output_dir={second}",
        "resume_from_checkpoint=True",
        *common,
        nproc=2,
    )
    uninterrupted, resumed = losses(first), losses(second)
    assert resumed and all(uninterrupted[step] == loss for step, loss in resumed.items()), (uninterrupted, resumed)
    assert min(resumed) == 7


def test_fsdp_cpu_offload_trains_like_the_gpu_run_and_resumes_exactly(tiny_base, tmp_path):
    """``fsdp_cpu_offload``: params, grads and the AdamW step on CPU; clipping included."""
    common = [
        f"checkpoint_dir={tiny_base}",
        "epochs=2",
        "max_steps_per_epoch=4",
        "log_every_n_steps=1",
        "clip_grad_norm=1.0",
        "dtype=fp32",
    ]
    on_gpu, offloaded = tmp_path / "gpu", tmp_path / "offloaded"
    _run("full_finetune_distributed", "tiny/full", f"output_dir={on_gpu}", *common)
    _run("full_finetune_distributed", "tiny/full", f"output_dir={offloaded}", "fsdp_cpu_offload=true", *common)
    want, got = losses(on_gpu), losses(offloaded)
    assert sorted(got) == sorted(want)
    assert [got[s] for s in got] == pytest.approx([want[s] for s in got], rel=1e-4)
    resumed = resume_copy(offloaded, "epoch_1", tmp_path / "resumed")
    _run(
        "full_finetune_distributed",
        "tiny/full",
        f"output_dir={resumed}",
        "fsdp_cpu_offload=true",
        "resume_from_checkpoint=True",
        *common,
    )
    again = losses(resumed)
    assert min(again) == 5 and all(got[s] == v for s, v in again.items()), (got, again)


def test_activation_offloading_keeps_gradients_bitwise_and_lowers_the_peak():
    """One GPU, no FSDP: the same model and batch with and without offloading each layer's saved tensors."""
    import copy

    from shardtune.models import build_model, get_model_args
    from shardtune.training.activation_offload import offload_layer_activations

    args = get_model_args("tiny").replace(n_layers=6, max_seq_len=2048)
    torch.manual_seed(0)
    plain = build_model(args, dtype=torch.float32).cuda()
    offloaded = copy.deepcopy(plain)
    offload_layer_activations(offloaded.model.layers)
    tokens = torch.randint(0, args.vocab_size, (4, 2048), device="cuda")

    def grads_and_peak(model):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model(tokens).float().square().mean().backward()
        torch.cuda.synchronize()
        return {n: p.grad for n, p in model.named_parameters()}, torch.cuda.max_memory_allocated() - base

    want, plain_peak = grads_and_peak(plain)
    got, offloaded_peak = grads_and_peak(offloaded)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert offloaded_peak < 0.7 * plain_peak, (offloaded_peak, plain_peak)


def test_activation_offloading_recipe_trains_like_the_plain_run(tiny_base, tmp_path):
    common = [f"checkpoint_dir={tiny_base}", "epochs=1", "max_steps_per_epoch=4", "log_every_n_steps=1", "dtype=fp32"]
    plain, offloaded = tmp_path / "plain", tmp_path / "offloaded"
    _run("lora_finetune_distributed", "tiny/lora", f"output_dir={plain}", *common)
    _run(
        "lora_finetune_distributed",
        "tiny/lora",
        f"output_dir={offloaded}",
        "enable_activation_offloading=true",
        *common,
    )
    assert losses(offloaded) == losses(plain)


def test_batched_generation_on_cuda_equals_the_cpu():
    """``generate_batch`` with the model and KV cache on the GPU (left-padded rows of a tiny Qwen3-MoE, its
    grouped-GEMM experts, fp32): the greedy completions' first tokens equal the same call on the CPU (later
    ones may part where the GPU's rounding flips a near-tie)."""
    from shardtune.inference.generation import generate_batch
    from shardtune.models import from_hf_config
    from tests.unit.test_models_moe import hf_moe_model

    hf = hf_moe_model("qwen3_moe", num_hidden_layers=2, mlp_only_layers=[1])
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], [12, 13, 14, 15]]
    options = {"max_new_tokens": 12, "pad_id": 0, "temperature": 0}
    got = {}
    for device in ("cpu", "cuda"):
        model = from_hf_config(hf.config.to_dict()).to(device)
        model.load_state_dict(hf.state_dict(), strict=True)
        model.init_buffers(device)
        got[device] = generate_batch(model, prompts, device=device, generator=torch.Generator(), **options)
    assert [row[:4] for row in got["cuda"]] == [row[:4] for row in got["cpu"]], got


@pytest.mark.parametrize(
    ("dtype", "dv", "kernel"),
    [
        (torch.float32, 64, "cuda_efficient"),
        (torch.bfloat16, 64, "cuda_flash"),
        (torch.float32, 48, "cuda_efficient"),  # values narrower than keys (latent attention)
        (torch.bfloat16, 48, "cuda_flash"),
    ],
)
def test_context_parallel_segment_attention_on_cuda_equals_masked_sdpa(dtype, dv, kernel):
    """A context-parallel segment's maskless attention (CUDA's kernels for a prefix and a causal part, merged by
    the log-sum-exps they return; backward through their backward ops) equals SDPA with the explicit mask on
    the GPU, forward and backward, grouped-query heads."""
    import torch.nn.functional as F

    from shardtune.models import lse_attention

    heads, kv_heads, d, earlier, n = 8, 2, 64, 700, 300
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(2, h, s, width, generator=g, device="cuda", dtype=dtype).requires_grad_()
        for h, s, width in ((heads, n, d), (kv_heads, earlier + n, d), (kv_heads, earlier + n, dv))
    )
    grad = torch.randn(2, heads, n, dv, generator=g, device="cuda", dtype=dtype)
    chosen = lse_attention.kernel_for(q, k, v)
    assert chosen is not None and chosen.name == kernel
    out = lse_attention.prefix_then_causal(q, k, v, earlier, scale=d**-0.5, kernel=chosen)
    got = torch.autograd.grad(out, (q, k, v), grad)
    mask = (
        torch.arange(earlier + n, device="cuda")[None, :] <= torch.arange(earlier, earlier + n, device="cuda")[:, None]
    )
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d**-0.5, enable_gqa=True)
    want = torch.autograd.grad(ref, (q, k, v), grad)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(out, ref, **tol)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **tol)


def test_tiny_grpo_recipe_rolls_out_and_trains_on_one_gpu(tiny_base, tmp_path):
    """``grpo_distributed`` on one GPU: batched KV-cache rollouts with the weights gathered, rewards,
    the policy loss with the k3 KL (adapters off), finite metrics and generation speed logged."""
    out = tmp_path / "out"
    _run(
        "grpo_distributed",
        "tiny/grpo",
        f"output_dir={out}",
        f"checkpoint_dir={tiny_base}",
        "max_steps_per_epoch=3",
        "batch_size=4",
        "save_every_n_steps=null",
        "grpo.max_completion_tokens=8",
        "grpo.beta=0.04",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3], rows
    for row in rows:
        assert all(v == v and abs(v) != float("inf") for v in row.values() if isinstance(v, float)), row
        assert row["gen_tokens_per_second"] > 0 and row["completion_length"] > 0, row


def test_deepseek_v3_on_cuda_equals_transformers_on_the_cpu():
    """A tiny DeepSeek-V3 on CUDA (latent attention through SDPA with values narrower than keys, the group-limited
    sigmoid router, shared experts) against transformers' model on the CPU: loss and every gradient, fp32."""
    found = checks.deepseek_v3_on("cuda")
    assert found["loss"] <= 1e-4 and found["grad"] <= 2e-3, found


def test_block_fp8_checkpoint_loads_onto_one_gpu(nccl1, tmp_path):
    """A block-FP8 directory (blocks that divide none of the dims) loaded onto the GPU: every weight equals the
    hand-dequantized one, and the shards live on the GPU."""
    from tests.unit.test_block_fp8 import _fused, fp8_dir

    _, expected = fp8_dir(tmp_path)
    found = nccl1.run_ok(checks.block_fp8_load, "cuda", str(tmp_path), _fused(expected))[0]
    assert found["wrong"] == [] and found["where"] == {"cuda"}, found


def test_fp8_lora_step_on_cuda_equals_peft_on_the_cpu(tmp_path):
    """LoRA over a block-FP8 DeepSeek-V3 base kept in FP8 on the GPU (the bases and routed experts dequantized per
    layer there, adapters on the latent attention and the experts): logits and every LoRA gradient against peft
    over the hand-dequantized transformers model on the CPU."""
    found = checks.fp8_lora_on("cuda", str(tmp_path))
    assert found["experts"] == (torch.float8_e4m3fn, "cuda"), found
    assert found["base"] == {(torch.float8_e4m3fn, "cuda")}, found
    assert found["logits"] <= 1e-4 and found["grad"] <= 2e-3, found
