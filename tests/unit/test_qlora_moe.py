"""NF4 experts (QLoRA on mixture-of-experts layers) in one process, against torchao and peft.

torchao's ``to_nf4`` of each expert's 2-D slice is the reference for the stored experts (bit for
bit, fp32 and bf16, and for every piece FSDP2 cuts on the expert dim); peft's LoRA over those
dequantized experts is the reference for the logits and for ``merge_lora`` (Qwen3-MoE, Qwen3.5-MoE, and Gemma
4's experts beside its dense MLP). Shapes that NF4 cannot quantize per expert are refused naming the parameter. The sharded case: tests/distributed/test_qlora_moe_sharded.py.
"""

from __future__ import annotations

import copy
import dataclasses

import peft
import pytest
import torch
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from shardtune.peft import apply_lora, merge_lora
from shardtune.state_dict.nf4 import dequantize
from shardtune.state_dict.nf4_experts import NF4Experts, quantize_experts
from tests.distributed.test_qlora_moe_sharded import ALPHA, PARAMETERS, RANK
from tests.unit.test_models_moe import batch, hf_moe_model, ours_from

BLOCKS = {"block_size": 64, "scaler_block_size": 128}  # non-default sizes; per expert [256, 64] and [64, 128]


def _per_expert_nf4(w: torch.Tensor, block_size: int, scaler_block_size: int) -> torch.Tensor:
    return torch.stack([to_nf4(w[e], block_size, scaler_block_size).get_original_weight() for e in range(len(w))])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_expert_is_torchaos_nf4_of_its_slice_and_pieces_keep_their_bits(dtype):
    w = torch.randn(6, 256, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    q = quantize_experts(w, **BLOCKS)
    reference = _per_expert_nf4(w, **BLOCKS)
    assert isinstance(q, NF4Experts) and q.dtype == dtype and q.shape == w.shape
    assert torch.equal(dequantize(q), reference)
    halves = q.chunk(3)  # what FSDP2 does to a parameter on 3 ranks
    assert [h.shape[0] for h in halves] == [2, 2, 2]
    assert torch.equal(dequantize(halves[1]), reference[2:4])
    padded = q.new_zeros((2, 256, 64))
    padded.narrow(0, 0, 2).copy_(halves[2])
    assert torch.equal(dequantize(padded), reference[4:])
    assert torch.equal(dequantize(torch.nn.Parameter(q, requires_grad=False)), reference)
    meta = quantize_experts(w.to("meta"), **BLOCKS)
    assert meta.is_meta and meta.shape == w.shape
    with pytest.raises(NotImplementedError, match="dequantize them first"):
        q + 1


def _qlora_moe(hf, parameters=PARAMETERS):
    kw = {"rank": RANK, "alpha": ALPHA, "target_modules": [], "target_parameters": parameters}
    return apply_lora(ours_from(hf), **kw, quantize_base=True, **BLOCKS)


def _gemma4_moe():
    from tests.unit.test_gemma4 import hf_model

    return hf_model("gemma4_text_moe", moe_intermediate_size=128)


# family -> (its tiny random model, expert widths 2I = 256 != H = 64; the parameters adapted, the experts first)
FAMILIES = {
    "qwen3_moe": (lambda: hf_moe_model("qwen3_moe", moe_intermediate_size=128), PARAMETERS),
    "qwen3_5_moe_text": (lambda: hf_moe_model("qwen3_5_moe_text", moe_intermediate_size=128), PARAMETERS),
    "gemma4_text_moe": (_gemma4_moe, ["experts.gate_up_proj", "experts.down_proj"]),  # beside the dense MLP
}


def _nf4_experts_peft(hf, parameters: list[str]):
    """peft's LoRA (random factors) over a copy of ``hf`` whose experts are torchao's NF4 of each slice, dequantized."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(_per_expert_nf4(p, **BLOCKS))
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=[], target_parameters=parameters)
    pm = peft.get_peft_model(ref, config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return pm


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_qlora_experts_logits_and_merge_equal_peft_over_nf4_experts(family):
    make, parameters = FAMILIES[family]
    hf = make()
    pm = _nf4_experts_peft(hf, parameters)
    model = _qlora_moe(hf, parameters)
    layer = model.model.layers[0]
    experts = layer.mlp.experts if hasattr(layer.mlp, "experts") else layer.experts
    assert isinstance(experts.gate_up_proj, NF4Experts) and isinstance(experts.down_proj, NF4Experts)
    router = layer.mlp.gate.weight if family != "gemma4_text_moe" else layer.router.proj.weight
    assert type(router) is torch.nn.Parameter  # the router stays as it is
    state = {k.removeprefix("base_model.model."): v for k, v in pm.state_dict().items() if "lora_" in k}
    model.load_state_dict({k.replace(".default", ""): v for k, v in state.items()}, strict=False)
    tokens, mask, _ = batch()
    with torch.no_grad():
        expected = pm(tokens, attention_mask=mask).logits
        got = model(tokens)
        real = mask.bool()
        assert ((got - expected)[real].abs().max() / expected[real].abs().max()) < 1e-5
        assert ((expected - hf(tokens, attention_mask=mask).logits)[real].abs().max()) > 1e-3  # NF4 + adapters
        merged = merge_lora(model).state_dict()
        for key, value in pm.merge_and_unload().state_dict().items():
            assert (merged[key] - value).abs().max() < 1e-6, key


def test_experts_nf4_cannot_quantize_are_refused_naming_the_parameter():
    hf = hf_moe_model("qwen3_moe")  # each expert's gate_up_proj [48, 64]: 3072 elements, not 64 * 256
    with pytest.raises(ValueError, match=r"cannot quantize model\.layers\.0\.mlp\.experts\.gate_up_proj .*smaller NF4"):
        apply_lora(
            ours_from(hf), rank=RANK, alpha=ALPHA, target_modules=[], target_parameters=PARAMETERS, quantize_base=True
        )


def test_bundled_mixtral_qlora_config_holds_nf4_experts_for_mixtral_8x7b():
    from shardtune.config import load_config
    from shardtune.models import get_model_args
    from shardtune.models.registry import build_model
    from shardtune.recipes.registry import get_recipe

    lora = load_config("mixtral/8x7B_qlora", schema=get_recipe("lora_finetune_distributed").schema).lora
    args = get_model_args("mixtral_8x7b")
    one_layer = dataclasses.replace(args, n_layers=1, layer_types=args.layer_types[:1])  # every layer's shapes
    model = build_model(one_layer, device="meta")
    options = {key: getattr(lora, key) for key in ("rank", "alpha", "dropout", "quantize_base")}
    apply_lora(model, **options, target_modules=lora.target_modules, target_parameters=lora.target_parameters)
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, NF4Experts) and isinstance(experts.down_proj, NF4Experts)
    assert tuple(experts.gate_up_proj.shape) == (8, 2 * 14336, 4096)


def test_nf4_experts_run_in_the_activations_dtype():
    """FSDP2's mixed precision casts plain params to bf16 but leaves NF4 experts in their own dtype (fp32)."""
    model = _qlora_moe(hf_moe_model("qwen3_moe", moe_intermediate_size=128))
    experts = model.model.layers[0].mlp.experts
    x = torch.randn(12, 64, generator=torch.Generator().manual_seed(2))
    counts = torch.tensor([3, 0, 2, 1, 1, 2, 0, 3])
    with torch.no_grad():
        full = experts(x, counts)
        half = experts(x.bfloat16(), counts)
    assert half.dtype == torch.bfloat16
    assert (half.float() - full).abs().max() < 2e-2 * full.abs().max()
