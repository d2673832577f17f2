"""LoRA over block-FP8 bases kept in FP8 under FSDP2 on 2 ranks, against peft in one process.

The FP8 directory of ``tests/unit/test_block_fp8.fp8_dir`` (blocks of 20 x 40): FSDP cuts the 64-row
attention weights at row 32, inside a block, so each rank holds FP8 rows and scale rows that start or
end mid-block. Each rank's base pieces are the checkpoint's FP8 bytes and its scales spread over its
rows; the logits and the adapters' gradients of a first step equal peft's LoRA over the transformers
model holding the hand-dequantized weights (every rank reading its rows, or rank 0 sending them); the
merged HF save written by both ranks equals ``W_deq + scaling * B @ A``, and the weight stream sends
those tensors. Mixed precision over the bases is refused by name. Under NCCL's rules.

The routed experts stay in FP8 too: a tiny DeepSeek-V3 with 5 experts (not divisible by 2 ranks, so
FSDP2 splits the stacked experts on their rows: ``gate_up [5, 52, 64]`` at row 26, inside the up
projections' first block; ``down [5, 64, 26]`` at row 32, inside a block) with LoRA on the experts
(``target_parameters``) and the latent attention equals peft over the dequantized weights in one process;
so does one with 6 experts at ``expert_parallel=2`` (each rank reading and holding its 3 experts whole).
With the whole frozen base kept in FP8 (``fp8_linears``: the shared experts, the dense layer's MLP, the
projections LoRA does not wrap), FSDP2 cuts the shared experts' 26-row gate at row 13, inside a block: each
rank holds its FP8 rows and scale rows of it, the first step equals peft's, and the merged save written by
both ranks holds those linears hand-dequantized.
"""

from __future__ import annotations

import pytest
import safetensors.torch
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy

from shardtune.checkpoint.formats.hf_load import fp8_linears, load_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.inference.stream import stream_weights
from shardtune.models import from_hf_config
from shardtune.peft import apply_lora
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import load_from_full_model_state_dict
from tests.nccl_rules import nccl_rules
from tests.unit.test_block_fp8 import BLOCK, fp8_dir
from tests.unit.test_fp8_lora import ALPHA, RANK, TARGETS, adapters_of, deepseek_fp8_dir, peft_over
from tests.unit.test_lora_moe import _peft
from tests.unit.test_models_moe import batch
from tests.unit.test_moe_checkpoint import tensors

pytestmark = pytest.mark.timeout(300)

Q = "model.layers.0.self_attn.q_proj"


def _run(hf_dir: str, out: str, shared: bool, adapters: dict, tokens: torch.Tensor, real: torch.Tensor) -> dict:
    with torch.device("meta"):
        model = from_hf_config(hf_dir, dtype=torch.float32)
        apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=TARGETS, quantize_base="block_fp8", fp8_block=BLOCK)
    shard_model(model, mesh=make_mesh())
    with nccl_rules() as rules:
        rules.host(adapters)
        dist.barrier()
        load_hf_checkpoint(model, hf_dir, device="cpu", strict=False, shared_filesystem=shared)
        load_from_full_model_state_dict(model, adapters if shared or dist.get_rank() == 0 else {}, "cpu")
    model.init_buffers("cpu")
    logits = model(tokens)
    logits[real].square().mean().backward()
    params = dict(model.named_parameters())
    weight, scales = params[f"{Q}.weight"].to_local(), params[f"{Q}.weight_scale_rows"].to_local()
    grads = {n: p.grad.full_tensor() for n, p in params.items() if p.requires_grad}
    with nccl_rules():
        save_hf_checkpoint(model, out, shared_filesystem=shared)
    with stream_weights(model, to="all", expert_layout="per_expert") as stream:
        streamed = {name: tensor.clone() for name, tensor in stream}
    return {
        "streamed": streamed,
        "logits": logits.detach(),
        "grads": grads,
        "weight": weight.view(torch.uint8).clone(),
        "dtype": weight.dtype,
        "scales": scales.clone(),
        "frozen": sorted(n for n, p in params.items() if not p.requires_grad and "lora" in n),
    }


@pytest.mark.parametrize("shared", [True, False], ids=["every-rank-reads", "rank0-sends"])
def test_sharded_fp8_bases_equal_peft_over_the_dequantized_weights(pool2, tmp_path, shared):
    hf, expected = fp8_dir(tmp_path / "fp8")
    pm = peft_over(hf)
    adapters = adapters_of(pm)
    tokens, mask, _ = batch()
    real = mask.bool()
    res = pool2.run_ok(_run, str(tmp_path / "fp8"), str(tmp_path / "out"), shared, adapters, tokens, real, timeout=240)
    want = pm(tokens, attention_mask=mask).logits
    want[real].square().mean().backward()
    theirs = {
        k.removeprefix("base_model.model.").replace(".default", ""): p.grad
        for k, p in pm.named_parameters()
        if "lora_" in k
    }
    stored = safetensors.torch.load_file(tmp_path / "fp8" / "model.safetensors")
    rows = stored[f"{Q}.weight_scale_inv"].repeat_interleave(BLOCK[0], 0)[: stored[f"{Q}.weight"].shape[0]]
    for rank, r in enumerate(res):
        cut = r["weight"].shape[0]
        assert cut == 32 and cut % BLOCK[0], cut  # the shard boundary lies inside a block
        assert r["dtype"] == torch.float8_e4m3fn and not r["frozen"]
        mine = slice(rank * cut, (rank + 1) * cut)
        assert torch.equal(r["weight"], stored[f"{Q}.weight"].view(torch.uint8)[mine])
        assert torch.equal(r["scales"], rows[mine])
        assert (r["logits"] - want.detach())[real].abs().max() <= 1e-5 * want[real].abs().max()
        assert sorted(r["grads"]) == sorted(theirs)
        for key, grad in theirs.items():
            assert (r["grads"][key] - grad).abs().max() <= 1e-5 * grad.abs().max() + 1e-9, (rank, key)
    saved = tensors(tmp_path / "out")
    assert not any("scale" in k or "lora" in k for k in saved)
    for r in res:  # the weight stream sends what the save writes
        assert sorted(r["streamed"]) == sorted(saved)
        assert all(torch.equal(r["streamed"][k], v) for k, v in saved.items())
    for name in (n for n in saved if n.rsplit(".", 2)[-2] in TARGETS):
        prefix = name.removesuffix(".weight")
        a, b = adapters[f"{prefix}.lora_A.weight"], adapters[f"{prefix}.lora_B.weight"]
        assert torch.allclose(saved[name], expected[name] + ALPHA / RANK * b @ a, rtol=0, atol=1e-6), name


def _mixed_precision(hf_dir: str) -> str:
    with torch.device("meta"):
        model = from_hf_config(hf_dir, dtype=torch.float32)
        apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=TARGETS, quantize_base="block_fp8", fp8_block=BLOCK)
    try:
        shard_model(model, mesh=make_mesh(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    except ValueError as exc:
        return str(exc)
    return "sharded"


def test_mixed_precision_over_fp8_bases_is_refused_naming_the_option(pool2, tmp_path):
    fp8_dir(tmp_path)
    for message in pool2.run_ok(_mixed_precision, str(tmp_path), timeout=120):
        assert message.startswith("model.layers.0.self_attn.q_proj.weight: a block-FP8 LoRA base")
        assert "set mixed_precision=false" in message


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
FIVE_EXPERTS = {"n_routed_experts": 5, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 26}
SIX_EXPERTS = {"moe_intermediate_size": 26}


SHARED = "model.layers.1.mlp.shared_experts.gate_proj"


def _experts_run(hf_dir: str, adapters: dict, tokens: torch.Tensor, ep: int, out: str | None = None) -> dict:
    """``out``: keep every linear the directory stores in FP8 in it, and save the merged model there."""
    with torch.device("meta"):
        model = from_hf_config(hf_dir, dtype=torch.float32)
        kept = fp8_linears(model, hf_dir) if out is not None else []
        apply_lora(
            model,
            rank=RANK,
            alpha=ALPHA,
            target_modules=MLA,
            target_parameters=EXPERTS,
            quantize_base="block_fp8",
            fp8_block=BLOCK,
            fp8_linears=kept,
        )
    shard_model(model, mesh=make_mesh(expert_parallel=ep))
    with nccl_rules() as rules:
        rules.host(adapters)
        dist.barrier()
        load_hf_checkpoint(model, hf_dir, device="cpu", strict=False)
        load_from_full_model_state_dict(model, adapters, "cpu")
    model.init_buffers("cpu")
    logits = model(tokens)
    logits.square().mean().backward()
    experts = model.model.layers[1].mlp.experts
    local = {n: _local(getattr(experts, n)).clone() for n in ("gate_up_proj", "gate_up_proj_scale_rows")}
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    if out is not None:
        shared = model.get_submodule(SHARED)
        local |= {n: _local(getattr(shared, n)).clone() for n in ("weight", "weight_scale_rows")}
        with nccl_rules():
            save_hf_checkpoint(model, out)
    return {"logits": logits.detach(), "grads": grads, "local": local, "placement": experts.down_proj.placements}


def _local(param: torch.Tensor) -> torch.Tensor:
    """This rank's piece of an experts parameter (a DTensor on ep and efsdp under expert parallelism)."""
    while hasattr(param, "to_local"):
        param = param.to_local()
    return param


@pytest.mark.parametrize(
    ("ep", "changes", "whole"),
    [(1, FIVE_EXPERTS, False), (2, SIX_EXPERTS, False), (1, FIVE_EXPERTS, True)],
    ids=["fsdp-rows", "ep2", "fsdp-rows-whole-base-fp8"],
)
def test_fp8_experts_sharded_equal_peft_in_one_process(pool2, tmp_path, ep, changes, whole):
    hf = deepseek_fp8_dir(tmp_path, **changes)
    experts = hf.config.n_routed_experts
    pm = _peft(hf, EXPERTS, modules=MLA)
    adapters = adapters_of(pm)
    tokens = batch()[0]
    out = str(tmp_path / "merged") if whole else None
    res = pool2.run_ok(_experts_run, str(tmp_path), adapters, tokens, ep, out, timeout=240)
    want = pm(tokens).logits
    want.square().mean().backward()
    theirs = {
        k.removeprefix("base_model.model.").replace(".default", ""): p.grad
        for k, p in pm.named_parameters()
        if "lora_" in k
    }
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    prefix = "model.layers.1.mlp.experts"
    fp8 = torch.stack(
        [torch.cat([stored[f"{prefix}.{e}.{p}.weight"] for p in ("gate_proj", "up_proj")]) for e in range(experts)]
    )
    rows = {k: v.repeat_interleave(BLOCK[0], 0)[:26] for k, v in stored.items() if k.endswith("_scale_inv")}
    scales = torch.stack(
        [
            torch.cat([rows[f"{prefix}.{e}.{p}.weight_scale_inv"] for p in ("gate_proj", "up_proj")])
            for e in range(experts)
        ]
    )
    for rank, r in enumerate(res):
        if ep == 1:
            assert str(r["placement"][0]) == "S(1)"  # 5 experts on 2 ranks: the rows are split
        mine = (slice(None), slice(26 * rank, 26 * (rank + 1))) if ep == 1 else slice(3 * rank, 3 * rank + 3)
        assert r["local"]["gate_up_proj"].dtype == torch.float8_e4m3fn
        assert torch.equal(r["local"]["gate_up_proj"].view(torch.uint8), fp8[mine].view(torch.uint8))
        assert torch.equal(r["local"]["gate_up_proj_scale_rows"], scales[mine])
        assert (r["logits"] - want.detach()).abs().max() <= 1e-5 * want.abs().max()
        assert sorted(r["grads"]) == sorted(theirs) and len(theirs) == 2 * len(MLA) * 3 + 2 * len(EXPERTS) * 2
        for key, grad in theirs.items():
            assert (r["grads"][key] - grad).abs().max() <= 1e-4 * grad.abs().max(), (rank, key)
    if not whole:
        return
    shared = stored[f"{SHARED}.weight"]
    shared_rows = rows[f"{SHARED}.weight_scale_inv"]
    for rank, r in enumerate(res):  # 26 rows cut at 13, inside the first block of 20
        mine = slice(13 * rank, 13 * (rank + 1))
        assert r["local"]["weight"].dtype == torch.float8_e4m3fn
        assert torch.equal(r["local"]["weight"].view(torch.uint8), shared.view(torch.uint8)[mine])
        assert torch.equal(r["local"]["weight_scale_rows"], shared_rows[mine])
    saved, dequantized = tensors(tmp_path / "merged"), hf.state_dict()
    frozen = [n for n, v in stored.items() if v.dtype == torch.float8_e4m3fn and n.rsplit(".", 2)[-2] not in MLA]
    frozen = [n for n in frozen if ".experts." not in n]
    assert len(frozen) == 3 + 3 * 2  # the dense MLP's and the shared experts'
    assert not any("scale" in k or "lora" in k for k in saved)
    for name in frozen:
        assert torch.equal(saved[name], dequantized[name]), name


def _held_save(hf_dir: str, adapters: dict, out: str) -> None:
    """LoRA on the latent attention only: every expert and other linear frozen in FP8, saved in block FP8."""
    with torch.device("meta"):
        model = from_hf_config(hf_dir, dtype=torch.float32)
        kept = fp8_linears(model, hf_dir)
        apply_lora(
            model,
            rank=RANK,
            alpha=ALPHA,
            target_modules=MLA,
            quantize_base="block_fp8",
            fp8_block=BLOCK,
            fp8_linears=kept,
        )
    shard_model(model)
    with nccl_rules() as rules:
        rules.host(adapters)
        dist.barrier()
        load_hf_checkpoint(model, hf_dir, device="cpu", strict=False)
        load_from_full_model_state_dict(model, adapters, "cpu")
        save_hf_checkpoint(model, out, merge_adapters=False, weight_format="block_fp8")


def test_a_block_fp8_save_writes_the_frozen_experts_and_linears_as_read(pool2, tmp_path):
    """5 experts on 2 ranks: each expert's 26 gate and up rows are cut at 13, inside the first block of 20, so
    each rank holds the first row of only some blocks of each per-expert file tensor."""
    hf = deepseek_fp8_dir(tmp_path, **FIVE_EXPERTS)
    adapters = adapters_of(peft_over(hf, targets=MLA))
    pool2.run_ok(_held_save, str(tmp_path), adapters, str(tmp_path / "out"), timeout=240)
    stored, saved = tensors(tmp_path), tensors(tmp_path / "out")
    assert sorted(k for k in saved if ".lora_" not in k) == sorted(stored)
    frozen = [n for n, v in stored.items() if v.dtype == torch.float8_e4m3fn and n.rsplit(".", 2)[-2] not in MLA]
    assert any(".experts.4.up_proj." in n for n in frozen) and any("shared_experts" in n for n in frozen)
    for name in frozen:
        assert torch.equal(saved[name].view(torch.uint8), stored[name].view(torch.uint8)), name
        assert torch.equal(saved[f"{name}_scale_inv"], stored[f"{name}_scale_inv"]), name
