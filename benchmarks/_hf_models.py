"""The seeded Hugging Face models the benchmarks train, stream and load: their shapes and HF directories.

Rule: a shape is plain dimensions (what a benchmark's report prints and its parameter count), and a
model directory is written once from a shape with seed 0 and reused by every later run and method, so
every stack of a benchmark loads the same weights. :class:`Shape` is a Llama decoder (untied head),
:class:`MoeShape` a Qwen3-MoE one (every layer sparse), :class:`MoeCheckpointShape` the latter with the
tensor layout ``save_pretrained`` writes (per-expert or fused). :func:`saved_once` writes any model with
``save_pretrained`` (to a temporary name, then renamed, so a stopped run leaves no half directory);
:func:`llama_dir` is a :class:`Shape`'s directory.

State-only fixtures (a bare module tree, random safetensors files written tensor by tensor, no
transformers) are :mod:`benchmarks._fixtures`'.
"""

from __future__ import annotations

import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

BF16 = 2  # bytes per element of a bf16 checkpoint file


@dataclass(frozen=True, kw_only=True)
class Shape:
    """The Llama model both stacks train."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int

    def hf_config(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "intermediate_size": self.ffn,
            "vocab_size": self.vocab,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
        }

    def params(self) -> int:
        head_dim = self.hidden // self.heads
        attn = 2 * self.hidden * self.heads * head_dim + 2 * self.hidden * self.kv_heads * head_dim
        layer = attn + 3 * self.hidden * self.ffn + 2 * self.hidden
        return self.layers * layer + 2 * self.vocab * self.hidden + self.hidden


@dataclass(frozen=True, kw_only=True)
class MoeShape:
    """The Qwen3-MoE model both stacks train: every layer sparse, ``top_k`` of ``experts`` experts."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ffn: int
    vocab: int

    def hf_config(self) -> dict[str, Any]:
        return {
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": 4 * self.expert_ffn,  # unused: no dense layers
            "moe_intermediate_size": self.expert_ffn,
            "num_experts": self.experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": True,
            "router_aux_loss_coef": 0.001,
            "vocab_size": self.vocab,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
        }

    def params(self, *, active: bool = False) -> int:
        """Weights of the model; ``active``: with only ``top_k`` experts per layer (what a token runs through)."""
        attn = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim
        experts = (self.top_k if active else self.experts) * 3 * self.hidden * self.expert_ffn
        norms = 2 * self.hidden + 2 * self.head_dim
        layer = attn + self.hidden * self.experts + experts + norms
        return self.layers * layer + 2 * self.vocab * self.hidden + self.hidden


@dataclass(frozen=True, kw_only=True)
class MoeCheckpointShape(MoeShape):
    """The MoE training benchmark's Qwen3-MoE shape (every layer sparse), as an HF directory."""

    def hf_config(self) -> dict[str, Any]:
        """``config.json``: the model's config with its model type and saved dtype."""
        named = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "bfloat16"}
        return {**super().hf_config(), **named}

    def file_shapes(self, *, fused: bool) -> dict[str, tuple[int, ...]]:
        """HF key -> shape as transformers' ``save_pretrained`` writes it (``fused``:
        ``save_original_format=False``)."""
        h, i, e = self.hidden, self.expert_ffn, self.experts
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            shapes |= {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "self_attn.q_norm.weight": (self.head_dim,),
                p + "self_attn.k_norm.weight": (self.head_dim,),
                p + "mlp.gate.weight": (e, h),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
            if fused:
                shapes |= {p + "mlp.experts.gate_up_proj": (e, 2 * i, h), p + "mlp.experts.down_proj": (e, h, i)}
                continue
            for x in range(e):
                shapes |= {
                    f"{p}mlp.experts.{x}.gate_proj.weight": (i, h),
                    f"{p}mlp.experts.{x}.up_proj.weight": (i, h),
                    f"{p}mlp.experts.{x}.down_proj.weight": (h, i),
                }
        shapes |= {"model.norm.weight": (h,), "lm_head.weight": (self.vocab, h)}
        return shapes

    def expert_tensors(self) -> int:
        return 3 * self.experts * self.layers

    def expert_bytes(self) -> int:
        return self.expert_tensors() * self.hidden * self.expert_ffn * BF16

    def total_bytes(self) -> int:
        return sum(math.prod(s) for s in self.file_shapes(fused=True).values()) * BF16

    def largest_bytes(self, *, fused: bool) -> int:
        return max(math.prod(s) for s in self.file_shapes(fused=fused).values()) * BF16


# Qwen2.5-0.5B's shape (Llama layers: no q/k/v bias; untied head), ~0.63B parameters, 1.26 GB in bf16
HALF_B = Shape(hidden=896, layers=24, heads=14, kv_heads=2, ffn=4864, vocab=151936)
TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, ffn=128, vocab=512)  # --smoke runs


def llama_dir(bench_dir: Path, shape: Shape) -> Path:
    """The seeded HF Llama directory of ``shape`` that every stack loads (written once, reused)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = bench_dir / f"train_llama_h{shape.hidden}_l{shape.layers}_v{shape.vocab}"
    return saved_once(path, lambda: LlamaForCausalLM(LlamaConfig(**shape.hf_config())), safe_serialization=True)


def saved_once(path: Path, build: Callable[[], nn.Module], **save: Any) -> Path:
    """``build()``'s model (seed 0) written with ``save_pretrained(**save)`` to ``path``, unless it is there."""
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    torch.manual_seed(0)
    model = build()
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, **save)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path
