"""DeepSeek-V3 (``deepseek_v3``): the multi-head latent attention block and the whole family against transformers.

The block alone against ``DeepseekV3Attention`` with the same weights (queries through the bottleneck or one
``q_proj``, interleaved rope or halves, yarn with its softmax mscale); the model's logits and every gradient,
packed rows (each sample alone), greedy generation with the latent KV cache, HF directories both ways (block FP8
as the hub ships them too), LoRA on
the latent attention projections and the experts against peft, refused configs, presets. Shapes: values
narrower than keys, ``2 * moe_intermediate_size != hidden_size``, 6 experts in 2 groups.

References: transformers' ``DeepseekV3ForCausalLM`` (tiny random models), peft 0.21, transformers' config
defaults (DeepSeek-V3's published shape) and meta-device models.
"""

from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_deepseek

from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.inference.generation import generate
from shardtune.models import from_hf_config, model_args_from_hf_config, model_args_to_hf_config
from shardtune.models.blocks.mla_attention import MLAttention
from shardtune.models.registry import build_model, get_model_args
from shardtune.models.rope import RotaryEmbedding
from shardtune.peft import merge_lora
from tests.unit.test_lora_moe import _ours, _peft, lora_grad_errors
from tests.unit.test_models_families import COMMON, DEEPSEEK_V3
from tests.unit.test_models_moe import _rel, batch
from tests.unit.test_moe_checkpoint import tensors

VOCAB = COMMON["vocab_size"]
TOL = 1e-4  # max |ours - hf| / max |hf|
YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,  # != mscale: the cos/sin factor is not 1, and the softmax scale grows
    "rope_theta": 10000.0,
}
MLA_MODULES = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def config(**changes) -> transformers.PretrainedConfig:
    return transformers.AutoConfig.for_model("deepseek_v3", **{**COMMON, **DEEPSEEK_V3, **changes})


def random_grouped_moe(
    hf_config: transformers.PretrainedConfig, seed: int, *, bias_std: float
) -> transformers.PreTrainedModel:
    """A transformers model of a group-routed family (DeepSeek-V3, GLM-4.5) with every parameter random, norms
    around 1, and a random selection bias (transformers' init leaves it zero; it changes which experts are
    chosen)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        hf_config, attn_implementation="eager", experts_implementation="eager"
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "gate.weight" in n else 0.1) + ("norm" in n))
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * bias_std)
    return model


def hf_model(seed: int = 0, **changes) -> transformers.PreTrainedModel:
    """A random ``DeepseekV3ForCausalLM`` (:func:`random_grouped_moe`)."""
    return random_grouped_moe(config(**changes), seed, bias_std=0.1).eval()


def ours_from(hf) -> torch.nn.Module:
    model = from_hf_config(hf.config.to_dict()).eval()
    model.load_state_dict(hf.state_dict(), strict=True)
    return model


@pytest.mark.parametrize("q_lora_rank", [24, None])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("yarn", [False, True])
def test_the_attention_block_equals_transformers(q_lora_rank, interleave, yarn):
    """Outputs and input/weight gradients of one block against ``DeepseekV3Attention`` with the same weights,
    each with its own rotary tables (ours from ``shardtune.models.rope``)."""
    changes = {"q_lora_rank": q_lora_rank, "rope_interleave": interleave, "attention_bias": q_lora_rank is None}
    if yarn:
        changes["rope_parameters"] = YARN
    cfg = config(**changes)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    theirs = hf_deepseek.DeepseekV3Attention(cfg, layer_idx=0)
    args = model_args_from_hf_config(cfg.to_dict())
    ours = MLAttention(args)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for n, p in theirs.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2 + ("norm" in n))
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    x = torch.randn(2, 40, COMMON["hidden_size"], generator=gen)
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    positions = torch.arange(40).unsqueeze(0)
    hf_rope = hf_deepseek.DeepseekV3RotaryEmbedding(cfg)(x, positions)
    rope = RotaryEmbedding(
        args.rotary_dim, theta=args.rope_theta, rope_scaling=args.rope_scaling, max_position_embeddings=args.max_seq_len
    )
    got = ours(x_ours, *rope(positions, x.dtype))
    causal = torch.full((40, 40), float("-inf")).triu(1)[None, None]  # transformers' eager takes the mask it is given
    expected = theirs(x_theirs, hf_rope, attention_mask=causal)[0]
    assert _rel(got, expected) < 1e-5
    weights = torch.randn(got.shape, generator=gen)
    (got * weights).sum().backward()
    (expected * weights).sum().backward()
    assert _rel(x_ours.grad, x_theirs.grad) < 1e-5
    their_params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert _rel(p.grad, their_params[name].grad) < 1e-5, name
    assert ours.scale == theirs.scaling and (ours.scale != 24**-0.5) == yarn


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_logits_and_every_gradient_equal_transformers(q_lora_rank):
    hf = hf_model(q_lora_rank=q_lora_rank)
    ours = ours_from(hf)
    assert list(ours.state_dict()) == list(hf.state_dict())
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in ours.state_dict()
    tokens, mask, labels = batch()
    real = mask.bool()
    expected = hf(tokens).logits
    got = ours(tokens)
    assert _rel(got[real], expected[real]) < TOL
    target = labels[:, 1:].flatten()
    F.cross_entropy(got[:, :-1].flatten(0, 1), target, ignore_index=-100).backward()
    F.cross_entropy(expected[:, :-1].flatten(0, 1), target, ignore_index=-100).backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert hf_params[name].grad.abs().max() > 0, name
        assert _rel(p.grad, hf_params[name].grad) < TOL, name


def test_the_latent_attention_features_matter():
    """Parity above is not vacuous: the pair layout of the rotated channels and the yarn softmax mscale each
    change the logits."""
    hf = hf_model(rope_parameters=YARN)
    ours = ours_from(hf)
    tokens = batch()[0]
    args = ours.args
    with torch.no_grad():
        base = ours(tokens)
        for change in (
            {"mla": dataclasses.replace(args.mla, rope_interleave=False)},
            {"rope_scaling": {k: v for k, v in args.rope_scaling.items() if k != "mscale_all_dim"}},
        ):
            other = type(ours)(args.replace(**change)).eval()
            other.load_state_dict(hf.state_dict())
            assert _rel(other(tokens), base) > 1e-3, change


def test_a_packed_row_trains_each_sample_as_if_alone():
    hf = hf_model()
    ours, alone = ours_from(hf), ours_from(hf)
    lengths = [13, 20, 7]
    gen = torch.Generator().manual_seed(5)
    samples = [torch.randint(0, VOCAB, (1, n), generator=gen) for n in lengths]
    targets = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    logits = ours(torch.cat(samples, dim=1), position_ids=positions, sample_lengths=[lengths])[0]
    loss = F.cross_entropy(logits, torch.cat(targets), reduction="sum")
    hf_loss = sum(F.cross_entropy(hf(s).logits[0], t, reduction="sum") for s, t in zip(samples, targets, strict=True))
    assert abs(loss.item() - hf_loss.item()) < 1e-4 * hf_loss.item()
    loss.backward()
    sum(F.cross_entropy(alone(s)[0], t, reduction="sum") for s, t in zip(samples, targets, strict=True)).backward()
    reference = dict(alone.named_parameters())
    for name, p in ours.named_parameters():
        assert _rel(p.grad, reference[name].grad) < 1e-4, name


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_greedy_generation_with_the_latent_cache_equals_transformers(q_lora_rank):
    hf = hf_model(q_lora_rank=q_lora_rank, rope_parameters=YARN)
    ours = ours_from(hf)
    prompt = batch()[0][0, :12].tolist()
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt) :].tolist()
    assert generate(ours, prompt, max_new_tokens=10, device="cpu") == expected


def test_left_padded_batch_generation_equals_each_prompt_alone():
    """Prompts of different lengths share one latent cache (the shorter one left-padded): each row's greedy tokens
    are those of its prompt alone."""
    from shardtune.inference.generation import generate_batch

    ours = ours_from(hf_model())
    tokens = batch()[0]
    prompts = [tokens[0, :12].tolist(), tokens[1, :5].tolist()]
    alone = [generate(ours, prompt, max_new_tokens=8, device="cpu") for prompt in prompts]
    together = generate_batch(
        ours, prompts, max_new_tokens=8, device="cpu", generator=torch.Generator(), pad_id=0, temperature=0.0
    )
    assert together == alone


def test_hf_dirs_load_and_save_both_ways(tmp_path):
    """transformers' save (per-expert files) loads with equal logits; ours saves a dir transformers loads to
    the same logits, with the selection bias kept in fp32."""
    hf = hf_model()
    hf.save_pretrained(tmp_path / "hf")
    with torch.device("meta"):
        ours = from_hf_config(tmp_path / "hf")
    load_hf_checkpoint(ours, tmp_path / "hf", device="cpu", strict=True)
    ours.init_buffers("cpu")
    ours.eval()
    tokens = batch()[0]
    with torch.no_grad():
        expected = hf(tokens).logits
        assert _rel(ours(tokens), expected) < TOL
    save_hf_checkpoint(ours, tmp_path / "out")
    saved = tensors(tmp_path / "out")
    assert saved["model.layers.2.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert sorted(saved) == sorted(tensors(tmp_path / "hf"))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", experts_implementation="eager")
    with torch.no_grad():
        assert _rel(reloaded.eval()(tokens).logits, expected) < TOL


def test_a_block_fp8_dir_loads_the_hand_dequantized_weights(tmp_path):
    """DeepSeek-V3's hub format: every linear (the latent attention's, the dense and shared MLPs', each expert's)
    stored in FP8 with a scale per block of 20 x 40 (blocks cut at the edges: kv_a_proj_with_mqa is [24, 64]), the
    router, norms, embeddings and the selection bias as they are. Every weight equals the hand-dequantized one;
    logits equal transformers' on those weights."""
    from tests.unit.test_block_fp8 import BLOCK, QUANT, _fused, hand_quantize, is_quantized

    hf = hf_model()
    hf.save_pretrained(tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    expected = {}
    for name, value in list(stored.items()):
        if is_quantized(name, value):
            fp8, scale = hand_quantize(value)
            stored[name], stored[f"{name}_scale_inv"] = fp8, scale
            expected[name] = (
                fp8.float()
                * scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[
                    : value.shape[0], : value.shape[1]
                ]
            )
        else:
            expected[name] = value.float()
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv" in stored
    safetensors.torch.save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}))
    with torch.device("meta"):
        ours = from_hf_config(tmp_path, dtype=torch.float32)
    load_hf_checkpoint(ours, tmp_path, device="cpu", strict=True)
    ours.init_buffers("cpu")
    state = ours.state_dict()
    dequantized = _fused(expected)
    assert all(torch.equal(state[name], value) for name, value in dequantized.items())
    hf.load_state_dict(dequantized, strict=True)
    tokens = batch()[0]
    with torch.no_grad():
        assert _rel(ours.eval()(tokens), hf(tokens).logits) < TOL


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_lora_on_the_latent_attention_and_the_experts_equals_peft(q_lora_rank):
    hf = hf_model(q_lora_rank=q_lora_rank)
    modules = MLA_MODULES if q_lora_rank else ["q_proj", *MLA_MODULES[2:]]
    pm = _peft(hf, EXPERTS, modules=modules)
    ours = _ours(hf, pm, EXPERTS, modules=modules)
    wrapped = {n.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for n, _ in ours.named_parameters()}
    assert set(modules) <= wrapped
    tokens = batch()[0]
    expected = pm(tokens).logits
    got = ours(tokens)
    assert _rel(got, expected) < 1e-5
    assert _rel(expected, hf(tokens).logits) > 1e-3  # the adapters matter
    expected.square().sum().backward()
    got.square().sum().backward()
    errors = lora_grad_errors(ours, pm)
    assert all(error < 1e-4 for error in errors.values()), errors
    with torch.no_grad():
        merged = merge_lora(ours).state_dict()
    reference = pm.merge_and_unload().state_dict()
    assert list(merged) == list(reference)
    for key, value in reference.items():
        assert (merged[key] - value).abs().max() < 1e-6, key


def test_llama_lora_names_reach_the_latent_projections():
    from shardtune.peft import apply_lora

    ours = ours_from(hf_model())
    apply_lora(ours, rank=2, alpha=4, target_modules=["q_proj", "k_proj", "v_proj"])
    assert ours.lora_config.target_modules == ["q_b_proj", "kv_b_proj"]


def test_dense_only_and_multi_token_prediction_configs_are_accepted():
    """``first_k_dense_replace = num_hidden_layers`` (no sparse layer) builds transformers' model; a config naming
    a multi-token-prediction layer is accepted (that layer is not part of the model)."""
    hf = hf_model(first_k_dense_replace=3, num_nextn_predict_layers=1)
    ours = ours_from(hf)
    tokens = batch()[0]
    with torch.no_grad():
        assert _rel(ours(tokens), hf(tokens).logits) < TOL
    cfg = model_args_to_hf_config(ours.args)
    assert cfg["first_k_dense_replace"] == 3
    assert model_args_from_hf_config(cfg) == ours.args


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"kv_lora_rank": None}, r"lacks \['kv_lora_rank'\]"),
        ({"v_head_dim": 0}, "MlaArgs.v_head_dim must be a positive int"),
        ({"num_key_value_heads": 2}, r"n_kv_heads \(2\) must equal n_heads \(4\).*num_key_value_heads"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim must be even"),
        ({"rope_interleave": "yes"}, "rope_interleave must be true or false"),
        ({"n_group": 4}, r"n_group \(4\) must divide the 6 experts"),
        ({"num_nextn_predict_layers": -1}, "num_nextn_predict_layers must be an integer >= 0"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(change, match):
    cfg = {**config().to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        model_args_from_hf_config(cfg)


def test_a_config_without_the_latent_geometry_is_refused():
    cfg = {k: v for k, v in config().to_dict().items() if k != "q_lora_rank"}
    with pytest.raises(ValueError, match=r"lacks \['q_lora_rank'\].*q_lora_rank may be null"):
        model_args_from_hf_config(cfg)


def test_latent_attention_geometry_only_where_the_family_has_it():
    args = model_args_from_hf_config(config().to_dict())
    with pytest.raises(ValueError, match="ModelArgs.mla .* model_type 'deepseek_v3' needs it"):
        build_model(args.replace(mla=None), device="meta")
    llama = get_model_args("tiny")
    with pytest.raises(ValueError, match="ModelArgs.mla .* model_type 'llama' has none"):
        build_model(llama.replace(mla=args.mla, head_dim=8, n_kv_heads=llama.n_heads), device="meta")


def test_config_round_trip_keeps_every_deepseek_key():
    cfg = config(q_lora_rank=None, rope_interleave=False, attention_bias=True, rope_parameters=YARN).to_dict()
    args = model_args_from_hf_config(cfg)
    written = model_args_to_hf_config(args, rope_style="rope_parameters")
    keys = [
        *("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_interleave"),
        *("n_routed_experts", "n_shared_experts", "moe_intermediate_size", "first_k_dense_replace"),
        *("n_group", "topk_group", "routed_scaling_factor", "norm_topk_prob", "attention_bias"),
    ]
    assert {k: written[k] for k in keys} == {k: cfg[k] for k in keys}
    rebuilt = transformers.AutoConfig.for_model(**json.loads(json.dumps(written)))
    assert rebuilt.rope_parameters["mscale_all_dim"] == 0.8 and rebuilt.head_dim == 8
    assert copy.deepcopy(model_args_from_hf_config(written)) == args


# transformers' DeepseekV3Config defaults are DeepSeek-V3's published shape (its docstring); the hub's config.json
# adds 163,840 positions and yarn x40. Kimi K2: 64 heads, 384 experts in one group, one dense layer, a 163,840 vocab.
SHAPE_KEYS = [
    *("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers"),
    *("num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor"),
    *("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group"),
    *("num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "rms_norm_eps", "rope_interleave"),
]
KIMI_K2 = {
    "vocab_size": 163840,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
}
PRESETS = {"tiny_deepseek_v3": (None, 0), "deepseek_v3_671b": ({}, 671), "kimi_k2_1t": (KIMI_K2, 1026)}


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_have_the_published_shapes_and_transformers_parameter_count(preset):
    differs, billions = PRESETS[preset]
    args = get_model_args(preset)
    config = transformers.AutoConfig.for_model(**model_args_to_hf_config(args))
    if differs is not None:
        default = transformers.DeepseekV3Config()
        for key in SHAPE_KEYS:
            assert getattr(config, key) == differs.get(key, getattr(default, key)), key
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    ours = build_model(args, device="meta")
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in reference.state_dict().items()
    ]
    assert round(sum(p.numel() for p in reference.parameters()) / 1e9) == billions
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in reference.parameters())


def test_flops_count_keys_and_values_of_their_own_widths():
    """Per token at sequence length t: 6 x the active weights (the dense layer's MLP, 2 of 6 experts and the shared
    expert in the sparse ones, the router, the latent attention's projections, the head) plus
    6 x layers x heads x (qk 24 + v 12) x t, the scores and values at their widths."""
    from shardtune.training.flops import flops_per_token_fn

    model = from_hf_config(config().to_dict(), device="meta")
    h, heads, seq = COMMON["hidden_size"], 4, 40
    attention = h * 24 + 24 * heads * 24 + h * (16 + 8) + 16 * heads * (16 + 12) + heads * 12 * h
    norms = 24 + 16 + 2 * h  # q_a/kv_a layernorms, the layer's two norms
    dense, shared, experts = 3 * h * COMMON["intermediate_size"], 3 * h * 24, 2 * 3 * h * 24
    weights = 3 * (attention + norms) + dense + 2 * (shared + experts + 6 * h) + VOCAB * h + h
    assert flops_per_token_fn(model)(seq) == 6 * weights + 6 * 3 * heads * (24 + 12) * seq
