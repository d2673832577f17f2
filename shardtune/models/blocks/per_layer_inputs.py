"""Per-layer inputs (``ModelArgs.per_layer_input_dim`` > 0, Gemma 4's "per-layer embeddings"), as transformers.

Rule: every layer gets its own ``per_layer_input_dim``-wide input per token, made once per forward from the
tokens and their (scaled) embeddings: ``(norm(proj(embeds) / sqrt(dim)) + table[token] * sqrt(d)) / sqrt(2)``
(:func:`model_inputs`), and after its feed-forward residual each layer adds
``norm(projection(act(gate(h)) * its input))`` (:func:`add_layer_input`). The modules sit directly on the
model and on each layer under transformers' names (:func:`model_modules`, :func:`layer_modules`), so
``state_dict`` keys equal its checkpoints'. Per token only: packing and context parallelism need nothing.
"""

from __future__ import annotations

from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardtune.models.args import ModelArgs
from shardtune.models.blocks.norm import RMSNorm, init_linear

__all__ = ["add_layer_input", "init_modules", "layer_modules", "model_inputs", "model_modules"]


def model_modules(args: ModelArgs, *, norm: dict[str, Any], device=None, dtype=None) -> dict[str, nn.Module]:
    """The model's modules, by name in transformers' order: the packed table of every layer's token inputs,
    the projection of the embeddings and its norm (``norm``: the family's RMSNorm options)."""
    width = args.n_layers * args.per_layer_input_dim
    kw = {"device": device, "dtype": dtype}
    vocab = args.per_layer_input_vocab_size or args.vocab_size
    return {
        "embed_tokens_per_layer": nn.Embedding(vocab, width, **kw),
        "per_layer_model_projection": nn.Linear(args.dim, width, bias=False, **kw),
        "per_layer_projection_norm": RMSNorm(args.per_layer_input_dim, **norm, **kw),
    }


def layer_modules(args: ModelArgs, *, norm: dict[str, Any], device=None, dtype=None) -> dict[str, nn.Module]:
    """A layer's modules, by name in transformers' order: the gate, the projection back and its norm."""
    kw = {"device": device, "dtype": dtype}
    return {
        "per_layer_input_gate": nn.Linear(args.dim, args.per_layer_input_dim, bias=False, **kw),
        "per_layer_projection": nn.Linear(args.per_layer_input_dim, args.dim, bias=False, **kw),
        "post_per_layer_input_norm": RMSNorm(args.dim, **norm, **kw),
    }


def init_modules(owner: nn.Module, std: float) -> None:
    """transformers' initialization of the per-layer-input modules ``owner`` (a model or a layer) holds."""
    for name, module in owner.named_children():
        if isinstance(module, nn.Embedding) and name == "embed_tokens_per_layer" and not module.weight.is_meta:
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif name in ("per_layer_model_projection", "per_layer_input_gate", "per_layer_projection"):
            init_linear(module, std)
        elif name in ("per_layer_projection_norm", "post_per_layer_input_norm"):
            cast(RMSNorm, module).reset_parameters()


def _child(owner: nn.Module, name: str) -> nn.Module:
    return cast(nn.Module, getattr(owner, name))


def _scaled(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` first, as transformers' scaled embeddings (on the CPU: no device copy)."""
    return torch.tensor(value, dtype=dtype).item()


def model_inputs(model: nn.Module, tokens: Tensor, embeds: Tensor, args: ModelArgs) -> Tensor:
    """Every layer's input ``[b, s, n_layers, per_layer_input_dim]`` from ``tokens`` and their scaled ``embeds``."""
    d = args.per_layer_input_dim
    token_part = _child(model, "embed_tokens_per_layer")(tokens)
    token_part = (token_part * _scaled(d**0.5, token_part.dtype)).reshape(*tokens.shape, args.n_layers, d)
    projected = _child(model, "per_layer_model_projection")(embeds) * args.dim**-0.5
    projected = _child(model, "per_layer_projection_norm")(projected.reshape(*tokens.shape, args.n_layers, d))
    return (projected + token_part) * 2.0**-0.5


def add_layer_input(layer: nn.Module, h: Tensor, layer_input: Tensor, *, gelu: bool) -> Tensor:
    """``h`` plus the layer's part, ``norm(projection(act(gate(h)) * layer_input))`` (``gelu``: tanh-GELU, else
    SiLU)."""
    gate = _child(layer, "per_layer_input_gate")(h)
    act = F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)
    projected = _child(layer, "per_layer_projection")(act * layer_input)
    return h + _child(layer, "post_per_layer_input_norm")(projected)
