"""Checkpoints of expert-parallel models on 4 gloo ranks, against transformers and torch's own gathers:
a tiny Qwen3-MoE (2I != H) with 8 experts (``[_StridedShard(0), Shard(0)]`` on ``(efsdp, ep)``) and 6
(``[Shard(1), Shard(0)]``: 3 experts per ep rank do not split over 2 efsdp ranks), and a tiny gpt-oss
(8 biased experts, ``[E, H, 2I]``), and on 2 ranks a tiny Qwen3.5-MoE (6 experts, a shared expert), loads from
transformers' per-expert files and from a rank-0 state dict, gathers and saves (both layouts) exactly the weights; after
a step, the optimizer state saved at ``expert_parallel=2`` comes back for every expert (not one rank's
copy) at 1, 2 and 4, and resuming at 2 continues bitwise; the same in the DCP format (checkpoint_format=dcp);
low-bit AdamW is refused by name when built and when its state is gathered."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardtune.checkpoint import load_hf_checkpoint, save_hf_checkpoint
from shardtune.checkpoint.formats.optimizer_io import load_optimizer, save_optimizer
from shardtune.models import from_hf_config
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training import gather_cpu_state_dict, load_from_full_model_state_dict
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(300)

SMALL = {"num_hidden_layers": 2, "mlp_only_layers": [1]}
CPU = torch.device("cpu")
LAYOUTS = ("per_expert", "fused")
STRIDED = (_StridedShard(0, split_factor=2), Shard(0))
PLACEMENTS = {  # case -> the experts' gate_up_proj placements and local shape on rank 0
    "8": (STRIDED, (2, 48, 64)),
    "6": ((Shard(1), Shard(0)), (3, 24, 64)),
    "gpt_oss": (STRIDED, (2, 64, 48)),  # gpt-oss: [E, H, 2I], biases split with their experts
}


def _model(hf, degree: int):
    with torch.device("meta"):
        model = from_hf_config(hf.config.to_dict())
    return shard_model(model, mesh=make_mesh(expert_parallel=degree))


def _full(model) -> dict[str, torch.Tensor]:
    """Every param in full by torch's own gather (the oracle for shardtune's pieces)."""
    return {n: p.full_tensor() for n, p in model.named_parameters()}


def _state(opt, model) -> dict[str, torch.Tensor]:
    """Each param's exp_avg and exp_avg_sq in full (torch's gather)."""
    return {
        f"{n}.{k}": opt.state[p][k].full_tensor()
        for n, p in model.named_parameters()
        for k in ("exp_avg", "exp_avg_sq")
    }


def _step(model, opt, hf) -> float:
    from tests.unit.test_models_moe import _loss, batch

    tokens, mask, labels = batch(seed=1 + dist.get_rank())
    loss = _loss(model, tokens, mask, labels, hf.config.router_aux_loss_coef)[0]
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _round_trip(case: str, out: str) -> dict:
    import transformers

    from tests.unit.test_models_gpt_oss import hf_gpt_oss
    from tests.unit.test_models_moe import hf_moe_model

    out_dir, rank0 = Path(out) / case, dist.get_rank() == 0
    if case == "qwen3_5_moe_text":  # 6 experts in both layers, the second full attention
        hf = hf_moe_model(case, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    else:
        hf = hf_gpt_oss() if case == "gpt_oss" else hf_moe_model("qwen3_moe", num_experts=int(case), **SMALL)
    experts = hf.model.layers[0].mlp.experts.num_experts
    expected = hf.state_dict()
    if rank0:
        hf.save_pretrained(out_dir / "hf")  # transformers' default: per-expert keys
    dist.barrier()
    r: dict = {}
    with nccl_rules() as rules:
        model = _model(hf, 2)
        load_hf_checkpoint(model, out_dir / "hf", device=CPU, strict=True)
        model.init_buffers("cpu")
        rules.host(model)
        from_state = _model(hf, 2)
        load_from_full_model_state_dict(from_state, expected if rank0 else {}, "cpu", strict=True)
        gathered = gather_cpu_state_dict(model, rank0)
        save_hf_checkpoint(model, out_dir / "per_expert")
        save_hf_checkpoint(model, out_dir / "fused", expert_layout="fused")
    expert = model.model.layers[0].mlp.experts.gate_up_proj
    r["placements"] = (tuple(expert.placements), tuple(expert._local_tensor.shape))
    r["hf_load"] = [n for n, t in _full(model).items() if not torch.equal(t, expected[n])]
    r["state_load"] = [n for n, t in _full(from_state).items() if not torch.equal(t, expected[n])]
    if rank0:
        r["gather"] = sorted(gathered) == sorted(expected) and all(
            torch.equal(gathered[k], expected[k]) for k in expected
        )
        for layout in LAYOUTS:
            loaded = transformers.AutoModelForCausalLM.from_pretrained(out_dir / layout).state_dict()
            r[layout] = all(torch.equal(v, expected[k]) for k, v in loaded.items())
    # a step, then the optimizer saved at expert_parallel=2 and loaded at 1, 2 and 4
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, hf)
    save_hf_checkpoint(model, out_dir / "step1")
    with nccl_rules() as rules:
        save_optimizer(model, opt, out_dir / "step1")
    weights, state = _full(model), _state(opt, model)
    r["every_expert_stepped"] = bool(
        (state["model.layers.0.mlp.experts.down_proj.exp_avg"].flatten(1) != 0).any(1).all()
    )
    for degree in (1, 2, 4) if experts % 4 == 0 else (1, 2):
        fresh = _model(hf, degree)
        load_hf_checkpoint(fresh, out_dir / "step1", device=CPU, strict=True)
        fresh.init_buffers("cpu")
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        load_optimizer(fresh, fresh_opt, out_dir / "step1", device="cpu")
        same = all(torch.equal(t, weights[n]) for n, t in _full(fresh).items())
        r[f"resumed_at_{degree}"] = same and all(torch.equal(t, state[k]) for k, t in _state(fresh_opt, fresh).items())
        if degree == 2:
            r["next_loss_bitwise"] = _step(fresh, fresh_opt, hf) == _step(model, opt, hf)
    return r


def _dcp_round_trip(out: str) -> dict[str, bool]:
    """A step at expert_parallel=2, saved in the DCP format (checkpoint_format=dcp), loaded at 1, 2 and 4
    (1 and 2 for 6 experts): every param and AdamW moment equal torch's gather of the saved ones."""
    from shardtune.checkpoint.formats.dcp_format import load_dcp, save_dcp
    from tests.unit.test_models_moe import hf_moe_model

    res = {}
    for experts in (8, 6):
        hf = hf_moe_model("qwen3_moe", num_experts=experts, **SMALL)
        model = _model(hf, 2)
        load_from_full_model_state_dict(model, hf.state_dict() if dist.get_rank() == 0 else {}, "cpu", strict=True)
        model.init_buffers("cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, opt, hf)
        with nccl_rules():
            save_dcp(model, opt, Path(out) / f"dcp_{experts}", async_save=False)
        weights, state = _full(model), _state(opt, model)
        for degree in (1, 2, 4) if experts % 4 == 0 else (1, 2):
            fresh = _model(hf, degree)
            fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
            load_dcp(fresh, fresh_opt, Path(out) / f"dcp_{experts}", device="cpu")
            same = all(torch.equal(t, weights[n]) for n, t in _full(fresh).items())
            res[f"{experts}_at_{degree}"] = same and all(
                torch.equal(t, state[k]) for k, t in _state(fresh_opt, fresh).items()
            )
    return res


def _low_bit_refused() -> dict[str, str]:
    """What building shardtune's low-bit AdamW, and gathering a torchao AdamW8bit's state, raised with EP."""
    from torchao.optim import AdamW8bit

    from shardtune.state_dict import get_full_optimizer_state_dict
    from shardtune.training.optim import build_optimizer
    from tests.unit.test_models_moe import hf_moe_model

    hf = hf_moe_model("qwen3_moe", **SMALL)
    model = from_hf_config(hf.config.to_dict())
    shard_model(model, mesh=make_mesh(expert_parallel=2))
    raised = {}
    for what, call in (
        ("build", lambda: build_optimizer(model, name="adamw8bit", lr=1e-3)),
        ("state", lambda: get_full_optimizer_state_dict(model, AdamW8bit(model.parameters()), dist.get_rank() == 0)),
    ):
        try:
            call()
            raised[what] = ""
        except Exception as exc:  # noqa: BLE001 - reported to the test
            raised[what] = f"{type(exc).__name__}: {exc}"
    return raised


def _all(out: str) -> dict:
    cases = {case: _round_trip(case, out) for case in PLACEMENTS}
    return cases | {"dcp": _dcp_round_trip(out), "low_bit": _low_bit_refused()}


def test_expert_parallel_checkpoints_load_save_and_resume_every_expert(pool4, tmp_path):
    for rank, r in enumerate(pool4.run_ok(_all, str(tmp_path), timeout=280)):
        for case, placement in PLACEMENTS.items():
            got = r[case]
            resumed = {f"resumed_at_{d}" for d in ((1, 2) if case == "6" else (1, 2, 4))}
            checked = {"every_expert_stepped", "next_loss_bitwise", *resumed} | (
                {"gather", *LAYOUTS} if rank == 0 else set()
            )
            assert set(got) == {"placements", "hf_load", "state_load", *checked}, (rank, sorted(got))
            assert got.pop("placements") == placement, got
            assert got.pop("hf_load") == [] and got.pop("state_load") == [], got
            assert all(v is True for v in got.values()), (case, got)
        assert r["dcp"] == {k: True for k in ("8_at_1", "8_at_2", "8_at_4", "6_at_1", "6_at_2")}, r["dcp"]
        build, state = r["low_bit"]["build"], r["low_bit"]["state"]
        assert build.startswith("ValueError: optimizer.name=adamw8bit does not run with expert_parallel > 1"), build
        assert state.startswith("StateDictError") and "state does not support expert_parallel > 1" in state, state
        assert all(
            "set optimizer.name=adamw or expert_parallel=1" in m or "use optimizer.name=adamw" in m
            for m in (build, state)
        )


def test_qwen3_5_moe_expert_parallel_checkpoint_loads_saves_and_resumes_on_2_ranks(pool2, tmp_path):
    """The round trip above for Qwen3.5-MoE (hybrid layers, a shared expert, 6 experts) at expert_parallel=2
    on 2 ranks, resumed at 1 and 2."""
    for rank, r in enumerate(pool2.run_ok(_round_trip, "qwen3_5_moe_text", str(tmp_path), timeout=280)):
        checked = {"every_expert_stepped", "next_loss_bitwise", "resumed_at_1", "resumed_at_2"}
        assert set(r) == {"placements", "hf_load", "state_load", *checked, *(("gather", *LAYOUTS) if rank == 0 else ())}
        assert r.pop("placements") == (STRIDED, (3, 48, 64)), r
        assert r.pop("hf_load") == [] and r.pop("state_load") == [], r
        assert all(v is True for v in r.values()), r
