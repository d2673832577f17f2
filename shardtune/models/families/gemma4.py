"""Gemma 4 text (``gemma4_text``, transformers' ``Gemma4ForCausalLM``): Gemma 3's sandwich-normed local/global
layers with per-layer-type head geometry, normed values, keys shared across layers and per-layer inputs.

What differs from Gemma 3: RMSNorm weights scale in fp32 without the ``1 +`` offset; attention is the
``qkv_norm_attention`` kind (q/k/v norms, scale 1; full layers with their own head width and kv heads,
``per_layer_config`` or the published ``global_head_dim``/``num_global_key_value_heads``, and keys as values
with ``attention_k_eq_v``); the last ``num_kv_shared_layers`` layers reuse earlier keys and values; every
layer ends with a ``layer_scalar`` and, with ``hidden_size_per_layer_input`` > 0, adds its per-layer input;
full layers rotate with ``proportional`` rope; with ``enable_moe_block`` every layer adds routed experts beside
its MLP (``Blocks.experts_beside_mlp``: router ``scale``/``per_expert_scale``, no load-balancing loss unless
``router_aux_loss_coef`` says so). transformers forces the last layer to full attention; so does this reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from shardtune.models.args import FULL, SLIDING, ModelArgs
from shardtune.models.families.config_rules import require
from shardtune.models.moe_args import MoeArgs
from shardtune.models.spec import AttentionSpec, Blocks, Family, Multimodal, SparseSpec

__all__ = ["GEMMA4_TEXT"]

_DEFAULT_ROPE: dict[str, dict[str, Any]] = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}
_GLOBAL_HEAD_DIM = 512  # transformers' default global_head_dim
_PATTERN = 6  # transformers' default: five sliding layers, then a full one
_LAYER_OVERRIDES = {"head_dim", "num_key_value_heads"}
_EXPERT_KEYS = {"num_experts": "num_experts", "top_k": "top_k_experts", "intermediate_size": "moe_intermediate_size"}


def _int(cfg: Mapping[str, Any], key: str, default: Any, *, minimum: int = 1) -> Any:
    value = cfg.get(key, default)
    if value is None and default is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"config {key} must be an integer >= {minimum}, got {value!r}; fix config.json")
    return value


def _flag(cfg: Mapping[str, Any], key: str) -> bool:
    value = cfg.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"config {key} must be true or false, got {value!r}; fix config.json")
    return value


def _layer_types(cfg: Mapping[str, Any]) -> list[str]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        types = [SLIDING if (i + 1) % _PATTERN else FULL for i in range(n)]
    unknown = sorted(set(types) - {FULL, SLIDING})
    if len(types) != n or unknown:
        raise ValueError(
            f"config layer_types must list num_hidden_layers={n} entries of {FULL!r} or {SLIDING!r}; got "
            f"{len(types)} entries" + (f" with unknown kinds {unknown}" if unknown else "") + ". Fix config.json"
        )
    return [*types[:-1], FULL]  # as transformers: the last layer is always full attention


def _full_geometry(cfg: Mapping[str, Any], types: list[str]) -> tuple[int | None, int | None]:
    """``(full_head_dim, full_n_kv_heads)`` from ``per_layer_config`` or the published global keys."""
    head_dim = _int(cfg, "head_dim", 256)
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        full_dim = _int(cfg, "global_head_dim", _GLOBAL_HEAD_DIM)
        full_kv = _int(cfg, "num_global_key_value_heads", None) if cfg.get("attention_k_eq_v") else None
    else:
        if not isinstance(per_layer, Mapping):
            raise ValueError(f"config per_layer_config must be an object of layer overrides, got {per_layer!r}")
        overrides = _layer_overrides(per_layer, types)
        full_dim, full_kv = overrides.get("head_dim"), overrides.get("num_key_value_heads")
    return (None if full_dim in (None, head_dim) else full_dim), (None if full_kv in (None, kv_heads) else full_kv)


def _layer_overrides(per_layer: Mapping[str, Any], types: list[str]) -> dict[str, Any]:
    """The one override dict ``per_layer_config`` gives every full-attention layer (and no other layer)."""
    given: dict[int, Any] = {}
    for key, value in per_layer.items():
        if not str(key).isdigit() or int(key) >= len(types) or not isinstance(value, Mapping):
            raise ValueError(f"config per_layer_config: {key!r} must be a layer index with an object of overrides")
        if set(value) - _LAYER_OVERRIDES:
            raise ValueError(
                f"config per_layer_config[{key!r}] overrides {sorted(set(value) - _LAYER_OVERRIDES)}; only "
                f"{sorted(_LAYER_OVERRIDES)} of full-attention layers are supported"
            )
        given[int(key)] = dict(value)
    full = [i for i, t in enumerate(types) if t == FULL]
    distinct = {tuple(sorted(given.get(i, {}).items())) for i in full}
    if set(given) - set(full) or len(distinct) > 1:
        raise ValueError(
            "config per_layer_config must give every full_attention layer the same head_dim/num_key_value_heads "
            f"and no sliding layer any (full layers: {full}, overridden: {sorted(given)})"
        )
    return dict(distinct.pop()) if distinct else {}


def _rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Full layers' rope (``proportional``: partial rotary) and the sliding layers' base."""
    params = cfg.get("rope_parameters") or _DEFAULT_ROPE
    if not isinstance(params, Mapping) or not isinstance(params.get(FULL), Mapping):
        raise ValueError(f"config rope_parameters must map {FULL!r} and {SLIDING!r} to rope dicts, got {params!r}")
    sliding = params.get(SLIDING) or _DEFAULT_ROPE[SLIDING]
    if sliding.get("rope_type", "default") != "default":
        raise ValueError("config rope_parameters.sliding_attention: only rope_type 'default' is supported")
    full: dict[str, Any] = dict(params[FULL])
    theta = full.pop("rope_theta", _DEFAULT_ROPE[FULL]["rope_theta"])
    # transformers' default rope of Gemma 4 rotates every channel of the layer's head
    scaling = None if full.get("rope_type", "default") == "default" else full
    return {
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "partial_rotary_factor": 1.0,
        "rope_local_theta": float(sliding.get("rope_theta", 10_000.0)),
    }


def _gemma4_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention") not in (None, "vision"):  # "vision": text tokens stay causal
        raise ValueError(
            "config use_bidirectional_attention must be null or 'vision' (causal LM training only), got "
            f"{cfg['use_bidirectional_attention']!r}"
        )
    types = _layer_types(cfg)
    full_dim, full_kv = _full_geometry(cfg, types)
    bias = _flag(cfg, "attention_bias")
    per_layer_dim = _int(cfg, "hidden_size_per_layer_input", 256, minimum=0)
    vocab = _int(cfg, "vocab_size_per_layer_input", 262_144)
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "head_dim": _int(cfg, "head_dim", 256),
        "sliding_window": _int(cfg, "sliding_window", 512),
        "layer_types": types,
        "final_logit_softcapping": cfg.get("final_logit_softcapping"),
        "full_head_dim": full_dim,
        "full_n_kv_heads": full_kv,
        "attention_k_eq_v": _flag(cfg, "attention_k_eq_v"),
        "kv_shared_layers": _int(cfg, "num_kv_shared_layers", 0, minimum=0),
        "double_wide_mlp": _flag(cfg, "use_double_wide_mlp") and bool(cfg.get("num_kv_shared_layers")),
        "per_layer_input_dim": per_layer_dim,
        "per_layer_input_vocab_size": None if not per_layer_dim or vocab == cfg["vocab_size"] else vocab,
        "moe": _read_experts(cfg),
        **_rope(cfg),
    }


def _read_experts(cfg: Mapping[str, Any]) -> MoeArgs | None:
    """Every layer's routed experts beside its MLP when ``enable_moe_block`` (none otherwise)."""
    if not _flag(cfg, "enable_moe_block"):
        return None
    sizes = {key: _int(cfg, key, None) for key in _EXPERT_KEYS.values()}
    missing = [key for key, value in sizes.items() if value is None]
    if missing:
        raise ValueError(f"config enable_moe_block=true needs {missing}; use the model's config.json")
    return MoeArgs(
        **{field: sizes[key] for field, key in _EXPERT_KEYS.items()},
        norm_topk_prob=True,  # Gemma 4's router always renormalizes its top k
        router_aux_loss_coef=float(cfg.get("router_aux_loss_coef") or 0.0),  # trained without one
    )


def _gemma4_write(args: ModelArgs) -> dict[str, Any]:
    require(args, "gemma4_text", o_proj_bias=args.attention_bias, mlp_bias=False)
    types = list(args.layer_types or ())
    if args.sliding_window is None or types[-1] != FULL:
        raise ValueError(
            "model_type 'gemma4_text' needs sliding_window and a full_attention last layer (ModelArgs.layer_types)"
        )
    overrides: dict[str, int] = {"head_dim": args.head_dim_of(FULL)}
    if args.full_n_kv_heads is not None:
        overrides["num_key_value_heads"] = args.full_n_kv_heads
    full = [i for i, t in enumerate(types) if t == FULL]
    digits = len(str(max(full)))
    out: dict[str, Any] = {
        "attention_bias": args.attention_bias,
        "head_dim": args.head_dim,
        "global_head_dim": args.head_dim_of(FULL),
        "per_layer_config": {str(i).zfill(digits): dict(overrides) for i in full},
        "sliding_window": args.sliding_window,
        "layer_types": types,
        "final_logit_softcapping": args.final_logit_softcapping,
        "use_bidirectional_attention": None,
        "attention_k_eq_v": args.attention_k_eq_v,
        "num_kv_shared_layers": args.kv_shared_layers,
        "use_double_wide_mlp": args.double_wide_mlp,
        "hidden_size_per_layer_input": args.per_layer_input_dim,
        "vocab_size_per_layer_input": args.per_layer_input_vocab_size or args.vocab_size,
        "enable_moe_block": args.moe is not None,
    }
    if args.attention_k_eq_v:
        out["num_global_key_value_heads"] = args.kv_heads_of(FULL)
    return out | _write_experts(args)


def _write_experts(args: ModelArgs) -> dict[str, Any]:
    moe = args.moe
    if moe is None:
        return {}
    every_layer = MoeArgs(
        moe.num_experts, moe.top_k, moe.intermediate_size, True, router_aux_loss_coef=moe.router_aux_loss_coef
    )
    if moe != every_layer:
        raise ValueError(
            "model_type 'gemma4_text' has routed experts in every layer, renormalized, with no other MoeArgs "
            f"option; got {moe}"
        )
    out = {key: getattr(moe, field) for field, key in _EXPERT_KEYS.items()}
    if moe.router_aux_loss_coef:
        out["router_aux_loss_coef"] = moe.router_aux_loss_coef
    return out


GEMMA4_TEXT = Family(
    "gemma4_text",
    "Gemma4ForCausalLM",
    _gemma4_read,
    _gemma4_write,
    blocks=Blocks(
        attention=AttentionSpec(kind="qkv_norm_attention"),
        sandwich_norm=True,
        scale_embeddings=True,
        norm_fp32_weight=True,
        layer_scalar=True,
        sparse=SparseSpec(router="scaled_softmax_topk", router_name="router", router_first=True),
        experts_beside_mlp=True,
    ),
    config_fields=frozenset(
        {
            "final_logit_softcapping",
            "hidden_act",
            "rope_local_theta",
            "full_head_dim",
            "full_n_kv_heads",
            "attention_k_eq_v",
            "kv_shared_layers",
            "double_wide_mlp",
            "per_layer_input_dim",
            "per_layer_input_vocab_size",
        }
    ),
    act_key="hidden_activation",
    default_act="gelu_pytorch_tanh",
    default_tie=True,
    default_theta=1_000_000.0,
    default_local_theta=10_000.0,
    rope_parameters_only=True,
    moe_optional=True,
)

# The hub checkpoints (Gemma4ForConditionalGeneration): the text decoder under model.language_model (its head
# tied to the embeddings), the vision and audio towers and their projections into the text (embed_vision,
# embed_audio) carried through.
GEMMA4 = Multimodal(
    "gemma4",
    "Gemma4ForConditionalGeneration",
    "gemma4_text",
    file_prefixes=(("model.", "model.language_model."),),
    text_prefixes=("model.language_model.", "lm_head."),
    towers={"vision_config": "model.vision_tower.", "audio_config": "model.audio_tower."},
)
