"""Weight decay skips exactly the params transformers' ``Trainer`` skips, in every optimizer we offer.

The oracle is transformers 5's ``Trainer.get_decay_parameter_names`` (what TRL, axolotl and
LLaMA-Factory group by), run on the transformers model of each family and on ours built from
its config; the steps are compared with torch's AdamW over transformers' two groups.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from shardtune.choices import OPTIMIZERS
from shardtune.models import from_hf_config
from shardtune.peft import apply_lora
from shardtune.training.optim import build_optimizer
from shardtune.training.weight_decay import no_decay_names
from tests.unit.test_models_families import FAMILY_CONFIGS, hf_model, ours_from_hf
from tests.unit.test_models_gpt_oss import hf_gpt_oss
from tests.unit.test_models_moe import MOE_CONFIGS, hf_moe_model

BUILDERS = {
    **{name: lambda name=name: hf_model(name) for name in FAMILY_CONFIGS},
    **{name: lambda name=name: hf_moe_model(name) for name in MOE_CONFIGS},
    "gpt_oss": hf_gpt_oss,
}


def _transformers_no_decay(model: torch.nn.Module) -> set[str]:
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    return {name for name, _ in model.named_parameters()} - decay


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_no_decay_params_are_transformers_on_every_family(family):
    hf = BUILDERS[family]()
    ours = from_hf_config(hf.config.to_dict())
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in hf.named_parameters()}
    exempt = _transformers_no_decay(hf)
    assert no_decay_names(ours) == exempt == _transformers_no_decay(ours)
    assert any("norm" in n for n in exempt) and not any(n.endswith("proj.weight") for n in exempt)


def test_biases_and_qk_norms_are_exempt():
    """Qwen2's q/k/v biases and Qwen3's q_norm/k_norm by name; gpt-oss's expert and router biases."""
    qwen2 = no_decay_names(from_hf_config(hf_model("qwen2_tied").config.to_dict()))
    assert {"model.layers.0.self_attn.q_proj.bias", "model.norm.weight"} <= qwen2
    qwen3 = no_decay_names(from_hf_config(hf_model("qwen3").config.to_dict()))
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= qwen3
    gpt_oss = no_decay_names(from_hf_config(hf_gpt_oss().config.to_dict()))
    assert {"model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.router.bias"} <= gpt_oss
    assert "model.layers.0.self_attn.sinks" not in gpt_oss  # not a bias or a norm: decayed, as in transformers


def test_a_norm_is_exempt_by_its_type_whatever_its_name():
    from shardtune.models.blocks.norm import RMSNorm

    model = torch.nn.ModuleDict({"ln_f": RMSNorm(4), "final": torch.nn.LayerNorm(4), "proj": torch.nn.Linear(4, 4)})
    assert no_decay_names(model) == {"ln_f.weight", "final.weight", "final.bias", "proj.bias"}


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_every_optimizer_gets_two_groups_and_one_on_request(name):
    ours = ours_from_hf(hf_model("qwen2_tied"))
    exempt = no_decay_names(ours)
    params = dict(ours.named_parameters())
    opt = build_optimizer(ours, name=name, lr=1e-3, weight_decay=0.1)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert [{id(p) for p in g["params"]} for g in opt.param_groups] == [
        {id(p) for n, p in params.items() if n not in exempt},
        {id(p) for n, p in params.items() if n in exempt},
    ]
    (one,) = build_optimizer(ours, name=name, lr=1e-3, weight_decay=0.1, decay_norms_and_biases=True).param_groups
    assert one["weight_decay"] == 0.1 and [id(p) for p in one["params"]] == [id(p) for p in params.values()]


def test_adamw_steps_equal_torch_adamw_over_transformers_groups():
    """Three steps at lr 1e-2, wd 0.1: every tensor equals torch's AdamW over transformers' groups
    (to rounding: fused on CPU here against torch's loop); the norm weights and biases were not decayed."""
    hf = hf_model("qwen2_tied")
    ours = ours_from_hf(hf)
    decay = set(transformers.Trainer.get_decay_parameter_names(None, hf))
    named = list(hf.named_parameters())
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    theirs = torch.optim.AdamW(groups, lr=1e-2, betas=(0.8, 0.95))
    opt = build_optimizer(ours, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95))
    decay_all = ours_from_hf(hf_model("qwen2_tied"))  # the same weights, every param decayed
    all_opt = build_optimizer(decay_all, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95), decay_norms_and_biases=True)
    hf_params, our_params, all_params = dict(named), dict(ours.named_parameters()), dict(decay_all.named_parameters())
    for step in range(3):
        for i, (n, p) in enumerate(sorted(hf_params.items())):
            grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
            p.grad, our_params[n].grad, all_params[n].grad = grad.clone(), grad.clone(), grad.clone()
        for o in (theirs, opt, all_opt):
            o.step()
    for n, p in hf_params.items():
        torch.testing.assert_close(our_params[n].detach(), p.detach(), rtol=1e-6, atol=1e-7, msg=n)
    # Decaying the norm weights moves them by about lr * wd * |w| a step: far outside the tolerance.
    moved = (all_params["model.norm.weight"] - hf_params["model.norm.weight"]).abs().max().item()
    assert moved > 1e-4


def test_lora_adapters_decay_and_the_second_group_is_empty():
    model = from_hf_config(hf_model("qwen2_tied").config.to_dict())
    for p in model.parameters():
        p.requires_grad_(False)
    apply_lora(model, rank=2, alpha=4.0, target_modules=["q_proj", "v_proj"])
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    assert trainable and set(trainable) <= decay
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    assert [len(g["params"]) for g in opt.param_groups] == [len(trainable), 0]
