"""gpt-oss bf16 HF checkpoints under FSDP2 on 2 ranks, against transformers' ``save_pretrained`` of a tiny model.

transformers writes gpt-oss's runtime keys in both ``save_original_format`` modes (checked here), so a
directory loads key for key: each rank reads exactly its own bytes (experts on ``Shard(0)``: 8 experts, or
``Shard(1)``: 5, biases included), its pieces are DTensor's cut of transformers' weights, and the save,
written in place with no gather, holds transformers' tensors exactly; ``from_pretrained`` of it gives the
logits of ``from_pretrained`` of transformers' directory bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import transformers
from torch.distributed.tensor import distribute_tensor

from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.models import from_hf_config
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import stats
from tests.nccl_rules import nccl_rules
from tests.unit.test_moe_checkpoint import tensors

pytestmark = pytest.mark.timeout(300)


def _pieces_equal(params: dict, reference: dict) -> dict[str, bool]:
    """Per parameter: this rank's piece equals DTensor's cut of the full ``reference`` tensor."""
    return {
        n: torch.equal(p.to_local(), distribute_tensor(reference[n], p.device_mesh, p.placements).to_local())
        for n, p in params.items()
    }


def _load_and_save(hf_dir: str, out: str, reference: dict) -> dict:
    with nccl_rules() as rules:
        rules.host(reference)
        dist.barrier()
        stats.reset()
        with torch.device("meta"):
            model = from_hf_config(hf_dir, dtype=torch.bfloat16)
        shard_model(model, mesh=make_mesh())
        load_hf_checkpoint(model, hf_dir, device="cpu", strict=True)
        model.init_buffers("cpu")
        read = stats.bytes_read
        save_hf_checkpoint(model, out)
    params = dict(model.named_parameters())
    equal = _pieces_equal(params, reference)
    return {
        "read": read,
        "own": sum(p.to_local().nbytes for p in params.values()),
        "equal": equal,
        "placement": params["model.layers.0.mlp.experts.gate_up_proj_bias"].placements[0].dim,
        "gathered": "batch_isend_irecv" in rules.counts,
    }


@pytest.mark.parametrize(("experts", "placement"), [(8, 0), (5, 1)])
def test_each_rank_reads_its_bytes_and_the_save_loads_in_transformers(pool2, tmp_path, experts, placement):
    from tests.unit.test_models_gpt_oss import hf_gpt_oss
    from tests.unit.test_models_moe import batch

    hf = hf_gpt_oss(num_local_experts=experts).to(torch.bfloat16).eval()
    hf.save_pretrained(tmp_path / "hf")
    hf.save_pretrained(tmp_path / "runtime", save_original_format=False)
    want = tensors(tmp_path / "hf")
    runtime = tensors(tmp_path / "runtime")
    assert sorted(want) == sorted(runtime) == sorted(hf.state_dict())
    assert all(torch.equal(runtime[k], v) for k, v in want.items())
    res = pool2.run_ok(_load_and_save, str(tmp_path / "hf"), str(tmp_path / "out"), hf.state_dict(), timeout=200)
    for r in res:
        assert all(r["equal"].values()) and r["placement"] == placement, r["equal"]
        assert r["read"] == r["own"] and not r["gathered"], r
    got = tensors(tmp_path / "out")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in want.items())
    # our config.json too: transformers builds the same model from it (norms kept in fp32 by both loads)
    kw = {"attn_implementation": "eager", "experts_implementation": "eager"}
    ours, theirs = (transformers.AutoModelForCausalLM.from_pretrained(tmp_path / d, **kw) for d in ("out", "hf"))
    with torch.no_grad():
        assert torch.equal(ours.eval()(batch()[0]).logits, theirs.eval()(batch()[0]).logits)


def _load_mxfp4(hf_dir: str, out: str, expected: dict, degree: int = 1) -> dict:
    """Load an MXFP4 directory at expert parallel ``degree`` (bytes read counted), compare each piece with
    DTensor's cut of transformers' dequantization, save; or the error the load raised."""
    dist.barrier()
    stats.reset()
    with torch.device("meta"):
        model = from_hf_config(hf_dir, dtype=torch.bfloat16)
    shard_model(model, mesh=make_mesh(expert_parallel=degree))
    try:
        load_hf_checkpoint(model, hf_dir, device="cpu", strict=True)
    except Exception as exc:  # the refusal every rank must raise
        return {"error": f"{type(exc).__name__}: {exc}"}
    read = stats.bytes_read
    save_hf_checkpoint(model, out)
    params = dict(model.named_parameters())
    equal = _pieces_equal(params, expected)
    # its own experts' FP4 bytes (half a byte a value) and exponents (one a block of 32); the rest as stored
    own = sum(
        p.to_local().numel() // 2 + p.to_local().numel() // 32
        if n.endswith(("experts.gate_up_proj", "experts.down_proj"))
        else p.to_local().nbytes
        for n, p in params.items()
    )
    return {"equal": equal, "read": read, "own": own}


@pytest.mark.parametrize(("ranks", "degree"), [(2, 1), (4, 2)])
def test_mxfp4_experts_are_dequantized_per_rank_and_saved_as_bf16(request, tmp_path, ranks, degree):
    """8 experts on 2 ranks, and on 4 at expert_parallel=2 (2 experts a rank): each rank reads and
    dequantizes only its experts' blocks; the save is bf16 HF."""
    from tests.unit.test_mxfp4 import quantized_dir

    stored, dequantized = quantized_dir(tmp_path / "hf")
    expected = {k: v for k, v in stored.items() if not k.endswith(("_blocks", "_scales"))} | dequantized
    pool = request.getfixturevalue(f"pool{ranks}")
    res = pool.run_ok(_load_mxfp4, str(tmp_path / "hf"), str(tmp_path / "out"), expected, degree, timeout=200)
    for r in res:
        assert all(r["equal"].values()), r["equal"]
        assert r["read"] == r["own"], r
    got = tensors(tmp_path / "out")
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], v) and got[k].dtype == torch.bfloat16 for k, v in expected.items())


def test_a_sharding_that_cuts_mxfp4_blocks_is_refused_on_every_rank(pool2, tmp_path):
    """5 experts on 2 ranks split dim 1 (H = 96) at 48, inside a block of 32: refused naming the tensor."""
    from tests.unit.test_mxfp4 import quantized_dir

    quantized_dir(tmp_path / "hf", num_local_experts=5)
    res = pool2.run_ok(_load_mxfp4, str(tmp_path / "hf"), str(tmp_path / "out"), {}, timeout=200)
    for r in res:
        assert "CheckpointError" in r["error"] and "experts.gate_up_proj: a piece of rows" in r["error"], r
        assert "cuts the MXFP4 blocks" in r["error"], r
