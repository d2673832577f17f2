"""The tiny demo base models (``model_presets.TINY_PRESETS``) written as HF model directories (config.json,
safetensors, tokenizer), crash-safe as a checkpoint is (:mod:`shardtune.checkpoint.safety.atomic`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from shardtune.checkpoint.safety.atomic import fsync_tree
from shardtune.data.tokenizer import save_byte_tokenizer
from shardtune.model_presets import TINY_PRESETS
from shardtune.models.hf_config import model_args_to_hf_config
from shardtune.models.registry import build_model, get_model_args

TINY_SEED = 1234


def create_tiny_base(directory: str | os.PathLike, *, seed: int = TINY_SEED, preset: str = "tiny") -> Path:
    """Write ``preset`` (one of ``TINY_PRESETS``) with seeded random weights and the byte tokenizer to ``directory``.

    Single process (no collectives). The directory appears complete or not at all: files are
    written to a temporary sibling that is renamed at the end. Experts are written in
    transformers' fused layout (``mlp.experts.gate_up_proj``), which ``from_pretrained`` reads.
    """
    if preset not in TINY_PRESETS:
        raise ValueError(f"preset {preset!r} cannot be created as a tiny base; use one of {list(TINY_PRESETS)}")
    final = Path(directory)
    tmp = final.with_name(f".tmp-{final.name}-{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    args = get_model_args(preset)
    torch.manual_seed(seed)
    model = build_model(args, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if args.tie_word_embeddings:  # one tensor on disk, as transformers writes a tied head
        state.pop("lm_head.weight")
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(model_args_to_hf_config(args, dtype=torch.float32), indent=2))
    save_byte_tokenizer(tmp)
    fsync_tree(tmp)
    if final.exists():  # another process created it meanwhile
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        return final
    os.rename(tmp, final)
    return final
