"""The state-dict functions obey NCCL's rules (tests/nccl_rules.py) on a gloo group.

First the harness is shown to fail on each rule; then the four public functions and the
rank-0 reads and writes run under it and still equal an unsharded single-process reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

from shardtune.ranks import comm
from shardtune.training import (
    gather_cpu_state_dict,
    get_full_optimizer_state_dict,
    load_from_full_model_state_dict,
    load_from_full_optimizer_state_dict,
)
from tests.distributed import toy
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(240)

NF4_KEYS = [f"layers.{i}.{p}.weight" for i in range(2) for p in ("q_proj", "up_proj", "down_proj")]
P2P = ("send", "recv")


def _offloaded_model():
    model = toy.build_sharded(meta=True)
    load_from_full_model_state_dict(model, toy.full_state_dict(seed=20), "cpu", cpu_offload=True)
    return model


def _broken(rule: str):
    """Break one rule, symmetrically on both ranks (so no rank waits for the other)."""
    model = _offloaded_model() if rule in ("host_all_gather", "host_full_tensor") else None
    with nccl_rules() as rules:
        if rule == "p2p":
            t = torch.arange(4.0)
            (dist.isend(t, 1) if dist.get_rank() == 0 else dist.irecv(t, 0)).wait()
        elif rule == "uint16":
            dist.all_reduce(torch.ones(3, dtype=torch.uint16))
        elif rule == "host_all_gather":
            rules.host(model)
            shard = model.layers[0].q_proj.weight._local_tensor
            dist.all_gather([torch.empty_like(shard) for _ in range(2)], shard)
        elif rule == "host_full_tensor":
            rules.host(model)
            model.layers[0].norm.full_tensor()  # a functional all-gather of the offloaded local tensor
        elif rule == "two_in_flight":
            peer, op = 1 - dist.get_rank(), dist.isend if dist.get_rank() == 0 else dist.irecv
            first = dist.batch_isend_irecv([dist.P2POp(op, torch.zeros(4), peer)])
            second = dist.batch_isend_irecv([dist.P2POp(op, torch.zeros(4), peer)])  # queued behind the first
            for work in first + second:
                work.wait()
        elif rule == "funcol_left_in_flight":
            funcol.all_gather_tensor(torch.zeros(4), 0, dist.group.WORLD).view(2, 4)  # neither waited nor read
        elif rule == "left_in_flight":
            comm.start_exchange([(torch.zeros(4), 1)], []) if dist.get_rank() == 0 else comm.exchange(
                [], [(torch.zeros(4), 0)]
            )


@pytest.mark.parametrize(
    ("rule", "words"),
    [
        ("p2p", "unbatched send"),
        ("uint16", "dtype torch.uint16"),
        ("host_all_gather", "all_gather: a torch.float32 tensor of shape (128, 256) is host memory"),
        ("host_full_tensor", "funcol.all_gather_into_tensor: a torch.float32 tensor"),
        ("two_in_flight", "batch_isend_irecv started while an exchange is in flight"),
        ("funcol_left_in_flight", "funcol.all_gather_into_tensor is still in flight at the end of the block"),
    ],
)
def test_harness_catches_each_broken_rule(pool2, rule, words):
    outcomes = pool2.run(_broken, rule, timeout=60)
    assert all(not o.ok and o.error.startswith("NcclRuleError") for o in outcomes), [o.error for o in outcomes]
    assert words in outcomes[0].error


def test_harness_catches_an_exchange_left_in_flight(pool2):
    outcomes = pool2.run(_broken, "left_in_flight", timeout=60)
    assert outcomes[1].ok and not outcomes[0].ok  # rank 0 returned with its send in flight
    assert "an exchange is still in flight at the end of the block" in outcomes[0].error


def _allowed_forms():
    """The same moves the rules refuse above, made the allowed way."""
    model = _offloaded_model()
    rank = dist.get_rank()
    with nccl_rules() as rules:
        rules.host(model)
        t = torch.arange(4.0) if rank == 0 else torch.zeros(4)
        comm.exchange([(t, 1)], []) if rank == 0 else comm.exchange([], [(t, 0)])
        shorts = torch.tensor([1, 2, 65535], dtype=torch.uint16) if rank == 0 else torch.zeros(3, dtype=torch.uint16)
        comm.broadcast_from_rank0(shorts)  # travels as bytes
        norm = comm.full_tensor(model.layers[0].norm, comm.comm_device("cpu"))
    return {"p2p": t.tolist(), "shorts": shorts.tolist(), "norm": norm.tolist(), "counts": dict(rules.counts)}


def test_allowed_forms_pass_and_move_the_right_values(pool2):
    res = pool2.run_ok(_allowed_forms, timeout=60)
    expected_norm = toy.full_state_dict(seed=20)["layers.0.norm"].tolist()
    for r in res:
        assert r["p2p"] == [0.0, 1.0, 2.0, 3.0] and r["shorts"] == [1, 2, 65535] and r["norm"] == expected_norm
        assert r["counts"]["batch_isend_irecv"] == 1 and not any(k in r["counts"] for k in P2P)


def test_normalize_device_gives_accelerators_the_current_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert comm.normalize_device(None) is None
    assert comm.normalize_device("cpu") == torch.device("cpu")
    assert comm.normalize_device(torch.device("meta")) == torch.device("meta")
    assert comm.normalize_device("cuda") == comm.normalize_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert comm.normalize_device("cuda:1") == torch.device("cuda", 1)


@pytest.mark.parametrize(
    ("backend", "device", "expected"),
    [
        ("nccl", None, "cuda:2"),
        ("nccl", "cuda", "cuda:2"),
        ("nccl", "cuda:1", "cuda:1"),
        ("nccl", "cpu", "cuda:2"),  # CPU-offloaded shards still move on the accelerator
        ("cpu:gloo,cuda:nccl", "cuda", "cuda:2"),
        ("gloo", "cuda", "cpu"),
        ("cpu:gloo", None, "cpu"),
    ],
)
def test_transfer_device_follows_the_backend(monkeypatch, backend, device, expected):
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    assert comm.comm_device(device) == torch.device(expected)


def test_batches_are_bounded_and_cover_every_rank():
    assert comm.batches({1: 10, 2: 10, 3: 10}, limit=20) == [[1, 2], [3]]
    assert comm.batches({1: 50, 2: 5}, limit=20) == [[1], [2]]  # a larger block gets its own batch
    assert comm.batches({}, limit=20) == []


# --- the four functions under the rules ------------------------------------------------------


def _load_and_gather(mode: str, kind: str):
    """Load (every-rank or rank-0 input) and gather back, with the checkpoint and, for offloaded
    models, the model registered as host memory."""
    nf4 = kind.startswith("nf4")
    offload = kind.endswith("offload")
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    sd = toy.full_state_dict(seed=21, lora_rank=4 if nf4 else 0)
    model = toy.build_sharded(meta=not offload, dtype=dtype, lora_rank=4 if nf4 else 0, nf4=nf4)
    given = sd if mode == "every_rank" or dist.get_rank() == 0 else {}
    with nccl_rules() as rules:
        rules.host(given)
        if offload:
            rules.host(model)  # materialized on CPU: filled in place, never received into directly
        load_from_full_model_state_dict(model, given, "cpu", strict=True, cpu_offload=offload)
        if offload:
            rules.host(model)  # the new NF4 shards
        out = gather_cpu_state_dict(model, dist.get_rank() == 0)
    result = {"counts": dict(rules.counts)}
    if dist.get_rank() == 0:
        expected = {
            k: (to_nf4(v).get_original_weight() if nf4 and k in NF4_KEYS else v).to(dtype) for k, v in sd.items()
        }
        result["mismatched"] = [k for k in expected if not torch.equal(out[k], expected[k])]
        result["keys"] = sorted(out) == sorted(expected)
    return result


@pytest.mark.parametrize("mode", ["every_rank", "rank0"])
@pytest.mark.parametrize("kind", ["bf16", "fp32_offload", "nf4_offload"])
def test_load_and_gather_obey_nccl_rules(pool2, mode, kind):
    res = pool2.run_ok(_load_and_gather, mode, kind)
    assert res[0]["mismatched"] == [] and res[0]["keys"]
    for r in res:
        assert not any(k in r["counts"] for k in P2P)
        assert r["counts"]["batch_isend_irecv"] >= 1  # the gather (and a rank-0 load) exchange in batches


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, toy.VOCAB, (2, 12), generator=torch.Generator().manual_seed(200 + step))


def _train(model, opt, steps: int) -> None:
    for step in range(steps):
        tokens = _batch(step)
        loss = F.cross_entropy(model(tokens)[:, :-1].reshape(-1, toy.VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()


def _optimizer_round_trip(mode: str):
    """Gather the optimizer state, load it into a fresh optimizer (every-rank or rank-0 input),
    gather again: both gathers equal a single-process optimizer trained the same way."""
    sd = toy.full_state_dict(seed=22)
    model = toy.build_sharded(meta=True)
    load_from_full_model_state_dict(model, sd, "cpu", cpu_offload=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with nccl_rules() as rules:
        rules.host(model, opt)
        full = get_full_optimizer_state_dict(model, opt, dist.get_rank() == 0)
        holder = [full]
        if mode == "every_rank":
            dist.broadcast_object_list(holder, src=0)
        rules.host(holder[0])
        load_from_full_optimizer_state_dict(model, fresh, holder[0], "cpu")
        again = get_full_optimizer_state_dict(model, fresh, dist.get_rank() == 0)
    result = {"counts": dict(rules.counts)}
    if dist.get_rank() == 0:
        ref = toy.reference(sd)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        _train(ref, ref_opt, 2)
        names = {id(p): n for n, p in ref.named_parameters()}
        expected = {names[id(p)]: s for p, s in ref_opt.state.items()}
        worst = 0.0
        for got in (full, again):
            assert sorted(got["state"]) == sorted(expected)
            for fqn, state in expected.items():
                for key, value in state.items():
                    worst = max(worst, (got["state"][fqn][key].float() - value.float()).abs().max().item())
        result["worst"] = worst
    return result


@pytest.mark.parametrize("mode", ["every_rank", "rank0"])
def test_optimizer_round_trip_obeys_nccl_rules(pool2, mode):
    res = pool2.run_ok(_optimizer_round_trip, mode)
    assert res[0]["worst"] < 1e-5
    assert all(not any(k in r["counts"] for k in P2P) and r["counts"]["batch_isend_irecv"] >= 1 for r in res)


def _outside_the_block():
    with nccl_rules() as rules:
        dist.all_reduce(torch.ones(2))
    dist.all_reduce(torch.ones(2, dtype=torch.uint16).to(torch.int32))
    with nccl_rules():
        pass
    isend_after = dist.isend if dist.get_rank() == 0 else dist.irecv
    isend_after(torch.ones(1), 1 - dist.get_rank()).wait()  # unbatched, but after the blocks: not seen
    return dict(rules.counts)


def test_harness_sees_only_its_block(pool2):
    assert pool2.run_ok(_outside_the_block, timeout=60) == [{"all_reduce": 1}, {"all_reduce": 1}]


# --- reads and writes without a shared filesystem (rank 0 does the file I/O) -------------------


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A transformers-made checkpoint in several files and its weights (the reference)."""
    from tests.distributed.test_hf_io import _hf_model

    root = tmp_path_factory.mktemp("nccl_hf")
    model = _hf_model(tied=False, seed=5)
    model.save_pretrained(root, safe_serialization=True, max_shard_size="300KB")
    return {"dir": root, "sd": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def _qlora_rank0_save_then_load(src: str, out: str):
    """Save a QLoRA model merged via rank 0, then load the result via rank 0 into a plain model
    and gather it; every model registered as host memory, as if CPU-offloaded."""
    from shardtune.checkpoint.formats.hf_load import load_hf_checkpoint
    from shardtune.checkpoint.formats.hf_save import save_hf_checkpoint
    from shardtune.models import build_model
    from shardtune.ranks.sharding import shard_model
    from tests.distributed.test_hf_io import _lora_model

    model, adapters = _lora_model(src, quantize=True)
    with nccl_rules() as rules:
        rules.host(model)
        save_hf_checkpoint(model, out, max_shard_size="400KB", merge_adapters=True, shared_filesystem=False)
        plain = build_model(out, device="meta")
        shard_model(plain)
        load_hf_checkpoint(plain, out, device="cpu", shared_filesystem=False, strict=True)
        rules.host(plain)
        gathered = gather_cpu_state_dict(plain, dist.get_rank() == 0)
    if dist.get_rank() != 0:
        return {"counts": dict(rules.counts)}
    return {"counts": dict(rules.counts), "adapters": adapters, "gathered": gathered}


def test_rank0_writes_and_reads_obey_nccl_rules(pool2, hf_dir, tmp_path):
    from tests.distributed.test_hf_io import LORA_ALPHA, LORA_RANK, _saved_tensors

    res = pool2.run_ok(_qlora_rank0_save_then_load, str(hf_dir["dir"]), str(tmp_path / "out"))
    saved, adapters, gathered = _saved_tensors(tmp_path / "out"), res[0]["adapters"], res[0]["gathered"]
    assert sorted(saved) == sorted(hf_dir["sd"]) == sorted(gathered)
    merged = 0
    for key, weight in hf_dir["sd"].items():
        a = adapters.get(key.replace(".weight", ".lora_A.weight"))
        if a is None:
            expected = weight
        else:
            b = adapters[key.replace(".weight", ".lora_B.weight")]
            expected = to_nf4(weight).get_original_weight() + (LORA_ALPHA / LORA_RANK) * (b @ a)
            merged += 1
        torch.testing.assert_close(saved[key], expected, atol=1e-6, rtol=0)
        assert torch.equal(gathered[key], saved[key]), key
    assert merged > 0
    for r in res:
        assert not any(k in r["counts"] for k in P2P) and r["counts"]["batch_isend_irecv"] >= 1


def _optimizer_files_round_trip(out: str):
    """Optimizer state saved and loaded with rank 0 doing the file I/O, under the rules, equals
    a single-process optimizer trained the same way."""
    from pathlib import Path

    from shardtune.checkpoint.formats.optimizer_io import load_optimizer, save_optimizer

    sd = toy.full_state_dict(seed=23)
    model = toy.build_sharded(meta=True)
    load_from_full_model_state_dict(model, sd, "cpu", cpu_offload=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt, 2)
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with nccl_rules() as rules:
        rules.host(model, opt)
        save_optimizer(model, opt, Path(out), shared_filesystem=False)
        load_optimizer(model, fresh, Path(out), device="cpu", shared_filesystem=False)
        rules.host(fresh)
        again = get_full_optimizer_state_dict(model, fresh, dist.get_rank() == 0)
    result = {"counts": dict(rules.counts)}
    if dist.get_rank() == 0:
        ref = toy.reference(sd)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        _train(ref, ref_opt, 2)
        names = {id(p): n for n, p in ref.named_parameters()}
        result["worst"] = max(
            (again["state"][names[id(p)]][k].float() - v.float()).abs().max().item()
            for p, state in ref_opt.state.items()
            for k, v in state.items()
        )
    return result


def test_optimizer_rank0_files_obey_nccl_rules(pool2, tmp_path):
    res = pool2.run_ok(_optimizer_files_round_trip, str(tmp_path / "opt"))
    assert res[0]["worst"] < 1e-5
    assert all(not any(k in r["counts"] for k in P2P) and r["counts"]["batch_isend_irecv"] >= 1 for r in res)


def _small_batches(mode: str):
    """Rank-0 load and gather with one rank per batch (the bound hit on every tensor), under the rules."""
    sd = toy.full_state_dict(seed=24)
    model = toy.build_sharded(meta=True, mesh_kind="2d")
    given = sd if dist.get_rank() == 0 else {}
    limit, comm.BATCH_BYTES = comm.BATCH_BYTES, 1
    try:
        with nccl_rules() as rules:
            rules.host(given)
            load_from_full_model_state_dict(model, given, "cpu", strict=True)
            out = gather_cpu_state_dict(model, dist.get_rank() == 0)
    finally:
        comm.BATCH_BYTES = limit
    sharded = sum(1 for p in model.parameters() if p.placements[-1].is_shard())
    result = {"batches": rules.counts["batch_isend_irecv"], "sharded": sharded}
    if dist.get_rank() == 0:
        result["mismatched"] = [k for k in sd if not torch.equal(out[k], sd[k])]
    return result


def test_one_rank_per_batch_on_an_hsdp_mesh(pool4):
    res = pool4.run_ok(_small_batches, "rank0")
    assert res[0]["mismatched"] == []
    # rank 0 scatters to 3 ranks and gathers from the other shard's lowest owner (rank 1), batch by batch
    assert res[0]["batches"] == res[0]["sharded"] * (3 + 1)
    assert res[1]["batches"] == 2 * res[1]["sharded"]  # rank 1: one receive, and one send of its distinct shard
    assert all(r["batches"] == r["sharded"] for r in res[2:])  # replicas: one receive, nothing to send


def _read_ahead():
    """Rank-0 load from a state dict in host memory (so every block is staged), under the rules."""
    sd = toy.full_state_dict(seed=25)
    model = toy.build_sharded(meta=True)
    given = sd if dist.get_rank() == 0 else {}
    with nccl_rules() as rules:
        rules.host(given)
        load_from_full_model_state_dict(model, given, "cpu", strict=True)
    out = gather_cpu_state_dict(model, dist.get_rank() == 0)
    sharded = sum(1 for p in model.parameters() if p.placements[-1].is_shard())
    result = {"ahead": rules.ahead, "batches": rules.counts["batch_isend_irecv"], "sharded": sharded}
    if dist.get_rank() == 0:
        result["mismatched"] = [k for k in sd if not torch.equal(out[k], sd[k])]
    return result


def test_rank0_reads_ahead_with_one_batch_in_flight(pool2):
    """Rank 0 stages the next tensor's batch and reads its own blocks while the last batch is in
    flight (tensor ops run between a batch's start and its wait), yet never has two batches in
    flight nor another collective behind one (the rules above); the values equal the state dict.
    (Several batches per tensor: test_one_rank_per_batch_on_an_hsdp_mesh, under the same rules.)"""
    res = pool2.run_ok(_read_ahead)
    assert res[0]["mismatched"] == []
    assert res[0]["batches"] == res[1]["batches"] == res[0]["sharded"]  # one per sharded tensor at 2 ranks
    assert res[0]["ahead"] >= res[0]["batches"]  # at least one op (a copy) behind each batch
    assert res[1]["ahead"] == 0  # receivers wait for their bytes
