"""A Qwen3-MoE base (transformers' fused expert layout) through the full and LoRA fine-tuning recipes on
2 CPU ranks, with activation checkpointing and the chunked loss: the first step's loss equals
transformers' ``out.loss`` (cross-entropy plus ``router_aux_loss_coef`` times the load-balancing loss
of the real tokens) on the same global batch, ``aux_loss`` is logged, the saved model loads in
transformers with the trained weights, the LoRA adapter (attention) in peft with the merged model's
logits. A per-expert base (transformers' default save) trains and is saved per expert. The runs run
in-process (``recipe_pool``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.recipes.test_recipes import _first_global_batch

pytestmark = pytest.mark.timeout(600)

COEF = 0.05


def _moe_base(tiny_base: Path, dest: Path, *, fused: bool = True) -> Path:
    import transformers

    base = json.loads((tiny_base / "config.json").read_text())
    config = transformers.Qwen3MoeConfig(
        vocab_size=base["vocab_size"],
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        router_aux_loss_coef=COEF,
        bos_token_id=base.get("bos_token_id"),
        eos_token_id=base.get("eos_token_id"),
        pad_token_id=base.get("pad_token_id"),
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)  # routing that differs between tokens, so the aux loss is not at its minimum
    model.save_pretrained(dest, save_original_format=not fused)
    for f in tiny_base.iterdir():
        if f.name != "config.json" and not f.name.startswith("model"):
            shutil.copy(f, dest / f.name)
    return dest


def _reference_first_step(base: Path, config: str) -> tuple[float, float]:
    """(loss, aux_loss) of step 1 as the loop defines them, from transformers on each rank's batch."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, experts_implementation="eager").eval()
    loss_sum, aux_sum, tokens = 0.0, 0.0, 0
    with torch.no_grad():
        for batch in _first_global_batch(config, base):
            out = model(batch["tokens"], attention_mask=batch["attention_mask"], output_router_logits=True)
            logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
            ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
            n = int((labels != -100).sum())
            loss_sum += ce.item() + COEF * out.aux_loss.item() * n
            aux_sum += out.aux_loss.item() * n
            tokens += n
    return loss_sum / tokens, aux_sum / tokens


def _first_step_checked(pool, recipe: str, config: str, tiny_dirs, tmp_path: Path, *extra: str) -> tuple[Path, Path]:
    """Run ``recipe`` 2 steps on ``pool`` on a fresh MoE base; check step 1's loss and aux_loss; returns
    (base, epoch_1)."""
    base = _moe_base(tiny_dirs["base"], tmp_path / "moe_base")
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "model=null", "epochs=1", "max_steps_per_epoch=2"]
    pool.run(recipe, config, *overrides, "batch_size=4", "log_every_n_steps=1", *extra)
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    loss, aux = _reference_first_step(base, config)  # LoRA: fresh adapters, the base's loss
    assert abs(first["loss"] - loss) < 1e-4 * loss and abs(first["aux_loss"] - aux) < 1e-4 * aux, (first, loss)
    return base, out / "epoch_1"


def test_moe_full_finetune_first_step_equals_transformers_and_saves_fused(tiny_dirs, tmp_path, recipe_pool):
    import transformers

    checkpointing = "enable_activation_checkpointing=true"
    recipe = ("full_finetune_distributed", "tiny/full")
    _, final = _first_step_checked(recipe_pool, *recipe, tiny_dirs, tmp_path, checkpointing)
    saved = load_file(final / "model.safetensors")
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 48, 64)
    trained, info = transformers.AutoModelForCausalLM.from_pretrained(
        final, experts_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for name, p in trained.state_dict().items():
        assert torch.equal(p, saved[name]), name


def test_moe_lora_first_step_equals_transformers_and_adapter_loads_in_peft(tiny_dirs, tmp_path, recipe_pool):
    import peft
    import transformers

    targets = "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]"
    base, final = _first_step_checked(
        recipe_pool, "lora_finetune_distributed", "tiny/lora", tiny_dirs, tmp_path, targets
    )
    tokens = torch.arange(3, 40).reshape(1, -1)
    load = {"experts_implementation": "eager"}
    merged = transformers.AutoModelForCausalLM.from_pretrained(final, **load).eval()
    base_model = transformers.AutoModelForCausalLM.from_pretrained(base, **load).eval()
    with torch.no_grad():
        plain = base_model(tokens).logits
        adapted = peft.PeftModel.from_pretrained(base_model, final / "adapter").eval()(tokens).logits
        got = merged(tokens).logits
    assert (got - adapted).abs().max() < 1e-4
    assert (got - plain).abs().max() > 1e-3  # the adapters changed the model


def test_per_expert_base_trains_and_saves_per_expert_covered_by_checksums(tiny_dirs, tmp_path, recipe_pool):
    """transformers' default (per-expert) save as the base: the run writes that layout back, exactly as
    transformers' ``save_pretrained`` of the trained weights; ``shardtune verify`` finds a flipped expert byte."""
    import transformers

    from shardtune import cli
    from tests.unit.test_moe_checkpoint import tensors

    base = _moe_base(tiny_dirs["base"], tmp_path / "per_expert", fused=False)
    out = tmp_path / "run"
    overrides = [f"output_dir={out}", f"checkpoint_dir={base}", "model=null", "epochs=1", "max_steps_per_epoch=1"]
    recipe_pool.run("full_finetune_distributed", "tiny/full", *overrides, "batch_size=4")
    final = out / "epoch_1"
    trained = transformers.AutoModelForCausalLM.from_pretrained(final, dtype="auto", experts_implementation="eager")
    trained.save_pretrained(tmp_path / "resaved")  # transformers' per-expert layout of the same weights
    got, want = tensors(final), tensors(tmp_path / "resaved")
    assert sorted(got) == sorted(want) and "model.layers.1.mlp.experts.7.up_proj.weight" in got
    assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in want.items())
    assert cli.main(["verify", str(final)]) == 0
    weights = final / "model.safetensors"
    data = bytearray(weights.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    start = json.loads(data[8 : 8 + header_len])["model.layers.1.mlp.experts.7.up_proj.weight"]["data_offsets"][0]
    data[8 + header_len + start] ^= 0x01
    weights.write_bytes(bytes(data))
    assert cli.main(["verify", str(final)]) == 1
