"""QLoRA on experts (NF4 experts, ``lora.quantize_base`` with ``lora.target_parameters``) on 2 ranks against
transformers + peft in one process over torchao NF4 experts.

The reference is a tiny random Qwen3-MoE (E = 8, top-2, expert widths 2I = 512 != H = 64, each expert's
slices a multiple of torchao's default 64 * 256 block) whose expert weights are replaced, expert by expert,
by ``to_nf4(W[e]).get_original_weight()``, with peft's LoRA on both expert weights and the router (every
factor random, so the update is not zero). shardtune loads the *unrounded* HF checkpoint, in both layouts
(per expert with every rank reading, fused with rank 0 sending), into NF4 experts on ``Shard(0)``: each
rank's experts dequantize bit-equal to torchao's, the first-step loss (cross-entropy plus the
load-balancing loss) and the logits equal the reference's; the gathered base is the NF4-rounded
experts; the adapter saved equals peft's file; the merged export (dequantized + merged) equals peft's
``merge_and_unload``; adapter and optimizer saved after a step and loaded into a fresh model continue
bitwise; on a 2x2 HSDP mesh and with expert parallelism the logits equal the reference's too. Under NCCL's rules."""

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
from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.optimizer_io import load_optimizer, save_optimizer
from shardtune.models import from_hf_config
from shardtune.peft import apply_lora
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training import gather_cpu_state_dict
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(300)

RANK, ALPHA = 4, 8.0
PARAMETERS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
WIDTH = {"moe_intermediate_size": 256}  # per expert [512, 64] and [64, 256]: whole 64*256 NF4 groups


def _hf():
    from tests.unit.test_models_moe import hf_moe_model

    return hf_moe_model("qwen3_moe", **WIDTH)


def nf4_experts_reference(hf, block_size: int = 64, scaler_block_size: int = 256):
    """A copy of ``hf`` whose expert weights are torchao's NF4 of each expert's 2-D slice, dequantized."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(EXPERTS):
                nf4 = [to_nf4(p[e].contiguous(), block_size, scaler_block_size) for e in range(p.shape[0])]
                p.copy_(torch.stack([q.get_original_weight() for q in nf4]))
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


def _qlora(hf_dir: Path, *, shared_filesystem: bool, replicate: int = 1, expert_parallel: int = 1):
    with torch.device("meta"):
        model = from_hf_config(hf_dir / "config.json")
        apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=[], target_parameters=PARAMETERS, quantize_base=True)
    shard_model(model, mesh=make_mesh(replicate=replicate, expert_parallel=expert_parallel))
    load_hf_checkpoint(model, hf_dir, device="cpu", shared_filesystem=shared_filesystem)
    model.init_buffers("cpu")
    return model


def _step(model, opt, tokens) -> None:
    model(tokens).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _run(tmp: str, layout: str, shared_filesystem: bool, expected_logits, reference, coef: float, full: bool) -> dict:
    """Load ``layout`` into NF4 experts; the first-step loss and logits; with ``full`` also the saves and a resume."""
    from tests.unit.test_models_moe import _loss, batch

    tmp_path, out = Path(tmp), Path(tmp) / f"out-{layout}"
    tokens, mask, labels = batch()
    with nccl_rules() as rules:
        model = _qlora(tmp_path / layout, shared_filesystem=shared_filesystem)
        load_peft_adapter(model, tmp_path / "peft", device="cpu")
        rules.host(model)
        loss, _, logits = _loss(model, tokens, mask, labels, coef)
        if full:
            save_peft_adapter(model, out / "adapter")
            save_hf_checkpoint(model, out / "merged", expert_layout="fused")
            gathered = gather_cpu_state_dict(model, dist.get_rank() == 0)
    experts = model.model.layers[0].mlp.experts
    local = experts.gate_up_proj.to_local()
    mine = slice(dist.get_rank() * 4, dist.get_rank() * 4 + 4)
    result = {
        "loss": loss.item(),
        "logits": ((logits - expected_logits)[mask.bool()].abs().max() / expected_logits.abs().max()).item(),
        "type": type(local).__name__,
        "placement": tuple(experts.gate_up_proj.placements),
        "bits": torch.equal(local.get_original_weight(), reference[mine]),
        "frozen": not experts.gate_up_proj.requires_grad,
    }
    if full and dist.get_rank() == 0:  # the gathered base: the NF4-rounded experts, dequantized
        result["gathered"] = torch.equal(gathered["model.layers.0.mlp.experts.gate_up_proj"], reference)
    if full:  # resume: a step, adapter + optimizer saved, both loaded into a fresh model; the next steps agree
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
        adapters = dict(fresh.named_parameters())
        result["resumed"] = all(
            torch.equal(p.to_local(), adapters[n].to_local()) for n, p in model.named_parameters() if p.requires_grad
        )
    return result


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
    reference = ref.model.layers[0].mlp.experts.gate_up_proj.detach()
    coef = ref.config.router_aux_loss_coef
    # per expert, every rank reading its own experts (and saving, resuming); fused, rank 0 sending them
    outcomes = {}
    for layout, shared, full in (("per_expert", True, True), ("fused", False, False)):
        args = (str(tmp_path), layout, shared, expected.logits, reference, coef, full)
        outcomes[layout] = pool2.run_ok(_run, *args, timeout=240)
        for r in outcomes[layout]:
            assert r["type"] == "NF4Experts" and r["placement"] == (Shard(0),) and r["frozen"], r
            assert r["bits"], r  # each rank's experts are torchao's NF4 of its own expert slices
            assert abs(r["loss"] - expected.loss.item()) < 1e-5, (layout, r)
            assert r["logits"] < 1e-5, (layout, r)
    assert all(r["resumed"] for r in outcomes["per_expert"]) and outcomes["per_expert"][0]["gathered"]
    ours = load_file(tmp_path / "out-per_expert/adapter/adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], v) for k, v in theirs.items())
    merged = load_file(tmp_path / "out-per_expert/merged/model.safetensors")
    assert sorted(merged) == sorted(merged_reference)
    for key, value in merged_reference.items():
        assert (merged[key] - value).abs().max() < 1e-6, key


MESHES = {"hsdp": (2, 1, True), "ep2": (1, 2, True), "ep4_rank0": (1, 4, False)}  # replicate, ep, shared fs


def _mesh_logits(tmp: str, expected_logits) -> dict[str, float]:
    from tests.unit.test_models_moe import batch

    tokens, mask, _ = batch()
    errors = {}
    for name, (replicate, degree, shared) in MESHES.items():
        with nccl_rules() as rules:
            model = _qlora(
                Path(tmp) / "per_expert", shared_filesystem=shared, replicate=replicate, expert_parallel=degree
            )
            load_peft_adapter(model, Path(tmp) / "peft", device="cpu")
            rules.host(model)
            with torch.no_grad():
                logits = model(tokens)
        errors[name] = ((logits - expected_logits)[mask.bool()].abs().max() / expected_logits.abs().max()).item()
    return errors


def test_nf4_experts_on_hsdp_and_expert_parallel_meshes_equal_peft_over_torchao_nf4(pool4, tmp_path):
    """2 replicas of 2 shards: each shard group holds the experts whole per rank, as on a 1-D mesh. Expert
    parallel 2 (every rank reading its experts) and 4 (rank 0 sending each rank its experts; one rank per
    efsdp group, where FSDP2 leaves the NF4 experts alone): each rank quantizes its own experts."""
    from tests.unit.test_models_moe import batch

    hf = _hf()
    hf.save_pretrained(tmp_path / "per_expert")
    pm = _peft(nf4_experts_reference(hf))
    pm.save_pretrained(tmp_path / "peft")
    tokens, mask, _ = batch()
    with torch.no_grad():
        expected = pm(tokens, attention_mask=mask).logits
    for errors in pool4.run_ok(_mesh_logits, str(tmp_path), expected, timeout=240):
        assert sorted(errors) == sorted(MESHES) and all(e < 1e-5 for e in errors.values()), errors


def _shard_nf4_experts(changes: dict) -> None:
    from tests.unit.test_models_moe import moe_config

    with torch.device("meta"):
        model = from_hf_config(moe_config("mixtral", **changes).to_dict())
        apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=[], target_parameters=PARAMETERS, quantize_base=True)
    shard_model(model, mesh=make_mesh())


def test_nf4_experts_that_cannot_be_whole_per_rank_are_refused_on_every_rank(pool2):
    # 5 experts on 2 ranks would be Shard(1): rows of every expert, cutting their NF4 blocks
    outcomes = pool2.run(_shard_nf4_experts, {"num_local_experts": 5, "intermediate_size": 256}, timeout=60)
    assert not any(o.ok for o in outcomes) and len({o.error for o in outcomes}) == 1, outcomes
    error = outcomes[0].error
    assert error.startswith("ValueError: model.layers.0.mlp.experts.gate_up_proj: NF4 experts"), error
    assert "does not divide its 5 experts" in error and "quantize_base=false" in error, error


def _rank0_per_expert(hf_dir: str, reference: dict[str, torch.Tensor]) -> dict:
    """NF4 experts from per-expert files that rank 0 alone reads and sends: each rank's experts
    dequantized against ``reference``'s (torchao's NF4 of each expert); the exchanges this rank made."""
    from shardtune.state_dict import stats

    stats.reset()
    with nccl_rules() as rules:
        model = _qlora(Path(hf_dir), shared_filesystem=False)
    experts = {n: p.to_local() for n, p in model.named_parameters() if n.endswith(EXPERTS)}
    mine = slice(dist.get_rank() * 4, dist.get_rank() * 4 + 4)  # Shard(0): 4 of the 8 experts each
    return {
        "types": {type(t).__name__ for t in experts.values()},
        "bits": [n for n, t in experts.items() if not torch.equal(t.get_original_weight(), reference[n][mine])],
        "read": stats.bytes_read,
        "exchanges": rules.counts["batch_isend_irecv"],
        "loaded": sum(1 for n, p in model.named_parameters() if "lora_" not in n and p.to_local().numel()),
    }


def test_nf4_experts_from_per_expert_files_sent_by_rank0(pool2, tmp_path):
    """Rank 0 reads the per-expert files and sends each rank its experts' plain bytes, one exchange
    per parameter (not per expert file tensor); each rank quantizes its own experts to torchao's NF4."""
    hf = _hf()
    hf.save_pretrained(tmp_path / "per_expert")
    ref = nf4_experts_reference(hf)
    reference = {n: p.detach() for n, p in ref.named_parameters() if n.endswith(EXPERTS)}
    res = pool2.run_ok(_rank0_per_expert, str(tmp_path / "per_expert"), reference, timeout=120)
    assert all(r["types"] == {"NF4Experts"} and r["bits"] == [] for r in res), res
    assert res[1]["read"] == 0 and res[1]["exchanges"] == res[1]["loaded"], res[1]
