"""The whole frozen base kept in block FP8 under LoRA: linears LoRA does not wrap (``fp8_linears``), in one process.

The oracle: a tiny transformers DeepSeek-V3 (a dense first layer, shared experts, ``q_lora_rank`` set or
null) saved and quantized by hand in blocks of 20 x 40 (``tests/unit/test_fp8_lora.deepseek_fp8_dir``:
partial edge blocks, dims not multiples of the block), one linear then stored unquantized as
``modules_to_not_convert`` leaves some; the transformers model holds the hand-dequantized weights, with
peft's LoRA on two projections; a DCP checkpoint of that model converted by ``convert_dcp_to_hf``. The
sharded case: tests/distributed/test_fp8_lora_sharded.py.
"""

from __future__ import annotations

import json

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from shardtune.checkpoint import CheckpointError
from shardtune.checkpoint.formats.dcp_format import convert_dcp_to_hf, save_dcp, write_model_description
from shardtune.checkpoint.formats.hf_load import fp8_linears
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.checkpoint.layout import DCP_DIR
from shardtune.models import from_hf_config
from shardtune.peft import apply_lora, fp8_linear, merge_lora
from shardtune.peft.adapters import get_merged_state_dict
from shardtune.peft.fp8_linear import Fp8Linear
from tests.unit.test_block_fp8 import BLOCK, hand_quantize
from tests.unit.test_fp8_lora import ALPHA, RANK, adapters_of, deepseek_fp8_dir, fp8_lora, peft_over
from tests.unit.test_models_moe import batch
from tests.unit.test_moe_checkpoint import tensors

FP8 = torch.float8_e4m3fn
PLAIN = "model.layers.1.mlp.shared_experts.down_proj.weight"  # stored unquantized by the test


def targets(q_lora_rank: int | None) -> list[str]:
    return ["q_b_proj" if q_lora_rank else "q_proj", "o_proj"]


def make_dir(directory, q_lora_rank: int | None = 24):
    """The FP8 directory with :data:`PLAIN` stored dequantized (float32, no scale); its transformers model."""
    hf = deepseek_fp8_dir(directory, q_lora_rank=q_lora_rank)
    stored = safetensors.torch.load_file(directory / "model.safetensors")
    scale = stored.pop(PLAIN + "_scale_inv")
    stored[PLAIN] = _dequantize_fp8_weight(stored[PLAIN], scale, list(BLOCK), torch.float32)
    safetensors.torch.save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
    return hf


def frozen_fp8_names(stored: dict[str, torch.Tensor], wrapped: list[str]) -> set[str]:
    """The linears (module names) the file stores in FP8 that are neither LoRA targets nor routed experts."""
    return {
        name.removesuffix(".weight")
        for name, value in stored.items()
        if value.dtype == FP8 and ".experts." not in name and name.rsplit(".", 2)[-2] not in wrapped
    }


def test_every_linear_stored_in_fp8_is_held_in_fp8_and_no_other(tmp_path):
    make_dir(tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    model = fp8_lora(tmp_path, dtype=torch.bfloat16, target_modules=targets(24), whole_base=True)
    kept = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    # layer 0: q_a, kv_a, kv_b and the dense MLP's three; layers 1-2: q_a, kv_a, kv_b, the shared experts' three
    # but PLAIN
    assert kept == frozen_fp8_names(stored, targets(24)) and len(kept) == 6 + 6 + 5
    params = dict(model.named_parameters())
    for name, p in params.items():
        if name.endswith("_scale_rows") or "lora_" in name:
            continue
        if name in stored and stored[name].dtype == FP8:  # a LoRA base or a frozen linear: the file's bytes
            assert p.dtype == FP8 and not p.requires_grad and p.untyped_storage().nbytes() == p.numel(), name
            assert torch.equal(p.view(torch.uint8), stored[name].view(torch.uint8)), name
            rows = stored[name + "_scale_inv"].repeat_interleave(BLOCK[0], 0)[: p.shape[0]]
            assert torch.equal(params[name + "_scale_rows"], rows), name
        elif ".experts." in name:  # the routed experts, stored per expert (tests/unit/test_fp8_experts.py)
            assert p.dtype == FP8, name
        else:  # norms, the router, embeddings, lm_head and the linear stored unquantized: as stored
            assert p.dtype == torch.bfloat16, name
    assert (
        params[PLAIN].dtype == torch.bfloat16 and type(model.get_submodule(PLAIN[: -len(".weight")])) is torch.nn.Linear
    )


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_first_step_loss_and_adapter_grads_equal_peft_over_the_dequantized_base(tmp_path, q_lora_rank):
    hf = make_dir(tmp_path, q_lora_rank)
    pm = peft_over(hf, targets=targets(q_lora_rank))
    model = fp8_lora(tmp_path, target_modules=targets(q_lora_rank), whole_base=True)
    assert isinstance(model.model.layers[0].mlp.up_proj, Fp8Linear)
    assert isinstance(model.model.layers[1].mlp.shared_experts.gate_proj, Fp8Linear)
    assert isinstance(model.model.layers[2].self_attn.kv_a_proj_with_mqa, Fp8Linear)
    model.load_state_dict(adapters_of(pm), strict=False)
    tokens = batch()[0]

    def loss(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())

    want, got = loss(pm(tokens).logits), loss(model(tokens))
    assert (got - want).abs() <= 1e-5 * want.abs()
    want.backward()
    got.backward()
    grads = {k.removeprefix("base_model.model.").replace(".default", ""): p.grad for k, p in pm.named_parameters()}
    ours = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert sorted(ours) == sorted(k for k in grads if "lora_" in k) and len(ours) == 2 * 2 * 3
    for key, grad in ours.items():
        assert (grad - grads[key]).abs().max() <= 1e-4 * grads[key].abs().max(), key
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)


def test_saves_write_the_frozen_fp8_linears_dequantized_or_as_their_bytes(tmp_path):
    hf = make_dir(tmp_path / "fp8")
    pm = peft_over(hf, targets=targets(24))
    model = fp8_lora(tmp_path / "fp8", target_modules=targets(24), whole_base=True)
    model.load_state_dict(adapters_of(pm), strict=False)
    stored = tensors(tmp_path / "fp8")
    frozen = [f"{n}.weight" for n in sorted(frozen_fp8_names(stored, targets(24)))]
    dequantized = hf.state_dict()  # the hand dequantization
    save_hf_checkpoint(model, tmp_path / "base", merge_adapters=False)
    save_hf_checkpoint(model, tmp_path / "merged")
    save_hf_checkpoint(model, tmp_path / "requantized", weight_format="block_fp8")
    base, merged, requantized = (tensors(tmp_path / d) for d in ("base", "merged", "requantized"))
    assert not any("scale" in k or "lora" in k for k in merged)
    for name in frozen:  # dequantized in both dtype saves; the block-FP8 save gives back the file's bytes
        assert torch.equal(base[name], dequantized[name]) and torch.equal(merged[name], dequantized[name]), name
        assert torch.equal(requantized[name].view(torch.uint8), stored[name].view(torch.uint8)), name
        assert torch.equal(requantized[name + "_scale_inv"], stored[name + "_scale_inv"]), name
    assert sorted(requantized) == sorted(stored) and requantized[PLAIN].dtype == torch.float32
    theirs = pm.merge_and_unload().state_dict()
    for name in (n for n in theirs if n.rsplit(".", 2)[-2] in targets(24)):
        assert (merged[name] - theirs[name]).abs().max() <= 1e-6, name
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    tokens = batch()[0]
    with torch.no_grad():
        want = pm(tokens).logits
        assert (loaded(tokens).logits - want).abs().max() <= 1e-5 * want.abs().max()
    # merged in memory: plain linears again, holding the dequantized weights
    in_memory = merge_lora(model)
    assert not [m for m in in_memory.modules() if isinstance(m, Fp8Linear)]
    state = in_memory.state_dict()
    assert not any("scale" in k for k in state)
    for name in frozen:
        assert torch.equal(state[name], dequantized[name]), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # DCP in one process, as it says
def test_a_dcp_checkpoint_converts_to_the_merged_weights_and_to_the_base_format(tmp_path):
    """``convert_dcp_to_hf`` of a block-FP8 LoRA run's DCP checkpoint (the adapters, as the checkpointer writes
    them, beside the model description naming the base) rebuilds the frozen linears in FP8 from the base."""
    hf = make_dir(tmp_path / "fp8")
    pm = peft_over(hf, targets=targets(24))
    model = fp8_lora(tmp_path / "fp8", target_modules=targets(24), whole_base=True)
    model.load_state_dict(adapters_of(pm), strict=False)
    checkpoint = tmp_path / "step_1"
    save_dcp(model, None, checkpoint / DCP_DIR, async_save=False)
    write_model_description(model, checkpoint, tmp_path / "fp8")
    convert_dcp_to_hf(checkpoint, tmp_path / "merged")
    convert_dcp_to_hf(checkpoint, tmp_path / "requantized", weight_format="block_fp8")
    stored, merged, requantized = (tensors(tmp_path / d) for d in ("fp8", "merged", "requantized"))
    frozen = [f"{n}.weight" for n in sorted(frozen_fp8_names(stored, targets(24)))]
    dequantized, theirs = hf.state_dict(), pm.merge_and_unload().state_dict()
    assert not any("scale" in k or "lora" in k for k in merged)
    for name in frozen:  # the hand dequantization; in the base's format, the file's bytes and scales
        assert torch.equal(merged[name], dequantized[name]), name
        assert torch.equal(requantized[name].view(torch.uint8), stored[name].view(torch.uint8)), name
        assert torch.equal(requantized[name + "_scale_inv"], stored[name + "_scale_inv"]), name
    adapted = [n for n in theirs if n.rsplit(".", 2)[-2] in targets(24)]
    assert len(adapted) == 2 * 3
    for name in adapted:  # peft's merge; quantized again from it in the base's format
        assert (merged[name] - theirs[name]).abs().max() <= 1e-6, name
        fp8, scale = hand_quantize(merged[name])
        assert torch.equal(requantized[name].view(torch.uint8), fp8.view(torch.uint8)), name
        assert torch.equal(requantized[name + "_scale_inv"], scale), name
    assert sorted(requantized) == sorted(stored)
    config = json.loads((tmp_path / "requantized" / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == list(BLOCK)


def test_resident_bytes_of_the_frozen_linears_are_a_quarter_of_float32_plus_scales(tmp_path):
    make_dir(tmp_path)
    whole = fp8_lora(tmp_path, target_modules=targets(24), whole_base=True)
    before = fp8_lora(tmp_path, target_modules=targets(24))
    for name, m in whole.named_modules():
        if isinstance(m, Fp8Linear):
            plain = before.get_submodule(name).weight
            assert plain.dtype == torch.float32
            held = m.weight.untyped_storage().nbytes() + m.weight_scale_rows.untyped_storage().nbytes()
            assert held == plain.numel() + 4 * plain.shape[0] * -(-plain.shape[1] // BLOCK[1]), name


# --- refusals ------------------------------------------------------------------------------------------


def test_a_frozen_fp8_linear_on_a_materialized_model_is_refused_naming_it(tmp_path):
    make_dir(tmp_path)
    model = from_hf_config(tmp_path)
    name = "model.layers.0.mlp.up_proj"
    with pytest.raises(ValueError, match=f"{name}: a linear kept in block FP8 is filled by loading.*meta device"):
        fp8_linear.keep_in_fp8(model, [name], BLOCK)
    assert type(model.get_submodule(name)) is torch.nn.Linear


def test_a_missing_scale_of_a_frozen_linear_is_refused_naming_it(tmp_path):
    make_dir(tmp_path)
    name = "model.layers.1.mlp.shared_experts.gate_proj.weight"
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    del stored[name + "_scale_inv"]
    safetensors.torch.save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{name}: FP8 weight without its scale tensor {name}_scale_inv"):
        fp8_lora(tmp_path, target_modules=targets(24), whole_base=True)


def test_fp8_linears_without_a_block_fp8_base_or_naming_no_linear_are_refused(tmp_path):
    make_dir(tmp_path)
    with torch.device("meta"):
        model = from_hf_config(tmp_path)
        names = fp8_linears(model, tmp_path)
        with pytest.raises(ValueError, match='fp8_linears=.*quantize_base="block_fp8"'):
            apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=["o_proj"], fp8_linears=names)
        with pytest.raises(ValueError, match=r"model.layers.0.mlp: .*it is DenseMLP|model.layers.0.mlp: .*is \w+ of"):
            fp8_linear.keep_in_fp8(model, ["model.layers.0.mlp"], BLOCK)


def test_a_state_dict_merge_over_frozen_fp8_linears_is_refused_naming_one(tmp_path):
    make_dir(tmp_path)
    state = fp8_lora(tmp_path, target_modules=targets(24), whole_base=True).state_dict()
    adapters = {k for k in state if "lora_" in k or k.rsplit(".", 2)[-2] in targets(24)}
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj.weight is kept in block FP8.*merge_lora"):
        get_merged_state_dict({k: v for k, v in state.items() if k not in adapters}, alpha=ALPHA)


def test_the_convert_command_passes_the_weight_format_and_refuses_an_unknown_one(tmp_path, monkeypatch, capsys):
    from shardtune import cli
    from shardtune.checkpoint.formats import dcp_format

    seen = {}

    def convert(checkpoint, out_dir, **options):
        seen.update(options)
        return out_dir

    monkeypatch.setattr(dcp_format, "convert_dcp_to_hf", convert)
    assert cli.main(["convert", str(tmp_path / "step_1"), str(tmp_path / "hf"), "--weight-format", "block_fp8"]) == 0
    assert seen["weight_format"] == "block_fp8"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["convert", str(tmp_path / "step_1"), str(tmp_path / "hf"), "--weight-format", "fp8"])
    assert exit_.value.code == 2 and "block_fp8" in capsys.readouterr().err
