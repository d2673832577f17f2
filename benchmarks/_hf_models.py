"""The seeded Hugging Face models the benchmarks train, stream and load: their shapes and HF directories.

Rule: a shape is plain dimensions (what a benchmark's report prints and its parameter count), and a
model directory is written once from a shape with seed 0 and reused by every later run and method, so
every stack of a benchmark loads the same weights. :class:`Shape` is a Llama decoder (untied head),
:class:`MoeShape` a Qwen3-MoE one (every layer sparse), :class:`MoeCheckpointShape` the latter with the
tensor layout ``save_pretrained`` writes (per-expert or fused), :class:`Qwen3_5MoeCheckpointShape` a
Qwen3.5-MoE one (hybrid Gated DeltaNet / gated attention layers, a gated shared expert) and
:class:`DeepseekV3CheckpointShape` a DeepSeek-V3 one (latent attention, dense first layers, a shared
expert) in the same layouts. :func:`saved_once` writes any model with
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
from typing import Any, ClassVar

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

    model_name: ClassVar[str] = "Qwen3-MoE"

    def hf_config(self) -> dict[str, Any]:
        """``config.json``: the model's config with its model type and saved dtype."""
        named = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "dtype": "bfloat16"}
        return {**super().hf_config(), **named}

    def describe(self) -> str:
        """The model's dimensions in words (a report's *Model* line)."""
        return (
            f"{self.model_name}, hidden {self.hidden}, {self.layers} layers (all sparse), {self.experts} experts "
            f"of width {self.expert_ffn}, {self.heads} heads ({self.kv_heads} kv, head_dim {self.head_dim}), "
            f"vocabulary {self.vocab}"
        )

    def mixer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        """Layer ``layer``'s token-mixer keys (under ``model.layers.<layer>.``) and shapes."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "self_attn.q_norm.weight": (self.head_dim,),
            "self_attn.k_norm.weight": (self.head_dim,),
        }

    def dense_mlp_shapes(self) -> dict[str, tuple[int, ...]]:
        """A layer's non-expert ``mlp`` keys besides the router (none here)."""
        return {}

    def file_shapes(self, *, fused: bool) -> dict[str, tuple[int, ...]]:
        """HF key -> shape as transformers' ``save_pretrained`` writes it (``fused``:
        ``save_original_format=False``)."""
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, self.hidden)}
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            shapes |= {p + k: s for k, s in self.mixer_shapes(layer).items()}
            shapes |= {p + k: s for k, s in self.mlp_shapes(layer, fused=fused).items()}
        shapes |= {"model.norm.weight": (self.hidden,), "lm_head.weight": (self.vocab, self.hidden)}
        return shapes

    def mlp_shapes(self, layer: int, *, fused: bool) -> dict[str, tuple[int, ...]]:
        """Layer ``layer``'s keys after its token mixer: its non-expert ``mlp`` keys, the router, the
        layer norms and the routed experts (``fused``: two stacked tensors, else three per expert)."""
        h, i, e = self.hidden, self.expert_ffn, self.experts
        shapes = self.dense_mlp_shapes() | {
            "mlp.gate.weight": (e, h),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }
        if fused:
            return shapes | {"mlp.experts.gate_up_proj": (e, 2 * i, h), "mlp.experts.down_proj": (e, h, i)}
        for x in range(e):
            shapes |= {
                f"mlp.experts.{x}.gate_proj.weight": (i, h),
                f"mlp.experts.{x}.up_proj.weight": (i, h),
                f"mlp.experts.{x}.down_proj.weight": (h, i),
            }
        return shapes

    def stored_dtype(self, name: str) -> str:
        """The safetensors dtype a release stores unquantized tensor ``name`` in."""
        return "BF16"

    def expert_tensors(self) -> int:
        return 3 * self.experts * self.layers

    def expert_bytes(self) -> int:
        return self.expert_tensors() * self.hidden * self.expert_ffn * BF16

    def total_bytes(self) -> int:
        return sum(math.prod(s) for s in self.file_shapes(fused=True).values()) * BF16

    def largest_bytes(self, *, fused: bool) -> int:
        return max(math.prod(s) for s in self.file_shapes(fused=fused).values()) * BF16


@dataclass(frozen=True, kw_only=True)
class Qwen3_5MoeCheckpointShape(MoeCheckpointShape):
    """A Qwen3.5-MoE text model (``qwen3_5_moe_text``): every ``full_attention_interval``-th layer gated
    attention (``q_proj`` doubled for the output gate), the others Gated DeltaNet (``linear_attn``), every
    layer's ``mlp`` routed experts plus a shared expert of width ``shared_ffn`` with its sigmoid gate."""

    model_name: ClassVar[str] = "Qwen3.5-MoE"

    shared_ffn: int
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    full_attention_interval: int = 4
    conv_kernel: int = 4

    def layer_types(self) -> list[str]:
        every = self.full_attention_interval
        return ["full_attention" if (n + 1) % every == 0 else "linear_attention" for n in range(self.layers)]

    def hf_config(self) -> dict[str, Any]:
        """``config.json`` of ``Qwen3_5MoeForCausalLM`` with its saved dtype."""
        base = {k: v for k, v in super().hf_config().items() if k not in ("intermediate_size", "norm_topk_prob")}
        return {
            **base,
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "shared_expert_intermediate_size": self.shared_ffn,
            "layer_types": self.layer_types(),
            "linear_num_key_heads": self.linear_key_heads,
            "linear_num_value_heads": self.linear_value_heads,
            "linear_key_head_dim": self.linear_head_dim,
            "linear_value_head_dim": self.linear_head_dim,
            "linear_conv_kernel_dim": self.conv_kernel,
        }

    def describe(self) -> str:
        full = self.layer_types().count("full_attention")
        return (
            f"{self.model_name}, hidden {self.hidden}, {self.layers} layers (all sparse: {self.layers - full} "
            f"Gated DeltaNet with {self.linear_key_heads} key / {self.linear_value_heads} value heads of "
            f"{self.linear_head_dim}, {full} gated attention with {self.heads} heads ({self.kv_heads} kv, head_dim "
            f"{self.head_dim})), {self.experts} experts of width {self.expert_ffn} + a gated shared expert of width "
            f"{self.shared_ffn}, vocabulary {self.vocab}"
        )

    def mixer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        if self.layer_types()[layer] == "full_attention":
            gated = super().mixer_shapes(layer)
            q = 2 * self.heads * self.head_dim  # query rows, then the output gate's
            return gated | {"self_attn.q_proj.weight": (q, self.hidden)}
        h, kd, vd = (
            self.hidden,
            self.linear_key_heads * self.linear_head_dim,
            self.linear_value_heads * self.linear_head_dim,
        )
        heads = self.linear_value_heads
        return {
            "linear_attn.dt_bias": (heads,),
            "linear_attn.A_log": (heads,),
            "linear_attn.conv1d.weight": (2 * kd + vd, 1, self.conv_kernel),
            "linear_attn.norm.weight": (self.linear_head_dim,),
            "linear_attn.out_proj.weight": (h, vd),
            "linear_attn.in_proj_qkv.weight": (2 * kd + vd, h),
            "linear_attn.in_proj_z.weight": (vd, h),
            "linear_attn.in_proj_b.weight": (heads, h),
            "linear_attn.in_proj_a.weight": (heads, h),
        }

    def dense_mlp_shapes(self) -> dict[str, tuple[int, ...]]:
        h, s = self.hidden, self.shared_ffn
        return {
            "mlp.shared_expert.gate_proj.weight": (s, h),
            "mlp.shared_expert.up_proj.weight": (s, h),
            "mlp.shared_expert.down_proj.weight": (h, s),
            "mlp.shared_expert_gate.weight": (1, h),
        }


@dataclass(frozen=True, kw_only=True)
class DeepseekV3CheckpointShape(MoeCheckpointShape):
    """A DeepSeek-V3 model (``deepseek_v3``): multi-head latent attention in every layer (``q_lora_rank``
    bottleneck for queries, ``kv_lora_rank`` for keys and values, ``head_dim`` the decoupled RoPE width),
    the first ``first_dense`` layers a dense MLP of width ``dense_ffn``, the others group-limited sigmoid
    routing (router weight + fp32 ``e_score_correction_bias``) over ``experts`` routed experts and an
    ungated shared MLP ``shared_experts`` experts wide. No multi-token-prediction layer."""

    model_name: ClassVar[str] = "DeepSeek-V3"

    dense_ffn: int
    first_dense: int
    shared_experts: int
    q_lora_rank: int
    kv_lora_rank: int
    nope_head_dim: int
    v_head_dim: int
    n_group: int
    topk_group: int

    def hf_config(self) -> dict[str, Any]:
        """``config.json`` of ``DeepseekV3ForCausalLM`` with its saved dtype."""
        return {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "dtype": "bfloat16",
            "hidden_size": self.hidden,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.heads,  # latent attention: one key/value head per query head
            "intermediate_size": self.dense_ffn,
            "moe_intermediate_size": self.expert_ffn,
            "n_routed_experts": self.experts,
            "n_shared_experts": self.shared_experts,
            "num_experts_per_tok": self.top_k,
            "first_k_dense_replace": self.first_dense,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.nope_head_dim,
            "qk_rope_head_dim": self.head_dim,
            "v_head_dim": self.v_head_dim,
            "num_nextn_predict_layers": 0,
            "vocab_size": self.vocab,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
        }

    def describe(self) -> str:
        return (
            f"{self.model_name}, hidden {self.hidden}, {self.layers} layers ({self.first_dense} dense of width "
            f"{self.dense_ffn}, {self.sparse_layers()} sparse: {self.experts} experts of width {self.expert_ffn} + "
            f"{self.shared_experts} shared), latent attention with {self.heads} heads (q rank {self.q_lora_rank}, kv "
            f"rank {self.kv_lora_rank}, nope/rope/v {self.nope_head_dim}/{self.head_dim}/{self.v_head_dim}), "
            f"vocabulary {self.vocab}"
        )

    def sparse_layers(self) -> int:
        return max(self.layers - self.first_dense, 0)

    def expert_tensors(self) -> int:
        return 3 * self.experts * self.sparse_layers()

    def mixer_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        h, heads, rope = self.hidden, self.heads, self.head_dim
        return {
            "self_attn.q_a_proj.weight": (self.q_lora_rank, h),
            "self_attn.q_a_layernorm.weight": (self.q_lora_rank,),
            "self_attn.q_b_proj.weight": (heads * (self.nope_head_dim + rope), self.q_lora_rank),
            "self_attn.kv_a_proj_with_mqa.weight": (self.kv_lora_rank + rope, h),
            "self_attn.kv_a_layernorm.weight": (self.kv_lora_rank,),
            "self_attn.kv_b_proj.weight": (heads * (self.nope_head_dim + self.v_head_dim), self.kv_lora_rank),
            "self_attn.o_proj.weight": (h, heads * self.v_head_dim),
        }

    def dense_mlp_shapes(self) -> dict[str, tuple[int, ...]]:
        """A sparse layer's shared MLP and the router's correction bias."""
        h, s = self.hidden, self.shared_experts * self.expert_ffn
        return {
            "mlp.gate.e_score_correction_bias": (self.experts,),
            "mlp.shared_experts.gate_proj.weight": (s, h),
            "mlp.shared_experts.up_proj.weight": (s, h),
            "mlp.shared_experts.down_proj.weight": (h, s),
        }

    def mlp_shapes(self, layer: int, *, fused: bool) -> dict[str, tuple[int, ...]]:
        if layer >= self.first_dense:
            return super().mlp_shapes(layer, fused=fused)
        h, f = self.hidden, self.dense_ffn
        return {
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }

    def stored_dtype(self, name: str) -> str:
        return "F32" if name.endswith("e_score_correction_bias") else "BF16"

    def params(self, *, active: bool = False) -> int:
        """Weights of the model (``active``: ``top_k`` routed experts per sparse layer), from the file shapes
        (the router's correction bias is a buffer, not a weight)."""
        shapes = self.file_shapes(fused=True)
        total = sum(math.prod(s) for k, s in shapes.items() if not k.endswith("e_score_correction_bias"))
        idle = (self.experts - self.top_k) * 3 * self.hidden * self.expert_ffn * self.sparse_layers()
        return total - idle if active else total


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
