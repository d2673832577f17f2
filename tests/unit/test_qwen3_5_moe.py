"""Qwen3.5-MoE text (``qwen3_5_moe_text``) beyond the MoE matrices it is in (``test_models_moe.py``,
``test_moe_checkpoint.py``, ``test_lora_moe.py``): LoRA on its shared expert and linear-attention projections
with the experts adapted, against peft; its shared expert and gate matter; the shared expert as spec data
(other names, ungated); refused input; the Qwen3.5-MoE preset; multimodal (hub) checkpoints in both expert
layouts.

References: transformers' ``Qwen3_5MoeForCausalLM`` (tiny random models), peft 0.21, and for the ungated
spec the block's own routed output plus the shared MLP computed by hand; for the preset transformers' config
defaults and meta-device models.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import transformers

from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.models import LlamaForCausalLM, from_hf_config, model_args_from_hf_config, model_args_to_hf_config
from shardtune.models.blocks.kinds import build_feed_forward
from shardtune.models.families import get_family
from shardtune.models.registry import build_model, get_model_args
from shardtune.models.spec import SharedExpertSpec
from shardtune.peft import merge_lora
from shardtune.state_dict import StateDictError, load_from_full_model_state_dict
from tests.unit.test_lora_moe import _ours, _peft, lora_grad_errors
from tests.unit.test_models_moe import _rel, batch, hf_moe_model, moe_config, ours_from
from tests.unit.test_moe_checkpoint import hf_dirs, tensors

NAME = "qwen3_5_moe_text"
LINEAR_ATTENTION = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
SHARED = ["gate_proj", "up_proj", "down_proj", "shared_expert_gate"]  # the shared expert's linears and its gate
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def test_lora_on_the_shared_expert_linear_attention_and_experts_equals_peft():
    hf = hf_moe_model(NAME)
    modules = ["q_proj", "o_proj", *LINEAR_ATTENTION, *SHARED]
    pm = _peft(hf, EXPERTS, modules=modules)
    ours = _ours(hf, pm, EXPERTS, modules=modules)
    wrapped = {n.removesuffix(".lora_A.weight").rsplit(".", 1)[-1] for n, _ in ours.named_parameters()}
    assert {*LINEAR_ATTENTION, *SHARED, "q_proj", "o_proj"} <= wrapped
    tokens, mask, _ = batch()
    real = mask.bool()
    expected = pm(tokens, attention_mask=mask).logits
    got = ours(tokens)
    assert _rel(got[real], expected[real]) < 1e-5
    expected[real].square().sum().backward()
    got[real].square().sum().backward()
    errors = lora_grad_errors(ours, pm)
    assert all(error < 1e-4 for error in errors.values()), errors
    with torch.no_grad():
        merged = merge_lora(ours).state_dict()
    reference = pm.merge_and_unload().state_dict()
    assert list(merged) == list(reference)
    for key, value in reference.items():
        assert (merged[key] - value).abs().max() < 1e-6, key


def test_the_shared_expert_and_its_gate_change_the_logits():
    """The parity of the MoE matrices is not vacuous: a gate of 0.5 everywhere, or no shared expert, differs."""
    ours = ours_from(hf_moe_model(NAME)).eval()
    tokens = batch()[0]
    mlp = ours.model.layers[0].mlp
    with torch.no_grad():
        base = ours(tokens)
        mlp.shared_expert_gate.weight.zero_()
        half = ours(tokens)
        mlp.shared_expert.down_proj.weight.zero_()
        without = ours(tokens)
    assert _rel(half, base) > 1e-3 and _rel(without, half) > 1e-3


def test_an_ungated_shared_expert_under_other_names_adds_its_mlp_output():
    """DeepSeek-V3/GLM-4.5 style (``shared_experts``, no gate) as spec data: keys under the spec's names, and the
    block's output is the routed experts' plus the shared MLP's ``down(silu(gate(x)) * up(x))``."""
    args = model_args_from_hf_config(moe_config(NAME).to_dict())
    sparse = get_family(NAME).blocks.sparse
    assert sparse is not None
    torch.manual_seed(0)
    spec = dataclasses.replace(sparse, shared=SharedExpertSpec("shared_experts", gate_name=None))
    block = build_feed_forward(args, spec, layer_idx=0)
    block.init_weights(0.1)
    shared_keys = [k for k in block.state_dict() if "shared" in k]
    assert shared_keys == [f"shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")]
    x = torch.randn(2, 5, args.dim)
    mlp, flat = block.shared_experts, x.reshape(-1, args.dim)
    with torch.no_grad():
        by_hand = F.silu(F.linear(flat, mlp.gate_proj.weight)) * F.linear(flat, mlp.up_proj.weight)
        by_hand = F.linear(by_hand, mlp.down_proj.weight).view_as(x)
        out = block(x)
        block.shared_names = (None, None)  # the routed experts alone
        routed = block(x)
    assert by_hand.abs().max() > 1e-2
    torch.testing.assert_close(out, routed + by_hand, atol=1e-6, rtol=1e-6)


def test_a_dir_mixing_expert_layouts_is_refused_naming_the_tensors(tmp_path):
    _, dirs = hf_dirs(NAME, tmp_path)
    fused, per_expert = tensors(dirs["fused"]), tensors(dirs["per_expert"])
    mixed = {k: v for k, v in fused.items() if ".layers.2." not in k}
    mixed |= {k: v for k, v in per_expert.items() if ".layers.2." in k}
    with torch.device("meta"):
        ours = from_hf_config(dirs["fused"])
    with pytest.raises(StateDictError, match=r"mixes layouts: \['model\.layers\.0\.mlp\.experts\.gate_up_proj'"):
        load_from_full_model_state_dict(ours, mixed, "cpu")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"layer_types": ["linear_attention", "full_attention"]}, "layer_types must list num_hidden_layers=3"),
        ({"shared_expert_intermediate_size": None}, r"lacks required keys \['shared_expert_intermediate_size'\]"),
        ({"num_experts_per_tok": 7}, r"top_k \(7\) exceeds num_experts \(6\)"),
    ],
)
def test_bad_configs_are_refused_naming_the_key(change, match):
    cfg = {**moe_config(NAME).to_dict(), **change}
    with pytest.raises(ValueError, match=match):
        model_args_from_hf_config(cfg)


def test_experts_the_config_cannot_express_are_refused():
    args = model_args_from_hf_config(moe_config(NAME).to_dict())
    assert args.intermediate_size == args.moe.shared_expert_intermediate_size == 40
    for change in ({"norm_topk_prob": False}, {"mlp_only_layers": (1,)}, {"shared_expert_intermediate_size": 8}):
        with pytest.raises(ValueError, match="shared_expert_intermediate_size=ModelArgs.intermediate_size"):
            model_args_to_hf_config(args.replace(moe=dataclasses.replace(args.moe, **change)))
    with pytest.raises(ValueError, match="shared_expert_intermediate_size must be set exactly .* needs it"):
        LlamaForCausalLM(args.replace(moe=dataclasses.replace(args.moe, shared_expert_intermediate_size=None)))
    qwen3_moe = model_args_from_hf_config(moe_config("qwen3_moe").to_dict())
    with pytest.raises(ValueError, match="model_type 'qwen3_moe' has none"):
        LlamaForCausalLM(qwen3_moe.replace(moe=dataclasses.replace(qwen3_moe.moe, shared_expert_intermediate_size=8)))


# The preset's sources: transformers' config defaults, which its docstring calls the Qwen3.5-35B-A3B shape, and
# the model card (rope base 1e7 on 64 of 256 dims, 262,144 tokens), where transformers' defaults are generic.
DEFAULT_SHAPES = {"qwen3_5_moe_35b_a3b": (transformers.Qwen3_5MoeTextConfig, 35)}
SHAPE_KEYS = [
    *("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"),
    *("layer_types", "rms_norm_eps", "tie_word_embeddings"),
    *("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"),
    "linear_conv_kernel_dim",
]
MOE_KEYS = [
    *("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"),
    "router_aux_loss_coef",
]


@pytest.mark.parametrize("preset", sorted(DEFAULT_SHAPES))
def test_presets_are_transformers_default_shapes_with_its_parameter_count(preset):
    cls, billions = DEFAULT_SHAPES[preset]
    args = get_model_args(preset)
    config, default = transformers.AutoConfig.for_model(**model_args_to_hf_config(args)), cls()
    assert type(config) is cls
    for key in SHAPE_KEYS + MOE_KEYS:
        assert getattr(config, key) == getattr(default, key), key
    assert config.max_position_embeddings == 262144
    assert config.rope_parameters["rope_theta"] == 1e7 and config.rope_parameters["partial_rotary_factor"] == 0.25
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    ours = build_model(args, device="meta")
    shapes = [(k, v.shape) for k, v in ours.state_dict().items()]
    assert shapes == [(k, v.shape) for k, v in reference.state_dict().items()]
    assert round(sum(p.numel() for p in reference.parameters()) / 1e9) == billions


def hf_multimodal() -> transformers.PreTrainedModel:
    """A tiny random ``Qwen3_5MoeForConditionalGeneration`` (the hub checkpoints' class): the text tower as in
    the MoE matrices, a one-block vision tower."""
    from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = moe_config(NAME, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]).to_dict()
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    vision |= {"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2}
    torch.manual_seed(0)
    model = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=text, vision_config=vision)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


@pytest.mark.parametrize("per_expert", [True, False])
def test_a_multimodal_checkpoint_trains_its_text_tower_and_saves_back_the_same_files(tmp_path, per_expert):
    """Both expert layouts of a ``Qwen3_5MoeForConditionalGeneration`` directory load as this family with
    transformers' logits, and save back (the layout read, the vision tower carried) to its very tensors."""
    hf = hf_multimodal()
    hf.save_pretrained(tmp_path / "hf", save_original_format=per_expert)
    files = tensors(tmp_path / "hf")
    assert any(".visual." in k for k in files)
    assert any(k.endswith(".mlp.experts.0.up_proj.weight") for k in files) == per_expert
    with torch.device("meta"):
        ours = from_hf_config(tmp_path / "hf")
    assert ours.args.model_type == NAME
    load_hf_checkpoint(ours, tmp_path / "hf", device="cpu", strict=True)
    ours.init_buffers("cpu")
    tokens = batch()[0]
    with torch.no_grad():
        assert _rel(ours(tokens), hf(input_ids=tokens).logits) < 1e-5
    save_hf_checkpoint(ours, tmp_path / "out", source_dir=tmp_path / "hf")
    saved = tensors(tmp_path / "out")
    assert sorted(saved) == sorted(files) and all(torch.equal(saved[k], v) for k, v in files.items())
    assert json.loads((tmp_path / "out/config.json").read_text())["architectures"] == [
        "Qwen3_5MoeForConditionalGeneration"
    ]
