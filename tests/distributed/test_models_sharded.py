"""shardtune models under FSDP2 against single-process references (transformers and unsharded)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from shardtune.models import ModelArgs, build_model
from shardtune.peft import apply_lora
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training import gather_cpu_state_dict, load_from_full_model_state_dict

pytestmark = pytest.mark.timeout(240)

ARGS = ModelArgs(
    vocab_size=128,
    dim=256,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    intermediate_size=512,
    tie_word_embeddings=True,
    norm_eps=1e-6,
    rope_theta=10000.0,
)


def _hf_model():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))


def _hf_logits_under_sharding(mode: str, replicate: int, checkpointing: bool):
    hf = _hf_model()
    hf_sd = hf.state_dict()
    with torch.device("meta"):
        model = build_model(ARGS)
    shard_model(model, mesh=make_mesh(replicate=replicate), activation_checkpointing=checkpointing)
    keys = load_from_full_model_state_dict(
        model, hf_sd if mode == "every_rank" or dist.get_rank() == 0 else {}, "cpu", strict=True
    )
    model.init_buffers("cpu")
    tokens = _tokens()
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    return {
        "diff": diff,
        "missing": keys.missing_keys,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "placements": str(
            model.model.layers[0].mlp.up_proj.weight.placements
            if not checkpointing
            else model.model.layers[0]._checkpoint_wrapped_module.mlp.up_proj.weight.placements
        ),
    }


@pytest.mark.parametrize("mode", ["every_rank", "rank0"])
def test_hf_state_dict_reproduces_hf_logits_sharded(pool2, mode):
    res = pool2.run_ok(_hf_logits_under_sharding, mode, 1, False)
    assert all(r["diff"] <= 1e-4 and r["missing"] == [] and r["tied"] for r in res)
    assert res[0]["placements"] == "(Shard(dim=0),)"


def test_hsdp_and_activation_checkpointing(pool4):
    res = pool4.run_ok(_hf_logits_under_sharding, "rank0", 2, True)
    assert all(r["diff"] <= 1e-4 and r["missing"] == [] for r in res)
    assert res[0]["placements"] == "(Replicate(), Shard(dim=0))"


def _loss(model, tokens):
    logits = model(tokens)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _forward_backward_matches_reference(lora: bool):
    torch.manual_seed(1)
    reference = build_model(ARGS)
    if lora:
        apply_lora(reference, rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
        with torch.no_grad():
            for name, p in reference.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.02)
    full_sd = reference.state_dict()
    with torch.device("meta"):
        model = build_model(ARGS)
        if lora:
            apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    shard_model(model)
    load_from_full_model_state_dict(model, full_sd, "cpu", strict=True)
    model.init_buffers("cpu")
    tokens = _tokens()
    loss = _loss(model, tokens)
    loss.backward()
    ref_loss = _loss(reference, tokens)
    ref_loss.backward()
    # Gradients are sharded DTensors (averaged over ranks, which all saw the same batch).
    worst, names = 0.0, []
    for (name, p), (_, ref_p) in zip(model.named_parameters(), reference.named_parameters()):
        if p.grad is None:
            assert ref_p.grad is None, name
            continue
        names.append(name)
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, (grad - ref_p.grad).abs().max().item())
    return {
        "loss": abs(loss.item() - ref_loss.item()),
        "grad": worst,
        "n_grads": len(names),
        "only_lora": all("lora" in n for n in names),
    }


@pytest.mark.parametrize("lora", [False, True])
def test_sharded_forward_backward_equals_single_process(pool2, lora):
    res = pool2.run_ok(_forward_backward_matches_reference, lora)
    for r in res:
        assert r["loss"] < 1e-5 and r["grad"] < 1e-5
        assert r["only_lora"] == lora and r["n_grads"] == (
            12 if lora else 20
        )  # 9 per layer + embedding (tied head) + norm


def _qlora_round_trip():
    torch.manual_seed(2)
    reference = build_model(ARGS)
    base_sd = reference.state_dict()
    with torch.device("meta"):
        model = build_model(ARGS)
        apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], quantize_base=True)
    shard_model(model)
    keys = load_from_full_model_state_dict(model, base_sd if dist.get_rank() == 0 else {}, "cpu")
    from shardtune.peft import init_lora_parameters

    init_lora_parameters(model, device="cpu")
    model.init_buffers("cpu")
    out = gather_cpu_state_dict(model, dist.get_rank() == 0)
    nf4_local = type(model.model.layers[0].self_attn.q_proj.weight._local_tensor).__name__
    if dist.get_rank() != 0:
        return {"nf4": nf4_local}
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    q = "model.layers.1.self_attn.q_proj.weight"
    return {
        "nf4": nf4_local,
        "q_equal": torch.equal(out[q], to_nf4(base_sd[q]).get_original_weight()),
        "missing_lora_only": all("lora" in k for k in keys.missing_keys),
    }


def test_qlora_model_loads_sharded_nf4(pool2):
    res = pool2.run_ok(_qlora_round_trip)
    assert res[0]["q_equal"] and res[0]["missing_lora_only"]
    assert res[0]["nf4"] == res[1]["nf4"] == "NF4Tensor"


def _compiled_layers_keep_their_names():
    with torch.device("meta"):
        model = build_model("tiny", dtype=torch.float32)
    names = list(model.state_dict())
    shard_model(model, activation_checkpointing=True, compile=True)
    compiled = [getattr(layer, "_compiled_call_impl", None) is not None for layer in model.model.layers]
    return compiled, list(model.state_dict()) == names


def test_compile_compiles_every_layer_in_place(pool2):
    for compiled, same_names in pool2.run_ok(_compiled_layers_keep_their_names):
        assert compiled and all(compiled)
        assert same_names


def _units_gathered_after_forward(frozen: bool):
    """Which units hold gathered (plain, not DTensor) params after a training forward, then after backward."""
    with torch.device("meta"):
        model = build_model(dataclasses.replace(ARGS, n_layers=3, layer_types=None))
    shard_model(model, frozen=frozen)
    torch.manual_seed(0)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.init_buffers("cpu")

    def gathered() -> list[bool]:
        units = [model.model.embed_tokens.weight, *(layer.mlp.up_proj.weight for layer in model.model.layers)]
        return [not isinstance(w, DTensor) for w in units]

    loss = _loss(model, _tokens())
    after_forward = gathered()
    loss.backward()
    return after_forward, gathered()


@pytest.mark.parametrize("frozen", [False, True])
def test_root_and_last_layer_stay_gathered_until_backward(pool2, frozen):
    """Backward starts with the root (head) and the last layer: they are not resharded after a training
    forward (unless ``frozen``), every other layer is; after backward every unit is sharded again."""
    for after_forward, after_backward in pool2.run_ok(_units_gathered_after_forward, frozen):
        n = len(after_forward) - 1
        assert after_forward == ([False] * (n + 1) if frozen else [True, *[False] * (n - 1), True])
        assert after_backward == [False] * (n + 1)
