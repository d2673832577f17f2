"""One model tensor stored as several file tensors (N:1): stacked experts <-> per-expert weights.

A toy MoE block holds ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; its files hold
``{e}.gate_proj.weight``, ``{e}.up_proj.weight`` ``[I, H]`` and ``{e}.down_proj.weight``
``[H, I]`` (transformers' per-expert layout). On 2 ranks with FSDP2 ``Shard(0)`` (a range of
experts, E = 5 uneven) and ``Shard(1)`` (rows of every expert): the saved files, read with
safetensors, equal the hand split of the full tensors; a load from them gives every rank its
piece while reading exactly its own bytes; the collectives do not grow with the experts, nor
do the exchanges when rank 0 alone holds the files and sends each rank its blocks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from shardtune.state_dict.parts import stacked_parts
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(180)

INTER, HID = 3, 4  # I and H: 2I != H, so a transposed or mis-cut tensor cannot pass
GATE_UP = ("gate_proj", "up_proj")


class Experts(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * INTER, HID))
        self.down_proj = nn.Parameter(torch.empty(experts, HID, INTER))

    def file_parts(self, prefix, name, shape):
        if name == "gate_up_proj":
            return stacked_parts(shape, lambda e, c: f"{prefix}.{e}.{GATE_UP[c]}.weight", chunks=2)
        if name == "down_proj":
            return stacked_parts(shape, lambda e, c: f"{prefix}.{e}.down_proj.weight")
        return None


class Moe(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(HID, experts, bias=False)  # the router: stored as itself
        self.experts = Experts(experts)


class Toy(nn.Module):
    def __init__(self, experts: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.ModuleDict({"mlp": Moe(experts)})])


def _full(experts: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(experts)
    p = "layers.0.mlp."
    return {
        p + "gate.weight": torch.randn(experts, HID, generator=g),
        p + "experts.gate_up_proj": torch.randn(experts, 2 * INTER, HID, generator=g),
        p + "experts.down_proj": torch.randn(experts, HID, INTER, generator=g),
    }


def _per_expert(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The hand split: what transformers' per-expert files hold."""
    p = "layers.0.mlp."
    out = {p + "gate.weight": full[p + "gate.weight"]}
    for e, (gu, down) in enumerate(zip(full[p + "experts.gate_up_proj"], full[p + "experts.down_proj"])):
        out[f"{p}experts.{e}.gate_proj.weight"] = gu[:INTER]
        out[f"{p}experts.{e}.up_proj.weight"] = gu[INTER:]
        out[f"{p}experts.{e}.down_proj.weight"] = down
    return out


def _sharded(experts: int, dim: int) -> Toy:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    with torch.device("meta"):
        model = Toy(experts)
    fully_shard(model, shard_placement_fn=lambda p: Shard(dim if p.dim() == 3 else 0))
    return model


def _round_trip(out: str, experts: int, dim: int, shared: bool):
    """Load the fused tensors, save per-expert files, load them into a fresh model: each
    rank's pieces, bytes read and collective counts."""
    from torch.distributed.tensor import distribute_tensor

    from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
    from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
    from shardtune.state_dict import load_from_full_model_state_dict, stats

    full = _full(experts)
    model = _sharded(experts, dim)
    load_from_full_model_state_dict(model, full, "cpu", strict=True)  # the fused keys: stored as themselves
    with nccl_rules() as rules:
        rules.host(model)
        save_hf_checkpoint(
            model,
            out,
            config={"model_type": "toy"},
            max_shard_size="400B",
            shared_filesystem=shared,
            expert_layout="per_expert",  # read fused: the default writes back the layout read
        )
        fresh = _sharded(experts, dim)
        dist.barrier()
        stats.reset()
        load_hf_checkpoint(fresh, out, device="cpu", strict=True, shared_filesystem=shared)
        read = stats.bytes_read
    pieces = {n: p.to_local() for n, p in fresh.named_parameters()}
    wanted = {  # DTensor's own cut of the full tensors: the reference
        n: distribute_tensor(full[n], p.device_mesh, p.placements).to_local() for n, p in fresh.named_parameters()
    }
    return {
        "read": read,
        "counts": dict(rules.counts),
        "equal": {n: torch.equal(pieces[n], wanted[n]) for n in pieces},
        "own_bytes": sum(t.nbytes for t in pieces.values()),
        "expert_bytes": sum(t.nbytes for n, t in pieces.items() if "experts" in n),
    }


@pytest.mark.parametrize("dim", [0, 1])
def test_stacked_experts_round_trip_through_per_expert_files(pool2, tmp_path, dim):
    experts = 5
    res = pool2.run_ok(_round_trip, str(tmp_path / "hf"), experts, dim, True)
    expected = _per_expert(_full(experts))
    saved = {}
    files = sorted((tmp_path / "hf").glob("*.safetensors"))
    assert len(files) > 1  # offsets in several files
    for path in files:
        with safe_open(str(path), "pt") as f:  # the independent reader
            saved.update({k: f.get_tensor(k) for k in f.keys()})
    assert sorted(saved) == sorted(expected)
    for key, value in expected.items():
        assert saved[key].shape == value.shape and torch.equal(saved[key], value), key
    total_expert_bytes = sum(v.nbytes for k, v in expected.items() if "experts" in k)
    for r in res:
        assert all(r["equal"].values()), r["equal"]
        assert r["read"] == r["own_bytes"]  # exactly this rank's bytes, straight from the files
        assert r["expert_bytes"] < total_expert_bytes
    assert sum(r["expert_bytes"] for r in res) == total_expert_bytes


@pytest.mark.parametrize("dim", [0, 1])
def test_collectives_do_not_grow_with_the_experts(pool2, tmp_path, dim):
    few = pool2.run_ok(_round_trip, str(tmp_path / "few"), 2, dim, True)
    many = pool2.run_ok(_round_trip, str(tmp_path / "many"), 9, dim, True)
    assert [r["counts"] for r in few] == [r["counts"] for r in many]
    assert all("batch_isend_irecv" not in r["counts"] for r in many)  # no data crosses the network


def test_rank0_files_obey_nccl_rules(pool2, tmp_path):
    """Without a shared filesystem rank 0 gathers each file tensor and sends each rank its
    blocks of every part, under NCCL's rules."""
    res = pool2.run_ok(_round_trip, str(tmp_path / "rank0"), 5, 1, False)
    saved = {}
    for path in sorted((tmp_path / "rank0").glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            saved.update({k: f.get_tensor(k) for k in f.keys()})
    expected = _per_expert(_full(5))
    assert sorted(saved) == sorted(expected) and all(torch.equal(saved[k], v) for k, v in expected.items())
    assert all(all(r["equal"].values()) for r in res)
    assert res[1]["read"] == 0 and all(r["counts"]["batch_isend_irecv"] >= 1 for r in res)


def _partial_checkpoint():
    from shardtune.state_dict import load_from_full_model_state_dict

    sd = _per_expert(_full(5))
    del sd["layers.0.mlp.experts.3.up_proj.weight"]
    load_from_full_model_state_dict(_sharded(5, 0), sd, "cpu")


def test_a_missing_expert_tensor_is_refused_on_every_rank(pool2):
    outcomes = pool2.run(_partial_checkpoint, timeout=60)
    assert all(not o.ok for o in outcomes)
    assert len({o.error for o in outcomes}) == 1
    assert "layers.0.mlp.experts.gate_up_proj: the checkpoint holds 9 of its 10" in outcomes[0].error
    assert "experts.3.up_proj.weight" in outcomes[0].error


# --- rank 0 holds the files (shared_filesystem=false): batched sends -------------------------


def _rank0_load(experts: int, dim: int, limit: int | None):
    """Load per-expert tensors that rank 0 alone holds (in host memory): this rank's collective
    counts, the block sizes of each batch rank 0 staged, and its pieces against DTensor's cut of
    the fused tensors and against a load in which every rank reads its own bytes."""
    from torch.distributed.tensor import distribute_tensor

    from shardtune.ranks import comm
    from shardtune.state_dict import blocks, load_from_full_model_state_dict

    full = _full(experts)
    files = _per_expert(full)
    direct = _sharded(experts, dim)
    load_from_full_model_state_dict(direct, files, "cpu", strict=True)
    given = files if dist.get_rank() == 0 else {}
    model = _sharded(experts, dim)
    staged: list[list[int]] = []  # the block sizes of each batch rank 0 staged
    reserve, saved_limit = blocks.SendBuffer.reserve, comm.BATCH_BYTES

    def record(self, sizes, device):
        staged.append(list(sizes))
        reserve(self, sizes, device)

    blocks.SendBuffer.reserve = record
    comm.BATCH_BYTES = saved_limit if limit is None else limit
    try:
        with nccl_rules() as rules:
            rules.host(given)  # staged before sending, as host memory is on a GPU run
            load_from_full_model_state_dict(model, given, "cpu", strict=True)
    finally:
        blocks.SendBuffer.reserve, comm.BATCH_BYTES = reserve, saved_limit
    direct_pieces = {n: p.to_local() for n, p in direct.named_parameters()}
    return {
        "counts": dict(rules.counts),
        "staged": [s for s in staged if s],
        "equal_cut": all(
            torch.equal(p.to_local(), distribute_tensor(full[n], p.device_mesh, p.placements).to_local())
            for n, p in model.named_parameters()
        ),
        "equal_direct": all(torch.equal(p.to_local(), direct_pieces[n]) for n, p in model.named_parameters()),
    }


def _few_and_many(dim: int, limit: int | None):
    return [_rank0_load(experts, dim, limit) for experts in (2, 9)]


@pytest.mark.parametrize("dim", [0, 1])
def test_rank0_load_exchanges_do_not_grow_with_the_experts(pool2, dim):
    """Rank 0 sends all parts' blocks of one parameter to a rank in one exchange: E = 2 and E = 9
    make the same collectives (one exchange per sharded parameter), under NCCL's rules; only the
    point-to-point ops inside each exchange (one per block) grow with E."""
    res = pool2.run_ok(_few_and_many, dim, None)
    for few, many in res:
        assert few["equal_cut"] and many["equal_cut"] and few["equal_direct"] and many["equal_direct"]
        calls = [{k: n for k, n in r["counts"].items() if not k.startswith("batched_")} for r in (few, many)]
        assert calls[0] == calls[1], calls
    assert all(many["counts"]["batch_isend_irecv"] == 3 for _, many in res)  # router, gate_up, down


def test_rank0_load_stages_at_most_one_block_per_batch(pool2):
    """With a batch limit of 1 byte every block travels alone: rank 0 stages one block per batch
    (E = 9, Shard(1): rank 1 holds the up_proj rows and half the rows of every down_proj), and
    the values still arrive in their places."""
    res = pool2.run_ok(_few_and_many, 1, 1)
    many = [r for _, r in res]
    assert all(r["equal_cut"] and r["equal_direct"] for r in many)
    router, up, down_half = 4 * HID * 4, INTER * HID * 4, (HID // 2) * INTER * 4  # rank 1's blocks, in bytes
    assert many[0]["staged"] == [[router]] + [[up]] * 9 + [[down_half]] * 9
    assert many[1]["counts"]["batch_isend_irecv"] == 1 + 9 + 9  # router, 9 up_proj parts, 9 down_proj halves


def _rank0_staging(experts: int, dim: int):
    """Rank-0 load of per-expert tensors held in host memory (every block staged), one block per
    batch: after each batch rank 0 stages, the room that batch needed and the staging memory held."""
    from shardtune.ranks import comm
    from shardtune.state_dict import blocks, load_from_full_model_state_dict

    files = _per_expert(_full(experts))
    given = files if dist.get_rank() == 0 else {}
    model = _sharded(experts, dim)
    needed, held = [], []
    reserve, saved_limit = blocks.SendBuffer.reserve, comm.BATCH_BYTES

    def record(self, sizes, device):
        reserve(self, sizes, device)
        needed.append(sum(-(-n // blocks.SendBuffer._ALIGN) * blocks.SendBuffer._ALIGN for n in sizes))
        held.append(self.nbytes)

    blocks.SendBuffer.reserve, comm.BATCH_BYTES = record, 1
    try:
        with nccl_rules() as rules:
            rules.host(given)
            load_from_full_model_state_dict(model, given, "cpu", strict=True)
    finally:
        blocks.SendBuffer.reserve, comm.BATCH_BYTES = reserve, saved_limit
    return {"needed": needed, "held": held}


def test_rank0_load_stages_at_most_two_batches(pool2):
    """Rank 0 stages the next batch while the last is in flight: its staging memory holds two
    batches' rooms, never more (the largest, twice), and none on the receiving rank."""
    res = pool2.run_ok(_rank0_staging, 9, 1)
    needed, held = res[0]["needed"], res[0]["held"]
    assert len(needed) == 1 + 9 + 9  # router, up_proj parts, down_proj halves: one batch each
    assert max(needed) < max(held) <= 2 * max(needed)
    assert res[1] == {"needed": [], "held": []}


def _rank0_part_fails():
    from shardtune.state_dict import load_from_full_model_state_dict
    from tests.distributed.test_errors import _FailingSlice  # a truncated file: fails on read

    files = _per_expert(_full(5))
    key = "layers.0.mlp.experts.3.up_proj.weight"
    files[key] = _FailingSlice(files[key].shape)
    load_from_full_model_state_dict(_sharded(5, 1), files if dist.get_rank() == 0 else {}, "cpu")


def test_rank0_part_read_failure_raises_on_every_rank(pool2):
    outcomes = pool2.run(_rank0_part_fails, timeout=60)
    assert all(not o.ok for o in outcomes)
    assert len({o.error for o in outcomes}) == 1
    assert "layers.0.mlp.experts.3.up_proj.weight: OSError: read failed: file truncated" in outcomes[0].error
