"""Model FLOPs per token against the shape formula, written out by hand."""

from __future__ import annotations

import pytest
import torch

from shardtune.models import build_model, get_model_args
from shardtune.peft import apply_lora
from shardtune.training.flops import flops_per_token_fn, peak_tflops, rank_batch_flops


def _hand_weights(args, *, head: bool = True) -> int:
    d, h, kv, hd, inter, v = (
        args.dim,
        args.n_heads,
        args.n_kv_heads,
        args.head_dim,
        args.intermediate_size,
        args.vocab_size,
    )
    attention = d * h * hd + 2 * d * kv * hd + h * hd * d
    layer = attention + 3 * d * inter + 2 * d  # q, k, v, o; gate, up, down; two norms
    return args.n_layers * layer + d + (v * d if head else 0)  # final norm, output head


@pytest.mark.parametrize("tied", [False, True])
def test_full_fine_tuning_is_6n_plus_attention(tied):
    args = get_model_args("tiny").replace(tie_word_embeddings=tied)
    with torch.device("meta"):
        model = build_model(args)
    n = _hand_weights(args)  # a tied head still multiplies: counted once, the lookup not at all
    attention = 12 * args.n_layers * args.n_heads * args.head_dim
    assert flops_per_token_fn(model)(128) == 6 * n + attention * 128


def test_lora_base_weights_get_no_weight_gradient_flops():
    args = get_model_args("tiny")
    with torch.device("meta"):
        model = build_model(args)
        apply_lora(model, rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"])
    per_layer_lora = 4 * (args.dim + args.n_heads * args.head_dim) + 4 * (args.dim + args.n_kv_heads * args.head_dim)
    lora = args.n_layers * per_layer_lora
    n = _hand_weights(args) + lora
    attention = 12 * args.n_layers * args.n_heads * args.head_dim
    assert flops_per_token_fn(model)(64) == 4 * n + 2 * lora + attention * 64


def test_peak_is_configured_or_unknown_off_gpu():
    assert peak_tflops(torch.device("cpu"), configured=None) is None
    assert peak_tflops(torch.device("cpu"), configured=123.0) == 123.0


@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_counts_each_ranks_part_of_the_rows(cp):
    """A rank of a ``cp`` group counts its ``1 / cp`` of the padded rows, whose queries see the whole row,
    so the group together counts each row once (the loop used to count the whole batch on every rank)."""
    args = get_model_args("tiny")
    with torch.device("meta"):
        model = build_model(args)
    per_token = flops_per_token_fn(model)
    six_n = 6 * _hand_weights(args)
    attention = 12 * args.n_layers * args.n_heads * args.head_dim
    rows, seq = 3, 61  # 61 tokens: cp 2 pads to 64 (32 a rank), cp 4 to 64 (16 a rank)
    assert rank_batch_flops(per_token, rows, seq) == rows * seq * (six_n + attention * seq)
    mine = rank_batch_flops(per_token, rows, seq, context_parallel=cp)
    assert mine == rows * (64 // cp) * (six_n + attention * 64)
    assert cp * mine == rank_batch_flops(per_token, rows, 64)  # the group: the padded rows once
