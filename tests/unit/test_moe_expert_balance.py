"""The loop logs each step's expert balance: ``tokens_per_expert_min/max/mean`` over the experts of every
sparse layer, of the real tokens of all micro-batches, against transformers' router logits."""

from __future__ import annotations

import torch

from shardtune.losses.next_token import next_token_loss
from tests.unit.test_loop_scaling import _one_step
from tests.unit.test_models_moe import batch, hf_moe_model, ours_from


def _batches() -> list[dict[str, torch.Tensor]]:
    out = []
    for seed in (1, 2):
        tokens, mask, labels = batch(seed=seed)
        out.append({"tokens": tokens, "labels": labels, "attention_mask": mask})
    return out


def _expected(hf, batches) -> torch.Tensor:
    """transformers' top-k choices of every real token, counted per sparse layer and expert."""
    counts = None
    for b in batches:
        out = hf(b["tokens"], attention_mask=b["attention_mask"], output_router_logits=True)
        real = b["attention_mask"].reshape(-1).bool()
        layers = [logits for logits in out.router_logits if logits is not None]
        chosen = [logits[real].topk(hf.config.num_experts_per_tok, dim=-1).indices.reshape(-1) for logits in layers]
        per_layer = torch.stack([torch.bincount(c, minlength=hf.config.num_experts) for c in chosen]).double()
        counts = per_layer if counts is None else counts + per_layer
    assert counts is not None
    return counts


def test_step_logs_tokens_per_expert_min_max_mean():
    hf = hf_moe_model("qwen3_moe")
    model, batches = ours_from(hf), _batches()
    expected = _expected(hf, batches)
    loss_fn = next_token_loss(model, device=torch.device("cpu"))
    rows = _one_step(model, batches, loss_fn=loss_fn, accumulate=len(batches))
    row = rows.rows[0]
    assert expected.min() < expected.max()  # the tiny router is unbalanced: min and max differ
    assert row["tokens_per_expert_min"] == expected.min().item()
    assert row["tokens_per_expert_max"] == expected.max().item()
    assert abs(row["tokens_per_expert_mean"] - expected.mean().item()) < 1e-9
    assert "aux_loss" in row and "tokens_per_expert" not in row
