"""Aux-loss-free balancing (``router_bias_update_rate``) on 2 gloo ranks with the experts split over them
(``expert_parallel=2``): after two steps of the training loop every rank holds the same correction biases,
equal to one process's on the same global batches (the loads summed over ranks are the loads of one process),
and balancing adds no collective to the loop's (NCCL's rules checked, collectives counted with it off and on)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardtune.data import collate
from shardtune.data.sampler import build_dataloader
from shardtune.losses.next_token import next_token_loss
from shardtune.models import build_model, get_model_args
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training import load_from_full_model_state_dict
from shardtune.training.loop import LoopSettings, Training, run_training
from tests.distributed.test_loop_nccl_rules import _Hosted, _Rows
from tests.nccl_rules import nccl_rules
from tests.unit.checkpointer_stubs import NoCheckpoints

pytestmark = pytest.mark.timeout(240)

PRESET, ACCUMULATE, BATCH, STEPS, RATE = "tiny_glm4_moe", 2, 2, 2, 2.0**-6


def _samples() -> list[dict]:
    vocab = get_model_args(PRESET).vocab_size
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(16):
        tokens = torch.randint(1, vocab, (6 + 5 * (i % 3),), generator=gen).tolist()
        out.append({"tokens": tokens, "labels": [-100, *tokens[1:]]})
    return out


def _reference_sd() -> dict[str, torch.Tensor]:
    torch.manual_seed(3)
    model = build_model(PRESET, dtype=torch.float32)
    with torch.no_grad():  # a random correction bias, so the first loads are not transformers' init's
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return model.state_dict()


def _biases(model) -> list[torch.Tensor]:
    return [layer.mlp.gate.e_score_correction_bias.clone() for layer in model.model.layers[1:]]


def _train(model, *, rank: int, world: int, accumulate: int, rate: float, rules=None) -> None:
    loader, sampler = build_dataloader(
        _samples(),
        batch_size=BATCH,
        rank=rank,
        world_size=world,
        seed=0,
        shuffle=False,
        collate_fn=lambda b: collate(b, pad_id=0),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # frozen weights: only the biases move
    settings = LoopSettings(
        epochs=1, gradient_accumulation_steps=accumulate, max_steps_per_epoch=STEPS, router_bias_update_rate=rate
    )
    run_training(
        Training(
            model=model,
            loader=loader if rules is None else _Hosted(loader, rules),
            sampler=sampler,
            optimizer=opt,
            lr_scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0),
            checkpointer=NoCheckpoints(),
        ),
        loss_fn=next_token_loss(model, device=torch.device("cpu")),
        logger=_Rows(),
        settings=settings,
    )


def _two_ranks() -> dict:
    out = {}
    for rate in (0.0, RATE):
        with torch.device("meta"):
            model = build_model(PRESET, dtype=torch.float32)
        shard_model(model, mesh=make_mesh(expert_parallel=2))
        load_from_full_model_state_dict(model, _reference_sd(), "cpu", strict=True)
        model.init_buffers("cpu")
        with nccl_rules() as rules:
            _train(model, rank=dist.get_rank(), world=2, accumulate=ACCUMULATE, rate=rate, rules=rules)
        out[rate] = {"biases": _biases(model), "counts": dict(rules.counts)}
    return out


def test_every_rank_moves_the_biases_as_one_process_does_with_no_collective_added(pool2):
    ranks = pool2.run_ok(_two_ranks)
    single = build_model(PRESET, dtype=torch.float32)
    single.load_state_dict(_reference_sd())
    start = _biases(single)
    # one process: the same global batches (2 ranks x ACCUMULATE micro-batches a step)
    _train(single, rank=0, world=1, accumulate=2 * ACCUMULATE, rate=RATE)
    expected = _biases(single)
    assert any(not torch.equal(e, s) for e, s in zip(expected, start, strict=True))
    for r in ranks:
        assert all(torch.equal(b, s) for b, s in zip(r[0.0]["biases"], start, strict=True))  # off: as loaded
        assert all(torch.equal(b, e) for b, e in zip(r[RATE]["biases"], expected, strict=True))
        assert r[RATE]["counts"] == r[0.0]["counts"]
