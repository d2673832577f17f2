"""What context parallel saves of a rank's activation memory, measured: the bytes autograd keeps for backward
in one forward of a long row (every tensor saved for backward, counted once per storage, the weights left
out), with ``torch.autograd.graph.saved_tensors_hooks``, in one process on the whole row and on each of 2
gloo ranks on its half.

A segment that starts after earlier keys attends without a mask (its prefix and its causal diagonal merged
by log-sum-exp, :mod:`shardtune.models.lse_attention`), so no ``queries x keys`` mask is kept per layer (SDPA
would keep it, as float on CPU: with masks a rank kept ~75% of the whole row's bytes at 1024 tokens). What
stays is about half: a rank's ``S / 2`` tokens plus the gathered keys and values (the whole row's, the part
that does not halve; its share falls as the hidden size grows over the kv width)."""

from __future__ import annotations

import pytest
import torch

from shardtune.losses.chunked import chunked_cross_entropy
from shardtune.models import from_hf_config
from shardtune.models.context_parallel import context_group, split_batch

pytestmark = pytest.mark.timeout(300)

SEQ = 1024
NAME = "qwen3"  # 4 query heads: a saved [1, 1, q, k] tensor is a mask broadcast over heads


def _saved_bytes(name: str, cp: int) -> dict[str, int]:
    """Bytes saved for backward by one forward of a ``SEQ``-token row (split over ``cp`` gloo ranks when > 1):
    the attention masks' and the rest's."""
    from tests.unit.test_models_families import VOCAB, hf_model

    hf = hf_model(name)
    model = from_hf_config(hf.config.to_dict()).train()
    model.load_state_dict(hf.state_dict(), strict=True)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    head_dim = hf.config.head_dim
    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(0))
    storages: dict[int, tuple[str, int]] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            # [1, 1, queries, keys]: broadcast over heads, not rope's [1, 1, tokens, head_dim]
            is_mask = tensor.dim() == 4 and tensor.shape[1] == 1 and tensor.shape[3] not in (1, head_dim)
            storages[storage.data_ptr()] = ("masks" if is_mask else "rest", storage.nbytes())
        return tensor

    forward: dict = {}
    targets = tokens.roll(-1, 1)
    if cp > 1:
        part = split_batch(tokens, tokens, group=context_group(cp, device="cpu"))
        tokens, targets = part.tokens, part.targets
        forward = {"position_ids": part.position_ids, "context": part.shard}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens, head_loss=lambda h, head: chunked_cross_entropy(h, head, targets), **forward)
    loss.backward()
    totals = {"masks": 0, "rest": 0}
    for kind, nbytes in storages.values():
        totals[kind] += nbytes
    return totals


@pytest.fixture(scope="module")
def measured(pool2) -> tuple[dict[str, int], list[dict[str, int]]]:
    return _saved_bytes(NAME, 1), pool2.run_ok(_saved_bytes, NAME, 2, timeout=240)


def test_cp2_keeps_about_half_the_activation_memory_of_one_rank(measured):
    whole, halves = measured
    print(f"saved for backward, bytes: whole row {whole}, cp 2 ranks {halves}")
    assert whole["masks"] == 0 and all(half["masks"] == 0 for half in halves)  # no [1, 1, q, k] kept
    ratios = [sum(half.values()) / sum(whole.values()) for half in halves]
    assert all(0.45 <= r <= 0.65 for r in ratios), ratios  # measured 0.58 and 0.60
