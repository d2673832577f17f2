"""LoRA on fused experts and the router under FSDP2 on 2 ranks, experts sharded on the expert dim
(Qwen3-MoE, 8 experts; Qwen3.5-MoE, 6) or the next (Mixtral, 5 experts), against peft in one process: a peft-saved
adapter loads, logits and adapter gradients equal peft's; the adapter is written with each rank writing
its own rows (no gather) and equals peft's file; the merged export, fused or per expert (as transformers
saves it), equals ``merge_and_unload``; adapter
and optimizer saved after a step and loaded into a fresh model continue bitwise. Under NCCL's rules."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import Shard

from shardtune.checkpoint import load_peft_adapter, save_hf_checkpoint, save_peft_adapter
from shardtune.checkpoint.formats.optimizer_io import load_optimizer, save_optimizer
from shardtune.models import from_hf_config
from shardtune.peft import apply_lora
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training import load_from_full_model_state_dict
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(300)

CASES = [
    ("qwen3_moe", {}, Shard(0)),
    ("mixtral", {"num_local_experts": 5}, Shard(1)),
    ("qwen3_5_moe_text", {}, Shard(0)),  # hybrid layers and a shared expert; 6 experts
]


def _sharded_lora(hf_config: dict, hf_sd: dict, *, rules=None):
    from tests.unit.test_lora_moe import ALPHA, MODULES, PARAMETERS, RANK

    with torch.device("meta"):
        model = from_hf_config(hf_config)
        apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=MODULES, target_parameters=PARAMETERS)
    shard_model(model, mesh=make_mesh())
    if rules is not None:
        rules.host(hf_sd)
    load_from_full_model_state_dict(model, hf_sd if dist.get_rank() == 0 else {}, "cpu", strict=False)
    model.init_buffers("cpu")
    return model


def _step(model, opt, tokens) -> torch.Tensor:
    logits = model(tokens)
    logits.square().mean().backward()
    opt.step()
    opt.zero_grad()
    return logits.detach()


def _run(name: str, changes: dict, peft_dir: str, out: str):
    from tests.unit.test_lora_moe import _peft, lora_grad_errors
    from tests.unit.test_models_moe import batch, hf_moe_model

    hf = hf_moe_model(name, **changes)
    pm = _peft(hf)
    tokens = batch()[0]
    expected = pm(tokens).logits
    expected.square().sum().backward()
    out_dir = Path(out)
    with nccl_rules() as rules:
        model = _sharded_lora(hf.config.to_dict(), hf.state_dict(), rules=rules)
        load_peft_adapter(model, Path(peft_dir), device="cpu")
        rules.host(model)
        logits = model(tokens)
        logits.square().sum().backward()
        worst = max(lora_grad_errors(model, pm).values())
        model.zero_grad()
        save_peft_adapter(model, out_dir / "adapter")
        save_hf_checkpoint(model, out_dir / "merged", expert_layout="fused")
        save_hf_checkpoint(model, out_dir / "per_expert", expert_layout="per_expert")
    layer = model.model.layers[0].mlp.experts
    # resume: a step, adapter + optimizer saved, both loaded into a fresh model; the next steps agree bitwise
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _step(model, opt, tokens)
    save_peft_adapter(model, out_dir / "step1")
    save_optimizer(model, opt, out_dir / "step1")
    fresh = _sharded_lora(hf.config.to_dict(), hf.state_dict())
    load_peft_adapter(fresh, out_dir / "step1", device="cpu")
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    load_optimizer(fresh, fresh_opt, out_dir / "step1", device="cpu")
    _step(model, opt, tokens)
    _step(fresh, fresh_opt, tokens)
    resumed = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    return {
        "logits": (logits - expected).abs().max().item() / expected.abs().max().item(),
        "grads": worst,
        "expert": tuple(layer.gate_up_proj.placements),
        "lora_b_local": tuple(layer.lora_B.weight.to_local().shape),
        "lora_b": tuple(layer.lora_B.weight.shape),
        "resumed": resumed,
    }


@pytest.mark.parametrize(("name", "changes", "placement"), CASES)
def test_sharded_expert_lora_equals_peft_saves_in_place_and_resumes(pool2, tmp_path, name, changes, placement):
    from tests.unit.test_lora_moe import _peft
    from tests.unit.test_models_moe import hf_moe_model

    hf = hf_moe_model(name, **changes)
    pm = _peft(hf)
    pm.save_pretrained(tmp_path / "peft")
    for r in pool2.run_ok(_run, name, changes, str(tmp_path / "peft"), str(tmp_path / "out"), timeout=240):
        assert r["logits"] < 1e-5 and r["grads"] < 1e-4, r
        assert r["expert"] == (placement,), r
        out, cols = r["lora_b"]  # PEFT's [out, r * E]: each rank holds whole rows, which it writes in place
        assert r["lora_b_local"] == (out // 2, cols), r
        assert r["resumed"], r
    theirs = load_file(tmp_path / "peft/adapter_model.safetensors")
    ours = load_file(tmp_path / "out/adapter/adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], v) for k, v in theirs.items())
    merged_model = pm.merge_and_unload()
    merged_model.save_pretrained(tmp_path / "hf")  # transformers' default: per-expert tensors
    per_expert = {k: v for k, v in load_file(tmp_path / "hf/model.safetensors").items() if ".experts." in k}
    for ours_dir, reference in (("merged", merged_model.state_dict()), ("per_expert", per_expert)):
        merged = load_file(tmp_path / "out" / ours_dir / "model.safetensors")
        if ours_dir == "per_expert":  # only the experts are declared per expert here (Mixtral renames its router too)
            merged = {k: v for k, v in merged.items() if ".experts." in k}
        assert sorted(merged) == sorted(reference)
        for key, value in reference.items():
            assert (merged[key] - value).abs().max() < 1e-6, (ours_dir, key)


def _fresh_adapters(name: str, changes: dict, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter factor of a fresh (seeded) LoRA model, whole: sharded when run on a pool."""
    from shardtune.peft import get_adapter_params, init_lora_parameters
    from tests.unit.test_models_moe import hf_moe_model

    hf = hf_moe_model(name, **changes)
    model = _sharded_lora(hf.config.to_dict(), hf.state_dict()) if dist.is_initialized() else None
    if model is None:
        from tests.unit.test_lora_moe import ALPHA, MODULES, PARAMETERS, RANK

        model = from_hf_config(hf.config.to_dict())
        apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=MODULES, target_parameters=PARAMETERS)
    torch.manual_seed(seed)
    init_lora_parameters(model, device="cpu")
    return {
        n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in get_adapter_params(model).items()
    }


def test_fresh_adapters_do_not_depend_on_the_sharding(pool2):
    """The same seed gives the same fresh adapters on 2 ranks (experts sharded on the expert dim or
    the next) as in one unsharded process: each factor is drawn whole, each rank keeps its piece."""
    for name, changes, _ in CASES:
        one = _fresh_adapters(name, changes, seed=3)
        assert any(".experts." in n for n in one) and any("lora_A" in n and v.abs().sum() > 0 for n, v in one.items())
        for r in pool2.run_ok(_fresh_adapters, name, changes, 3, timeout=120):
            assert r.keys() == one.keys()
            for n, v in one.items():
                assert torch.equal(r[n], v), f"{name} {n}: differs from the unsharded draw"
