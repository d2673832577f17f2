"""LoRA on experts under expert parallelism on 4 gloo ranks, against peft in one process: a tiny Qwen3-MoE
(E=8, 2I != H) with adapters on attention, the router and both expert weights (from a peft-saved adapter
with every factor random), each rank its own batch. At expert_parallel=2 the loss, clipped norm and every
adapter gradient equal expert_parallel=1 (fp32, 1e-5) and peft's; the adapter is written in place in PEFT's
format (no rank gathers it) with the same bytes at both degrees; adapter and optimizer state saved after a
step at expert_parallel=2 load at 1 and 4 with every expert's factors and moments bitwise. QLoRA (NF4 experts,
each rank quantizing its own): loss and adapter gradients at expert_parallel 2 and 4 equal 1. Under NCCL's rules.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import Replicate

from shardtune.checkpoint import load_peft_adapter, save_peft_adapter
from shardtune.checkpoint.formats.optimizer_io import load_optimizer, save_optimizer
from shardtune.models import from_hf_config
from shardtune.peft import apply_lora
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training import load_from_full_model_state_dict
from shardtune.training.grad_norm import clip_grad_norm
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(300)

MAX_NORM = 0.05  # below the adapters' gradient norm: clipping scales every gradient
SMALL = {"num_hidden_layers": 2, "mlp_only_layers": [1]}
NF4 = {"quantize_base": True, "block_size": 64, "scaler_block_size": 8}  # whole groups of each expert's slice


def _model(hf, peft_dir: Path, degree: int, *, quantize: bool = False):
    from tests.unit.test_lora_moe import ALPHA, MODULES, PARAMETERS, RANK

    lora = {"rank": RANK, "alpha": ALPHA, "target_modules": MODULES, "target_parameters": PARAMETERS}
    with torch.device("meta"):
        model = from_hf_config(hf.config.to_dict())
        apply_lora(model, **lora, **(NF4 if quantize else {}))
    shard_model(model, mesh=make_mesh(expert_parallel=degree))
    load_from_full_model_state_dict(model, hf.state_dict() if dist.get_rank() == 0 else {}, "cpu", strict=False)
    model.init_buffers("cpu")
    load_peft_adapter(model, peft_dir, device="cpu")
    return model


def _optimizer(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().full_tensor() for n, p in model.named_parameters() if p.requires_grad}


def _moments(model, opt) -> dict[str, torch.Tensor]:
    names = {p: n for n, p in model.named_parameters()}
    return {f"{names[p]}.{k}": v.full_tensor() for p, s in opt.state.items() for k, v in s.items() if k != "step"}


def _step(hf, peft_dir: Path, degree: int, out: Path) -> dict:
    """One clipped step at ``degree``; the adapter saved before it, adapter and optimizer after it."""
    from tests.unit.test_models_moe import _loss, batch

    model = _model(hf, peft_dir, degree)
    tokens, mask, labels = batch(seed=1 + dist.get_rank())
    opt = _optimizer(model)
    with nccl_rules() as rules:
        rules.host(tokens, mask, labels)
        loss = _loss(model, tokens, mask, labels, hf.config.router_aux_loss_coef)[0]
        loss.backward()
        norm = clip_grad_norm(model.parameters(), MAX_NORM)
        save_peft_adapter(model, out / f"loaded_ep{degree}")
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    save_peft_adapter(model, out / f"step_ep{degree}")
    save_optimizer(model, opt, out / f"step_ep{degree}")
    factor = model.model.layers[0].mlp.experts.lora_B.weight
    return {
        "loss": loss.item(),
        "norm": norm.item(),
        "grads": grads if dist.get_rank() == 0 else None,
        "factor": (tuple(factor.device_mesh.mesh_dim_names or ()), tuple(factor.placements)),
        "after": (_adapters(model), _moments(model, opt)),
    }


def _resumed(hf, peft_dir: Path, degree: int, out: Path) -> tuple[dict, dict]:
    """Adapter and optimizer saved at expert_parallel=2 loaded into a fresh model at ``degree``."""
    model = _model(hf, peft_dir, degree)
    load_peft_adapter(model, out / "step_ep2", device="cpu")
    opt = _optimizer(model)
    load_optimizer(model, opt, out / "step_ep2", device="cpu")
    return _adapters(model), _moments(model, opt)


def _run(peft_dir: str, out: str) -> dict:
    from tests.unit.test_models_moe import hf_moe_model

    hf, adapter, out_dir = hf_moe_model("qwen3_moe", **SMALL), Path(peft_dir), Path(out)
    steps = {degree: _step(hf, adapter, degree, out_dir) for degree in (1, 2)}
    resumed = {degree: _resumed(hf, adapter, degree, out_dir) for degree in (1, 4)}
    dist.barrier()
    return {"steps": steps, "resumed": resumed}


def _reference(peft_dir: Path, ranks: int) -> tuple[list[float], dict[str, torch.Tensor], float]:
    """peft in one process: each rank's loss, and the clipped adapter gradients of their mean."""
    import peft

    from tests.unit.test_models_moe import batch, hf_moe_model

    pm = peft.PeftModel.from_pretrained(hf_moe_model("qwen3_moe", **SMALL), peft_dir, is_trainable=True)
    losses = []
    for rank in range(ranks):
        tokens, mask, labels = batch(seed=1 + rank)
        out = pm(tokens, attention_mask=mask, labels=labels, output_router_logits=True)
        (out.loss / ranks).backward()
        losses.append(out.loss.item())
    trainable = [p for p in pm.parameters() if p.requires_grad]
    norm = torch.nn.utils.clip_grad_norm_(trainable, MAX_NORM).item()
    return losses, {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if p.requires_grad}, norm


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def test_expert_lora_at_expert_parallel_2_equals_1_and_peft_and_resumes_at_any_degree(pool4, tmp_path):
    from tests.unit.test_lora_moe import _peft
    from tests.unit.test_models_moe import hf_moe_model

    pm = _peft(hf_moe_model("qwen3_moe", **SMALL))
    pm.save_pretrained(tmp_path / "peft")
    res = pool4.run_ok(_run, str(tmp_path / "peft"), str(tmp_path / "out"), timeout=280)
    losses, peft_grads, peft_norm = _reference(tmp_path / "peft", 4)
    for rank, r in enumerate(res):
        one, two = r["steps"][1], r["steps"][2]
        assert abs(two["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"]), (rank, two["loss"], one["loss"])
        assert abs(two["loss"] - losses[rank]) <= 1e-5 * abs(losses[rank]), (rank, two["loss"], losses[rank])
        assert abs(two["norm"] - one["norm"]) <= 1e-5 * one["norm"] and abs(two["norm"] - peft_norm) <= 1e-4 * peft_norm
        # the factors are replicated over ep and FSDP2-sharded over efsdp
        assert two["factor"][0] == ("efsdp", "ep") and two["factor"][1][1] == Replicate(), two["factor"]
    grads = {degree: res[0]["steps"][degree]["grads"] for degree in (1, 2)}
    assert sorted(grads[2]) == sorted(grads[1]) and len(grads[2]) == 14  # 2 q/v + router + 2 expert weights, A and B
    for name, grad in grads[2].items():
        assert _rel(grad, grads[1][name]) < 1e-5, name  # expert parallel == data parallel
        key = "base_model.model." + name.replace("_checkpoint_wrapped_module.", "")
        assert _rel(grad, peft_grads[key]) < 1e-4, name
    # the loaded adapter, written in place at both degrees, is peft's file byte for byte
    theirs = load_file(tmp_path / "peft/adapter_model.safetensors")
    for degree in (1, 2):
        mine = load_file(tmp_path / f"out/loaded_ep{degree}/adapter_model.safetensors")
        assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], v) for k, v in theirs.items()), degree
    # every expert's factors and moments saved at ep 2 come back at ep 1 and 4, not one rank's copy
    params, moments = res[0]["steps"][2]["after"]
    assert len(moments) == 2 * len(params)
    for degree in (1, 4):
        got_params, got_moments = res[0]["resumed"][degree]
        assert all(torch.equal(got_params[k], v) for k, v in params.items()), degree
        assert sorted(got_moments) == sorted(moments) and all(
            torch.equal(got_moments[k], v) for k, v in moments.items()
        )
    key = "model.layers.0.mlp.experts.lora_B.weight"
    assert not torch.equal(params[key], theirs[f"base_model.model.{key}"])  # the step moved the expert adapters


def _qlora_step(peft_dir: str, out: str) -> dict:
    """Loss and adapter gradients over NF4 experts at expert_parallel 1, 2 and 4 (4: one rank per expert
    group's efsdp, where FSDP2 leaves the NF4 experts alone); the adapter saved at 4."""
    from shardtune.state_dict.layout import local_tensor
    from shardtune.state_dict.nf4 import is_nf4_experts
    from tests.unit.test_models_moe import _loss, batch, hf_moe_model

    hf = hf_moe_model("qwen3_moe", **SMALL)
    tokens, mask, labels = batch(seed=1 + dist.get_rank())
    res = {}
    for degree in (1, 2, 4):
        model = _model(hf, Path(peft_dir), degree, quantize=True)
        with nccl_rules() as rules:
            rules.host(tokens, mask, labels)
            loss = _loss(model, tokens, mask, labels, hf.config.router_aux_loss_coef)[0]
            loss.backward()
            if degree == 4:
                save_peft_adapter(model, Path(out) / "qlora_ep4")
        experts = model.model.layers[0].mlp.experts.gate_up_proj
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
        res[degree] = {"loss": loss.item(), "nf4": is_nf4_experts(local_tensor(experts)), "grads": grads}
    return res


def test_qlora_on_experts_at_expert_parallel_2_and_4_equals_1(pool4, tmp_path):
    from tests.unit.test_lora_moe import _peft
    from tests.unit.test_models_moe import hf_moe_model

    _peft(hf_moe_model("qwen3_moe", **SMALL)).save_pretrained(tmp_path / "peft")
    res = pool4.run_ok(_qlora_step, str(tmp_path / "peft"), str(tmp_path / "out"), timeout=200)
    for rank, r in enumerate(res):
        assert all(r[degree]["nf4"] for degree in (1, 2, 4)), rank
        for degree in (2, 4):
            assert abs(r[degree]["loss"] - r[1]["loss"]) <= 1e-5 * abs(r[1]["loss"]), (rank, degree, r[degree]["loss"])
            for name, grad in r[degree]["grads"].items():
                assert _rel(grad, r[1]["grads"][name]) < 1e-5, (rank, degree, name)
    assert len(res[0][4]["grads"]) == 14
    theirs = load_file(tmp_path / "peft/adapter_model.safetensors")
    mine = load_file(tmp_path / "out/qlora_ep4/adapter_model.safetensors")
    assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], v) for k, v in theirs.items())


def _fresh_factors_agree() -> bool:
    """Fresh adapters (``init_lora_parameters``, as the recipes start) at expert_parallel=2: each factor's
    copies on the ranks of an expert group are equal (replicas that differed would train apart)."""
    from shardtune.peft import init_lora_parameters
    from shardtune.peft.param_lora import adapted_modules
    from tests.unit.test_lora_moe import ALPHA, PARAMETERS, RANK
    from tests.unit.test_models_moe import moe_config

    torch.manual_seed(0)
    with torch.device("meta"):
        model = from_hf_config(moe_config("qwen3_moe", **SMALL).to_dict())
        apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=[], target_parameters=PARAMETERS)
    shard_model(model, mesh=make_mesh(expert_parallel=2))
    init_lora_parameters(model, device="cpu")
    agree = []
    for _, module in adapted_modules(model):
        for adapter in module.adapters.values():
            factor = adapter.lora_A.weight
            if "ep" not in (factor.device_mesh.mesh_dim_names or ()):
                continue  # the router's adapters: dense
            group = factor.device_mesh.get_group("ep")
            copies = [torch.empty_like(factor.to_local()) for _ in range(group.size())]
            dist.all_gather(copies, factor.to_local().contiguous(), group=group)
            agree += [torch.equal(c, copies[0]) and c.abs().sum() > 0 for c in copies]
    return len(agree) == 4 and all(agree)


def test_fresh_expert_adapters_are_equal_on_every_rank_of_an_expert_group(pool4):
    assert all(pool4.run_ok(_fresh_factors_agree, timeout=120))
