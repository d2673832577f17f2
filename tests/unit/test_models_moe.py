"""Mixture-of-experts families (Qwen3-MoE, Mixtral, Qwen3.5-MoE) against transformers' eager experts.

Tiny random models made by transformers are the reference: E = 8 experts (Qwen3.5-MoE: 6), top-2, and expert
widths with 2I != H so a transposed expert tensor cannot pass. The batch has right padding,
which transformers' ``attention_mask`` leaves out of the load-balancing loss.
"""

from __future__ import annotations

import dataclasses

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from torch.distributed.tensor import DTensor, Shard

from shardtune.inference.generation import generate
from shardtune.models import LlamaForCausalLM, from_hf_config, model_args_from_hf_config, model_args_to_hf_config
from shardtune.models.blocks.experts import expert_shard_placement
from shardtune.models.moe_aux import Routing
from shardtune.models.moe_kernels import grouped_experts, looped_experts
from shardtune.training.flops import flops_per_token_fn
from tests.unit.test_models_families import COMMON as DENSE_COMMON

VOCAB, SEQ, PAD = 128, 40, 9  # the second row's last PAD tokens are padding
TOL = 1e-4  # max |ours - hf| / max |hf|
ATOL = {"qwen3_5_moe_text": 1e-4}  # max |ours - hf| where not 1e-5: the chunked delta rule sums in another order
COMMON = {**DENSE_COMMON, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.05}  # each config sets its widths
MOE_CONFIGS = {
    # layer 1 dense (mlp_only_layers), experts 2I = 48 != H = 64; dense intermediate 96
    "qwen3_moe": (
        transformers.Qwen3MoeConfig,
        {"intermediate_size": 96, "moe_intermediate_size": 24, "num_experts": 8, "mlp_only_layers": [1]},
    ),
    # renormalized top-k; every 2nd layer sparse; a head_dim of its own and q/k/v/o biases
    "qwen3_moe_step2": (
        transformers.Qwen3MoeConfig,
        {
            "num_hidden_layers": 4,
            "intermediate_size": 96,
            "moe_intermediate_size": 40,
            "num_experts": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 2,
            "head_dim": 24,
            "attention_bias": True,
        },
    ),
    "mixtral": (transformers.MixtralConfig, {"intermediate_size": 24, "num_local_experts": 8, "sliding_window": 8}),
    # hybrid layers (Gated DeltaNet, gated attention); 6 experts 2I = 48 != H = 64, a gated shared expert of 40
    "qwen3_5_moe_text": (
        transformers.Qwen3_5MoeTextConfig,
        {
            "head_dim": 16,
            "layer_types": ["linear_attention", "full_attention", "linear_attention"],
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 8,
            "num_experts": 6,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40,
        },
    ),
}


def moe_config(name: str, **changes):
    cls, kw = MOE_CONFIGS[name]
    return cls(**{**COMMON, **kw, **changes})


def hf_moe_model(name: str, seed: int = 0, **changes):
    torch.manual_seed(seed)
    config = moe_config(name, **changes)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager"
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "gate.weight" in n else 0.1) + ("norm" in n))
    return model


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, -PAD:] = 0
    labels = tokens.masked_fill(mask == 0, -100)
    return tokens, mask, labels


def ours_from(hf) -> torch.nn.Module:
    model = from_hf_config(hf.config.to_dict())
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def worst_grad(model, reference: dict[str, torch.Tensor]) -> float:
    """The largest relative gap between ``model``'s gradients (sharded ones gathered) and ``reference``
    (by name; activation checkpointing's wrapper prefix dropped)."""
    worst = 0.0
    for n, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        worst = max(worst, _rel(grad, reference[n.replace("_checkpoint_wrapped_module.", "")]))
    return worst


def check_equals_transformers(hf, ours, *, every_grad_nonzero: bool = False) -> None:
    """Keys and shapes, logits, each routed layer's router logits, aux loss, loss and every gradient of
    ``ours`` equal ``hf``'s on a padded batch."""
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [(k, v.shape) for k, v in hf.state_dict().items()]
    tokens, mask, labels = batch()
    out = hf(tokens, attention_mask=mask, labels=labels, output_router_logits=True)
    loss, routing, logits = _loss(ours, tokens, mask, labels, hf.config.router_aux_loss_coef)
    real = mask.bool()
    assert _rel(logits[real], out.logits[real]) < TOL
    hf_router = [r for r in out.router_logits if r is not None]
    routed = [
        i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate") or hasattr(layer.mlp, "router")
    ]
    assert sorted(routing.router_logits) == routed and len(hf_router) == len(routed)
    for i, expected in zip(routed, hf_router, strict=True):
        assert _rel(routing.router_logits[i][real.flatten()], expected[real.flatten()]) < TOL
    assert abs(routing.aux_loss().item() - out.aux_loss.item()) < 1e-6 * out.aux_loss.item()
    assert abs(loss.item() - out.loss.item()) < 1e-5
    loss.backward()
    out.loss.backward()
    hf_grads = dict(hf.named_parameters())
    for n, p in ours.named_parameters():
        assert not every_grad_nonzero or hf_grads[n].grad.abs().max() > 0, n
        assert _rel(p.grad, hf_grads[n].grad) < 1e-4, n


def _loss(model, tokens, mask, labels, coef: float) -> tuple[torch.Tensor, Routing, torch.Tensor]:
    routing = Routing(mask=mask)
    logits = model(tokens, routing=routing)
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    return routing.add_to(ce, coef), routing, logits


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_keys_logits_router_logits_aux_loss_and_grads_equal_transformers(name):
    hf = hf_moe_model(name)
    check_equals_transformers(hf, ours_from(hf))


def test_aux_loss_gradient_reaches_the_routers():
    """Only the aux loss's gradient: the routers' grads equal transformers' for ``coef * aux_loss`` alone."""
    hf = hf_moe_model("qwen3_moe")
    ours = ours_from(hf)
    tokens, mask, _ = batch()
    routing = Routing(mask=mask)
    logits = ours(tokens, routing=routing)
    routing.add_to(logits.sum() * 0, 3.0).backward()
    out = hf(tokens, attention_mask=mask, output_router_logits=True)
    (3.0 * out.aux_loss).backward()
    gates = [n for n, _ in hf.named_parameters() if n.endswith("mlp.gate.weight")]
    hf_grads, ours_grads = dict(hf.named_parameters()), dict(ours.named_parameters())
    for n in gates:
        assert hf_grads[n].grad.abs().max() > 0
        assert _rel(ours_grads[n].grad, hf_grads[n].grad) < 1e-4, n


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen3_5_moe_text"])
def test_fused_hf_dir_loads_with_equal_logits_and_config_round_trips(name, tmp_path):
    hf = hf_moe_model(name).eval()
    hf.save_pretrained(tmp_path, save_original_format=False)
    args = model_args_from_hf_config(tmp_path)
    ours = from_hf_config(tmp_path)
    ours.load_state_dict(safetensors.torch.load_file(tmp_path / "model.safetensors"), strict=True)
    tokens, _, _ = batch()
    with torch.no_grad():
        expected = hf(tokens).logits
        assert _rel(ours(tokens), expected) < TOL
        # the config we write builds the same transformers model
        rebuilt = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(**model_args_to_hf_config(args)), experts_implementation="eager"
        )
        rebuilt.load_state_dict(ours.state_dict(), strict=True)
        assert _rel(rebuilt(tokens).logits, expected) < TOL


def test_grouped_mm_equals_the_loop_in_bf16_on_cpu():
    """bf16 on CPU: forward and grads agree to bf16 resolution (bitwise on the machine this was written on)."""
    gen = torch.Generator().manual_seed(0)
    experts, dim, inter = 8, 64, 24
    counts = torch.tensor([5, 0, 7, 1, 0, 9, 3, 6])  # empty groups included
    x = torch.randn(int(counts.sum()), dim, generator=gen).bfloat16()
    gate_up = (torch.randn(experts, 2 * inter, dim, generator=gen) * 0.2).bfloat16()
    down = (torch.randn(experts, dim, inter, generator=gen) * 0.2).bfloat16()
    results = []
    for kernel in (grouped_experts, looped_experts):
        leaves = [t.clone().requires_grad_() for t in (x, gate_up, down)]
        y = kernel(leaves[0], counts, leaves[1], leaves[2], F.silu)
        y.float().square().sum().backward()
        results.append([y, *(t.grad for t in leaves)])
    for got, expected in zip(*results):
        assert _rel(got.float(), expected.float()) < 1e-2


def test_bf16_model_runs_grouped_mm_close_to_fp32():
    hf = hf_moe_model("qwen3_moe")
    ours = ours_from(hf)
    tokens, mask, labels = batch()
    loss32 = _loss(ours, tokens, mask, labels, 0.05)[0]
    ours16 = ours.to(torch.bfloat16)
    loss16 = _loss(ours16, tokens, mask, labels, 0.05)[0]
    loss16.backward()
    assert abs(loss16.item() - loss32.item()) < 2e-2 * loss32.item()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in ours16.parameters())


def test_expert_placement_is_the_expert_dim_when_the_shard_group_divides_it():
    model = from_hf_config(moe_config("qwen3_moe").to_dict(), device="meta")
    experts = model.model.layers[0].mlp.experts
    assert expert_shard_placement(model, 4)(experts.gate_up_proj) == Shard(0)
    place3 = expert_shard_placement(model, 3)
    assert place3(experts.down_proj) == Shard(1) and place3(model.model.layers[0].mlp.gate.weight) is None
    assert (
        expert_shard_placement(from_hf_config(moe_config("qwen3_moe").to_dict() | {"model_type": "qwen3"}), 2) is None
    )


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen3_5_moe_text"])
def test_greedy_generation_with_the_kv_cache_equals_transformers(name):
    hf = hf_moe_model(name).eval()
    ours = ours_from(hf).eval()
    prompt = batch()[0][0, :12].tolist()  # longer than Mixtral's sliding window
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :].tolist()
    assert generate(ours, prompt, max_new_tokens=10, device="cpu") == expected


def test_flops_count_the_active_experts():
    model = from_hf_config(moe_config("qwen3_moe").to_dict(), device="meta")
    h, vocab, experts_per_token = 64, VOCAB, 2
    attention = 2 * h * h + 2 * h * (2 * 16)  # q, o: h x h; k, v: h x (2 kv heads x head_dim 16)
    sparse = h * 8 + experts_per_token * 3 * h * 24  # router + 2 of 8 experts of width 24
    dense = 3 * h * 96
    norms = 3 * (2 * h + 2 * 16) + h  # per layer 2 norms + q/k norms; the final norm
    weights = 3 * attention + 2 * sparse + dense + vocab * h + norms  # 3 layers, layer 1 dense; lm_head
    assert flops_per_token_fn(model)(SEQ) == 6 * weights + 12 * 3 * 4 * 16 * SEQ


def test_experts_a_config_cannot_express_are_refused():
    args = model_args_from_hf_config(moe_config("mixtral").to_dict())
    with pytest.raises(ValueError, match="norm_topk_prob=True"):
        model_args_to_hf_config(args.replace(moe=dataclasses.replace(args.moe, norm_topk_prob=False)))
    with pytest.raises(ValueError, match="model_type 'mixtral' needs experts"):
        model_args_to_hf_config(args.replace(moe=None))
    with pytest.raises(ValueError, match="model_type 'llama' has no experts"):
        LlamaForCausalLM(args.replace(model_type="llama"), device="meta")


def test_router_jitter_noise_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="router_jitter_noise"):
        model_args_from_hf_config(moe_config("mixtral", router_jitter_noise=0.1).to_dict())


def test_batches_mark_padding_for_the_aux_loss():
    """collate and packing give transformers' attention_mask: 1 on real tokens, 0 on padding."""
    from shardtune.data import collate
    from shardtune.data.packing import PackedDataset

    samples = [{"tokens": [5, 6, 7], "labels": [5, 6, 7]}, {"tokens": [8], "labels": [8]}]
    assert collate(samples, pad_id=0)["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    packs = PackedDataset(samples, max_seq_len=6, pad_id=0)
    assert collate([packs[0]], pad_id=0)["attention_mask"].tolist() == [[1, 1, 1, 1, 0, 0]]
