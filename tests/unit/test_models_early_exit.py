"""Early-exit hidden states (vs transformers) and layer dropout schedules/behaviour."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from shardtune.models import LlamaForCausalLM, ModelArgs, layer_dropout_probs, llama_from_hf_config

VOCAB = 128
N_LAYERS = 4


def _hf_and_ours():
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=N_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.2 * noise)
    hf.eval()
    ours = llama_from_hf_config(cfg.to_dict()).eval()
    ours.load_state_dict(hf.state_dict(), strict=True)
    return hf, ours


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def test_hidden_states_match_hf_output_hidden_states():
    hf, ours = _hf_and_ours()
    x = _tokens()
    with torch.no_grad():
        ref = hf(x, output_hidden_states=True)
        logits, hidden = ours(x, output_hidden_states=[0, 2, N_LAYERS - 1])
    assert sorted(hidden) == [0, 2, N_LAYERS - 1]
    torch.testing.assert_close(logits, ref.logits, atol=1e-4, rtol=0)
    # HF: hidden_states[0] is the embedding, [i + 1] the output of layer i; the last one is normed.
    torch.testing.assert_close(hidden[0], ref.hidden_states[1], atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden[2], ref.hidden_states[3], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.model.norm(hidden[N_LAYERS - 1]), ref.hidden_states[-1], atol=1e-5, rtol=0)
    assert (hidden[0] - hidden[2]).abs().max() > 1e-2


def test_early_exit_logits_helpers_agree():
    hf, ours = _hf_and_ours()
    x = _tokens()
    with torch.no_grad():
        ref = hf(x, output_hidden_states=True)
        _, hidden = ours(x, output_hidden_states=[1])
        _, exit_logits = ours(x, output_hidden_states=[1, N_LAYERS - 1], hidden_to_logits=True)
    expected = hf.lm_head(hf.model.norm(ref.hidden_states[2]))
    torch.testing.assert_close(ours.logits_from_hidden(hidden[1]), expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(exit_logits[1], expected, atol=1e-4, rtol=0)
    torch.testing.assert_close(exit_logits[N_LAYERS - 1], ref.logits, atol=1e-4, rtol=0)


def test_bad_hidden_state_ids_raise():
    _, ours = _hf_and_ours()
    with pytest.raises(ValueError, match=r"\[4\]"):
        ours(_tokens(), output_hidden_states=[1, N_LAYERS])


def test_layer_dropout_schedule_values():
    assert layer_dropout_probs(5, max_prob=0.4, schedule="uniform") == [0.4] * 5
    assert layer_dropout_probs(5, max_prob=0.4, schedule="linear") == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    expo = [0.4 * (2 ** (i / 4) - 1) for i in range(5)]
    assert layer_dropout_probs(5, max_prob=0.4, schedule="exponential") == pytest.approx(expo)
    assert layer_dropout_probs(5, max_prob=0.4, schedule="linear", layers="2:") == pytest.approx(
        [0.0, 0.0, 0.2, 0.3, 0.4]
    )
    assert layer_dropout_probs(5, max_prob=0.4, layers=[1, 3]) == [0.0, 0.4, 0.0, 0.4, 0.0]
    assert layer_dropout_probs(5, max_prob=0.4, layers=":-1:2") == [0.4, 0.0, 0.4, 0.0, 0.0]
    assert layer_dropout_probs(1, max_prob=0.3, schedule="linear") == [0.3]
    with pytest.raises(ValueError, match="schedule"):
        layer_dropout_probs(5, max_prob=0.4, schedule="cosine")
    with pytest.raises(ValueError, match="max_prob"):
        layer_dropout_probs(5, max_prob=1.5)
    with pytest.raises(ValueError, match=r"\[7\]"):
        layer_dropout_probs(5, max_prob=0.5, layers=[7])


def _count_layer_calls(model: LlamaForCausalLM, n_forwards: int, x: torch.Tensor) -> list[int]:
    counts = [0] * len(model.model.layers)
    handles = [
        layer.register_forward_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        for _ in range(n_forwards):
            model(x)
    for h in handles:
        h.remove()
    return counts


def _micro_model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=VOCAB, dim=16, n_layers=5, n_heads=2, intermediate_size=32)
    return LlamaForCausalLM(args)


def test_layer_dropout_is_off_in_eval_and_follows_schedule_in_train():
    model = _micro_model()
    x = _tokens()[:, :4]
    probs = model.set_layer_dropout(max_prob=1.0, schedule="linear")
    assert probs == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    model.eval()
    assert _count_layer_calls(model, 10, x) == [10] * 5
    model.train()
    torch.manual_seed(123)
    counts = _count_layer_calls(model, 400, x)
    assert counts[0] == 400 and counts[-1] == 0
    for i, p in enumerate(probs):
        # 400 Bernoulli draws: 5 standard deviations is at most 50 calls.
        assert abs(counts[i] - 400 * (1 - p)) <= 5 * math.sqrt(400 * p * (1 - p)) + 1e-9, (i, counts)


def test_all_layers_dropped_passes_embeddings_through():
    model = _micro_model()
    x = _tokens()[:, :4]
    model.set_layer_dropout(max_prob=1.0, schedule="uniform")
    model.train()
    with torch.no_grad():
        logits = model(x)
        expected = model.lm_head(model.model.norm(model.model.embed_tokens(x)))
        torch.testing.assert_close(logits, expected)
        model.eval()
        assert (model(x) - expected).abs().max() > 1e-3


def test_layer_dropout_is_reproducible_under_seed_and_generator():
    model = _micro_model()
    x = _tokens()[:, :4]
    model.set_layer_dropout(max_prob=0.5)
    model.train()

    def run(seed: int) -> list[torch.Tensor]:
        torch.manual_seed(seed)
        with torch.no_grad():
            return [model(x) for _ in range(6)]

    a, b, c = run(7), run(7), run(8)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert not all(torch.equal(u, v) for u, v in zip(a, c))

    gen = torch.Generator().manual_seed(3)
    model.set_layer_dropout(max_prob=0.5, generator=gen)
    state = torch.get_rng_state()
    with torch.no_grad():
        first = [model(x) for _ in range(6)]
    assert torch.equal(torch.get_rng_state(), state)  # the private generator is used, not the global one
    gen.manual_seed(3)
    with torch.no_grad():
        again = [model(x) for _ in range(6)]
    assert all(torch.equal(u, v) for u, v in zip(first, again))

    model.set_layer_dropout(max_prob=0.0)
    assert model.model.layer_dropout_probs is None
