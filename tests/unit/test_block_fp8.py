"""Block-FP8 checkpoints against hand-quantized directories and transformers' own dequantization.

The test quantizes a tiny transformers ``qwen3_moe`` (attention, a dense layer, 8 experts per expert and
fused) itself, in blocks of 20 x 40 that neither divide its dims (64, 96, 24, 48, 32) nor are larger than
them: edge blocks are partial and a 2-rank shard of 32 or 48 rows starts inside a block. The oracle is
transformers' ``_dequantize_fp8_weight`` of each whole tensor (and the logits of the transformers model
holding those weights); a saved FP8 directory is checked against the test's own quantization of the
model's weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
import transformers
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from shardtune.checkpoint import CheckpointError, CheckpointOptions
from shardtune.checkpoint.formats.block_fp8 import dequantizing, read_quantization
from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint, open_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.checkpoint.strategies import WeightsInputs, pick_weights
from shardtune.models import from_hf_config
from shardtune.peft.lora import apply_lora, get_adapter_params, init_lora_parameters
from shardtune.ranks.errors import StateDictError
from shardtune.state_dict import load_from_full_model_state_dict
from tests.unit.test_models_moe import batch, hf_moe_model
from tests.unit.test_moe_checkpoint import LAYOUTS, tensors

BLOCK = (20, 40)
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(BLOCK)}
NOT_QUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")  # as DeepSeek's releases leave them


def hand_quantize(weight: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [..., R, C]`` -> (FP8 weight, float32 scale_inv ``[..., ceil(R/b0), ceil(C/b1)]``): per block,
    scale = 448 / amax (1 for an all-zero block), FP8 = clamp(w * scale), scale_inv = 1 / scale."""
    rows, cols = weight.shape[-2:]
    b0, b1 = block
    w = weight.to(torch.float32)
    padded = F.pad(w.abs(), (0, -cols % b1, 0, -rows % b0))
    grid = padded.unflatten(-1, (-1, b1)).unflatten(-3, (-1, b0))  # [..., R/b0, b0, C/b1, b1]
    amax = grid.amax(dim=(-3, -1))
    scale = torch.where(amax > 0, 448.0 / amax, torch.ones_like(amax))
    spread = scale.repeat_interleave(b0, -2).repeat_interleave(b1, -1)[..., :rows, :cols]
    return (w * spread).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), (1.0 / scale).to(torch.float32)


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() >= 2 and not any(part in name for part in NOT_QUANTIZED)


def fp8_dir(directory: Path, *, layout: str = "per_expert", **changes) -> tuple[object, dict[str, torch.Tensor]]:
    """A tiny qwen3_moe saved by transformers in ``layout``, its linear weights then quantized by hand:
    the transformers model holding the dequantized weights, and those weights (float32, by file name)."""
    hf = hf_moe_model("qwen3_moe", **changes).eval()
    hf.save_pretrained(directory, save_original_format=LAYOUTS[layout])
    stored = safetensors.torch.load_file(directory / "model.safetensors")
    expected = {}
    for name in list(stored):
        value = stored[name]
        if is_quantized(name, value):
            fp8, scale = hand_quantize(value)
            stored[name], stored[f"{name}_scale_inv"] = fp8, scale
            expected[name] = _dequantize_fp8_weight(fp8, scale, list(BLOCK), torch.float32)
        else:
            expected[name] = value.to(torch.float32)
    safetensors.torch.save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": QUANT}))
    hf = hf.float()
    if layout == "per_expert":
        hf.load_state_dict(_fused(expected), strict=True)
    else:
        hf.load_state_dict(expected, strict=True)
    return hf, expected


def _fused(per_expert: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' runtime keys from per-expert ones: ``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``."""
    out = {k: v for k, v in per_expert.items() if ".experts." not in k}
    layers = {k.split(".experts.")[0] for k in per_expert if ".experts." in k}
    for layer in layers:
        count = len({k for k in per_expert if k.startswith(f"{layer}.experts.") and k.endswith("down_proj.weight")})
        one = {
            p: [per_expert[f"{layer}.experts.{e}.{p}.weight"] for e in range(count)]
            for p in ("gate_proj", "up_proj", "down_proj")
        }
        out[f"{layer}.experts.gate_up_proj"] = torch.stack(
            [torch.cat(pair) for pair in zip(one["gate_proj"], one["up_proj"])]
        )
        out[f"{layer}.experts.down_proj"] = torch.stack(one["down_proj"])
    return out


# --- reading pieces ------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_every_piece_equals_the_same_piece_of_the_whole_dequantized_tensor(tmp_path, layout):
    _, expected = fp8_dir(tmp_path, layout=layout)
    with open_hf_checkpoint(tmp_path) as checkpoint:
        view, fmt = dequantizing(checkpoint, read_quantization(tmp_path), where=str(tmp_path))
        assert fmt is not None and fmt.block == BLOCK and fmt.config == QUANT
        assert not any(k.endswith("_scale_inv") for k in view) and sorted(view) == sorted(expected)
        quantized = [n for n in expected if f"{n}_scale_inv" in checkpoint]
        assert sorted(fmt.names) == sorted(quantized) and quantized
        for name in quantized:
            full = expected[name]
            lazy = view[name]
            assert lazy.get_shape() == list(full.shape)
            rows, cols = full.shape[-2:]
            # starts and ends inside blocks, single rows, whole blocks, the partial edge blocks, empty
            cuts = [(0, rows), (3, rows - 5), (21, 23), (20, 40), (rows - 1, rows), (5, 5)]
            for r0, r1 in cuts:
                for c0, c1 in [(0, cols), (7, cols - 1), (39, 41)]:
                    index = (*([slice(1, 3)] * (full.dim() - 2)), slice(r0, r1), slice(c0, c1))
                    assert torch.equal(lazy[index], full[index]), (name, index)


def test_the_model_loads_the_dequantized_weights_and_gives_transformers_logits(tmp_path):
    hf, expected = fp8_dir(tmp_path)
    with torch.device("meta"):
        ours = from_hf_config(tmp_path, dtype=torch.float32)
    load_hf_checkpoint(ours, tmp_path, device="cpu", strict=True)
    ours.init_buffers("cpu")
    state = ours.state_dict()
    for name, value in _fused(expected).items():
        assert torch.equal(state[name], value), name
    tokens = batch()[0]
    with torch.no_grad():
        assert torch.allclose(ours(tokens), hf(tokens).logits, rtol=0, atol=1e-5)


# --- bad input: refused naming the tensor or key and the fix ---------------------------------------

DOWN = "model.layers.0.self_attn.o_proj.weight"


def _rewrite(directory: Path, change) -> None:
    stored = safetensors.torch.load_file(directory / "model.safetensors")
    change(stored)
    safetensors.torch.save_file(stored, directory / "model.safetensors", metadata={"format": "pt"})


def _set_quant(directory: Path, quant) -> None:
    config = json.loads((directory / "config.json").read_text())
    if quant is None:
        config.pop("quantization_config")
    else:
        config["quantization_config"] = quant
    (directory / "config.json").write_text(json.dumps(config))


def _load(directory: Path) -> None:
    with torch.device("meta"):
        ours = from_hf_config(directory, dtype=torch.float32)
    load_hf_checkpoint(ours, directory, device="cpu", strict=True)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        (lambda s: s.pop(f"{DOWN}_scale_inv"), rf"{DOWN}: FP8 weight without its scale tensor {DOWN}_scale_inv"),
        (
            lambda s: s.update({f"{DOWN}_scale_inv": torch.ones(4, 1)}),
            rf"{DOWN}_scale_inv: shape \[4, 1\], but {DOWN} \[64, 64\] in blocks of weight_block_size \[20, 40\] "
            r"needs \[4, 2\]; fix weight_block_size",
        ),
        (
            lambda s: s.update({"model.norm.weight_scale_inv": torch.ones(1)}),
            r"model\.norm\.weight_scale_inv: a scale tensor whose weight model\.norm\.weight is not a float8_e4m3fn",
        ),
    ],
    ids=["scale-missing", "scale-shape", "lonely-scale"],
)
def test_inconsistent_scales_are_refused_naming_the_tensor(tmp_path, change, refusal):
    fp8_dir(tmp_path)
    _rewrite(tmp_path, change)
    with pytest.raises(CheckpointError, match=refusal):
        _load(tmp_path)


def test_a_block_size_the_scales_do_not_match_is_refused(tmp_path):
    fp8_dir(tmp_path)
    _set_quant(tmp_path, {**QUANT, "weight_block_size": [16, 16]})
    with pytest.raises(CheckpointError, match=r"in blocks of weight_block_size \[16, 16\] needs"):
        _load(tmp_path)
    _set_quant(tmp_path, {**QUANT, "weight_block_size": [128]})
    with pytest.raises(CheckpointError, match=r"quantization_config\.weight_block_size=\[128\]: need two positive"):
        _load(tmp_path)


def test_fp8_tensors_without_quantization_config_are_refused(tmp_path):
    fp8_dir(tmp_path)
    _set_quant(tmp_path, None)
    with pytest.raises(CheckpointError, match=r"holds FP8 or scale tensors .* has no quantization_config"):
        _load(tmp_path)


def test_an_unknown_quant_method_is_refused(tmp_path):
    fp8_dir(tmp_path)
    _set_quant(tmp_path, {"quant_method": "awq", "bits": 4})
    with pytest.raises(CheckpointError, match=r"quantization_config\.quant_method='awq' is not supported"):
        _load(tmp_path)


def test_non_finite_scales_are_refused_naming_the_tensor(tmp_path):
    fp8_dir(tmp_path)

    def poison(stored):
        stored[f"{DOWN}_scale_inv"][2, 1] = float("inf")

    _rewrite(tmp_path, poison)  # found as the piece is read: refused with the load's other read failures
    with pytest.raises(StateDictError, match=rf"{DOWN}_scale_inv: non-finite scales in blocks 0:4 x 0:2"):
        _load(tmp_path)


# --- saving ------------------------------------------------------------------------------------


def _loaded(directory: Path, dtype: torch.dtype = torch.bfloat16):
    with torch.device("meta"):
        ours = from_hf_config(directory, dtype=dtype)
    load_hf_checkpoint(ours, directory, device="cpu", strict=True)
    ours.init_buffers("cpu")
    return ours


def test_the_default_save_is_a_plain_directory_transformers_loads(tmp_path):
    fp8_dir(tmp_path / "fp8")
    ours = _loaded(tmp_path / "fp8")
    save_hf_checkpoint(ours, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["torch_dtype"] == "bfloat16"
    got = tensors(tmp_path / "out")
    assert not any(k.endswith("_scale_inv") for k in got) and {v.dtype for v in got.values()} == {torch.bfloat16}
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", experts_implementation="eager")
    tokens = batch()[0]
    with torch.no_grad():
        assert torch.equal(hf.eval()(tokens).logits.float(), ours(tokens).float())


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_an_fp8_save_equals_a_hand_quantization_and_loads_back(tmp_path, layout):
    fp8_dir(tmp_path / "fp8", layout=layout)
    ours = _loaded(tmp_path / "fp8")
    save_hf_checkpoint(ours, tmp_path / "plain")
    save_hf_checkpoint(ours, tmp_path / "out", weight_format="block_fp8")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"] == QUANT and config["torch_dtype"] == "bfloat16"
    plain, source, got = tensors(tmp_path / "plain"), tensors(tmp_path / "fp8"), tensors(tmp_path / "out")
    assert sorted(got) == sorted(source)
    for name, value in plain.items():
        if f"{name}_scale_inv" in source:
            fp8, scale = hand_quantize(value)
            assert got[name].dtype == torch.float8_e4m3fn and torch.equal(
                got[name].view(torch.uint8), fp8.view(torch.uint8)
            )
            assert torch.equal(got[f"{name}_scale_inv"], scale), name
        else:
            assert torch.equal(got[name], value), name
    again = _loaded(tmp_path / "out", torch.float32).state_dict()
    dequantized = {
        k: _dequantize_fp8_weight(v, got[f"{k}_scale_inv"], list(BLOCK), torch.float32)
        if f"{k}_scale_inv" in got
        else v.float()
        for k, v in got.items()
        if not k.endswith("_scale_inv")
    }
    for name, value in (_fused(dequantized) if layout == "per_expert" else dequantized).items():
        assert torch.equal(again[name], value), name


def test_a_model_resumed_from_a_plain_checkpoint_saves_in_its_base_format(tmp_path):
    """Loaded from a save in its dtype (as a resume is), the model takes the FP8 format of ``source_dir``."""
    fp8_dir(tmp_path / "fp8")
    save_hf_checkpoint(_loaded(tmp_path / "fp8"), tmp_path / "plain")
    ours = _loaded(tmp_path / "plain")
    with pytest.raises(CheckpointError, match="was not loaded from a block-FP8 checkpoint"):
        save_hf_checkpoint(ours, tmp_path / "x", weight_format="block_fp8")
    save_hf_checkpoint(ours, tmp_path / "out", weight_format="block_fp8", source_dir=tmp_path / "fp8")
    plain, got, source = tensors(tmp_path / "plain"), tensors(tmp_path / "out"), tensors(tmp_path / "fp8")
    assert sorted(got) == sorted(source)
    for name, value in plain.items():
        if f"{name}_scale_inv" in source:
            fp8, scale = hand_quantize(value)
            assert torch.equal(got[name].view(torch.uint8), fp8.view(torch.uint8)), name
            assert torch.equal(got[f"{name}_scale_inv"], scale), name


def test_an_fp8_save_of_a_model_not_loaded_from_fp8_is_refused(tmp_path):
    ours = from_hf_config(hf_moe_model("qwen3_moe").config.to_dict())
    with pytest.raises(CheckpointError, match="was not loaded from a block-FP8 checkpoint; save with weight_format="):
        save_hf_checkpoint(ours, tmp_path / "x", weight_format="block_fp8")
    with pytest.raises(CheckpointError, match="weight_format='fp4': choose one of dtype, block_fp8"):
        save_hf_checkpoint(ours, tmp_path / "x", weight_format="fp4")


def test_only_the_final_checkpoint_is_quantized(tmp_path):
    """``weight_format`` reaches the final save; intermediate saves, which resumes read, keep the dtype."""
    with pytest.raises(ValueError, match="weight_format='fp4': choose one of dtype, block_fp8"):
        CheckpointOptions(output_dir=tmp_path, weight_format="fp4")
    inputs = WeightsInputs(
        model=torch.nn.Linear(2, 2),
        optimizer=None,
        lora=False,
        base_dir=None,
        max_shard_size="5GB",
        adapter_weights_only=False,
        shared_filesystem=True,
        weight_format="block_fp8",
    )
    for async_save in (False, True):
        final, intermediate = pick_weights(
            inputs, checkpoint_format="hf", async_save=async_save, keep_staging_memory=False
        )
        assert final.inputs.weight_format == "block_fp8", async_save  # type: ignore[attr-defined]
        assert intermediate.inputs.weight_format == "dtype", async_save  # type: ignore[attr-defined]


def test_an_fp8_save_leaves_the_model_as_it_was(tmp_path):
    fp8_dir(tmp_path / "fp8")
    ours = _loaded(tmp_path / "fp8", torch.float32)
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    save_hf_checkpoint(ours, tmp_path / "out", weight_format="block_fp8")
    assert all(torch.equal(v, before[k]) for k, v in ours.state_dict().items())


def _lora_model(directory: Path, *, quantize_base: bool):
    """LoRA (B non-zero) on the attention and the experts of the model of ``directory``, loaded from it."""
    with torch.device("meta"):
        ours = from_hf_config(directory, dtype=torch.float32)
    apply_lora(
        ours,
        rank=4,
        alpha=8,
        target_modules=["q_proj", "o_proj"],
        target_parameters=["mlp.experts.gate_up_proj"],
        quantize_base=quantize_base,
        block_size=8,
        scaler_block_size=8,
    )
    load_hf_checkpoint(ours, directory, device="cpu")
    ours.init_buffers("cpu")
    init_lora_parameters(ours, device="cpu")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in get_adapter_params(ours).values():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return ours


def test_a_merged_lora_save_in_fp8_quantizes_the_merged_weights(tmp_path):
    """The FP8 save of a LoRA model quantizes ``W + scaling * B @ A``: the default save's merged weights."""
    fp8_dir(tmp_path / "fp8")
    ours = _lora_model(tmp_path / "fp8", quantize_base=False)
    save_hf_checkpoint(ours, tmp_path / "plain")
    save_hf_checkpoint(ours, tmp_path / "out", weight_format="block_fp8")
    plain, got, source = tensors(tmp_path / "plain"), tensors(tmp_path / "out"), tensors(tmp_path / "fp8")
    assert sorted(got) == sorted(source)
    merged = ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.experts.3.up_proj.weight"]
    for name, value in plain.items():
        if f"{name}_scale_inv" in source:
            fp8, scale = hand_quantize(value)
            assert torch.equal(got[name].view(torch.uint8), fp8.view(torch.uint8)), name
            assert torch.equal(got[f"{name}_scale_inv"], scale), name
    for name in merged:  # the adapters changed these: the save is of the merge, not of the base
        base = _dequantize_fp8_weight(source[name], source[f"{name}_scale_inv"], list(BLOCK), torch.float32)
        assert not torch.equal(plain[name], base), name


def test_qlora_over_an_fp8_checkpoint_quantizes_the_dequantized_weights_to_nf4(tmp_path):
    """QLoRA from a block-FP8 base: each NF4 base is torchao's NF4 of the dequantized weight."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    _, expected = fp8_dir(tmp_path / "fp8")
    ours = _lora_model(tmp_path / "fp8", quantize_base=True)
    name = "model.layers.0.self_attn.q_proj"
    got = ours.get_submodule(name).weight
    want = to_nf4(expected[f"{name}.weight"], block_size=8, scaler_block_size=8)
    assert torch.equal(got.get_original_weight(), want.get_original_weight())


def test_fp8_tensors_given_to_the_core_without_their_scales_are_refused(tmp_path):
    """A plain load of the FP8 files (not through load_hf_checkpoint) must not read unscaled weights."""
    fp8_dir(tmp_path)
    with torch.device("meta"):
        ours = from_hf_config(tmp_path, dtype=torch.float32)
    with open_hf_checkpoint(tmp_path) as checkpoint, pytest.raises(StateDictError, match="an FP8 tensor without its"):
        load_from_full_model_state_dict(ours, checkpoint, "cpu")
