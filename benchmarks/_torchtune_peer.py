"""torchtune 0.6.1 as a peer of the training-step benchmark, built as its full_finetune_distributed recipe does.

Rule: everything torchtune-specific lives here and nothing here imports torchtune at module import,
so the benchmark and its tests run where torchtune does not install; :func:`unavailable` says why
it does not, and the benchmark skips the peer with that reason.

What the recipe does, for full fine-tuning of a Llama checkpoint in Hugging Face format (its
``FullModelHFCheckpointer`` with ``model_type: LLAMA3``): the ``llama3`` builder on the meta device
in the training dtype; activation checkpointing on every ``TransformerSelfAttentionLayer``
(``training.set_activation_checkpointing``); ``fully_shard`` on every ``layers.N``, then on the root,
resharding after forward (``training.shard_model``); RoPE buffers initialised on the device; the HF
weights mapped by ``convert_weights.hf_to_tune`` (q/k rows permuted to torchtune's interleaved RoPE),
each full tensor cast to the parameter's dtype, ``distribute_tensor``-ed to its placement and loaded
with ``load_state_dict(assign=True)`` (``training.load_from_full_model_state_dict``); the loss is
``CEWithChunkedOutputLoss`` (8 chunks of logits, each upcast to fp32 on its own) after
``model.set_num_output_chunks``, on labels shifted by one with ``ignore_index`` at the end.

``torchtune.training`` itself does not import with torchao 0.18 (it imports ``TensorCoreTiledLayout``
and ``int4_weight_only``, which torchao removed), so its three utilities named above are applied here
with the torch calls they make (their dense, no-offload path); the model, the weight mapping and the
loss are torchtune's own. torchao 0.18 also moved ``NF4Tensor`` out of ``torchao.dtypes.nf4tensor``,
which ``import torchtune`` reads: :func:`import_torchtune` points that module name at its new home.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VERSION = "0.6.1"
# without pip resolving torch (torchtune's torchdata requirement would): what it imports that torch doesn't bring
INSTALL = (
    f"pip install --no-deps torchtune=={VERSION} omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 sentencepiece "
    "tiktoken pillow"
)
# torchao 0.18 moved NF4Tensor; torchtune 0.6.1 imports it from the old path when it is imported
_NF4_OLD = "torchao.dtypes.nf4tensor"
_NF4_NEW = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def import_torchtune() -> ModuleType:
    """``torchtune``, with NF4's pre-0.18 torchao module path pointing at its new home when only that exists."""
    if _NF4_OLD not in sys.modules and importlib.util.find_spec("torchao") is not None:
        try:
            old = importlib.util.find_spec(_NF4_OLD)
        except ModuleNotFoundError:
            old = None
        if old is None:
            sys.modules[_NF4_OLD] = importlib.import_module(_NF4_NEW)
    return importlib.import_module("torchtune")


def unavailable() -> str | None:
    """None when torchtune ``VERSION`` imports here, else why not (the text the report shows)."""
    try:
        torchtune = import_torchtune()
        for module in ("torchtune.models.llama3", "torchtune.models.convert_weights", "torchtune.modules.loss"):
            importlib.import_module(module)
    except ImportError as e:
        return f"torchtune {VERSION} does not import here ({type(e).__name__}: {e}); to add the peer: `{INSTALL}`"
    if not torchtune.__version__.startswith(VERSION):
        return f"torchtune {torchtune.__version__} is installed; the peer is torchtune {VERSION}"
    return None


def llama3_kwargs(hf: str | Path) -> dict[str, Any]:
    """The ``llama3`` builder's arguments for the Llama model in HF directory ``hf`` (plain RoPE only)."""
    config = json.loads((Path(hf) / "config.json").read_text())
    rope = config.get("rope_parameters") or {"rope_type": "default", "rope_theta": config.get("rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default" or config.get("tie_word_embeddings", False):
        raise ValueError(
            f"{hf}/config.json: the torchtune peer maps only untied Llama models with plain RoPE; got "
            f"rope_parameters={rope}, tie_word_embeddings={config.get('tie_word_embeddings')}: use the benchmark's "
            "own model directory"
        )
    return {
        "vocab_size": config["vocab_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": config["num_attention_heads"],
        "num_kv_heads": config["num_key_value_heads"],
        "embed_dim": config["hidden_size"],
        "max_seq_len": config["max_position_embeddings"],
        "intermediate_dim": config["intermediate_size"],
        "norm_eps": config["rms_norm_eps"],
        "rope_base": rope["rope_theta"],
    }


def tune_state_dict(hf: str | Path) -> dict[str, torch.Tensor]:
    """The HF checkpoint in ``hf`` (one ``model.safetensors``) in torchtune's names and RoPE layout."""
    from safetensors.torch import load_file

    import_torchtune()
    from torchtune.models.convert_weights import hf_to_tune

    kw = llama3_kwargs(hf)
    return hf_to_tune(
        load_file(Path(hf) / "model.safetensors"),
        num_heads=kw["num_heads"],
        num_kv_heads=kw["num_kv_heads"],
        dim=kw["embed_dim"],
        head_dim=kw["embed_dim"] // kw["num_heads"],
    )


def build_model(hf: str | Path, *, dtype: torch.dtype, device: torch.device | str = "meta") -> nn.Module:
    """torchtune's ``llama3`` decoder for ``hf``, its parameters in ``dtype`` on ``device`` (not loaded)."""
    import_torchtune()
    from torchtune.models.llama3 import llama3

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as training.set_default_dtype: the builder makes its parameters in it
    try:
        with torch.device(device):
            return llama3(**llama3_kwargs(hf))
    finally:
        torch.set_default_dtype(previous)


def chunked_loss(model: nn.Module):
    """``loss(tokens) -> mean next-token loss`` through ``CEWithChunkedOutputLoss``, as the recipe computes it."""
    import_torchtune()
    from torchtune.modules.loss import CEWithChunkedOutputLoss

    ce = CEWithChunkedOutputLoss()
    model.set_num_output_chunks(ce.num_output_chunks)

    def loss(tokens: torch.Tensor) -> torch.Tensor:
        labels = F.pad(tokens[:, 1:], (0, 1), value=ce.ignore_index)  # position t predicts token t+1
        return ce(model(tokens), labels)

    return loss


def _is_layer(name: str) -> bool:
    """``training.get_shard_conditions`` without names to match: a module named ``...layers.<N>``."""
    parts = name.split(".")
    return len(parts) >= 2 and parts[-2] == "layers" and parts[-1].isdigit()


def build(hf: str, device: torch.device, *, dtype: torch.dtype):
    """Collective: call on all ranks. The recipe's sharded, loaded model on this rank and its loss
    (``loss(tokens) -> mean next-token loss``); every rank reads the checkpoint, as the recipe does."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from torch.distributed.tensor import distribute_tensor

    import_torchtune()
    from torchtune.modules import TransformerSelfAttentionLayer

    model = build_model(hf, dtype=dtype)
    apply_activation_checkpointing(model, auto_wrap_policy=ModuleWrapPolicy({TransformerSelfAttentionLayer}))
    for name, module in reversed(list(model.named_modules())):
        if _is_layer(name):
            fully_shard(module, reshard_after_forward=True)
    fully_shard(model, reshard_after_forward=True)
    with torch.device(device):
        for m in model.modules():
            if hasattr(m, "rope_init"):
                m.rope_init()
    meta = model.state_dict()
    sharded = {
        name: nn.Parameter(
            distribute_tensor(full.to(meta[name].dtype).to(device), meta[name].device_mesh, meta[name].placements)
        )
        for name, full in tune_state_dict(hf).items()
    }
    model.load_state_dict(sharded, strict=True, assign=True)
    return model, chunked_loss(model)
