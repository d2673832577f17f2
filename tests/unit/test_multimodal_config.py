"""The config.json of a multimodal Qwen3.5 checkpoint: its text_config is the model, the rest is written back
as transformers reads it (its ``Qwen3_5Config`` is the oracle)."""

from __future__ import annotations

import pytest

from shardtune.models import model_args_from_hf_config, model_args_to_hf_config

TEXT = {
    "model_type": "qwen3_5_text",
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "layer_types": ["linear_attention", "full_attention"],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "tie_word_embeddings": True,
    # the multimodal rope's sections: text numerics ignore them, the vision positions need them
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.25,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    },
}
MULTIMODAL = {
    "model_type": "qwen3_5",
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "image_token_id": 100,
    "video_token_id": 101,
    "tie_word_embeddings": True,
    "vision_config": {"depth": 1, "hidden_size": 32, "num_heads": 2, "out_hidden_size": 64},
    "text_config": TEXT,
}


def test_the_text_config_is_the_model_and_the_checkpoint_config_is_written_back():
    from transformers.models.qwen3_5 import Qwen3_5Config

    args = model_args_from_hf_config(MULTIMODAL)
    assert args == model_args_from_hf_config(TEXT) and args.multimodal == MULTIMODAL
    written = model_args_to_hf_config(args)
    assert written["model_type"] == "qwen3_5" and written["vision_config"] == MULTIMODAL["vision_config"]
    assert Qwen3_5Config(**written).to_dict() == Qwen3_5Config(**MULTIMODAL).to_dict()
    assert model_args_to_hf_config(model_args_from_hf_config(TEXT))["model_type"] == "qwen3_5_text"  # text stays text


def test_the_outer_tie_word_embeddings_wins():
    untied_text = {**MULTIMODAL, "text_config": {**TEXT, "tie_word_embeddings": False}}
    assert model_args_from_hf_config(untied_text).tie_word_embeddings


@pytest.mark.parametrize(
    "text, words",
    [(None, "needs a text_config object"), ({**TEXT, "model_type": "llama"}, "text_config.model_type is 'llama'")],
)
def test_a_bad_text_config_is_refused(text, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        model_args_from_hf_config({**MULTIMODAL, "text_config": text})
