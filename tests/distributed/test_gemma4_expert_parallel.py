"""Gemma 4's MoE (experts beside every layer's dense MLP) under expert parallelism on 4 gloo ranks: the loss,
the clipped gradient norm and every gradient at expert_parallel=2 equal expert_parallel=1 (itself equal to
transformers in one process), full fine-tuning and LoRA on the fused experts; the experts' HF checkpoint
read and written per rank (each rank its own experts) loads in transformers with exactly the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from shardtune.models import from_hf_config
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training.grad_norm import clip_grad_norm
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(300)

NAME = "gemma4_text_moe"
MAX_NORM = 0.05
EXPERT_WEIGHTS = ["experts.gate_up_proj", "experts.down_proj"]


def _hf():
    from tests.unit.test_models_families import hf_model

    return hf_model(NAME)


def _step(degree: int, *, lora: bool = False) -> dict:
    from tests.unit.test_models_families import tokens

    hf = _hf()
    model = from_hf_config(hf.config.to_dict())
    model.load_state_dict(hf.state_dict(), strict=True)
    if lora:
        from shardtune.peft import apply_lora

        apply_lora(model, rank=2, alpha=4, target_modules=[], target_parameters=EXPERT_WEIGHTS)
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in (p for n, p in model.named_parameters() if "lora_" in n):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    shard_model(model, mesh=make_mesh(expert_parallel=degree))
    x, labels = tokens(seed=1 + dist.get_rank()), tokens(seed=11 + dist.get_rank())  # each rank its own batch
    with nccl_rules() as rules:
        rules.host(x, labels)
        loss = F.cross_entropy(model(x).flatten(0, 1), labels.flatten())
        loss.backward()
        norm = clip_grad_norm(model.parameters(), MAX_NORM)
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    expert = model.model.layers[0].experts.gate_up_proj
    return {
        "loss": loss.item(),
        "norm": norm.item(),
        "grads": grads if dist.get_rank() == 0 else None,
        "mesh": tuple(expert.device_mesh.mesh_dim_names or ()),
        "local": tuple(expert._local_tensor.shape),
        "all_to_all": rules.counts["all_to_all_single"] + rules.counts["funcol.all_to_all_single"],
    }


def _steps() -> dict:
    return {"dp": _step(1), "ep": _step(2), "lora_dp": _step(1, lora=True), "lora_ep": _step(2, lora=True)}


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def test_expert_parallel_equals_data_parallel(pool4):
    res = pool4.run_ok(_steps, timeout=240)
    for rank, r in enumerate(res):
        for kind in ("", "lora_"):
            dp, ep = r[f"{kind}dp"], r[f"{kind}ep"]
            assert abs(ep["loss"] - dp["loss"]) <= 1e-5 * abs(dp["loss"]), (rank, kind)
            assert abs(ep["norm"] - dp["norm"]) <= 1e-5 * dp["norm"], (rank, kind)
            assert ep["mesh"] == ("efsdp", "ep") and dp["all_to_all"] == 0 and ep["all_to_all"] > 0, (rank, ep)
            assert ep["local"][0] == 1, ep  # 4 experts: 2 per ep rank, 1 per efsdp rank
    assert abs(res[0]["lora_dp"]["loss"] - res[0]["dp"]["loss"]) > 1e-3  # the expert adapters change the model
    for kind in ("", "lora_"):
        grads = res[0][f"{kind}dp"]["grads"]
        assert any(name.endswith(".experts.gate_up_proj") for name in grads) == (kind == "")
        for name, grad in res[0][f"{kind}ep"]["grads"].items():
            assert _rel(grad, grads[name]) < 1e-5, (kind, name)


def _round_trip(out: str) -> dict:
    import transformers

    out_dir, rank0 = Path(out), dist.get_rank() == 0
    hf = _hf()
    expected = hf.state_dict()
    if rank0:
        hf.save_pretrained(out_dir / "hf")
    dist.barrier()
    with torch.device("meta"):
        model = from_hf_config(hf.config.to_dict())
    shard_model(model, mesh=make_mesh(expert_parallel=2))
    load_hf_checkpoint(model, out_dir / "hf", device=torch.device("cpu"), strict=True)
    model.init_buffers("cpu")
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    r = {"loaded": [n for n, t in full.items() if not torch.equal(t, expected[n])]}
    save_hf_checkpoint(model, out_dir / "saved")
    if rank0:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir / "saved").state_dict()
        r["saved"] = sorted(loaded) == sorted(expected) and all(torch.equal(v, expected[k]) for k, v in loaded.items())
    return r


def test_expert_parallel_checkpoint_round_trip(pool4, tmp_path):
    res = pool4.run_ok(_round_trip, str(tmp_path), timeout=240)
    assert all(r["loaded"] == [] for r in res), res
    assert res[0]["saved"], res[0]
