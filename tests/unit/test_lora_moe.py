"""LoRA on mixture-of-experts parameters (``lora.target_parameters``) against peft 0.21.2 as the oracle.

Tiny random Qwen3-MoE, Mixtral and Qwen3.5-MoE models from transformers (E = 8, top-2, expert widths 2I != H, rank
r = 4 != E): the same LoraConfig (attention modules plus both fused expert weights and the router) gives
the same adapter keys and shapes as peft's ``get_peft_model``, the same logits and adapter gradients on the
same weights, adapter files that peft saves with exactly the same names and that
``PeftModel.from_pretrained`` loads with our logits, and a merged export equal to ``merge_and_unload``.
"""

from __future__ import annotations

import copy

import peft
import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from shardtune.checkpoint import save_hf_checkpoint, save_peft_adapter
from shardtune.checkpoint.formats.peft_format import load_peft_adapter
from shardtune.peft import adapters_disabled, apply_lora, get_adapter_state_dict, get_merged_state_dict, merge_lora
from shardtune.peft.adapters import PEFT_PREFIX
from tests.unit.test_lora import _hf as dense_hf
from tests.unit.test_lora import _ours as dense_ours
from tests.unit.test_models_moe import ATOL, batch, hf_moe_model, ours_from

PEFT_VERSION = "0.21.2"  # the peft these expectations were checked with (its ParamWrapper layout)
RANK, ALPHA = 4, 8.0
MODULES = ["q_proj", "v_proj"]
PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]


def _peft(hf, parameters=PARAMETERS, seed: int = 3, modules=MODULES):
    """peft's model over a copy of ``hf``, every adapter factor random (B too, so the update is not zero)."""
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=modules, target_parameters=parameters)
    pm = peft.get_peft_model(copy.deepcopy(hf), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return pm


def _ours(hf, pm, parameters=PARAMETERS, modules=MODULES):
    model = apply_lora(ours_from(hf), rank=RANK, alpha=ALPHA, target_modules=modules, target_parameters=parameters)
    saved = peft.get_peft_model_state_dict(pm)
    ours = {PEFT_PREFIX + k: v for k, v in get_adapter_state_dict(model).items()}
    assert {k: tuple(v.shape) for k, v in ours.items()} == {k: tuple(v.shape) for k, v in saved.items()}
    state = {k.removeprefix(PEFT_PREFIX): v for k, v in saved.items()}
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora" in k]
    return model


def lora_grad_errors(model, pm) -> dict[str, float]:
    """Each LoRA parameter's max |grad - peft's| / max |peft's| by shardtune's name (sharded gradients
    gathered; activation checkpointing's wrapper prefix dropped)."""
    theirs = {k.replace(".default", ""): p.grad for k, p in pm.named_parameters() if "lora_" in k}
    errors = {}
    for key, p in model.named_parameters():
        if "lora" in key:
            grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            reference = theirs[PEFT_PREFIX + key.replace("_checkpoint_wrapped_module.", "")]
            errors[key] = ((grad - reference).abs().max() / reference.abs().max()).item()
    return errors


def test_peft_version_is_the_one_checked():
    assert peft.__version__ == PEFT_VERSION


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen3_5_moe_text"])
@pytest.mark.parametrize("parameters", [PARAMETERS, ["mlp.experts.down_proj"]])
def test_keys_logits_and_adapter_grads_equal_peft(name, parameters):
    hf = hf_moe_model(name)
    pm = _peft(hf, parameters)
    ours = _ours(hf, pm, parameters)
    tokens, mask, _ = batch()
    expected = pm(tokens, attention_mask=mask).logits
    got = ours(tokens)
    real = mask.bool()
    assert ((got - expected)[real].abs().max() / expected[real].abs().max()) < 1e-5
    assert (got - hf(tokens).logits)[real].abs().max() > 1e-2  # the expert adapters change the model
    expected[real].square().sum().backward()
    got[real].square().sum().backward()
    errors = lora_grad_errors(ours, pm)
    assert all(error < 1e-4 for error in errors.values()), errors
    assert not any(p.requires_grad for key, p in ours.named_parameters() if "lora" not in key)
    with torch.no_grad(), adapters_disabled(ours):
        # a DPO reference pass is the base
        assert (ours(tokens) - hf(tokens).logits)[real].abs().max() < ATOL.get(name, 1e-5)


def test_saved_adapter_has_peft_names_loads_in_peft_and_merges_as_peft(tmp_path):
    hf = hf_moe_model("qwen3_moe").eval()
    pm = _peft(hf)
    ours = _ours(hf, pm)
    pm.save_pretrained(tmp_path / "peft")
    save_peft_adapter(ours, tmp_path / "ours")
    theirs, mine = (
        load_file(tmp_path / "peft/adapter_model.safetensors"),
        load_file(tmp_path / "ours/adapter_model.safetensors"),
    )
    assert sorted(mine) == sorted(theirs)
    for key, value in theirs.items():
        assert torch.equal(mine[key], value), key
    tokens, _, _ = batch()
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    with torch.no_grad():
        logits = ours(tokens)
        assert (loaded(tokens).logits - logits).abs().max() < 1e-5
    save_hf_checkpoint(ours, tmp_path / "merged", expert_layout="fused")
    merged = load_file(tmp_path / "merged/model.safetensors")
    merged_model = pm.merge_and_unload()
    reference = merged_model.state_dict()
    assert sorted(merged) == sorted(reference)
    for key, value in reference.items():
        assert (merged[key] - value).abs().max() < 1e-6, key
    save_hf_checkpoint(ours, tmp_path / "per_expert", expert_layout="per_expert")
    merged_model.save_pretrained(tmp_path / "hf")  # transformers' default: per-expert tensors
    per_expert, expected = (
        load_file(tmp_path / "per_expert/model.safetensors"),
        load_file(tmp_path / "hf/model.safetensors"),
    )
    assert sorted(per_expert) == sorted(expected)
    for key, value in expected.items():
        assert (per_expert[key] - value).abs().max() < 1e-6, key
    again = apply_lora(ours_from(hf), rank=RANK, alpha=ALPHA, target_modules=MODULES, target_parameters=PARAMETERS)
    load_peft_adapter(again, tmp_path / "peft", device="cpu")  # peft's own file loads into ours
    with torch.no_grad():
        assert torch.equal(again(tokens), logits)
        folded = merge_lora(again)
        assert not get_adapter_state_dict(folded)
        for key, value in folded.state_dict().items():
            assert (value - reference[key]).abs().max() < 1e-6, key


def test_bad_target_parameters_are_refused_naming_the_option():
    hf = hf_moe_model("qwen3_moe")
    kw = {"rank": RANK, "alpha": ALPHA, "target_modules": MODULES}
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj .* to NF4 per expert"):
        apply_lora(ours_from(hf), **kw, target_parameters=PARAMETERS, quantize_base=True)
    with pytest.raises(ValueError, match="dropout.*set dropout=0"):
        apply_lora(ours_from(hf), **kw, target_parameters=PARAMETERS, dropout=0.1)
    with pytest.raises(ValueError, match="unknown LoRA target_parameters"):
        apply_lora(ours_from(hf), **kw, target_parameters=["mlp.experts.up_proj"])
    adapted = apply_lora(ours_from(hf), **kw, target_parameters=PARAMETERS)
    with pytest.raises(ValueError, match="target_parameters.*use merge_lora"):
        get_merged_state_dict(adapted.state_dict(), alpha=ALPHA)
    with pytest.raises(ValueError, match="names no parameter of this llama model"):
        apply_lora(dense_ours(dense_hf()), **kw, target_parameters=["mlp.experts.down_proj"])
