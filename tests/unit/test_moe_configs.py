"""The MoE presets and the ``router_aux_loss_coef`` recipe key.

Presets are checked against the published ``config.json`` values (written out below from the model
repositories) as transformers reads them, and against transformers' own parameter count; the key's
loss against transformers' cross-entropy and ``aux_loss`` on a tiny random model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from shardtune.config import ConfigError, load_config
from shardtune.losses.next_token import next_token_loss
from shardtune.models import get_model_args, model_args_to_hf_config
from shardtune.models.registry import build_model
from shardtune.recipes.registry import get_recipe
from tests.unit.test_models_moe import batch, hf_moe_model, ours_from

# From Qwen/Qwen3-30B-A3B and mistralai/Mixtral-8x7B-v0.1 config.json (the keys that shape the model).
PUBLISHED = {
    "qwen3_moe_30b_a3b": {
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
    "mixtral_8x7b": {
        "model_type": "mixtral",
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "router_aux_loss_coef": 0.02,
        "vocab_size": 32000,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}


@pytest.mark.parametrize("preset", sorted(PUBLISHED))
def test_moe_presets_have_the_published_shapes_and_transformers_parameter_count(preset):
    args = get_model_args(preset)
    config = transformers.AutoConfig.for_model(**model_args_to_hf_config(args))
    for key, value in PUBLISHED[preset].items():
        assert getattr(config, key) == value, key
    assert config.rope_parameters["rope_theta"] == 1e6
    with torch.device("meta"):
        reference = transformers.AutoModelForCausalLM.from_config(config)
    ours = build_model(args, device="meta")
    assert [(k, v.shape) for k, v in ours.state_dict().items()] == [
        (k, v.shape) for k, v in reference.state_dict().items()
    ]


def _loss_and_router_grads(coef: float | None):
    hf = hf_moe_model("qwen3_moe")  # router_aux_loss_coef 0.05 in its config
    ours = ours_from(hf)
    tokens, mask, labels = batch()
    loss_fn = next_token_loss(ours, device=torch.device("cpu"), router_aux_loss_coef=coef)
    loss, n_tokens, extra = loss_fn({"tokens": tokens, "labels": labels, "attention_mask": mask})
    loss.backward()
    out = hf(tokens, attention_mask=mask, output_router_logits=True)
    ce = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    grads = {n: p.grad for n, p in ours.named_parameters() if n.endswith("mlp.gate.weight")}
    return hf, out, ce, loss, extra["aux_loss"] / n_tokens, grads


@pytest.mark.parametrize("coef", [None, 0.5, 0.0])
def test_router_aux_loss_coef_sets_the_aux_loss_weight_as_transformers_applies_it(coef):
    hf, out, ce, loss, aux, grads = _loss_and_router_grads(coef)
    weight = hf.config.router_aux_loss_coef if coef is None else coef
    reference = ce + weight * out.aux_loss  # transformers' out.loss with router_aux_loss_coef=weight
    assert abs(loss.item() - reference.item()) < 1e-5
    assert abs(aux.item() - out.aux_loss.item()) < 1e-6  # logged also when it is not in the loss
    reference.backward()
    for name, grad in grads.items():
        expected = hf.get_parameter(name).grad
        assert ((grad - expected).abs().max() / expected.abs().max()).item() < 1e-4, name


def test_the_key_is_offered_by_every_recipe():
    overrides = ["router_aux_loss_coef=0.01"]
    cfg = load_config("tiny/moe_full", overrides, schema=get_recipe("full_finetune_distributed").schema)
    assert cfg.router_aux_loss_coef == 0.01 and cfg.model == "tiny_moe"
    assert load_config("tiny/lora", schema=get_recipe("lora_finetune_distributed").schema).router_aux_loss_coef is None
    for recipe, config in [
        ("lora_dpo_distributed", "tiny/lora_dpo"),
        ("full_dpo_distributed", "tiny/full_dpo"),
        ("knowledge_distillation_distributed", "tiny/kd"),
        ("early_exit_finetune_distributed", "tiny/early_exit"),
    ]:
        assert load_config(config, overrides, schema=get_recipe(recipe).schema).router_aux_loss_coef == 0.01, recipe
    with pytest.raises(ConfigError, match="router_aux_loss_coef"):
        load_config("tiny/lora_dpo", ["router_aux_loss_coef=-1"], schema=get_recipe("lora_dpo_distributed").schema)
