"""The LoRA recipe trains a non-Llama family on 2 ranks from a directory written by transformers' ``save_pretrained``,
with the generic (Llama-named) targets of ``tiny/lora``; its outputs load in transformers/peft as that family.
The full and LoRA recipes on a multimodal Qwen3.5 directory write it back as the same multimodal checkpoint."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

from shardtune.data import save_byte_tokenizer
from tests.recipes.conftest import losses
from tests.unit.test_models_families import hf_config, randomize_

pytestmark = pytest.mark.timeout(600)


# peft 0.21 reads gate_proj/up_proj/down_proj of a deepseek_v3 model as its fused experts: adapt the attention only,
# by Llama's names (q_proj -> q_b_proj, k_proj/v_proj -> kv_b_proj)
TARGETS = {"deepseek_v3": ["lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"]}


@pytest.mark.parametrize("name", ["phi3", "gemma2", "deepseek_v3"])
def test_lora_recipe_on_a_save_pretrained_dir(tmp_path, recipe_pool, name):
    config = hf_config(name)
    config.vocab_size, config.pad_token_id, config.bos_token_id, config.eos_token_id = 256, 0, 1, 2
    torch.manual_seed(0)
    base = randomize_(transformers.AutoModelForCausalLM.from_config(config), 0)
    base.save_pretrained(tmp_path / "base")
    save_byte_tokenizer(tmp_path / "base")
    out = tmp_path / "run"
    recipe_pool.run(
        "lora_finetune_distributed",
        "tiny/lora",
        f"checkpoint_dir={tmp_path / 'base'}",
        "model=null",
        f"output_dir={out}",
        "epochs=1",
        "max_steps_per_epoch=2",
        "batch_size=2",
        "log_every_n_steps=1",
        *TARGETS.get(name, []),
        nproc=2,
    )
    assert sorted(losses(out)) == [1, 2]
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "epoch_1").eval()
    assert type(merged) is type(base)
    x = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base_logits = base.eval()(x).logits
        with_adapter = peft.PeftModel.from_pretrained(base, out / "epoch_1" / "adapter").eval()  # wraps base in place
        expected = with_adapter(input_ids=x).logits
        assert (merged(x).logits - expected).abs().max() <= 1e-4 * expected.abs().max()
        assert (expected - base_logits).abs().max() > 1e-4  # training changed the adapters


@pytest.mark.parametrize(
    "recipe, config", [("full_finetune_distributed", "tiny/full"), ("lora_finetune_distributed", "tiny/lora")]
)
def test_recipe_writes_back_a_multimodal_qwen3_5_dir(tmp_path, recipe_pool, recipe, config):
    from transformers.models.qwen3_5 import Qwen3_5ForConditionalGeneration

    from tests.distributed.test_hf_multimodal import hf_multimodal, safetensors_tensors

    base = tmp_path / "base"
    hf_multimodal(vocab_size=256).save_pretrained(base)
    save_byte_tokenizer(base)
    out = tmp_path / "run"
    recipe_pool.run(
        recipe,
        config,
        f"checkpoint_dir={base}",
        "model=null",
        f"output_dir={out}",
        "epochs=1",
        "max_steps_per_epoch=2",
        "batch_size=2",
        "log_every_n_steps=1",
        nproc=2,
    )
    assert sorted(losses(out)) == [1, 2]
    source, saved = safetensors_tensors(base), safetensors_tensors(out / "epoch_1")
    assert sorted(saved) == sorted(source)
    assert all(torch.equal(saved[k], v) for k, v in source.items() if k.startswith("model.visual."))
    trained_key = "model.language_model.layers.1.self_attn.q_proj.weight"  # trained by both recipes
    assert not torch.equal(saved[trained_key], source[trained_key])
    trained = Qwen3_5ForConditionalGeneration.from_pretrained(out / "epoch_1").eval()
    assert torch.equal(trained.model.language_model.layers[1].self_attn.q_proj.weight, saved[trained_key])
    assert (out / "epoch_1" / "tokenizer.json").is_file()
    if recipe.startswith("lora"):  # the adapter loads on the multimodal base as the merged weights
        x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
        multimodal_base = Qwen3_5ForConditionalGeneration.from_pretrained(base).eval()
        with torch.no_grad():
            expected = trained(input_ids=x).logits
            with_adapter = peft.PeftModel.from_pretrained(multimodal_base, out / "epoch_1" / "adapter").eval()
            assert (with_adapter(input_ids=x).logits - expected).abs().max() <= 1e-4 * expected.abs().max()
