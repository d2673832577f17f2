"""Block-FP8 HF checkpoints under FSDP2 on 2 ranks, against hand-quantized directories.

The tiny qwen3_moe of ``tests/unit/test_block_fp8.py`` (blocks of 20 x 40): FSDP cuts its 64-row
attention weights at row 32 and its dense 96-row MLP weights at 48, both inside a block, and puts 4
of 8 experts on each rank (or, with 5, splits every expert's rows: ``Shard(1)``). Each rank's pieces equal DTensor's cut of transformers' dequantization of
the whole tensors; each rank reads exactly its FP8 rows, the scale rows covering them and its other
bytes (none without a shared filesystem: rank 0 sends each rank its dequantized piece). A ``block_fp8``
save (each rank its rows, the cut blocks' amax shared by an all-reduce; or rank 0 alone) equals the
test's quantization of the whole weights, with LoRA adapters merged too; a missing scale is refused
with the same message on both ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import distribute_tensor
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
from shardtune.models import from_hf_config
from shardtune.ranks import comm
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import stats
from shardtune.state_dict.layout import layout_of
from tests.nccl_rules import nccl_rules
from tests.unit.test_block_fp8 import BLOCK, _fused, fp8_dir, hand_quantize
from tests.unit.test_moe_checkpoint import tensors

pytestmark = pytest.mark.timeout(300)

# file tensors of one expert of the runtime tensor: (name, rows taken from the runtime rows)
EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def _scale_bytes(rows: tuple[int, int], cols: tuple[int, int]) -> int:
    """Bytes of the float32 scales covering rows ``[r0, r1)`` and columns ``[c0, c1)``."""
    (r0, r1), (c0, c1) = rows, cols
    return 4 * (-(-r1 // BLOCK[0]) - r0 // BLOCK[0]) * (-(-c1 // BLOCK[1]) - c0 // BLOCK[1])


def _own_reads(params: dict, scaled: set[str], layout: str) -> int:
    """What this rank must read: its FP8 bytes and the scales covering them, its other tensors' bytes."""
    total = 0
    for name, p in params.items():
        piece = layout_of(p, comm.world_size()).piece(comm.rank())
        kind = name.rsplit(".", 1)[-1]
        if layout == "per_expert" and kind in EXPERT_PARTS:  # each expert's file tensors: the rows met
            parts, (experts, rows, cols) = len(EXPERT_PARTS[kind]), piece.shape
            r0, height = piece.offset[1], p.shape[1] // parts
            for part in range(parts):
                lo, hi = max(r0, part * height) - part * height, min(r0 + rows, (part + 1) * height) - part * height
                if hi > lo:
                    total += experts * ((hi - lo) * cols + _scale_bytes((lo, hi), (0, cols)))
        elif name in scaled:
            (r0, c0), (rows, cols) = piece.offset[-2:], piece.shape[-2:]
            lead = piece.numel // (rows * cols) if rows * cols else 0
            total += piece.numel + lead * _scale_bytes((r0, r0 + rows), (c0, c0 + cols))
        else:
            total += piece.numel * 4  # stored float32
    return total


def _load_and_save(hf_dir: str, out: str, layout: str, shared: bool, expected: dict, scaled: set[str]) -> dict:
    """Load (bytes read counted), compare each piece with DTensor's cut of ``expected``, save as block FP8."""
    with nccl_rules() as rules:
        rules.host(expected)
        dist.barrier()
        stats.reset()
        with torch.device("meta"):
            model = from_hf_config(hf_dir, dtype=torch.float32)
        shard_model(model, mesh=make_mesh())
        load_hf_checkpoint(model, hf_dir, device="cpu", strict=True, shared_filesystem=shared)
        model.init_buffers("cpu")
        read = stats.bytes_read
        save_hf_checkpoint(model, out, weight_format="block_fp8", shared_filesystem=shared)
    params = dict(model.named_parameters())
    equal = {
        n: torch.equal(p.to_local(), distribute_tensor(expected[n], p.device_mesh, p.placements).to_local())
        for n, p in params.items()
    }
    cut = params["model.layers.0.self_attn.q_proj.weight"].to_local().shape[0]
    placement = params["model.layers.0.mlp.experts.down_proj"].placements[0].dim
    own = _own_reads(params, scaled, layout) if shared else 0
    return {"equal": equal, "read": read, "own": own, "cut": cut, "placement": placement}


@pytest.mark.parametrize(
    ("layout", "shared", "experts"),
    [("per_expert", True, 8), ("fused", True, 8), ("per_expert", False, 8), ("per_expert", True, 5)],
    ids=["per-expert", "fused", "rank0", "experts-shard1"],
)
def test_each_rank_dequantizes_its_piece_and_the_fp8_save_equals_a_hand_quantization(
    pool2, tmp_path, layout, shared, experts
):
    """8 experts: 4 whole ones a rank (``Shard(0)``); 5: every expert's rows split (``Shard(1)``), the down
    projections' 64 rows at 32, inside a block."""
    _, by_file = fp8_dir(tmp_path / "fp8", layout=layout, num_experts=experts)
    source = tensors(tmp_path / "fp8")
    expected = _fused(by_file) if layout == "per_expert" else by_file
    scaled = {n for n in expected if f"{n}_scale_inv" in source}
    args = (str(tmp_path / "fp8"), str(tmp_path / "out"), layout, shared, expected, scaled)
    res = pool2.run_ok(_load_and_save, *args, timeout=200)
    for rank, r in enumerate(res):
        assert all(r["equal"].values()), [n for n, ok in r["equal"].items() if not ok]
        assert r["cut"] == 32 and 32 % BLOCK[0], r  # the shard boundary lies inside a block
        assert r["placement"] == (0 if experts == 8 else 1), r
        assert r["read"] == (r["own"] if shared else (0 if rank else r["read"])), (rank, r)
    got = tensors(tmp_path / "out")
    assert sorted(got) == sorted(source)
    for name, value in by_file.items():
        if f"{name}_scale_inv" in source:
            fp8, scale = hand_quantize(value)
            assert torch.equal(got[name].view(torch.uint8), fp8.view(torch.uint8)), name
            assert torch.equal(got[f"{name}_scale_inv"], scale), name
        else:
            assert torch.equal(got[name], value), name


def _refusal(hf_dir: str, shared: bool) -> str:
    """The error every rank's load raises (the ranks that read nothing too)."""
    with torch.device("meta"):
        model = from_hf_config(hf_dir, dtype=torch.float32)
    shard_model(model, mesh=make_mesh())
    try:
        load_hf_checkpoint(model, hf_dir, device="cpu", strict=True, shared_filesystem=shared)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


@pytest.mark.parametrize("shared", [True, False], ids=["direct", "rank0"])
def test_a_missing_scale_is_refused_on_every_rank(pool2, tmp_path, shared):
    import safetensors.torch

    fp8_dir(tmp_path)
    stored = safetensors.torch.load_file(tmp_path / "model.safetensors")
    del stored["model.layers.1.mlp.down_proj.weight_scale_inv"]
    safetensors.torch.save_file(stored, tmp_path / "model.safetensors", metadata={"format": "pt"})
    res = pool2.run_ok(_refusal, str(tmp_path), shared, timeout=120)
    assert res[0] == res[1], res
    want = "model.layers.1.mlp.down_proj.weight: FP8 weight without its scale tensor"
    assert res[0].startswith("CheckpointError") and want in res[0], res[0]


def _lora_saves(hf_dir: str, plain: str, out: str) -> None:
    """LoRA on the attention (B non-zero), sharded, loaded from ``hf_dir``; saved merged plain and in FP8."""
    from shardtune.peft import apply_lora, get_adapter_params, init_lora_parameters

    with torch.device("meta"):
        model = from_hf_config(hf_dir, dtype=torch.float32)
        apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "o_proj"])
    shard_model(model, mesh=make_mesh())
    load_hf_checkpoint(model, hf_dir, device="cpu")
    model.init_buffers("cpu")
    init_lora_parameters(model, device="cpu")
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in get_adapter_params(model).values():
            full = torch.randn(p.shape, generator=gen) * 0.05
            p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
    save_hf_checkpoint(model, plain)
    save_hf_checkpoint(model, out, weight_format="block_fp8")


def test_a_merged_lora_fp8_save_on_2_ranks_equals_a_hand_quantization(pool2, tmp_path):
    """A merged tensor's amax is reduced in its own turn: rows cut inside blocks still get whole-block scales."""
    fp8_dir(tmp_path / "fp8")
    pool2.run_ok(_lora_saves, str(tmp_path / "fp8"), str(tmp_path / "plain"), str(tmp_path / "out"), timeout=200)
    plain, got, source = tensors(tmp_path / "plain"), tensors(tmp_path / "out"), tensors(tmp_path / "fp8")
    assert sorted(got) == sorted(source)
    for name, value in plain.items():
        if f"{name}_scale_inv" in source:
            fp8, scale = hand_quantize(value)
            assert torch.equal(got[name].view(torch.uint8), fp8.view(torch.uint8)), name
            assert torch.equal(got[f"{name}_scale_inv"], scale), name
    q = "model.layers.0.self_attn.q_proj.weight"  # merged: not the base
    assert not torch.equal(
        plain[q], _dequantize_fp8_weight(source[q], source[f"{q}_scale_inv"], list(BLOCK), torch.float32)
    )
