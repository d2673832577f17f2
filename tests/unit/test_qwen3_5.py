"""Qwen3.5/3.6 hybrids against transformers: the gated delta rule, logits and gradients over several chunks,
packed rows (no state or convolution window crosses a sample), and refused configs.

References: transformers' PyTorch gated delta rule and ``Qwen3_5ForCausalLM`` (tiny random models), and the
rule's token-by-token definition.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from shardtune.models import from_hf_config, get_model_args, model_args_from_hf_config, model_args_to_hf_config
from shardtune.models.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from shardtune.models.kv_cache import KVCache
from shardtune.models.registry import build_model

VOCAB = 97
CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 48,
    "intermediate_size": 80,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,  # != key dim: a transposed state cannot pass
    "linear_conv_kernel_dim": 4,
}


def rule_inputs(*, b=2, s=150, h=4, dk=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(b, s, h, dk, generator=gen), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(b, s, h, dk, generator=gen), dim=-1)
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -3 * torch.rand(b, s, h, generator=gen)  # strong decay too: exp(c_i - c_j) must not overflow
    beta = torch.rand(b, s, h, generator=gen)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk", [1, 16, 64, 200])
def test_chunked_rule_equals_the_recurrent_definition_and_transformers(chunk):
    q, k, v, g, beta = rule_inputs()
    state0 = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(5))
    want, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, state=state0)
    got, got_state = chunk_gated_delta_rule(q, k, v, g, beta, state=state0, chunk=chunk)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_state, want_state, atol=2e-5, rtol=1e-5)
    # transformers' token loop (it scales queries itself, and takes the rule's -g in the same sign)
    hf, hf_state = hf_qwen3_5.torch_recurrent_gated_delta_rule(
        q * 16**0.5, k, v, g, beta, initial_state=state0, output_final_state=True
    )
    torch.testing.assert_close(want, hf, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(want_state, hf_state, atol=2e-5, rtol=1e-5)


def test_a_row_cut_in_two_continues_from_the_first_parts_state():
    q, k, v, g, beta = rule_inputs(s=100)
    whole, state = chunk_gated_delta_rule(q, k, v, g, beta, chunk=32)
    first, mid = chunk_gated_delta_rule(*(t[:, :45] for t in (q, k, v, g, beta)), chunk=32)
    second, end = chunk_gated_delta_rule(*(t[:, 45:] for t in (q, k, v, g, beta)), state=mid, chunk=32)
    torch.testing.assert_close(torch.cat([first, second], dim=1), whole, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(end, state, atol=2e-5, rtol=1e-5)


def test_chunked_rule_gradients_equal_the_recurrent_definitions():
    inputs = [t.requires_grad_() for t in rule_inputs(s=70)]
    weights = torch.randn(2, 70, 4, 8, generator=torch.Generator().manual_seed(9))
    grads = []
    for rule in (recurrent_gated_delta_rule, lambda *a: chunk_gated_delta_rule(*a, chunk=16)):
        out, state = rule(*inputs)
        grads.append(torch.autograd.grad((out * weights).sum() + state.square().sum(), inputs))
    for got, want in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def hf_model(seed: int = 0, **changes) -> transformers.PreTrainedModel:
    """A random ``Qwen3_5ForCausalLM`` of ``CONFIG`` with ``changes``."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3_5TextConfig(**{**CONFIG, **changes}))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # every parameter random, norms and decay parameters included
        for _, p in model.named_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return model


def test_logits_and_every_gradient_equal_transformers_over_several_chunks():
    hf = hf_model()
    ours = from_hf_config(hf.config.to_dict())
    ours.load_state_dict(hf.state_dict())
    assert list(ours.state_dict()) == list(hf.state_dict())
    x = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(1))  # 3 chunks of 64
    labels = torch.randint(0, VOCAB, (2, 150), generator=torch.Generator().manual_seed(2))
    hf_logits = hf(x).logits
    logits = ours(x)
    assert ((logits - hf_logits).abs().max() / hf_logits.abs().max()).item() <= 1e-4
    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_linear_layers_and_the_output_gate_matter():
    """Parity above is not vacuous: the gated attention and the delta rule both change the logits."""
    hf = hf_model()
    ours = from_hf_config(hf.config.to_dict())
    ours.load_state_dict(hf.state_dict())
    x = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = ours(x)
        q_proj = ours.model.layers[1].self_attn.q_proj.weight  # per head: 16 query rows, then 16 gate rows
        q_proj.view(4, 2, 16, -1)[:, 1].zero_()  # gate 0.5 everywhere
        ungated = ours(x)
        ours.model.layers[0].linear_attn.A_log.add_(3.0)
        faster_decay = ours(x)
    assert (ungated - base).abs().max() > 1e-3
    assert (faster_decay - base).abs().max() > 1e-3


def packed_case(seed: int = 6):
    gen = torch.Generator().manual_seed(seed)
    lengths = [37, 70, 3, 20]  # one sample longer than a chunk, one shorter than the convolution
    samples = [torch.randint(0, VOCAB, (1, n), generator=gen) for n in lengths]
    targets = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    return lengths, samples, targets


def packed_loss(model, lengths, samples, targets):
    row = torch.cat(samples, dim=1)
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    logits = model(row, position_ids=positions, sample_lengths=[lengths])[0]
    return F.cross_entropy(logits, torch.cat(targets), reduction="sum")


def alone_loss(model, samples, targets):
    return sum(
        F.cross_entropy(model(sample)[0], target, reduction="sum")
        for sample, target in zip(samples, targets, strict=True)
    )


def grad_diff(got: torch.nn.Module, want: torch.nn.Module) -> float:
    """The largest ``max |got - want| / max |want|`` over the parameters' gradients."""
    want_params = dict(want.named_parameters())
    return max(
        ((p.grad - want_params[name].grad).abs().max() / want_params[name].grad.abs().max()).item()
        for name, p in got.named_parameters()
    )


def test_a_packed_row_trains_each_sample_as_if_alone():
    """Loss and every gradient of a packed row equal the sum over its samples run alone, against the same model
    and against transformers: neither the recurrent state nor the convolution window leaks across a sample
    boundary. (Gradients summed over a row in fp32 agree to ~1e-4; a leak moves them by far more, shown last.)"""
    lengths, samples, targets = packed_case()
    hf = hf_model(seed=4)
    ours = from_hf_config(hf.config.to_dict())
    ours.load_state_dict(hf.state_dict())
    alone, leaky = copy.deepcopy(ours), copy.deepcopy(ours)
    loss = packed_loss(ours, lengths, samples, targets)
    hf_loss = sum(
        F.cross_entropy(hf(sample).logits[0], target, reduction="sum")
        for sample, target in zip(samples, targets, strict=True)
    )
    torch.testing.assert_close(loss, hf_loss, atol=1e-4, rtol=1e-5)
    loss.backward()
    hf_loss.backward()
    alone_loss(alone, samples, targets).backward()
    assert grad_diff(ours, hf) <= 5e-4
    assert grad_diff(ours, alone) <= 5e-4
    # the same row unpacked: state and convolution run through the boundaries
    row_logits = leaky(torch.cat(samples, dim=1))[0]
    F.cross_entropy(row_logits, torch.cat(targets), reduction="sum").backward()
    assert grad_diff(leaky, alone) > 1e-2


def test_transformers_default_layer_pattern_and_partial_rotary_are_read():
    cfg = {k: v for k, v in CONFIG.items() if k != "layer_types"}
    args = model_args_from_hf_config({**cfg, "model_type": "qwen3_5_text", "num_hidden_layers": 8})
    assert args.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"
    ]
    assert args.partial_rotary_factor == 0.25


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types must list num_hidden_layers=4"),
        (
            {"layer_types": ["linear_attention", "mamba", "full_attention", "full_attention"]},
            r"unknown kinds \['mamba'\]",
        ),
        ({"linear_num_key_heads": 3}, r"num_value_heads \(4\) must be a multiple of num_key_heads \(3\)"),
        ({"linear_key_head_dim": 0}, "key_head_dim must be a positive int"),
        ({"linear_conv_kernel_dim": "4"}, "linear_conv_kernel_dim must be a positive integer"),
        ({"full_attention_interval": 0, "layer_types": None}, "full_attention_interval must be a positive integer"),
        ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 2}}, "partial_rotary_factor"),
    ],
)
def test_bad_hybrid_configs_are_refused_naming_the_key(change, match):
    cfg = {**CONFIG, "model_type": "qwen3_5_text", **change}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    with pytest.raises(ValueError, match=match):
        model_args_from_hf_config(cfg)


def test_the_generation_cache_goes_on_exactly_and_keeps_left_padding_out():
    """Prefill of a left-padded batch, a one-token step (recurrent form) and a two-token step (chunked form
    from the cached state) give each row's logits of its whole sequence run at once in transformers."""
    hf = hf_model(seed=7).eval()
    ours = from_hf_config(hf.config.to_dict()).eval()
    ours.load_state_dict(hf.state_dict())
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen) for n in (9, 3, 6)]
    pads = [9 - len(p) for p in prompts]
    padded = torch.stack([torch.cat([torch.zeros(pad, dtype=torch.long), p]) for pad, p in zip(pads, prompts)])
    steps = [torch.randint(3, VOCAB, (3, n), generator=gen) for n in (1, 2)]
    cache = KVCache(pad=torch.tensor(pads))
    with torch.no_grad():
        outs = [ours(padded, kv_cache=cache)] + [ours(step, kv_cache=cache) for step in steps]
        for i, (pad, prompt) in enumerate(zip(pads, prompts, strict=True)):
            want = hf(torch.cat([prompt, *(step[i] for step in steps)])[None]).logits[0]
            got = torch.cat([outs[0][i, pad:], outs[1][i], outs[2][i]])
            assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4, i


# From the Qwen/Qwen3.5-9B model card (the keys that shape its text model).
PUBLISHED_9B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "intermediate_size": 12288,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "vocab_size": 248320,
    "max_position_embeddings": 262144,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8,
}


# Qwen/Qwen3.5-27B's text_config (its config.json)
PUBLISHED_27B = PUBLISHED_9B | {
    "hidden_size": 5120,
    "num_hidden_layers": 64,
    "num_attention_heads": 24,
    "intermediate_size": 17408,
    "linear_num_value_heads": 48,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 16,
}


@pytest.mark.parametrize(
    ("preset", "published", "billions", "rope_style"),
    [
        ("qwen3_5_9b", PUBLISHED_9B, (8.9, 9.0), "legacy"),
        ("qwen3_5_9b", PUBLISHED_9B, (8.9, 9.0), "rope_parameters"),
        ("qwen3_5_27b", PUBLISHED_27B, (26.8, 27.0), "rope_parameters"),
    ],
)
def test_presets_have_the_published_shape_and_transformers_parameters(preset, published, billions, rope_style):
    args = get_model_args(preset)
    config = transformers.AutoConfig.for_model(**model_args_to_hf_config(args, rope_style=rope_style))
    for key, value in published.items():
        assert getattr(config, key) == value, key
    assert config.rope_parameters["partial_rotary_factor"] == 0.25  # 64 rotary dims of 256
    assert config.rope_parameters["rope_theta"] == 1e7
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
        ours = build_model(args, device="meta")
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in reference.state_dict().items()
    ]
    assert billions[0] * 1e9 < sum(p.numel() for p in ours.parameters()) < billions[1] * 1e9
