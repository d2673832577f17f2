"""clip_grad_norm on FSDP2 (1-D) and HSDP (2-D) meshes against torch's clip_grad_norm_ on the
unsharded single-process model with the same gradients."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardtune.state_dict import load_from_full_model_state_dict
from shardtune.training.grad_norm import clip_grad_norm
from tests.distributed.toy import VOCAB, build_sharded, full_state_dict, reference

pytestmark = pytest.mark.timeout(180)


def _tokens(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(100 + rank))


def _clip_on_ranks(mesh_kind: str, max_norm: float):
    world, rank = dist.get_world_size(), dist.get_rank()
    sd = full_state_dict(tied=False)
    model = build_sharded(mesh_kind=mesh_kind, tied=False)
    load_from_full_model_state_dict(model, sd, "cpu", strict=True)
    model(_tokens(rank)).square().mean().backward()
    norm = clip_grad_norm(model.parameters(), max_norm)
    clipped = {n: p.grad.full_tensor() for n, p in model.named_parameters()}

    ref = reference(sd, tied=False)
    # FSDP averages gradients over ranks: the reference loss is the mean of the ranks' losses
    loss = sum(ref(_tokens(r)).square().mean() for r in range(world)) / world
    loss.backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
    err = max(((clipped[n] - p.grad).abs().max() / p.grad.abs().max()).item() for n, p in ref.named_parameters())
    return norm.item(), want.item(), err


@pytest.mark.parametrize("max_norm", [1e-3, 1e9])  # clipped, and left alone
def test_clip_grad_norm_on_fsdp_equals_torch_on_the_unsharded_model(pool2, max_norm):
    for norm, want, err in pool2.run_ok(_clip_on_ranks, "1d", max_norm):
        assert norm == pytest.approx(want, rel=1e-5)
        assert err < 1e-5


def test_clip_grad_norm_on_hsdp_sums_over_shards_only(pool4):
    for norm, want, err in pool4.run_ok(_clip_on_ranks, "2d", 1e-3):
        assert norm == pytest.approx(want, rel=1e-5)
        assert err < 1e-5
