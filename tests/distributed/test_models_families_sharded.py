"""The unusual families (soft-capping, sliding windows, fused projections, QK-norm) under FSDP2 against
single-process references: transformers for plain bases, the unsharded model for QLoRA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shardtune.models import from_hf_config
from shardtune.peft import apply_lora, init_lora_parameters
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training import load_from_full_model_state_dict

pytestmark = pytest.mark.timeout(240)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LINEAR_ATTENTION_TARGETS = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def _sharded_vs_single_process(name: str, qlora: bool):
    from tests.unit.test_models_families import hf_model, tokens

    hf = hf_model(name)
    full_sd = hf.state_dict()
    lora = {
        "rank": 4,
        "alpha": 8,
        "target_modules": TARGETS,
        "quantize_base": True,
        "block_size": 32,
        "scaler_block_size": 32,
    }
    with torch.device("meta"):
        model = from_hf_config(hf.config.to_dict())
        if qlora:
            apply_lora(model, **lora)
    shard_model(model, mesh=make_mesh(replicate=1))
    keys = load_from_full_model_state_dict(model, full_sd if dist.get_rank() == 0 else {}, "cpu", strict=not qlora)
    if qlora:
        init_lora_parameters(model, device="cpu")
    model.init_buffers("cpu")
    model.eval()
    x = tokens()
    with torch.no_grad():
        got = model(x)
        if qlora:  # fresh adapters are the identity: the reference is the same QLoRA model, unsharded
            reference = apply_lora(from_hf_config(hf.config.to_dict()), **lora)
            reference.load_state_dict(full_sd, strict=False)
            expected = reference.eval()(x)
        else:
            expected = hf(x).logits
    shard_type = type(model.model.layers[0].mlp.down_proj.weight._local_tensor).__name__
    return {"diff": _rel(got, expected), "unexpected": keys.unexpected_keys, "type": shard_type}


@pytest.mark.parametrize(
    "name",
    [
        *("mistral", "qwen2_tied", "qwen2_sliding", "qwen3", "gemma2", "phi3", "gemma3_text", "qwen3_5_text"),
        *("gemma4_text", "gemma4_text_per_layer_inputs", "gemma4_text_moe"),
    ],
)
def test_sharded_forward_equals_transformers(pool2, name):
    res = pool2.run_ok(_sharded_vs_single_process, name, False)
    assert all(r["diff"] <= 1e-4 and r["unexpected"] == [] for r in res), res


@pytest.mark.parametrize("name", ["gemma2", "phi3", "qwen3_5_text"])
def test_sharded_qlora_equals_single_process(pool2, name):
    res = pool2.run_ok(_sharded_vs_single_process, name, True)
    assert all(r["diff"] <= 1e-4 and r["type"] == "NF4Tensor" for r in res), res


def _loss(model, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _sharded_lora_backward(name: str):
    from tests.unit.test_models_families import hf_model, tokens

    hf = hf_model(name)
    targets = TARGETS + (LINEAR_ATTENTION_TARGETS if name == "qwen3_5_text" else [])
    lora = {"rank": 4, "alpha": 8, "target_modules": targets}
    reference = apply_lora(from_hf_config(hf.config.to_dict()), **lora)
    reference.load_state_dict(hf.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    full_sd = reference.state_dict()
    with torch.device("meta"):
        model = apply_lora(from_hf_config(hf.config.to_dict()), **lora)
    shard_model(model, mesh=make_mesh(replicate=1), activation_checkpointing=True)
    load_from_full_model_state_dict(model, full_sd if dist.get_rank() == 0 else {}, "cpu", strict=True)
    model.init_buffers("cpu")
    x = tokens()
    loss, ref_loss = _loss(model, x), _loss(reference, x)
    loss.backward()
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    grads = {}
    for n, p in model.named_parameters():
        if p.grad is not None:
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[n.replace("_checkpoint_wrapped_module.", "")] = grad
    worst = max((grads[n] - g).abs().max().item() / g.abs().max().item() for n, g in ref_grads.items())
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": worst, "names": sorted(grads) == sorted(ref_grads)}


@pytest.mark.parametrize("name", ["gemma2", "phi3", "qwen3_5_text", "gemma4_text_per_layer_inputs"])
def test_sharded_lora_backward_with_checkpointing_equals_single_process(pool2, name):
    res = pool2.run_ok(_sharded_lora_backward, name)
    assert all(r["loss"] < 1e-5 and r["grad"] < 1e-4 and r["names"] for r in res), res


def _sharded_full_backward(name: str, checkpointing: str):
    """Every parameter's gradient of a sharded full fine-tune (packed rows, activation checkpointing)
    against transformers run unsharded on each sample alone."""
    from tests.unit.test_models_families import hf_model, tokens

    hf = hf_model(name)
    with torch.device("meta"):
        model = from_hf_config(hf.config.to_dict())
    shard_model(model, mesh=make_mesh(replicate=1), activation_checkpointing=checkpointing)
    load_from_full_model_state_dict(model, hf.state_dict() if dist.get_rank() == 0 else {}, "cpu", strict=True)
    model.init_buffers("cpu")
    samples = [tokens(batch=1, seq=n, seed=20 + i) for i, n in enumerate((25, 15))]
    row = torch.cat(samples, dim=1)
    positions = torch.cat([torch.arange(s.shape[1]) for s in samples]).unsqueeze(0)
    loss = _loss_packed(model(row, position_ids=positions, sample_lengths=[[25, 15]]), samples)
    ref_loss = _loss_packed(torch.cat([hf(s).logits for s in samples], dim=1), samples)
    loss.backward()
    ref_loss.backward()
    ref = dict(hf.named_parameters())
    worst = 0.0
    for n, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        want = ref[n.replace("_checkpoint_wrapped_module.", "")].grad
        worst = max(worst, ((grad - want).abs().max() / want.abs().max()).item())
    return {"loss": abs(loss.item() - ref_loss.item()), "grad": worst}


def _loss_packed(logits: torch.Tensor, samples: list[torch.Tensor]) -> torch.Tensor:
    """Next-token loss within each sample of a packed row (no target across a boundary)."""
    losses, start = [], 0
    for s in samples:
        n = s.shape[1]
        losses.append(F.cross_entropy(logits[0, start : start + n - 1].float(), s[0, 1:], reduction="sum"))
        start += n
    return sum(losses) / sum(s.shape[1] - 1 for s in samples)


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_sharded_full_backward_of_a_packed_hybrid_equals_transformers(pool2, checkpointing):
    res = pool2.run_ok(_sharded_full_backward, "qwen3_5_text", checkpointing)
    assert all(r["loss"] < 1e-5 and r["grad"] < 1e-4 for r in res), res
