"""The validation loss on 2 ranks against a single-process unsharded model over the whole set."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.data import collate
from shardtune.losses.chunked import chunked_cross_entropy
from shardtune.models import build_model, get_model_args
from shardtune.ranks.sharding import shard_model
from shardtune.state_dict import load_from_full_model_state_dict
from shardtune.training.evaluate import Evaluator

pytestmark = pytest.mark.timeout(180)


def _samples(n: int) -> list[dict]:
    vocab = get_model_args("tiny").vocab_size
    gen = torch.Generator().manual_seed(3)
    out = []
    for i in range(n):
        tokens = torch.randint(1, vocab, (4 + 3 * (i % 4),), generator=gen).tolist()
        out.append({"tokens": tokens, "labels": [-100, -100, *tokens[2:]]})
    return out


def _val_loss_on_ranks(n: int, batch_size: int):
    torch.manual_seed(0)
    reference = build_model("tiny", dtype=torch.float32)
    with torch.device("meta"):
        model = build_model("tiny", dtype=torch.float32)
    shard_model(model)
    load_from_full_model_state_dict(model, reference.state_dict(), "cpu", strict=True)
    model.init_buffers("cpu")
    forwards = []

    def loss_sum(batch):
        forwards.append(1)
        labels = batch["labels"]
        head_loss = lambda h, head: chunked_cross_entropy(h[:, :-1], head, labels[:, 1:], chunk_tokens=8)  # noqa: E731
        return model(batch["tokens"], head_loss=head_loss), int((labels[:, 1:] != -100).sum())

    evaluator = Evaluator(
        _samples(n), batch_size=batch_size, collate_fn=lambda b: collate(b, pad_id=0), loss_sum=loss_sum
    )
    model.train()
    got = evaluator(model)
    # the reference: every sample once, alone, in one process
    total, tokens = 0.0, 0
    with torch.no_grad():
        for sample in _samples(n):
            logits = reference(torch.tensor([sample["tokens"]]))[0, :-1]
            labels = torch.tensor(sample["labels"][1:])
            total += F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum").item()
            tokens += int((labels != -100).sum())
    return {
        "got": got,
        "want": total / tokens,
        "forwards": len(forwards),
        "training": model.training,
        "rank": dist.get_rank(),
    }


@pytest.mark.parametrize(("n", "batch_size"), [(7, 2), (1, 4)])  # uneven shares; one rank with no sample
def test_validation_loss_is_the_token_mean_over_every_sample_once(pool2, n, batch_size):
    results = pool2.run_ok(_val_loss_on_ranks, n, batch_size)
    for r in results:
        assert r["got"] == pytest.approx(r["want"], rel=1e-5)
        assert r["training"]  # left in the mode it had
    assert results[0]["got"] == results[1]["got"]
    assert results[0]["forwards"] == results[1]["forwards"]  # FSDP's all-gathers stay in step
