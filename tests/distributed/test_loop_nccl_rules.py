"""One optimizer step of the training loop on 2 ranks obeys NCCL's rules (tests/nccl_rules.py)
and logs the loss and grad norm a single process computes on the same global batch."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.data import collate
from shardtune.data.sampler import build_dataloader
from shardtune.losses.next_token import next_token_loss
from shardtune.models import build_model, get_model_args
from shardtune.ranks.sharding import shard_model
from shardtune.recipes import builders
from shardtune.training import load_from_full_model_state_dict
from shardtune.training.loop import LoopSettings, Training, run_training
from tests.nccl_rules import nccl_rules
from tests.unit.checkpointer_stubs import NoCheckpoints

pytestmark = pytest.mark.timeout(240)

ACCUMULATE, BATCH, SEED = 2, 2, 5


def _samples() -> list[dict]:
    vocab = get_model_args("tiny").vocab_size
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        tokens = torch.randint(1, vocab, (5 + 3 * (i % 3),), generator=gen).tolist()
        out.append({"tokens": tokens, "labels": [-100, *tokens[1:]]})
    return out


def _reference() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return build_model("tiny", dtype=torch.float32)


class _Hosted:
    """The loader, with every batch registered as host memory (pinned CPU memory on a GPU run)."""

    def __init__(self, loader, rules) -> None:
        self.loader, self.rules = loader, rules

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.rules.host(batch)
            yield batch


class _Rows(list):
    def log(self, row) -> None:
        self.append(row)


def _one_step_under_nccl_rules():
    full_sd = _reference().state_dict()
    with torch.device("meta"):
        model = build_model("tiny", dtype=torch.float32)
    shard_model(model)
    load_from_full_model_state_dict(model, full_sd, "cpu", strict=True)
    model.init_buffers("cpu")
    rank = dist.get_rank()
    run = builders.Run(rank=rank, world_size=2, device=torch.device("cpu"), dtype=torch.float32)
    loader, sampler = build_dataloader(
        _samples(),
        batch_size=BATCH,
        rank=rank,
        world_size=2,
        seed=0,
        shuffle=False,
        collate_fn=lambda b: collate(b, pad_id=0),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    rows = _Rows()
    settings = LoopSettings(epochs=1, gradient_accumulation_steps=ACCUMULATE, max_steps_per_epoch=1, clip_grad_norm=1e9)
    with nccl_rules() as rules:
        run_training(
            Training(
                model=model,
                loader=_Hosted(loader, rules),
                sampler=sampler,
                optimizer=opt,
                lr_scheduler=sched,
                checkpointer=NoCheckpoints(),
            ),
            loss_fn=next_token_loss(model, device=run.device),
            logger=rows,
            settings=settings,
        )
    return {"rows": rows, "counts": dict(rules.counts)}


def test_one_training_step_obeys_nccl_rules_and_logs_the_single_process_loss(pool2):
    res = pool2.run_ok(_one_step_under_nccl_rules)
    # Independent reference: one process, the global batch (both ranks' micro-batches), summed
    # per-token cross-entropy over all its label tokens.
    reference = _reference()
    samples = _samples()[: 2 * ACCUMULATE * BATCH]
    total = torch.zeros(())
    tokens = 0
    for sample in samples:
        batch = collate([sample], pad_id=0)
        logits, labels = reference(batch["tokens"])[:, :-1], batch["labels"][:, 1:]
        total = total + F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        tokens += int((labels != -100).sum())
    (total / tokens).backward()
    grad_norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in reference.parameters() if p.grad is not None])
    )
    for r in res:
        assert r["counts"].get("all_reduce", 0) >= 1  # the step's [loss, tokens] reduce, checked by the rules
        assert not any(kind in r["counts"] for kind in ("send", "recv"))
    (row,) = res[0]["rows"]
    assert row["loss"] == pytest.approx(total.item() / tokens, rel=1e-5)
    assert row["grad_norm"] == pytest.approx(grad_norm.item(), rel=1e-4)
