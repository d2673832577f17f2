"""GLM-4.5 (``glm4_moe``) and DeepSeek-V3's group-limited sigmoid router (``sigmoid_group_topk``) against
transformers' ``Glm4MoeForCausalLM``.

Tiny random models made by transformers are the reference (8 experts in 4 groups, top-2 of the best 2 groups,
weights scaled by 2.5; 2I = 48 != H = 64; a dense first layer; an ungated shared expert of 2 experts' width;
q/k/v biases; rotary on half the head; a random correction bias): logits, router logits, loss and gradients;
which experts each token picks (the bias must change it); both of transformers' expert file layouts loaded,
saved back to the same tensors and loaded by transformers; the bias a buffer no optimizer step moves, which
aux-loss-free balancing moves by hand-computed steps from transformers' routing; bad expert groups refused; the
GLM-4.5 presets' shapes and parameter counts on meta.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers

from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.models import LlamaForCausalLM, from_hf_config, model_args_from_hf_config, model_args_to_hf_config
from shardtune.models.moe_aux import Routing
from shardtune.models.registry import build_model, get_model_args
from shardtune.training.optim import build_optimizer
from shardtune.training.router_balance import balanced_routers, update_router_biases
from tests.unit.test_models_families import COMMON as DENSE_COMMON
from tests.unit.test_models_moe import _rel, batch, moe_config
from tests.unit.test_moe_checkpoint import tensors

TOL = 1e-4
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
GLM = {
    **DENSE_COMMON,
    "intermediate_size": 96,
    "moe_intermediate_size": 24,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 2,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "attention_bias": True,
    "use_qk_norm": True,
    "head_dim": 16,
    "num_nextn_predict_layers": 1,  # the hub's MTP layer: accepted, not part of the model
}


def glm_config(**changes) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model("glm4_moe", **{**GLM, **changes})


def hf_glm(seed: int = 0, **changes) -> transformers.PreTrainedModel:
    """A random tiny ``Glm4MoeForCausalLM`` (:func:`~tests.unit.test_deepseek_v3.random_grouped_moe`)."""
    from tests.unit.test_deepseek_v3 import random_grouped_moe

    return random_grouped_moe(glm_config(**changes), seed, bias_std=0.2)


def ours_from(hf) -> LlamaForCausalLM:
    model = from_hf_config(hf.config.to_dict())
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


@pytest.mark.parametrize(
    "changes",
    [{}, {"use_qk_norm": False, "n_group": 2, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0}],
    ids=["qk_norm", "no_qk_norm"],
)
def test_logits_router_logits_loss_and_grads_equal_transformers(changes):
    hf = hf_glm(**changes)
    ours = ours_from(hf)
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [(k, v.shape) for k, v in hf.state_dict().items()]
    assert ("model.layers.0.self_attn.q_norm.weight" in hf.state_dict()) == changes.get("use_qk_norm", True)
    tokens, mask, labels = batch()
    out = hf(tokens, attention_mask=mask, labels=labels, output_router_logits=True)
    routing = Routing(mask=mask)
    logits = ours(tokens, routing=routing)
    real = mask.bool()
    assert _rel(logits[real], out.logits[real]) < TOL
    assert sorted(routing.router_logits) == [1, 2]  # layer 0 is dense
    for i, expected in zip((1, 2), out.router_logits, strict=True):
        assert _rel(routing.router_logits[i][real.flatten()], expected[real.flatten()]) < TOL
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert abs(loss.item() - out.loss.item()) < 1e-5
    loss.backward()
    out.loss.backward()
    hf_grads = dict(hf.named_parameters())
    for n, p in ours.named_parameters():
        assert hf_grads[n].grad.abs().max() > 0, n
        assert _rel(p.grad, hf_grads[n].grad) < TOL, n


def test_router_picks_transformers_experts_and_the_correction_bias_changes_them():
    hf = hf_glm()
    ours = ours_from(hf)
    hf_gate, gate = hf.model.layers[1].mlp.gate, ours.model.layers[1].mlp.gate
    x = torch.randn(256, GLM["hidden_size"], generator=torch.Generator().manual_seed(3))
    bias = hf_gate.e_score_correction_bias.clone()

    def picks(router, biased: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts (ascending) and their weights, for transformers' router or ours."""
        with torch.no_grad():
            router.e_score_correction_bias.copy_(bias if biased else torch.zeros(8))
            if router is hf_gate:
                _, weights, indices = router(x)
            else:
                weights, indices = router.select(router(x))
        order = indices.argsort(dim=-1)
        return indices.gather(1, order), weights.gather(1, order)

    for biased in (True, False):
        expected, got = picks(hf_gate, biased), picks(gate, biased)
        assert torch.equal(got[0], expected[0])
        torch.testing.assert_close(got[1], expected[1], rtol=1e-6, atol=1e-6)
        assert got[1].dtype == torch.float32
    with_bias, without = picks(gate, True)[0], picks(gate, False)[0]
    changed = (with_bias != without).any(dim=-1)
    assert 0 < changed.sum() < len(x)  # the bias moves some tokens to other experts, not all
    # the weights are the unbiased scores: renormalized sigmoids of the chosen logits, times 2.5
    indices, weights = picks(gate, True)
    with torch.no_grad():
        scores = torch.sigmoid(gate(x)).gather(1, indices)
        ungrouped = torch.topk(torch.sigmoid(gate(x)) + bias, 2).indices.sort(dim=-1).values
    assert (ungrouped != indices).any()  # the group limit decides for some tokens
    torch.testing.assert_close(weights, 2.5 * scores / scores.sum(dim=-1, keepdim=True))


@pytest.mark.parametrize("per_expert", [True, False], ids=["per_expert", "fused"])
def test_hf_dirs_of_both_layouts_load_save_back_the_same_tensors_and_load_in_transformers(tmp_path, per_expert):
    hf = hf_glm().eval()
    hf.save_pretrained(tmp_path / "hf", save_original_format=per_expert)
    files = tensors(tmp_path / "hf")
    assert any(k.endswith(".mlp.experts.0.up_proj.weight") for k in files) == per_expert
    assert files[BIAS].dtype == torch.float32 and files[BIAS].abs().max() > 0
    with torch.device("meta"):
        ours = from_hf_config(tmp_path / "hf")
    load_hf_checkpoint(ours, tmp_path / "hf", device="cpu", strict=True)
    ours.init_buffers("cpu")
    assert torch.equal(ours.state_dict()[BIAS], files[BIAS])
    tokens = batch()[0]
    with torch.no_grad():
        expected = hf(tokens).logits
        assert _rel(ours(tokens), expected) < 1e-5
    save_hf_checkpoint(ours, tmp_path / "out", config=hf.config.to_dict())
    saved = tensors(tmp_path / "out")
    assert sorted(saved) == sorted(files)
    assert all(saved[k].dtype == v.dtype and torch.equal(saved[k], v) for k, v in files.items())
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        reference = load(tmp_path / "hf", experts_implementation="eager").eval()(tokens).logits
        assert torch.equal(load(tmp_path / "out", experts_implementation="eager").eval()(tokens).logits, reference)


def test_the_correction_bias_is_a_buffer_no_optimizer_step_moves():
    hf = hf_glm()
    ours = ours_from(hf)
    gate = ours.model.layers[1].mlp.gate
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    optimizer = build_optimizer(ours, lr=0.1)
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(gate.weight) in stepped and not gate.e_score_correction_bias.requires_grad
    assert not any(n.endswith("e_score_correction_bias") for n, _ in ours.named_parameters())
    tokens, _, labels = batch()
    logits = ours(tokens)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100).backward()
    optimizer.step()
    after = ours.state_dict()
    assert not torch.equal(after["model.layers.1.mlp.gate.weight"], before["model.layers.1.mlp.gate.weight"])
    for layer in (1, 2):
        key = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        assert torch.equal(after[key], before[key]) and after[key].dtype == torch.float32


def test_a_new_model_starts_with_a_zero_bias_as_transformers_does():
    model = build_model(get_model_args("tiny_glm4_moe"), device="cpu")
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.zeros(8))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"n_group": 3}, r"MoeArgs\.n_group \(3\) must divide the 8 experts.*config n_group"),
        ({"n_group": 8}, r"MoeArgs\.n_group \(8\) must divide the 8 experts into groups of at least 2"),
        ({"topk_group": 5}, r"MoeArgs\.topk_group \(5\) exceeds n_group \(4\); set config topk_group"),
        ({"topk_group": 1, "num_experts_per_tok": 3}, r"top_k \(3\) exceeds the experts of the topk_group=1 groups"),
        ({"n_shared_experts": 0}, "config n_shared_experts must be >= 1"),
        ({"n_group": True}, "n_group must be an integer"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(change, match):
    cfg = {**glm_config().to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        model_args_from_hf_config(cfg)


def test_group_routing_on_another_router_and_unexpressible_experts_are_refused():
    qwen = model_args_from_hf_config(moe_config("qwen3_moe").to_dict())
    with pytest.raises(ValueError, match="apply to group-limited sigmoid routers only.*'qwen3_moe' has none"):
        LlamaForCausalLM(qwen.replace(moe=dataclasses.replace(qwen.moe, n_group=2)), device="meta")
    args = model_args_from_hf_config(glm_config().to_dict())
    assert args.moe.shared_expert_intermediate_size == 48 and args.moe.mlp_only_layers == (0,)
    for change in ({"mlp_only_layers": (1,)}, {"shared_expert_intermediate_size": 40}, {"fp32_scores": False}):
        with pytest.raises(ValueError, match="first_k_dense_replace"):
            model_args_to_hf_config(args.replace(moe=dataclasses.replace(args.moe, **change)))


# zai-org/GLM-4.5 and GLM-4.5-Air: published totals 355B and 106B (without the multi-token-prediction layer their
# checkpoints add); transformers builds the same tensors from the config we write.
PRESETS = {"glm4_5_355b_a32b": (355, 92, True), "glm4_5_air_106b_a12b": (106, 46, False)}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_build_transformers_tensors_with_the_published_parameter_count(preset):
    billions, layers, qk_norm = PRESETS[preset]
    args = get_model_args(preset)
    config = transformers.AutoConfig.for_model(**model_args_to_hf_config(args))
    assert type(config) is transformers.Glm4MoeConfig
    assert (config.num_hidden_layers, config.use_qk_norm, config.head_dim) == (layers, qk_norm, 128)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5 and config.attention_bias
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    ours = build_model(args, device="meta")
    shapes = [(k, v.shape) for k, v in ours.state_dict().items()]
    assert shapes == [(k, v.shape) for k, v in reference.state_dict().items()]
    total = sum(p.numel() for p in reference.parameters())
    assert total == sum(p.numel() for p in ours.parameters())
    assert abs(total / 1e9 - billions) < 0.01 * billions


def test_the_tiny_preset_is_the_same_model_in_transformers():
    ours = build_model(get_model_args("tiny_glm4_moe"), device="cpu").eval()
    config = transformers.AutoConfig.for_model(**model_args_to_hf_config(ours.args))
    hf = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").eval()
    hf.load_state_dict(ours.state_dict(), strict=True)
    assert (config.n_group, config.topk_group, config.routed_scaling_factor) == (4, 2, 2.5)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _rel(ours(tokens), hf(tokens).logits) < TOL


RATE = 2.0**-6  # exact in binary: the hand computation below gives the same floats


def test_a_bias_update_moves_each_expert_by_the_rate_towards_its_layer_mean_load():
    routers = ours_from(hf_glm()).model.layers[1:]
    routers = [layer.mlp.gate for layer in routers]
    before = [r.e_score_correction_bias.clone() for r in routers]
    loads = torch.tensor([5, 0, 3, 8, 2, 2, 0, 4] + [3, 3, 3, 3, 3, 3, 3, 3], dtype=torch.float64)
    update_router_biases(routers, loads, rate=RATE)
    # layer 1's mean load is 3: an expert above it -rate, below it +rate, at it 0; layer 2 is even
    by_hand = [[-1, +1, 0, -1, +1, +1, +1, -1], [0] * 8]
    for router, old, signs in zip(routers, before, by_hand, strict=True):
        assert torch.equal(router.e_score_correction_bias, old + RATE * torch.tensor(signs, dtype=torch.float32))
    with pytest.raises(ValueError, match="router_bias_update_rate: 8 expert loads for 2 routers"):
        update_router_biases(routers, loads[:8], rate=RATE)


def test_the_loop_moves_the_biases_after_each_step_by_transformers_routing_of_the_real_tokens():
    """Two steps of two micro-batches (one row padded), weights frozen (lr 0): each step's loads are the
    experts transformers' routers pick for the step's real tokens (with the biases of that step), and the
    biases after the loop are the hand-updated ones."""
    from shardtune.losses.next_token import next_token_loss
    from shardtune.training import loop
    from tests.unit.checkpointer_stubs import NoCheckpoints
    from tests.unit.test_loop_scaling import _Rows, _Sampler

    hf = hf_glm().eval()
    ours = ours_from(hf)
    tokens, mask, labels = batch()
    micro = [
        {"tokens": tokens[i : i + 1], "labels": labels[i : i + 1], "attention_mask": mask[i : i + 1]} for i in (0, 1)
    ]
    batches = micro + micro[::-1]  # 2 steps of 2 micro-batches
    gates = [hf.model.layers[i].mlp.gate for i in (1, 2)]
    picked: list[torch.Tensor] = []
    hooks = [g.register_forward_hook(lambda _m, _i, out: picked.append(out[2])) for g in gates]
    biases = [g.e_score_correction_bias.clone() for g in gates]
    for step in (0, 1):
        loads = [torch.zeros(8, dtype=torch.float64) for _ in gates]
        for b in batches[2 * step : 2 * step + 2]:
            picked.clear()
            with torch.no_grad():
                hf(b["tokens"])
            real = b["attention_mask"].reshape(-1).bool()
            for load, chosen in zip(loads, picked, strict=True):
                load += torch.bincount(chosen[real].reshape(-1), minlength=8).double()
        for gate, bias, load in zip(gates, biases, loads, strict=True):
            bias += RATE * torch.sign(load.mean() - load).float()
            with torch.no_grad():
                gate.e_score_correction_bias.copy_(bias)
    for hook in hooks:
        hook.remove()
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.0)
    loop.run_training(
        loop.Training(
            model=ours,
            loader=batches,
            sampler=_Sampler(),
            optimizer=optimizer,
            lr_scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
            checkpointer=NoCheckpoints(),
        ),
        loss_fn=next_token_loss(ours, device=torch.device("cpu")),
        logger=_Rows(),
        settings=loop.LoopSettings(epochs=1, gradient_accumulation_steps=2, router_bias_update_rate=RATE),
    )
    start = hf_glm().state_dict()
    for layer, bias in zip((1, 2), biases, strict=True):
        got = ours.model.layers[layer].mlp.gate.e_score_correction_bias
        assert torch.equal(got, bias) and not torch.equal(
            got, start[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        )


def test_balancing_a_model_without_group_limited_routers_is_refused():
    qwen = from_hf_config(moe_config("qwen3_moe").to_dict())
    with pytest.raises(ValueError, match="router_bias_update_rate=0.001: .* this model has none"):
        balanced_routers(qwen, 0.001)
    assert balanced_routers(qwen, 0.0) == []


def test_greedy_generation_with_the_kv_cache_equals_transformers():
    from shardtune.inference.generation import generate

    hf = hf_glm().eval()
    prompt = batch()[0][0, :12].tolist()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :].tolist()
    assert generate(ours_from(hf).eval(), prompt, max_new_tokens=10, device="cpu") == expected


def test_flops_count_the_routed_experts_a_token_uses_and_the_shared_expert():
    from shardtune.training.flops import flops_per_token_fn

    model = build_model(get_model_args("tiny_glm4_moe"), device="meta")
    h, heads, kv_heads, head_dim, seq = 96, 4, 2, 32, 16
    attention = (
        2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + (heads + 2 * kv_heads) * head_dim
    )  # + q/k/v biases
    norms = 2 * h + 2 * head_dim  # per layer: 2 norms, q/k norms
    dense = 3 * h * 192
    sparse = h * 8 + 2 * 3 * h * 64 + 3 * h * 64  # router, 2 of 8 experts of width 64, the shared expert
    weights = 3 * (attention + norms) + dense + 2 * sparse + h + 256 * h  # layer 0 dense; final norm; lm_head
    assert flops_per_token_fn(model)(seq) == 6 * weights + 12 * 3 * heads * head_dim * seq


def _sequence_balance_by_hand(logits: torch.Tensor, chosen: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss of one layer, term by term: the mean over rows of
    sum_i f_i * P_i, f_i = E / (k T) * (row tokens choosing i), P_i = mean over the row's T tokens of s_i / sum_j s_j."""
    rows, seq = mask.shape
    experts, k = logits.shape[-1], chosen.shape[-1]
    logits, chosen = logits.view(rows, seq, experts), chosen.view(rows, seq, k)
    per_row = []
    for b in range(rows):
        real = [t for t in range(seq) if mask[b, t]]
        f = [experts / (k * len(real)) * sum(int(i in chosen[b, t].tolist()) for t in real) for i in range(experts)]
        shares = [torch.sigmoid(logits[b, t]) / torch.sigmoid(logits[b, t]).sum() for t in real]
        p = torch.stack(shares).mean(dim=0)
        per_row.append(sum(f[i] * p[i] for i in range(experts)))
    return torch.stack(per_row).mean()


def test_the_sequence_wise_balance_loss_and_its_router_gradients_follow_deepseek_v3():
    """The aux loss of group-limited routers is DeepSeek-V3's sequence-wise one: its value and the routers'
    gradients from it equal the formula computed term by term on transformers' router logits and choices."""
    coef = 3.0
    hf = hf_glm()
    ours = ours_from(hf)
    tokens, mask, _ = batch()
    routing = Routing(mask=mask)
    routing.add_to(ours(tokens, routing=routing).sum() * 0, coef).backward()
    captured: list[tuple[torch.Tensor, torch.Tensor]] = []
    gates = [hf.model.layers[i].mlp.gate for i in (1, 2)]
    hooks = [g.register_forward_hook(lambda _m, _i, out: captured.append((out[0], out[2]))) for g in gates]
    hf(tokens, attention_mask=mask)
    for hook in hooks:
        hook.remove()
    expected = sum(_sequence_balance_by_hand(logits, chosen, mask) for logits, chosen in captured)
    assert abs(routing.aux_loss().item() - expected.item()) < 1e-6 * expected.item()
    (coef * expected).backward()
    for i, gate in zip((1, 2), gates, strict=True):
        assert gate.weight.grad.abs().max() > 0
        assert _rel(ours.model.layers[i].mlp.gate.weight.grad, gate.weight.grad) < 1e-5
