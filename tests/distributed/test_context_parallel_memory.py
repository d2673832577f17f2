"""What context parallel saves of a rank's activation memory, measured: the bytes autograd keeps for backward
in one forward of a long row (every tensor saved for backward, counted once per storage, the weights left
out), with ``torch.autograd.graph.saved_tensors_hooks``, in one process on the whole row and on each of 2
gloo ranks on its half.

Measured: everything but the attention masks halves (the gathered keys and values, the whole row's, are the
part that does not). The masks do not: a segment that starts after earlier keys attends through a boolean
mask of its queries times its keys, which SDPA keeps for backward (as float on CPU), ``S / (2 cp) x S``
per segment and layer, where the whole row's causal kernel keeps none. At 1024 tokens on the tiny model they
already outweigh the halving; a kernel that takes lower-right causal attention without a mask (a log-sum-exp
merge of a prefix and a diagonal block, or a ring) removes them; until then the whole-budget test is a
strict xfail that turns into a failure when the masks go."""

from __future__ import annotations

import pytest
import torch

from shardtune.models import from_hf_config
from shardtune.models.chunked_loss import chunked_cross_entropy
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


def test_cp2_halves_every_activation_but_the_masks(measured):
    whole, halves = measured
    assert whole["masks"] == 0  # the whole row: SDPA's causal kernel, no mask
    ratios = [half["rest"] / whole["rest"] for half in halves]
    print(f"saved for backward, bytes: whole row {whole}, cp 2 ranks {halves}")
    assert all(0.45 <= r <= 0.6 for r in ratios), ratios
    heads_q = SEQ // 4  # every segment: a quarter of the row's queries (cp 2: chunks of S / 4)
    assert all(0 < half["masks"] <= 2 * 3 * heads_q * SEQ * 4 for half in halves)  # <= 2 segments x 3 layers


@pytest.mark.xfail(strict=True, reason="segment masks are kept for backward: O(S^2 / (2 cp)) per layer")
def test_cp2_keeps_about_half_the_activation_memory_of_one_rank(measured):
    whole, halves = measured
    ratios = [sum(half.values()) / sum(whole.values()) for half in halves]
    assert all(r <= 0.6 for r in ratios), ratios
