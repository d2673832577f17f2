"""The ``model`` key names the preset that creates a missing base; a model in ``checkpoint_dir`` wins.

Setup-level (no training run): ``base_model_dir`` then ``build_model`` on 2 gloo ranks, checked
against the shapes written by hand into ``config.json`` and the ``tiny`` preset's published shape.
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.distributed as dist

from shardtune.checkpoint.formats.tiny_base import create_tiny_base
from shardtune.config import Config
from shardtune.recipes import builders as setup

pytestmark = pytest.mark.timeout(120)

# A Llama shape unlike the tiny preset's (hidden 256, 4 layers, 8 heads, 4 kv, intermediate 768, vocab 256).
SMALL = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 128,
}


def _small_model_dir(path):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_act": "silu", **SMALL}))
    return path


def _setup_on_rank(checkpoint_dir: str, preset: str | None, key: str, preset_key: str, output_dir: str):
    keys = {key: checkpoint_dir, preset_key: preset}
    from shardtune.config import REQUIRED, Field
    from shardtune.recipes.schemas import BASE_SCHEMA

    defaults = {
        n: f.default for n, f in BASE_SCHEMA.fields.items() if isinstance(f, Field) and f.default is not REQUIRED
    }
    cfg = Config({**defaults, "output_dir": output_dir, **keys, "enable_activation_checkpointing": False})
    rank, world = dist.get_rank(), dist.get_world_size()
    run = setup.Run(rank=rank, world_size=world, device=torch.device("cpu"), dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        base_dir = setup.base_model_dir(cfg, run, key=key, preset_key=preset_key)
        model = setup.build_model(base_dir, run, cfg)
    q = model.model.layers[0].self_attn.q_proj.weight
    shape = {
        "hidden_size": model.model.embed_tokens.weight.shape[1],
        "num_hidden_layers": len(model.model.layers),
        "vocab_size": model.lm_head.weight.shape[0],
        "q_rows": q.shape[0],
        "intermediate_size": model.model.layers[0].mlp.up_proj.weight.shape[0],
    }
    return {"warnings": [str(w.message) for w in caught if issubclass(w.category, UserWarning)], "shape": shape}


@pytest.mark.parametrize(
    ("key", "preset_key"), [("checkpoint_dir", "model"), ("teacher_checkpoint_dir", "teacher_model")]
)
def test_a_preset_of_another_shape_warns_on_rank0_and_the_checkpoint_trains(pool2, tmp_path, key, preset_key):
    small = _small_model_dir(tmp_path / "small")
    rank0, rank1 = pool2.run_ok(_setup_on_rank, str(small), "tiny", key, preset_key, str(tmp_path / "out"))
    for result in (rank0, rank1):
        assert result["shape"] == {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "vocab_size": 128,
            "q_rows": 64,
            "intermediate_size": 128,
        }
    assert rank1["warnings"] == []
    (message,) = rank0["warnings"]
    assert f"{preset_key}=tiny (hidden size 256, 4 layers, 8 heads (4 kv), intermediate size 768, vocab 256)" in message
    assert f"{key}={small} (hidden size 64, 2 layers, 4 heads (2 kv), intermediate size 128, vocab 128)" in message
    assert f"drop {preset_key}" in message and f"point {key} at another directory" in message


@pytest.mark.parametrize("preset", ["tiny", None])
def test_a_matching_or_null_preset_does_not_warn(pool2, tmp_path, preset):
    base = create_tiny_base(tmp_path / "tiny_base")
    results = pool2.run_ok(_setup_on_rank, str(base), preset, "checkpoint_dir", "model", str(tmp_path / "out"))
    for result in results:
        assert result["warnings"] == []
        assert result["shape"] == {
            "hidden_size": 256,
            "num_hidden_layers": 4,
            "vocab_size": 256,
            "q_rows": 256,
            "intermediate_size": 768,
        }


def test_a_missing_base_is_created_from_the_preset_without_a_warning(pool2, tmp_path):
    results = pool2.run_ok(
        _setup_on_rank, str(tmp_path / "new_base"), "tiny", "checkpoint_dir", "model", str(tmp_path / "out")
    )
    assert (tmp_path / "new_base" / "config.json").is_file()
    for result in results:
        assert result["warnings"] == []
        assert result["shape"]["hidden_size"] == 256 and result["shape"]["num_hidden_layers"] == 4
