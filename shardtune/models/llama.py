"""One decoder for every supported family, whose ``state_dict()`` keys equal the family's HF ``*ForCausalLM``.

Structure (and therefore FQNs) mirrors transformers: ``model.embed_tokens``,
``model.layers[i].{self_attn,mlp,input_layernorm,post_attention_layernorm}``, ``model.norm``,
``lm_head``. Each layer's token mixer (``self_attn``, or the name its spec gives it: Qwen3.5's
``linear_attn``) and ``mlp`` are the blocks its family's spec names for it
(``spec.Blocks``, built through ``blocks/kinds.py``); the spec's norm options add
``pre_feedforward_layernorm``/``post_feedforward_layernorm`` (Gemma 2/3), its ``layer_scalar`` a scale
per layer; per-layer inputs (``ModelArgs.per_layer_input_dim``, ``blocks/per_layer_inputs.py``) and
keys/values shared across layers (``ModelArgs.kv_sharing``) are made once per forward and handed to
each layer. No code here asks which family it runs. Decoder layers sit in ``model.model.layers`` (an
``nn.ModuleList``) so FSDP2's ``fully_shard`` can be applied per layer, then to the root.

Attention is causal only (no padding mask): right-padded batches are fine because padded
positions come after every real token and are masked out of the loss. Packed rows attend within
each sample (``packed_attention.py``), never through an ``s x s`` mask.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import torch
from torch import Tensor, nn

from shardtune.losses.linear_cross_entropy import LinearHead, head_for_several_losses, softcap
from shardtune.models.args import FULL, LINEAR, SLIDING, ModelArgs
from shardtune.models.blocks import per_layer_inputs
from shardtune.models.blocks.attention import Attention
from shardtune.models.blocks.mlp import MLP
from shardtune.models.blocks.norm import RMSNorm, init_linear
from shardtune.models.blocks.qkv_norm_attention import SharedKV
from shardtune.models.context_parallel import ContextAttention, ContextShard
from shardtune.models.decoder_layer import DecoderLayer, norm_options
from shardtune.models.families import family_of
from shardtune.models.kv_cache import KVCache, cached_attention_mask
from shardtune.models.layer_dropout import LayerDropoutSchedule, layer_dropout_probs
from shardtune.models.moe_aux import Routing
from shardtune.models.packed_attention import (
    PackedSamples,
    SampleLengths,
    check_sample_lengths,
    sample_lengths,
    sample_positions,
)
from shardtune.models.rope import RotaryEmbedding

__all__ = [
    "MLP",
    "Attention",
    "DecoderForCausalLM",
    "DecoderLayer",
    "HeadLoss",
    "LlamaForCausalLM",
    "LlamaModel",
    "RMSNorm",
    "sample_lengths",
    "softcap",
]

HeadLoss = Callable[[Tensor, Callable[[Tensor], Tensor]], Any]  # (hidden, head) -> what forward returns


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and final norm (HF's ``model.`` prefix)."""

    def __init__(self, args: ModelArgs, *, device=None, dtype=None) -> None:
        super().__init__()
        self.args = args
        blocks = family_of(args).blocks
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim, device=device, dtype=dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(args, layer_type=t, layer_idx=i, device=device, dtype=dtype)
            for i, t in enumerate(args.layer_types or ())
        )
        self.norm = RMSNorm(args.dim, **norm_options(args), device=device, dtype=dtype)
        rope: dict[str, Any] = {"max_position_embeddings": args.max_seq_len}
        self.rotary_emb = RotaryEmbedding(
            args.rotary_dim_of(FULL), theta=args.rope_theta, rope_scaling=args.rope_scaling, **rope
        )
        # Gemma 3/4: sliding layers rotate with their own (unscaled) base, over their own head width.
        self.local_rotary_emb = None
        if args.rope_local_theta is not None:
            self.local_rotary_emb = RotaryEmbedding(args.rotary_dim_of(SLIDING), theta=args.rope_local_theta, **rope)
        if args.per_layer_input_dim:
            modules = per_layer_inputs.model_modules(args, norm=norm_options(args), device=device, dtype=dtype)
            for name, module in modules.items():
                self.add_module(name, module)
        self.embed_scale = args.dim**0.5 if blocks.scale_embeddings else None
        self.layer_dropout_probs: list[float] | None = None
        self.layer_dropout_generator: torch.Generator | None = None

    @property
    def decoder_layers(self) -> Sequence[DecoderLayer]:
        """``layers``, typed: a type checker sees an ``nn.ModuleList``'s items as plain Modules."""
        return cast("Sequence[DecoderLayer]", self.layers)

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
        sample_lengths: Sequence[Sequence[int]] | None = None,
        output_hidden_states: Iterable[int] | None = None,
        kv_cache: KVCache | None = None,
        routing: Routing | None = None,
        context: ContextShard | None = None,
    ) -> tuple[Tensor, dict[int, Tensor]]:
        """Return the final (normed) hidden state and ``{layer: output of layer}`` for requested layers.

        Packed rows: ``sample_lengths`` (per row, the lengths of its samples) keeps attention within
        each sample, and ``position_ids`` restart at 0 for every sample (made from the lengths when
        not given). Given ``position_ids`` alone, a new sample starts wherever they are 0; the
        lengths are then read from them, which waits for the device when they live there, so
        training passes both (``sample_lengths`` of the CPU batch). Without either, every row is
        one causal sequence. With ``kv_cache`` (generation) the tokens continue the cached ones
        (see ``kv_cache.py``). ``routing`` (mixture-of-experts models) records what the sparse
        layers routed, for the load-balancing loss (:class:`~shardtune.models.moe_aux.Routing`).

        ``context`` (context parallel, :mod:`shardtune.models.context_parallel`): ``tokens`` and
        ``position_ids`` are this rank's part of rows split over the shard's group, which every
        attention layer gathers keys from (a collective on that group).
        """
        if context is not None:
            self._check_context(context, kv_cache, position_ids, sample_lengths, routing)
        if kv_cache is not None:
            return self._forward_cached(tokens, kv_cache)
        wanted = _check_layer_ids(output_hidden_states, len(self.layers))
        h = self._embed(tokens)
        layer_inputs = self._layer_inputs(tokens, h)
        shared_kv = SharedKV()
        lengths = None if context is not None else self._packed_lengths(tokens, position_ids, sample_lengths)
        seq, device = tokens.shape[1], tokens.device
        if position_ids is None:
            position_ids = torch.arange(seq, device=device).unsqueeze(0)
            if lengths is not None:
                position_ids = sample_positions(lengths).to(device, non_blocking=True)
        types = {layer.layer_type for layer in self.decoder_layers}
        window = {FULL: None, SLIDING: self.args.sliding_window, LINEAR: None}
        packed: dict[str, PackedSamples | ContextAttention | None]
        if context is not None:
            masks = dict.fromkeys(types)
            packed = {t: context.layer(window[t]) for t in types}
        elif lengths is None:
            # a window shorter than the row: one sample per row, attended in bands of the window (no s x s mask)
            rows = ((seq,),) * tokens.shape[0]
            banded = {t for t in types if (w := window[t]) is not None and w < seq}
            masks = dict.fromkeys(types)
            packed = {t: PackedSamples(rows, window[t]) if t in banded else None for t in types}
        else:
            masks = dict.fromkeys(types)
            packed = {t: PackedSamples(lengths, window[t]) for t in types}
        rope_len = None if context is None else context.rope_seq_len
        global_rope = self.rotary_emb(position_ids, h.dtype, seq_len=rope_len)
        local = self.local_rotary_emb
        rope = {FULL: global_rope, SLIDING: global_rope, LINEAR: global_rope}
        if local is not None and SLIDING in types:
            rope[SLIDING] = local(position_ids, h.dtype, seq_len=rope_len)
        skipped = self._skipped_layers()
        hidden: dict[int, Tensor] = {}
        for i, layer in enumerate(self.decoder_layers):
            if skipped is None or not skipped[i]:
                cos, sin = rope[layer.layer_type]
                h = layer(
                    h,
                    cos,
                    sin,
                    masks[layer.layer_type],
                    packed=packed[layer.layer_type],
                    routing=routing,
                    layer_input=None if layer_inputs is None else layer_inputs[:, :, i],
                    shared_kv=shared_kv,
                )
            if i in wanted:
                hidden[i] = h
        return self.norm(h), hidden

    def _embed(self, tokens: Tensor) -> Tensor:
        h = self.embed_tokens(tokens)
        if self.embed_scale is not None:
            # HF rounds the scale to the activation dtype first; rounded on the CPU, it costs no device copy.
            h = h * torch.tensor(self.embed_scale, dtype=h.dtype).item()
        return h

    def _layer_inputs(self, tokens: Tensor, h: Tensor) -> Tensor | None:
        """Every layer's per-layer input ``[b, s, n_layers, d]``, or None when the model has none."""
        if not self.args.per_layer_input_dim:
            return None
        return per_layer_inputs.model_inputs(self, tokens, h, self.args)

    def _check_context(
        self,
        context: ContextShard,
        kv_cache: KVCache | None,
        position_ids: Tensor | None,
        lengths: Sequence[Sequence[int]] | None,
        routing: Routing | None,
    ) -> None:
        """Refuse, by name, what a context-parallel forward cannot run exactly (the same on every rank)."""
        if routing is not None and routing.group is not context.group:
            raise ValueError(
                f"context= with routing= ({self.args.model_type}): the load-balancing loss is over the whole rows, "
                "so the Routing must sum over the cp group: pass Routing(mask=part.mask, group=part.shard.group)"
            )
        if kv_cache is not None:
            raise ValueError("context= and kv_cache= do not combine: generate without context parallelism")
        if position_ids is None or lengths is not None:
            raise ValueError(
                "context= takes the position_ids of split_batch and no sample_lengths (the shard holds the "
                "samples); pass the ContextBatch's position_ids"
            )

    @staticmethod
    def _packed_lengths(
        tokens: Tensor, position_ids: Tensor | None, lengths: Sequence[Sequence[int]] | None
    ) -> SampleLengths | None:
        """The rows' sample lengths, or None when every row is one sample (plain causal attention)."""
        batch, seq = tokens.shape
        if lengths is None:
            if position_ids is None:
                return None
            lengths = sample_lengths(position_ids.expand(batch, seq))
        rows = check_sample_lengths(lengths, batch=batch, seq=seq)
        return None if all(len(row) == 1 for row in rows) else rows

    def _forward_cached(self, tokens: Tensor, cache: KVCache) -> tuple[Tensor, dict[int, Tensor]]:
        """Tokens after the ``cache.length`` cached ones: positions go on, keys and values are appended."""
        h = self._embed(tokens)
        layer_inputs = self._layer_inputs(tokens, h)
        shared_kv = SharedKV()
        new, device = tokens.shape[1], tokens.device
        window = {FULL: None, SLIDING: self.args.sliding_window, LINEAR: None}
        types = {layer.layer_type for layer in self.decoder_layers}
        masks = {
            t: cached_attention_mask(new, cache.length, device=device, window=window[t], pad=cache.pad) for t in types
        }
        position_ids = cache.positions(new, device)
        global_rope = self.rotary_emb(position_ids, h.dtype)
        rope = {FULL: global_rope, SLIDING: global_rope, LINEAR: global_rope}
        if self.local_rotary_emb is not None and SLIDING in types:
            rope[SLIDING] = self.local_rotary_emb(position_ids, h.dtype)
        for i, layer in enumerate(self.decoder_layers):
            cos, sin = rope[layer.layer_type]
            layer_input = None if layer_inputs is None else layer_inputs[:, :, i]
            h = layer(
                h, cos, sin, masks[layer.layer_type], cache.layer(i), layer_input=layer_input, shared_kv=shared_kv
            )
        cache.advance(new)
        return self.norm(h), {}


def _check_layer_ids(ids: Iterable[int] | None, n_layers: int) -> set[int]:
    if ids is None:
        return set()
    wanted = set(ids)
    bad = sorted(i for i in wanted if not isinstance(i, int) or not 0 <= i < n_layers)
    if bad:
        raise ValueError(f"output_hidden_states layer ids {bad} are out of range [0, {n_layers})")
    return wanted


class LlamaForCausalLM(nn.Module):
    """Decoder plus ``lm_head``; keys and numerics match the HF ``*ForCausalLM`` of ``args.model_type``.

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
        for layer in self.model.decoder_layers:
            layer.init_weights(std)
        self.model.norm.reset_parameters()
        per_layer_inputs.init_modules(self.model, std)
        if not self.args.tie_word_embeddings:
            init_linear(self.lm_head, std)

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """Post-materialization setup: re-tie embeddings and precompute RoPE on ``device``.

        Call after params were materialized from the meta device (``load_state_dict(..., assign=True)``
        or an external loader). RoPE would also be computed lazily on first forward.
        """
        self.tie_weights()
        for rope in (self.model.rotary_emb, self.model.local_rotary_emb):
            if rope is not None:
                rope.reset_cache(device)

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
        ``max_prob=0`` disables it. A layer whose keys and values later layers reuse is never skipped.
        """
        probs = layer_dropout_probs(len(self.model.layers), max_prob=max_prob, schedule=schedule, layers=layers)
        stores = [i for i, p in enumerate(probs) if p > 0 and self.args.kv_sharing(i) == "store"]
        if stores:
            raise ValueError(
                f"layer dropout would skip layers {stores}, whose keys and values later layers reuse "
                "(ModelArgs.kv_shared_layers); give layer_dropout layers that leave them out"
            )
        self.model.layer_dropout_probs = probs if max_prob > 0 else None
        self.model.layer_dropout_generator = generator
        return probs

    def logits_from_hidden(self, hidden: Tensor) -> Tensor:
        """Apply the shared final norm and ``lm_head`` to an intermediate hidden state (early exit)."""
        return self.output_head(self.model.norm(hidden))

    def output_head(self, hidden: Tensor) -> Tensor:
        """Final hidden states -> logits: ``lm_head``, then the family's final soft-capping (Gemma)."""
        return softcap(self.lm_head(hidden), self.args.final_logit_softcapping)

    def loss_head(self, *, final_norm: bool = False) -> Callable[[Tensor], Tensor]:
        """The head ``head_loss`` gets (with the shared final norm first for early exits): a
        :class:`LinearHead` when ``lm_head`` is a plain linear, so chunked losses make each chunk's
        gradients in the forward instead of again in backward; else the head as a function (LoRA
        on ``lm_head``). Call it inside forward, where FSDP2 has the weight gathered."""
        if type(self.lm_head) is not nn.Linear:
            return self.logits_from_hidden if final_norm else self.output_head
        norm = self.model.norm if final_norm else None
        return LinearHead(self.lm_head.weight, self.lm_head.bias, self.args.final_logit_softcapping, norm)

    def forward(
        self,
        tokens: Tensor,
        *,
        position_ids: Tensor | None = None,
        sample_lengths: Sequence[Sequence[int]] | None = None,
        output_hidden_states: Iterable[int] | None = None,
        hidden_to_logits: bool = False,
        head_loss: HeadLoss | None = None,
        kv_cache: KVCache | None = None,
        routing: Routing | None = None,
        context: ContextShard | None = None,
    ) -> Any:
        """``tokens`` ``[b, s]`` -> logits ``[b, s, vocab]``; packed rows give ``position_ids`` and
        ``sample_lengths`` (see :meth:`LlamaModel.forward`).

        With ``output_hidden_states=[i, ...]`` returns ``(logits, {i: output of layer i})``
        (layer ids are 0-based; HF's ``hidden_states[i + 1]``). ``hidden_to_logits=True``
        maps those through norm + lm_head inside this forward, which keeps the root's
        parameters inside FSDP's forward hooks.

        ``head_loss(hidden, head)`` replaces the logits: it gets the final hidden states and the
        output head (a function hidden -> logits) and returns what forward returns, e.g. a
        chunked loss (:mod:`shardtune.losses.chunked`) that never makes full logits. With
        ``output_hidden_states`` each chosen layer's output goes through it too, with the head
        ``norm + lm_head``: ``(head_loss(final), {i: head_loss(layer i)})``. It runs inside this
        forward, so FSDP2 has the head's parameters gathered in forward and backward.

        ``kv_cache`` (generation, :class:`~shardtune.models.kv_cache.KVCache`): ``tokens`` continue
        the cached ones; returns their logits.

        ``routing`` (mixture-of-experts models, :class:`~shardtune.models.moe_aux.Routing`): the sparse
        layers record their router logits there; ``routing.aux_loss()`` is then transformers'
        ``aux_loss`` and ``routing.add_to(loss, coef)`` adds it to a loss made from this forward.

        ``context`` (context parallel): ``tokens`` and ``position_ids`` are this rank's part of a
        :func:`~shardtune.models.context_parallel.split_batch`; the outputs are its tokens'.
        """
        h, hidden = self.model(
            tokens,
            position_ids=position_ids,
            sample_lengths=sample_lengths,
            output_hidden_states=output_hidden_states,
            kv_cache=kv_cache,
            routing=routing,
            context=context,
        )
        if head_loss is not None:
            out = head_loss(h, self.loss_head())
            if output_hidden_states is None:
                return out
            exit_head = head_for_several_losses(self.loss_head(final_norm=True))
            return out, {i: head_loss(x, exit_head) for i, x in hidden.items()}
        logits = self.output_head(h)
        if output_hidden_states is None:
            return logits
        if hidden_to_logits:
            hidden = {i: self.logits_from_hidden(x) for i, x in hidden.items()}
        return logits, hidden


DecoderForCausalLM = LlamaForCausalLM  # the family-neutral name of the one decoder class
