"""Gemma 4 text (``gemma4_text``) beyond the shared family checks (``test_models_families.py``): every gradient
equal transformers' with keys as values, keys/values shared across layers and per-layer inputs; each feature
changes the logits (so parity is not vacuous); generation with shared keys equal transformers' greedy
``generate``; activation checkpointing exact; published-style config.json files; bad configs refused by key;
presets with transformers' parameter counts."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from shardtune.models import from_hf_config, get_model_args, model_args_from_hf_config
from shardtune.models.blocks.norm import RMSNorm
from shardtune.ranks.activation_checkpointing import checkpointed
from tests.unit.test_models_families import COMMON, TOL, VOCAB, hf_config, randomize_, rel_diff, tokens

SHARED = "gemma4_text_per_layer_inputs"  # kv sharing (layer 2 reuses layer 1's), double-wide MLP, per-layer inputs


def hf_model(name: str, seed: int = 0, **changes):
    torch.manual_seed(seed)
    cfg = hf_config(name)
    for key, value in changes.items():
        setattr(cfg, key, value)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    return randomize_(model, seed).eval()


def ours_from(hf):
    ours = from_hf_config(hf.config.to_dict()).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return ours


@pytest.mark.parametrize("name", ["gemma4_text", SHARED, "gemma4_text_moe"])
def test_every_gradient_equals_transformers(name):
    hf = hf_model(name)
    ours = ours_from(hf)
    # not the pad token (id 0) as input: transformers' embeddings give its row no gradient (padding_idx)
    x, labels = tokens(seed=3).clamp(min=1), tokens(seed=4)
    hf_logits, logits = hf(x).logits, ours(x)
    assert rel_diff(logits, hf_logits) <= TOL
    F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    hf_params = dict(hf.named_parameters())
    for key, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, hf_params[key].grad, atol=1e-5, rtol=1e-4, msg=key)


def test_geometry_keys_as_values_and_shared_keys_are_as_configured():
    dense, shared = ours_from(hf_model("gemma4_text")), ours_from(hf_model(SHARED))
    sliding, full = dense.model.layers[0].self_attn, dense.model.layers[2].self_attn
    assert (sliding.head_dim, sliding.n_kv_heads, full.head_dim, full.n_kv_heads) == (16, 2, 32, 1)
    assert hasattr(sliding, "v_proj") and not hasattr(full, "v_proj")  # attention_k_eq_v: full layers only
    assert tuple(full.q_proj.weight.shape) == (4 * 32, 64)
    reuse = shared.model.layers[2].self_attn
    assert reuse.sharing == "reuse" and not hasattr(reuse, "k_proj") and shared.model.layers[1].self_attn.sharing
    assert shared.model.layers[2].mlp.down_proj.weight.shape[1] == 2 * COMMON["intermediate_size"]  # double-wide


def _logits(model, x):
    with torch.no_grad():
        return model(x)


def test_each_gemma4_feature_changes_the_logits():
    """Switching a feature off moves the logits: per-layer inputs, layer scalars, proportional rope and the
    value norm. (A reusing layer has no key/value projections: parity of logits and of the producer's
    gradients with transformers shows it attends to its producer's keys and values.)"""
    x = tokens()
    ours = ours_from(hf_model(SHARED))
    base = _logits(ours, x)
    changed = {}
    other = copy.deepcopy(ours)
    other.model.embed_tokens_per_layer.weight.data.zero_()
    changed["per-layer token inputs"] = _logits(other, x)
    other = copy.deepcopy(ours)
    for layer in other.model.layers:
        layer.layer_scalar.fill_(1.0)
    changed["layer_scalar"] = _logits(other, x)
    other = type(ours)(ours.args.replace(rope_scaling=None)).eval()  # every channel of the full heads rotated
    other.load_state_dict(ours.state_dict())
    changed["proportional rope"] = _logits(other, x)
    other = copy.deepcopy(ours)
    for layer in other.model.layers:
        norm = getattr(layer.self_attn, "v_norm", None)
        if norm is not None:
            norm.eps = 1e3  # values no longer unit RMS
    changed["value norm"] = _logits(other, x)
    for what, logits in changed.items():
        assert rel_diff(logits, base) > 1e-3, what


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_keeps_every_gradient(policy):
    hf = hf_model(SHARED)
    plain, ckpt = ours_from(hf), ours_from(hf)
    for i, layer in enumerate(list(ckpt.model.layers)):
        ckpt.model.layers[i] = checkpointed(layer, policy)
    assert list(ckpt.state_dict()) == list(plain.state_dict())
    x, labels = tokens(seed=5), tokens(seed=6)
    for model in (plain, ckpt):
        model.train()
        F.cross_entropy(model(x).flatten(0, 1), labels.flatten()).backward()
    ckpt_params = {k.replace("._checkpoint_wrapped_module", ""): p for k, p in ckpt.named_parameters()}
    for key, p in plain.named_parameters():
        torch.testing.assert_close(ckpt_params[key].grad, p.grad, atol=1e-6, rtol=1e-5, msg=key)


def test_rmsnorm_in_bf16_equals_transformers():
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    x = torch.randn(4, 7, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    theirs, ours = Gemma4RMSNorm(64).to(torch.bfloat16), RMSNorm(64, fp32_weight=True, dtype=torch.bfloat16)
    with torch.no_grad():
        theirs.weight.normal_()
        ours.weight.copy_(theirs.weight)
        assert torch.equal(ours(x), theirs(x))
        unscaled = RMSNorm(64, scale=False)
        assert torch.allclose(unscaled(x.float()), Gemma4RMSNorm(64, with_scale=False)(x.float()), atol=1e-6)
    assert not list(unscaled.parameters())


@pytest.mark.parametrize("moe", [False, True])
def test_greedy_generation_with_shared_keys_equals_transformers(tmp_path, moe):
    from shardtune.data.tokenizer import save_byte_tokenizer
    from shardtune.inference.generation import generate, load_generator

    cfg = transformers.Gemma4TextConfig(
        **{
            **COMMON,
            "vocab_size": 256,
            "num_hidden_layers": 4,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        },
        head_dim=16,
        global_head_dim=32,
        sliding_window=8,
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=256,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        enable_moe_block=moe,
        num_experts=4 if moe else None,
        top_k_experts=2 if moe else None,
        moe_intermediate_size=32 if moe else None,
    )
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, experts_implementation="eager")
    randomize_(reference, 0).eval()
    reference.save_pretrained(tmp_path)
    save_byte_tokenizer(tmp_path)
    generator = load_generator(tmp_path)
    ids = generator.prompt_ids("Hello there, how are you doing on this fine day?", chat=False)
    assert len(ids) > 8  # past the sliding window
    ours = generate(generator.model, ids, max_new_tokens=16, device="cpu")
    expected = reference.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids) :]
    assert ours == expected.tolist()


# A published-style config.json (keys as transformers 5.5 wrote them: global head keys, no per_layer_config)
PUBLISHED = {
    "architectures": ["Gemma4ForCausalLM"],
    "model_type": "gemma4_text",
    "hidden_activation": "gelu_pytorch_tanh",
    "head_dim": 16,
    "global_head_dim": 32,
    "num_global_key_value_heads": 1,
    "attention_k_eq_v": True,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0,
    "num_kv_shared_layers": 0,
    "use_bidirectional_attention": "vision",  # text tokens stay causal
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 10000.0, "rope_type": "default"},
    },
    "tie_word_embeddings": True,
}


def test_published_style_config_matches_transformers(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**COMMON, **PUBLISHED}))
    torch.manual_seed(0)
    hf_cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    hf = randomize_(transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="eager"), 0).eval()
    ours = from_hf_config(tmp_path).eval()
    assert ours.args.full_head_dim == 32 and ours.args.full_n_kv_heads == 1 and ours.args.attention_k_eq_v
    ours.load_state_dict(hf.state_dict(), strict=True)
    x = tokens()
    with torch.no_grad():
        assert rel_diff(ours(x), hf(x).logits) <= TOL


BAD = [
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    (
        {"enable_moe_block": True, "num_experts": 4, "moe_intermediate_size": 32},
        r"enable_moe_block=true needs \['top_k_",
    ),
    ({"enable_moe_block": True, "num_experts": 2, "top_k_experts": 4, "moe_intermediate_size": 32}, "top_k"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types must list num_hidden_layers=3"),
    ({"layer_types": ["sliding_attention", "linear_attention", "full_attention"]}, "unknown kinds"),
    ({"per_layer_config": {"0": {"head_dim": 32}}}, "per_layer_config"),
    ({"per_layer_config": {"2": {"sliding_window": 4}}}, r"per_layer_config\['2'\] overrides \['sliding_window'\]"),
    ({"num_kv_shared_layers": 4}, "kv_shared_layers"),
    ({"num_kv_shared_layers": 2}, "kv_shared_layers=2: every layer type"),  # no sliding producer before layer 1
    ({"hidden_size_per_layer_input": -1}, "hidden_size_per_layer_input"),
    ({"attention_k_eq_v": "yes"}, "attention_k_eq_v must be true or false"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "rope_parameters must map"),
    (
        {
            "rope_parameters": {
                **PUBLISHED["rope_parameters"],
                "sliding_attention": {"rope_type": "linear", "factor": 2},
            }
        },
        "sliding_attention: only rope_type 'default'",
    ),
]


@pytest.mark.parametrize(("change", "match"), BAD)
def test_bad_configs_are_refused_naming_the_key(change, match):
    cfg = {**COMMON, **PUBLISHED, "layer_types": ["sliding_attention", "full_attention", "full_attention"]}
    with pytest.raises(ValueError, match=match):
        model_args_from_hf_config({**cfg, **change})


def test_the_experts_beside_the_mlp_matter_and_route_as_transformers():
    """Experts and router change the logits (per_expert_scale too), the router picks transformers' experts
    with its weights, and the dense MLP stays the layer's ``mlp``."""
    hf = hf_model("gemma4_text_moe")
    ours = ours_from(hf)
    layer, hf_layer = ours.model.layers[0], hf.model.layers[0]
    assert type(layer.mlp).__name__ == "MLP" and type(layer.experts).__name__ == "Experts"
    flat = torch.randn(30, COMMON["hidden_size"], generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        _, hf_weights, hf_indices = hf_layer.router(flat)
        weights, indices = layer.router.select(layer.router(flat))
    assert torch.equal(indices, hf_indices)
    torch.testing.assert_close(weights, hf_weights, atol=1e-6, rtol=1e-5)
    x = tokens()
    base = _logits(ours, x)
    for change in ("per_expert_scale", "experts"):
        other = copy.deepcopy(ours)
        for each in other.model.layers:
            if change == "per_expert_scale":
                each.router.per_expert_scale.data.mul_(3.0)
            else:
                each.experts.down_proj.data.zero_()
        assert rel_diff(_logits(other, x), base) > 1e-3, change


def test_expert_adapters_equal_peft_target_parameters():
    """LoRA on the fused experts beside the MLP (``experts.gate_up_proj``/``down_proj``): peft's adapter keys,
    logits and adapter gradients."""
    import peft

    from shardtune.peft import apply_lora, get_adapter_state_dict
    from shardtune.peft.adapters import PEFT_PREFIX

    hf = hf_model("gemma4_text_moe")
    parameters = ["experts.gate_up_proj", "experts.down_proj"]
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=parameters)
    pm = peft.get_peft_model(copy.deepcopy(hf), config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for key, p in pm.named_parameters():
            if "lora_" in key:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    ours = apply_lora(ours_from(hf), rank=4, alpha=8, target_modules=["q_proj", "v_proj"], target_parameters=parameters)
    saved = peft.get_peft_model_state_dict(pm)
    mine = {PEFT_PREFIX + k: tuple(v.shape) for k, v in get_adapter_state_dict(ours).items()}
    assert mine == {k: tuple(v.shape) for k, v in saved.items()}
    result = ours.load_state_dict({k.removeprefix(PEFT_PREFIX): v for k, v in saved.items()}, strict=False)
    assert not result.unexpected_keys
    x, labels = tokens(seed=3), tokens(seed=4)
    expected, got = pm(input_ids=x).logits, ours(x)
    assert rel_diff(got, expected) <= TOL and rel_diff(expected, hf(x).logits) > 1e-3
    F.cross_entropy(expected.flatten(0, 1), labels.flatten()).backward()
    F.cross_entropy(got.flatten(0, 1), labels.flatten()).backward()
    theirs = {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if "lora_" in k}
    for key, p in ours.named_parameters():
        if "lora" in key:
            torch.testing.assert_close(p.grad, theirs[PEFT_PREFIX + key], atol=1e-5, rtol=1e-4, msg=key)


def test_layer_dropout_never_skips_a_layer_whose_keys_are_reused():
    ours = ours_from(hf_model(SHARED))  # layer 1 stores, layer 2 reuses
    with pytest.raises(ValueError, match=r"skip layers \[1\], whose keys and values later layers reuse"):
        ours.set_layer_dropout(max_prob=0.5, layers=[1, 2])
    assert ours.set_layer_dropout(max_prob=0.5, layers=[2])[2] == 0.5


def test_args_gemma4_cannot_say_are_refused_at_write():
    from shardtune.models import model_args_to_hf_config

    args = model_args_from_hf_config({**COMMON, **PUBLISHED})
    with pytest.raises(ValueError, match="full_attention last layer"):
        model_args_to_hf_config(args.replace(layer_types=["sliding_attention"] * 3))
    llama = get_model_args("tiny")
    with pytest.raises(ValueError, match="no config.json keys for ModelArgs \\['attention_k_eq_v'\\]"):
        model_args_to_hf_config(llama.replace(attention_k_eq_v=True))


# Published shapes (google/gemma-4-E2B, -E4B, -31B config.json text configs) against transformers on meta
@pytest.mark.parametrize("preset", ["gemma4_e2b", "gemma4_e4b", "gemma4_31b", "gemma4_26b_a4b"])
def test_presets_have_transformers_shapes_and_parameter_counts(preset):
    from shardtune.models import build_model, model_args_to_hf_config

    args = get_model_args(preset)
    config = transformers.AutoConfig.for_model(**model_args_to_hf_config(args, rope_style="rope_parameters"))
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config)
        ours = build_model(args)
    assert type(hf).__name__ == "Gemma4ForCausalLM"
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in hf.state_dict().items()}
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())
    assert model_args_from_hf_config(model_args_to_hf_config(args)) == args
    # QLoRA with the default NF4 block sizes can quantize every projection of the real shapes.
    from shardtune.peft import nf4, resolve_targets

    targets = resolve_targets(ours, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    for name, module in ours.named_modules():
        if name.rsplit(".", 1)[-1] in targets:
            nf4.check_nf4_shape(name, tuple(module.weight.shape), block_size=64, scaler_block_size=256)


@pytest.mark.parametrize("preset", ["tiny_gemma4", "tiny_gemma4_moe"])
def test_tiny_preset_writes_a_base_transformers_loads_equal(tmp_path, preset):
    from shardtune.checkpoint.formats.tiny_base import create_tiny_base
    from shardtune.models import build_model

    directory = create_tiny_base(tmp_path / "base", preset=preset)
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Gemma4ForCausalLM" and hf.config.enable_moe_block == preset.endswith("moe")
    ours = build_model(get_model_args(preset))
    ours.load_state_dict(hf.state_dict())
    x = torch.randint(0, VOCAB, (1, 50))
    with torch.no_grad():
        assert rel_diff(ours.eval()(x), hf(x).logits) <= TOL


def hf_multimodal(path):
    """A tiny random ``Gemma4ForConditionalGeneration`` (a one-layer vision tower, no audio) saved to ``path``."""
    from transformers.models.gemma4 import Gemma4ForConditionalGeneration

    text = hf_config("gemma4_text").to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"num_key_value_heads": 2, "head_dim": 16}
    config = transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None)
    torch.manual_seed(0)
    hf = randomize_(Gemma4ForConditionalGeneration(config), 0).eval()
    hf.save_pretrained(path)
    return hf


def test_a_multimodal_checkpoint_trains_its_text_tower_and_saves_back_the_same_files(tmp_path):
    """A ``Gemma4ForConditionalGeneration`` directory (vision tower; tied head) loads as ``gemma4_text`` with
    transformers' logits and saves back, the vision tower and its projection carried, to its very tensors."""
    from safetensors.torch import load_file

    from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
    from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint

    hf = hf_multimodal(tmp_path / "hf")
    files = load_file(tmp_path / "hf/model.safetensors")
    assert any(k.startswith("model.vision_tower.") for k in files) and "lm_head.weight" not in files
    with torch.device("meta"):
        ours = from_hf_config(tmp_path / "hf")
    assert ours.args.model_type == "gemma4_text"
    load_hf_checkpoint(ours, tmp_path / "hf", device="cpu", strict=True)
    ours.init_buffers("cpu")
    x = tokens()
    with torch.no_grad():
        assert rel_diff(ours(x), hf(input_ids=x).logits) <= TOL
    save_hf_checkpoint(ours, tmp_path / "out", source_dir=tmp_path / "hf")
    saved = load_file(tmp_path / "out/model.safetensors")
    assert sorted(saved) == sorted(files) and all(torch.equal(saved[k], v) for k, v in files.items())
    written = json.loads((tmp_path / "out/config.json").read_text())
    assert written["architectures"] == ["Gemma4ForConditionalGeneration"] and written["vision_config"]


def test_a_multimodal_lora_adapter_loads_in_peft_over_the_multimodal_model(tmp_path):
    """Its ``target_modules`` reach the text tower only (PEFT cannot adapt the vision tower's ``q_proj``), so
    ``PeftModel.from_pretrained`` over ``Gemma4ForConditionalGeneration`` gives the adapted model's logits;
    shardtune's generator reads the adapter back."""
    import peft

    from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
    from shardtune.checkpoint.formats.peft_format import peft_target_modules, save_peft_adapter
    from shardtune.peft import apply_lora, init_lora_parameters

    hf = hf_multimodal(tmp_path / "hf")
    targets = ["q_proj", "o_proj", "down_proj"]
    with torch.device("meta"):
        ours = apply_lora(from_hf_config(tmp_path / "hf"), rank=4, alpha=8, target_modules=targets)
    load_hf_checkpoint(ours, tmp_path / "hf", device="cpu", strict=False)
    init_lora_parameters(ours, device="cpu")
    ours.init_buffers("cpu")
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    save_peft_adapter(ours, tmp_path / "adapter")
    assert peft_target_modules(tmp_path / "adapter") == targets
    adapted = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    x = tokens()
    with torch.no_grad():
        want = adapted(input_ids=x).logits
        assert rel_diff(ours.eval()(x), want) <= TOL
        with adapted.disable_adapter():
            assert rel_diff(want, adapted(input_ids=x).logits) > 1e-3  # the adapters matter
