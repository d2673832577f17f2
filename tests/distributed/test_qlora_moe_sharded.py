"""QLoRA on experts (NF4 experts, ``lora.quantize_base`` with ``lora.target_parameters``) on 2 ranks against
transformers + peft in one process over torchao NF4 experts.

The reference is a tiny random Qwen3-MoE (E = 8, top-2, expert widths 2I = 512 != H = 64, each expert's
slices a multiple of torchao's default 64 * 256 block) whose expert weights are replaced, expert by expert,
by ``to_nf4(W[e]).get_original_weight()``, with peft's LoRA on both expert weights and the router (every
factor random, so the update is not zero). shardtune loads the *unrounded* HF checkpoint, in both layouts
(per expert with every rank reading, fused with rank 0 sending), into NF4 experts on ``Shard(0)``: each
rank's experts dequantize bit-equal to torchao's, the first-step loss (cross-entropy plus the
load-balancing loss) and the logits equal the reference's; the adapter saved equals peft's file; the
merged export (dequantized + merged) equals peft's ``merge_and_unload``; adapter and optimizer saved
after a step and loaded into a fresh model continue bitwise. Under NCCL's rules."""

from __future__ import annotations

import copy
from pathlib import Path

import peft
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.tensor import Shard
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from shardtune.checkpoint import load_peft_adapter, save_hf_checkpoint, save_peft_adapter
from shardtune.checkpoint.hf_load import load_hf_checkpoint
from shardtune.checkpoint.optimizer_io import load_optimizer, save_optimizer
from shardtune.distributed import make_mesh, shard_model
from shardtune.models import from_hf_config
from shardtune.peft import apply_lora
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(300)

RANK, ALPHA = 4, 8.0
PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
WIDTH = {"moe_intermediate_size": 256}  # per expert [512, 64] and [64, 256]: whole 64*256 NF4 groups


def _hf():
    from tests.unit.test_models_moe import hf_moe_model

    return hf_moe_model("qwen3_moe", **WIDTH)


def nf4_experts_reference(hf):
    """A copy of ``hf`` whose expert weights are torchao's NF4 of each expert's 2-D slice, dequantized."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(EXPERTS):
                p.copy_(torch.stack([to_nf4(p[e].contiguous()).get_original_weight() for e in range(p.shape[0])]))
    return ref


def _peft(ref):
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=[], target_parameters=PARAMETERS)
    pm = peft.get_peft_model(copy.deepcopy(ref), config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return pm


def _qlora(hf_dir: Path, *, shared_filesystem: bool):
    with torch.device("meta"):
        model = from_hf_config(hf_dir / "config.json")
        apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=[], target_parameters=PARAMETERS, quantize_base=True)
    shard_model(model, mesh=make_mesh())
    load_hf_checkpoint(model, hf_dir, device="cpu", shared_filesystem=shared_filesystem)
    model.init_buffers("cpu")
    return model


def _step(model, opt, tokens) -> None:
    model(tokens).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _run(tmp: str, layout: str, shared_filesystem: bool, expected_logits: torch.Tensor) -> dict:
    from tests.unit.test_models_moe import _loss, batch

    tmp_path = Path(tmp)
    ref = nf4_experts_reference(_hf())
    tokens, mask, labels = batch()
    with nccl_rules() as rules:
        model = _qlora(tmp_path / layout, shared_filesystem=shared_filesystem)
        load_peft_adapter(model, tmp_path / "peft", device="cpu")
        rules.host(model)
        loss, _, logits = _loss(model, tokens, mask, labels, ref.config.router_aux_loss_coef)
        out = tmp_path / f"out-{layout}"
        save_peft_adapter(model, out / "adapter")
        save_hf_checkpoint(model, out / "merged", expert_layout="fused")
    experts = model.model.layers[0].mlp.experts
    local = experts.gate_up_proj.to_local()
    reference = ref.model.layers[0].mlp.experts.gate_up_proj.detach()
    mine = slice(dist.get_rank() * 4, dist.get_rank() * 4 + 4)
    # resume: a step, adapter + optimizer saved, both loaded into a fresh model; the next steps agree bitwise
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _step(model, opt, tokens)
    save_peft_adapter(model, out / "step1")
    save_optimizer(model, opt, out / "step1")
    fresh = _qlora(tmp_path / layout, shared_filesystem=shared_filesystem)
    load_peft_adapter(fresh, out / "step1", device="cpu")
    fresh_opt = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=1e-2)
    load_optimizer(fresh, fresh_opt, out / "step1", device="cpu")
    _step(model, opt, tokens)
    _step(fresh, fresh_opt, tokens)
    adapters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fresh_adapters = dict(fresh.named_parameters())
    return {
        "loss": loss.item(),
        "logits": ((logits - expected_logits)[mask.bool()].abs().max() / expected_logits.abs().max()).item(),
        "type": type(local).__name__,
        "placement": tuple(experts.gate_up_proj.placements),
        "bits": torch.equal(local.get_original_weight(), reference[mine]),
        "frozen": not experts.gate_up_proj.requires_grad,
        "resumed": all(torch.equal(p.to_local(), fresh_adapters[n].to_local()) for n, p in adapters),
    }


def test_sharded_nf4_experts_equal_peft_over_torchao_nf4(pool2, tmp_path):
    from tests.unit.test_models_moe import batch

    hf = _hf()
    hf.save_pretrained(tmp_path / "per_expert")  # transformers' default: experts.N.{gate,up,down}_proj
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    ref = nf4_experts_reference(hf)
    pm = _peft(ref)
    pm.save_pretrained(tmp_path / "peft")
    tokens, mask, labels = batch()
    with torch.no_grad():
        expected = pm(tokens, attention_mask=mask, labels=labels, output_router_logits=True)
        unrounded = _peft(hf)(tokens, attention_mask=mask, labels=labels, output_router_logits=True).loss
    assert abs(unrounded.item() - expected.loss.item()) > 1e-3  # NF4 rounding of the experts shows in the loss
    theirs = load_file(tmp_path / "peft/adapter_model.safetensors")
    merged_reference = pm.merge_and_unload().state_dict()
    for layout, shared in (("per_expert", True), ("fused", False)):
        results = pool2.run_ok(_run, str(tmp_path), layout, shared, expected.logits, timeout=240)
        for r in results:
            assert r["type"] == "NF4Experts" and r["placement"] == (Shard(0),) and r["frozen"], r
            assert r["bits"], r  # each rank's experts are torchao's NF4 of its own expert slices
            assert abs(r["loss"] - expected.loss.item()) < 1e-5, (layout, r)
            assert r["logits"] < 1e-5, (layout, r)
            assert r["resumed"], r
        ours = load_file(tmp_path / f"out-{layout}/adapter/adapter_model.safetensors")
        assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], v) for k, v in theirs.items())
        merged = load_file(tmp_path / f"out-{layout}/merged/model.safetensors")
        assert sorted(merged) == sorted(merged_reference)
        for key, value in merged_reference.items():
            assert (merged[key] - value).abs().max() < 1e-6, (layout, key)
