"""Llama-family decoder whose ``state_dict()`` keys equal HF ``LlamaForCausalLM``'s.

Structure (and therefore FQNs) mirrors transformers: ``model.embed_tokens``,
``model.layers[i].{self_attn,mlp,input_layernorm,post_attention_layernorm}``, ``model.norm``,
``lm_head``. Decoder layers sit in ``model.model.layers`` (an ``nn.ModuleList``) so FSDP2's
``fully_shard`` can be applied per layer, then to the root.

Attention is causal only (no padding mask): right-padded batches are fine because padded
positions come after every real token and are masked out of the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardtune.models.args import ModelArgs
from shardtune.models.layer_dropout import LayerDropoutSchedule, layer_dropout_probs
from shardtune.models.rope import RotaryEmbedding, apply_rotary_emb

__all__ = [
    "Attention",
    "DecoderLayer",
    "HeadLoss",
    "LlamaForCausalLM",
    "LlamaModel",
    "MLP",
    "RMSNorm",
    "sample_attention_mask",
]

HeadLoss = Callable[[Tensor, Callable[[Tensor], Tensor]], Any]  # (hidden, head) -> what forward returns


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, cast back, then scaled (HF ``LlamaRMSNorm`` order)."""

    def __init__(self, dim: int, *, eps: float = 1e-6, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"


def _init_linear(linear: nn.Module, std: float) -> None:
    """Normal(0, std) weight and zero bias; works for ``nn.Linear`` and ``LoRALinear`` bases."""
    if linear.weight.is_meta:
        return
    if type(linear.weight).__name__ == "NF4Tensor" or not linear.weight.is_floating_point():
        raise ValueError("init_weights cannot re-initialize a quantized (NF4) base weight; initialize before QLoRA")
    nn.init.normal_(linear.weight, mean=0.0, std=std)
    if getattr(linear, "bias", None) is not None:
        nn.init.zeros_(linear.bias)


class Attention(nn.Module):
    """Grouped-query self-attention through ``scaled_dot_product_attention``: causal, or
    block-causal with a ``mask`` from :func:`sample_attention_mask` (packed rows)."""

    def __init__(self, args: ModelArgs, *, device=None, dtype=None) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_kv_heads
        self.head_dim = args.head_dim
        kw = {"device": device, "dtype": dtype}
        q_out, kv_out = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        self.q_proj = nn.Linear(args.dim, q_out, bias=args.attention_bias, **kw)
        self.k_proj = nn.Linear(args.dim, kv_out, bias=args.attention_bias, **kw)
        self.v_proj = nn.Linear(args.dim, kv_out, bias=args.attention_bias, **kw)
        self.o_proj = nn.Linear(q_out, args.dim, bias=args.o_proj_bias, **kw)

    def init_weights(self, std: float) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            _init_linear(proj, std)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_emb(q, k, cos, sin)
        # enable_gqa lets SDPA broadcast kv heads without materializing repeated k/v.
        gqa = self.n_kv_heads != self.n_heads
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, args: ModelArgs, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": args.mlp_bias}
        self.gate_proj = nn.Linear(args.dim, args.intermediate_size, **kw)
        self.up_proj = nn.Linear(args.dim, args.intermediate_size, **kw)
        self.down_proj = nn.Linear(args.intermediate_size, args.dim, **kw)

    def init_weights(self, std: float) -> None:
        for proj in (self.gate_proj, self.up_proj, self.down_proj):
            _init_linear(proj, std)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: attention and MLP, each with a residual."""

    def __init__(self, args: ModelArgs, *, device=None, dtype=None) -> None:
        super().__init__()
        self.self_attn = Attention(args, device=device, dtype=dtype)
        self.mlp = MLP(args, device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(args.dim, eps=args.norm_eps, device=device, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(args.dim, eps=args.norm_eps, device=device, dtype=dtype)

    def init_weights(self, std: float) -> None:
        self.self_attn.init_weights(std)
        self.mlp.init_weights(std)
        self.input_layernorm.reset_parameters()
        self.post_attention_layernorm.reset_parameters()

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None = None) -> Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, args: ModelArgs, *, device=None, dtype=None) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim, device=device, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(args, device=device, dtype=dtype) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps, device=device, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(args.head_dim, theta=args.rope_theta, rope_scaling=args.rope_scaling)
        self.layer_dropout_probs: list[float] | None = None
        self.layer_dropout_generator: torch.Generator | None = None

    def _skipped_layers(self) -> list[bool] | None:
        """Per-batch skip decisions; one draw per layer every call so RNG use is schedule-independent."""
        if not self.training or self.layer_dropout_probs is None:
            return None
        # CPU draw: no device sync, and reproducible under torch.manual_seed (or the given generator).
        draws = torch.rand(len(self.layers), generator=self.layer_dropout_generator)
        return (draws < torch.tensor(self.layer_dropout_probs)).tolist()

    def forward(
        self,
        tokens: Tensor,
        *,
        position_ids: Tensor | None = None,
        output_hidden_states: Iterable[int] | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Return the final (normed) hidden state and ``{layer: output of layer}`` for requested layers.

        ``position_ids`` (packed rows): a new sample starts wherever they are 0, and attention
        stays within each sample; without them every row is one causal sequence.
        """
        wanted = _check_layer_ids(output_hidden_states, len(self.layers))
        h = self.embed_tokens(tokens)
        mask = None
        if position_ids is None:
            position_ids = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
        else:
            mask = sample_attention_mask(position_ids)
        cos, sin = self.rotary_emb(position_ids, h.dtype)
        skipped = self._skipped_layers()
        hidden: dict[int, Tensor] = {}
        for i, layer in enumerate(self.layers):
            if skipped is None or not skipped[i]:
                h = layer(h, cos, sin, mask)
            if i in wanted:
                hidden[i] = h
        return self.norm(h), hidden


def sample_attention_mask(position_ids: Tensor) -> Tensor:
    """Block-causal mask ``[b, 1, s, s]`` (True = may attend) for rows of packed samples: a
    token sees itself and the earlier tokens of its own sample, which starts where
    ``position_ids`` is 0 (or at the row's start). Built from the ids alone, without a
    device sync."""
    starts = position_ids == 0
    starts[..., 0] = True
    sample = starts.cumsum(dim=-1)  # which sample of the row each token belongs to
    s = position_ids.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool, device=position_ids.device).tril()
    return ((sample.unsqueeze(-1) == sample.unsqueeze(-2)) & causal).unsqueeze(1)


def _check_layer_ids(ids: Iterable[int] | None, n_layers: int) -> set[int]:
    if ids is None:
        return set()
    wanted = set(ids)
    bad = sorted(i for i in wanted if not isinstance(i, int) or not 0 <= i < n_layers)
    if bad:
        raise ValueError(f"output_hidden_states layer ids {bad} are out of range [0, {n_layers})")
    return wanted


class LlamaForCausalLM(nn.Module):
    """Decoder plus ``lm_head``; keys and numerics match HF ``LlamaForCausalLM``.

    Build on the meta device for free (``with torch.device("meta"): LlamaForCausalLM(args)``);
    weights are only initialized when parameters are materialized at construction.
    """

    def __init__(self, args: ModelArgs, *, device=None, dtype=None) -> None:
        super().__init__()
        self.args = args
        self.model = LlamaModel(args, device=device, dtype=dtype)
        # A tied head is created on meta (no allocation) and then pointed at the embedding.
        head_device = "meta" if args.tie_word_embeddings else device
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False, device=head_device, dtype=dtype)
        self.tie_weights()
        # Re-tie after load_state_dict(assign=True), which would otherwise give lm_head its own Parameter.
        self.register_load_state_dict_post_hook(LlamaForCausalLM._retie_after_load)
        if not self.model.embed_tokens.weight.is_meta:
            self.init_weights()

    @staticmethod
    def _retie_after_load(module: LlamaForCausalLM, _incompatible_keys: object) -> None:
        module.tie_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the same Parameter as ``model.embed_tokens.weight`` when tied."""
        if self.args.tie_word_embeddings and self.lm_head.weight is not self.model.embed_tokens.weight:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, *, std: float = 0.02) -> None:
        """HF-style init: Normal(0, std) linears/embeddings, ones for norms, zero biases."""
        if not self.model.embed_tokens.weight.is_meta:
            nn.init.normal_(self.model.embed_tokens.weight, mean=0.0, std=std)
        for layer in self.model.layers:
            layer.init_weights(std)
        self.model.norm.reset_parameters()
        if not self.args.tie_word_embeddings:
            _init_linear(self.lm_head, std)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Post-materialization setup: re-tie embeddings and precompute RoPE on ``device``.

        Call after params were materialized from the meta device (``load_state_dict(..., assign=True)``
        or an external loader). RoPE would also be computed lazily on first forward.
        """
        self.tie_weights()
        self.model.rotary_emb.reset_cache(device)

    init_rope = init_buffers  # torchtune-style name

    def set_layer_dropout(
        self,
        *,
        max_prob: float,
        schedule: LayerDropoutSchedule = "uniform",
        layers: str | Sequence[int] | None = None,
        generator: torch.Generator | None = None,
    ) -> list[float]:
        """Enable layer dropout (training mode only); returns the per-layer probabilities.

        A skipped layer passes its input through; decisions are drawn once per forward from
        ``generator`` (default: torch's global CPU RNG). Under FSDP every rank must draw the
        same decisions (same seed / generator state), or the per-layer all-gathers desync.
        ``max_prob=0`` disables it.
        """
        probs = layer_dropout_probs(len(self.model.layers), max_prob=max_prob, schedule=schedule, layers=layers)
        self.model.layer_dropout_probs = probs if max_prob > 0 else None
        self.model.layer_dropout_generator = generator
        return probs

    def logits_from_hidden(self, hidden: Tensor) -> Tensor:
        """Apply the shared final norm and ``lm_head`` to an intermediate hidden state (early exit)."""
        return self.lm_head(self.model.norm(hidden))

    def forward(
        self,
        tokens: Tensor,
        *,
        position_ids: Tensor | None = None,
        output_hidden_states: Iterable[int] | None = None,
        hidden_to_logits: bool = False,
        head_loss: HeadLoss | None = None,
    ) -> Any:
        """``tokens`` ``[b, s]`` -> logits ``[b, s, vocab]``.

        With ``output_hidden_states=[i, ...]`` returns ``(logits, {i: output of layer i})``
        (layer ids are 0-based; HF's ``hidden_states[i + 1]``). ``hidden_to_logits=True``
        maps those through norm + lm_head inside this forward, which keeps the root's
        parameters inside FSDP's forward hooks.

        ``head_loss(hidden, head)`` replaces the logits: it gets the final hidden states and the
        output head (a function hidden -> logits) and returns what forward returns, e.g. a
        chunked loss (:mod:`shardtune.models.chunked_loss`) that never makes full logits. With
        ``output_hidden_states`` each chosen layer's output goes through it too, with the head
        ``norm + lm_head``: ``(head_loss(final), {i: head_loss(layer i)})``. It runs inside this
        forward, so FSDP2 has the head's parameters gathered in forward and backward.
        """
        h, hidden = self.model(tokens, position_ids=position_ids, output_hidden_states=output_hidden_states)
        if head_loss is not None:
            out = head_loss(h, self.lm_head)
            if output_hidden_states is None:
                return out
            return out, {i: head_loss(x, self.logits_from_hidden) for i, x in hidden.items()}
        logits = self.lm_head(h)
        if output_hidden_states is None:
            return logits
        if hidden_to_logits:
            hidden = {i: self.logits_from_hidden(x) for i, x in hidden.items()}
        return logits, hidden
