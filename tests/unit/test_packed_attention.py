"""Packed rows attend within each sample without any ``s x s`` tensor, and equal transformers on each sample alone.

Rows of 256 tokens hold 8 samples each, every one longer than the sliding window (Mistral) so
windows are cut inside samples; Gemma 2 adds attention soft-capping (its eager path). The
reference is transformers (eager attention) run on every sample by itself: packed logits equal
its logits, and packed gradients equal the sum of its per-sample gradients.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils._python_dispatch import TorchDispatchMode

from shardtune.models import sample_lengths
from shardtune.models.packed_attention import check_sample_lengths
from tests.unit.test_models_families import COMMON, FAMILY_CONFIGS, VOCAB, ours_from_hf, randomize_, rel_diff

SEQ = 256
ROWS = [(40, 25, 33, 31, 20, 47, 28, 32), (16, 50, 30, 30, 40, 24, 36, 30)]  # 8 samples per row, each sums to SEQ
CONFIGS = {"llama": (transformers.LlamaConfig, {}), **FAMILY_CONFIGS}
TOL = 1e-5


class RowSquares(TorchDispatchMode):
    """Counts the tensors any op makes (forward and backward) with two dims of at least ``seq``: a
    mask or score matrix over a row's ``seq`` tokens (flattened projections have one such dim)."""

    def __init__(self, seq: int) -> None:
        super().__init__()
        self.seq = seq
        self.found = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and sum(d >= self.seq for d in t.shape) >= 2:
                self.found += 1
        return out


def _hf(name: str):
    cls, kw = CONFIGS[name]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cls(**{**COMMON, **kw}), attn_implementation="eager")
    return randomize_(model, 0).eval()


def _packed_batch():
    # No pad id (0): transformers' Gemma embedding never gives its row a gradient (padding_idx).
    gen = torch.Generator().manual_seed(1)
    samples = [[torch.randint(1, VOCAB, (1, n), generator=gen) for n in row] for row in ROWS]
    batch = torch.cat([torch.cat(row, dim=1) for row in samples])
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in ROWS])
    return samples, batch, positions


@pytest.mark.parametrize("name", ["llama", "mistral", "gemma2"])
def test_packed_forward_and_backward_make_no_s_by_s_tensor_and_equal_transformers_per_sample(name):
    hf = _hf(name)
    ours = ours_from_hf(hf)
    samples, batch, positions = _packed_batch()
    weights = torch.randn(len(ROWS), SEQ, VOCAB, generator=torch.Generator().manual_seed(3))  # reaches every logit
    with RowSquares(SEQ) as packed_run:
        logits = ours(batch, position_ids=positions, sample_lengths=sample_lengths(positions))
        (logits * weights).sum().backward()
    assert packed_run.found == 0

    for r, row in enumerate(samples):
        start = 0
        for sample in row:
            n = sample.shape[1]
            expected = hf(sample).logits
            assert rel_diff(logits[r : r + 1, start : start + n].detach(), expected.detach()) <= TOL
            (expected * weights[r : r + 1, start : start + n]).sum().backward()  # grads add up over samples
            start += n
    hf_grads = dict(hf.named_parameters())
    for key, param in ours.named_parameters():
        assert rel_diff(param.grad, hf_grads[key].grad) <= TOL, key


def test_the_recorder_sees_the_dense_path_s_by_s_tensors():
    """The same rows unpacked: Gemma 2's full layers make soft-capped scores over the whole row."""
    ours = ours_from_hf(_hf("gemma2"))
    _, batch, _ = _packed_batch()
    with RowSquares(SEQ) as dense_run, torch.no_grad():
        ours(batch)
    assert dense_run.found > 0


def test_unpacked_rows_under_a_window_attend_in_bands_without_an_s_by_s_mask():
    """A window shorter than the row: blocks of the window's queries against their keys, equal to transformers
    (which masks the whole row), forward and backward; no s x s tensor."""
    hf = _hf("mistral")
    ours = ours_from_hf(hf)
    _, batch, _ = _packed_batch()
    weights = torch.randn(len(ROWS), SEQ, VOCAB, generator=torch.Generator().manual_seed(3))
    with RowSquares(SEQ) as run:
        logits = ours(batch)
        (logits * weights).sum().backward()
    assert run.found == 0
    expected = hf(batch).logits
    (expected * weights).sum().backward()
    assert rel_diff(logits.detach(), expected.detach()) <= TOL
    hf_grads = dict(hf.named_parameters())
    for key, param in ours.named_parameters():
        assert rel_diff(param.grad, hf_grads[key].grad) <= TOL, key


def test_packed_rows_need_the_positions_only_or_the_lengths_only():
    """Lengths alone make the restarting positions; positions alone give the lengths; both agree."""
    ours = ours_from_hf(_hf("mistral"))
    _, batch, positions = _packed_batch()
    with torch.no_grad():
        both = ours(batch, position_ids=positions, sample_lengths=sample_lengths(positions))
        torch.testing.assert_close(ours(batch, sample_lengths=ROWS), both, atol=0, rtol=0)
        torch.testing.assert_close(ours(batch, position_ids=positions), both, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ([(2, 2)], "has 1 rows but the batch has 2"),
        ([(2, 2), (3, 2)], "row 1 is \\(3, 2\\)"),
        ([(4,), (0, 4)], "row 1"),
    ],
)
def test_sample_lengths_that_do_not_fit_the_batch_are_refused(lengths, message):
    with pytest.raises(ValueError, match=message):
        check_sample_lengths(lengths, batch=2, seq=4)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="torch.compile on CPU needs a C++ compiler"
)
def test_compiled_checkpointed_layers_take_new_packings_without_recompiling():
    """As ``shard_model`` wraps them (checkpoint, then compile): recompute sees the same samples, so
    gradients equal the eager model's, and rows packed differently reuse the compiled layers."""
    hf = _hf("mistral")
    eager, compiled = ours_from_hf(hf), ours_from_hf(hf)
    layers = compiled.model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer)
        layers[i].compile()
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    for stance, rows in (("default", ((30, 20, 14), (64,))), ("fail_on_recompile", ((5, 9, 50), (12, 12, 40)))):
        batch = torch.randint(1, VOCAB, (2, 64), generator=gen)
        grads = []
        for model in (eager, compiled):
            model.zero_grad()
            with torch.compiler.set_stance(stance):
                model(batch, sample_lengths=rows).square().mean().backward()
            grads.append([p.grad for p in model.parameters()])
        for got, want in zip(grads[1], grads[0], strict=True):
            assert rel_diff(got, want) <= TOL
