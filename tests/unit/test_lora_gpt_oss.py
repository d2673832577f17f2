"""LoRA on gpt-oss's experts and router against peft 0.21.2 (PEFT's ``is_transposed`` expert layout).

A tiny random gpt-oss from transformers (E = 8, 2I = 48 != H = 64, so an adapter laid out for
``[E, out, in]`` cannot load): the same LoraConfig gives peft's adapter keys and shapes, peft's logits
and adapter gradients on the same weights, and a merged model equal to ``merge_and_unload``.
"""

from __future__ import annotations

import copy

import peft
import torch
from safetensors.torch import load_file

from shardtune.checkpoint import save_hf_checkpoint, save_peft_adapter
from tests.unit.test_lora_moe import _ours, _peft, lora_grad_errors
from tests.unit.test_models_gpt_oss import hf_gpt_oss
from tests.unit.test_models_moe import batch

PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.router.weight"]


def test_keys_logits_and_adapter_grads_equal_peft():
    hf = hf_gpt_oss()
    pm = _peft(hf, PARAMETERS)
    assert pm.base_model.model.model.layers[0].mlp.experts.get_base_layer().is_transposed  # peft: [E, in, out]
    ours = _ours(hf, pm, PARAMETERS)
    tokens, mask, _ = batch()
    expected = pm(tokens, attention_mask=mask).logits
    got = ours(tokens)
    real = mask.bool()
    assert ((got - expected)[real].abs().max() / expected[real].abs().max()) < 1e-5
    assert (got - hf(tokens).logits)[real].abs().max() > 1e-2  # the adapters change the model
    expected[real].square().sum().backward()
    got[real].square().sum().backward()
    errors = lora_grad_errors(ours, pm)
    assert all(error < 1e-4 for error in errors.values()), errors


def test_saved_adapter_has_peft_names_loads_in_peft_and_merges_as_peft(tmp_path):
    hf = hf_gpt_oss().eval()
    pm = _peft(hf, PARAMETERS)
    ours = _ours(hf, pm, PARAMETERS)
    pm.save_pretrained(tmp_path / "peft")
    save_peft_adapter(ours, tmp_path / "ours")
    theirs, mine = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("peft", "ours"))
    assert sorted(mine) == sorted(theirs)
    assert all(torch.equal(mine[key], value) for key, value in theirs.items())
    tokens = batch()[0]
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf), tmp_path / "ours").eval()
    with torch.no_grad():
        assert (loaded(tokens).logits - ours(tokens)).abs().max() < 1e-5
    save_hf_checkpoint(ours, tmp_path / "merged")
    merged = load_file(tmp_path / "merged/model.safetensors")
    reference = pm.merge_and_unload().state_dict()
    assert sorted(merged) == sorted(reference)
    for key, value in reference.items():
        assert (merged[key] - value).abs().max() < 1e-6, key
