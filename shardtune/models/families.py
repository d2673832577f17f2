"""One spec per supported HF ``model_type``: what differs from Llama and how its config.json reads/writes.

The decoder (``llama.py``) is shared; a ``Family`` only names the structural switches
(fused projections, QK-norm, Gemma-style norms) and converts the family's own config keys
to/from ``ModelArgs`` fields. Keys common to every family (sizes, heads, eps, rope, tied
embeddings) are handled once in ``args.py``. Adding a family = one ``Family`` entry here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardtune.model_presets import GPT_OSS_YARN
from shardtune.models.args import FULL, SLIDING, ModelArgs
from shardtune.models.moe_args import MoeArgs

__all__ = ["FAMILIES", "Family", "family_of", "get_family", "supported_model_types"]


@dataclass(frozen=True)
class Family:
    """Structure and config conversion of one HF model family.

    ``read(cfg)`` returns the family-specific ``ModelArgs`` keyword arguments; ``write(args)``
    returns the family-specific config.json entries (raising when ``args`` uses a feature the
    family's HF class cannot express). ``lora_aliases`` maps Llama projection names to the
    fused module that holds them (Phi-3), so generic LoRA targets still apply.
    """

    model_type: str
    architecture: str
    read: Callable[[Mapping[str, Any]], dict[str, Any]]
    write: Callable[[ModelArgs], dict[str, Any]]
    fused_qkv: bool = False
    fused_gate_up: bool = False
    qk_norm: bool = False
    gemma_norm: bool = False  # (1 + w) RMSNorm weights and embeddings scaled by sqrt(hidden)
    sandwich_norm: bool = False  # norms after attention/MLP outputs too (Gemma 2/3)
    act_key: str = "hidden_act"
    default_act: str = "silu"
    default_tie: bool = False
    lora_aliases: dict[str, str] = field(default_factory=dict)
    rope_type_aliases: dict[str, str] = field(default_factory=dict)
    default_theta: float = 10000.0
    default_eps: float = 1e-6
    default_local_theta: float | None = None  # sliding layers' own rope base (Gemma 3)
    moe: bool = False  # sparse layers route to experts (``ModelArgs.moe``, models/moe.py)
    clamped_swiglu: bool = False  # biased experts with a clamped SwiGLU, attention sinks (gpt-oss, models/gpt_oss.py)


def _require(args: ModelArgs, family: str, **expected: Any) -> None:
    """Raise when ``args`` has a value the family's HF class has no config key for."""
    for name, want in expected.items():
        if getattr(args, name) != want:
            raise ValueError(
                f"model_type {family!r} cannot express ModelArgs.{name}={getattr(args, name)!r} in config.json "
                f"(needs {want!r}); pick a model_type that has it (see shardtune.models.supported_model_types())"
            )


def _uniform_window(args: ModelArgs, family: str) -> int | None:
    """The window of families whose sliding window applies to every layer (Mistral, Phi-3)."""
    if args.sliding_window is None:
        return None
    if set(args.layer_types or ()) != {SLIDING}:
        raise ValueError(f"model_type {family!r} slides every layer or none; got layer_types={args.layer_types}")
    return args.sliding_window


def _read_window(cfg: Mapping[str, Any]) -> dict[str, Any]:
    window = cfg.get("sliding_window")
    return {"sliding_window": int(window) if window else None}


# --- llama ---------------------------------------------------------------------------------------------------------
def _llama_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias", False))}


def _llama_write(args: ModelArgs) -> dict[str, Any]:
    if args.attention_bias != args.o_proj_bias:
        raise ValueError(
            "HF Llama's attention_bias covers q/k/v and o_proj together; set o_proj_bias == attention_bias "
            "or use model_type='qwen2' (q/k/v biases only)"
        )
    _require(args, "llama", sliding_window=None)
    return {
        "attention_bias": args.attention_bias,
        "mlp_bias": args.mlp_bias,
        "head_dim": args.head_dim,
        "pretraining_tp": 1,
    }


# --- mistral ---------------------------------------------------------------------------------------------------------
def _mistral_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return _read_window(cfg)


def _mistral_write(args: ModelArgs) -> dict[str, Any]:
    _require(args, "mistral", attention_bias=False, o_proj_bias=False, mlp_bias=False)
    return {"head_dim": args.head_dim, "sliding_window": _uniform_window(args, "mistral")}


# --- qwen2 / qwen3 ---------------------------------------------------------------------------------------------------
def _qwen_window(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen: ``use_sliding_window`` gates the window; ``layer_types`` (or ``max_window_layers``) picks the layers."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        first = int(cfg.get("max_window_layers", 28))
        types = [SLIDING if window is not None and i >= first else FULL for i in range(n)]
    if window is None or SLIDING not in types:  # transformers drops the window unless both are set
        window, types = None, [FULL] * n
    return {"sliding_window": int(window) if window else None, "layer_types": list(types)}


def _qwen_window_write(args: ModelArgs) -> dict[str, Any]:
    sliding = args.sliding_window is not None
    return {
        "use_sliding_window": sliding,
        "sliding_window": args.sliding_window,
        "layer_types": list(args.layer_types or ()),
        "max_window_layers": args.n_layers,
    }


def _qwen2_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return {"attention_bias": True, **_qwen_window(cfg)}


def _qwen2_write(args: ModelArgs) -> dict[str, Any]:
    _require(args, "qwen2", attention_bias=True, o_proj_bias=False, mlp_bias=False)
    if args.head_dim != args.dim // args.n_heads:
        raise ValueError("model_type 'qwen2' needs head_dim == dim // n_heads; use model_type='llama'")
    return _qwen_window_write(args)


def _qwen3_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    return {"attention_bias": bias, "o_proj_bias": bias, **_qwen_window(cfg)}


def _qwen3_write(args: ModelArgs) -> dict[str, Any]:
    _require(args, "qwen3", o_proj_bias=args.attention_bias, mlp_bias=False)
    return {"attention_bias": args.attention_bias, "head_dim": args.head_dim, **_qwen_window_write(args)}


# --- phi3 ------------------------------------------------------------------------------------------------------------
def _phi3_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return _read_window(cfg)


def _phi3_write(args: ModelArgs) -> dict[str, Any]:
    _require(args, "phi3", attention_bias=False, o_proj_bias=False, mlp_bias=False)
    if args.head_dim != args.dim // args.n_heads:
        raise ValueError("model_type 'phi3' needs head_dim == dim // n_heads")
    out: dict[str, Any] = {
        "sliding_window": _uniform_window(args, "phi3"),
        "partial_rotary_factor": args.partial_rotary_factor,
    }
    if args.rope_scaling and "original_max_position_embeddings" in args.rope_scaling:
        out["original_max_position_embeddings"] = args.rope_scaling["original_max_position_embeddings"]
    return out


# --- gemma2 / gemma3_text --------------------------------------------------------------------------------------------
def _gemma_read(cfg: Mapping[str, Any], pattern: int, softcaps: tuple[float | None, float | None]) -> dict[str, Any]:
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("config use_bidirectional_attention=true is not supported (causal LM training only)")
    n = int(cfg["num_hidden_layers"])
    pattern = int(cfg.get("sliding_window_pattern", pattern))
    types = cfg.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    bias = bool(cfg.get("attention_bias", False))
    return {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "head_dim": int(cfg.get("head_dim", 256)),
        "query_pre_attn_scalar": cfg.get("query_pre_attn_scalar", 256),
        "sliding_window": int(cfg.get("sliding_window", 4096)),
        "layer_types": list(types),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping", softcaps[0]),
        "final_logit_softcapping": cfg.get("final_logit_softcapping", softcaps[1]),
    }


def _gemma_write(args: ModelArgs, family: str) -> dict[str, Any]:
    _require(args, family, o_proj_bias=args.attention_bias, mlp_bias=False)
    if args.sliding_window is None:
        raise ValueError(f"model_type {family!r} needs sliding_window (use layer_types to make every layer full)")
    return {
        "attention_bias": args.attention_bias,
        "head_dim": args.head_dim,
        "query_pre_attn_scalar": args.query_pre_attn_scalar or args.head_dim,
        "sliding_window": args.sliding_window,
        "layer_types": list(args.layer_types or ()),
        "attn_logit_softcapping": args.attn_logit_softcapping,
        "final_logit_softcapping": args.final_logit_softcapping,
        "hidden_activation": args.hidden_act,
        "use_bidirectional_attention": False,
    }


def _gemma2_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return _gemma_read(cfg, 2, (50.0, 30.0))


def _gemma3_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    return _gemma_read(cfg, 6, (None, None))


# --- qwen3_moe / mixtral ---------------------------------------------------------------------------------------------
def _experts(cfg: Mapping[str, Any], *, count_key: str, size_key: str, **fixed: Any) -> dict[str, Any]:
    # transformers' Qwen3MoeConfig maps num_experts to num_local_experts when it writes config.json
    count = cfg.get(count_key, cfg.get("num_local_experts"))
    if count is None or "num_experts_per_tok" not in cfg or size_key not in cfg:
        raise ValueError(
            f"config.json of model_type {cfg.get('model_type')!r} needs {count_key}, num_experts_per_tok and "
            f"{size_key}; use the model's config.json as transformers writes it"
        )
    return {
        "moe": MoeArgs(
            num_experts=int(count),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg[size_key]),
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.001)),
            **fixed,
        )
    }


def _qwen3_moe_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    bias = bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
    experts = _experts(
        cfg,
        count_key="num_experts",
        size_key="moe_intermediate_size",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()),
        decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
    )
    return {"attention_bias": bias, "o_proj_bias": bias, **_read_window({"sliding_window": window}), **experts}


def _moe_entries(moe: MoeArgs) -> dict[str, Any]:
    return {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.router_aux_loss_coef}


def _qwen3_moe_write(args: ModelArgs) -> dict[str, Any]:
    _require(args, "qwen3_moe", o_proj_bias=args.attention_bias, mlp_bias=False)
    moe, window = args.moe, _uniform_window(args, "qwen3_moe")
    assert moe is not None  # ModelArgs.__post_init__ requires it for this family
    return {
        "attention_bias": args.attention_bias,
        "head_dim": args.head_dim,
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "num_experts": moe.num_experts,
        "moe_intermediate_size": moe.intermediate_size,
        "norm_topk_prob": moe.norm_topk_prob,
        "mlp_only_layers": list(moe.mlp_only_layers),
        "decoder_sparse_step": moe.decoder_sparse_step,
        **_moe_entries(moe),
    }


def _mixtral_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    if cfg.get("router_jitter_noise"):
        raise ValueError(
            f"config router_jitter_noise={cfg['router_jitter_noise']} is not supported (it randomizes routing in "
            "training); set it to 0.0 in config.json"
        )
    experts = _experts(
        cfg, count_key="num_local_experts", size_key="intermediate_size", norm_topk_prob=True, fp32_scores=True
    )
    return {**_read_window(cfg), **experts}


def _every_layer_experts(args: ModelArgs, problem: str, **fixed: Any) -> MoeArgs:
    """``args.moe``, after checking it has experts of ``intermediate_size`` in every layer and the
    family's ``fixed`` fields (``problem``: the error otherwise)."""
    moe = args.moe
    assert moe is not None  # ModelArgs.__post_init__ requires it for MoE families
    expected = dataclasses.replace(
        moe, intermediate_size=args.intermediate_size, mlp_only_layers=(), decoder_sparse_step=1, **fixed
    )
    if moe != expected:
        raise ValueError(problem)
    return moe


def _mixtral_write(args: ModelArgs) -> dict[str, Any]:
    _require(args, "mixtral", attention_bias=False, o_proj_bias=False, mlp_bias=False)
    moe = _every_layer_experts(
        args,
        "model_type 'mixtral' has experts of intermediate_size in every layer, normalized fp32 top-k weights: "
        "set MoeArgs(intermediate_size=ModelArgs.intermediate_size, norm_topk_prob=True, fp32_scores=True) "
        "without mlp_only_layers, or use model_type='qwen3_moe'",
        norm_topk_prob=True,
        fp32_scores=True,
    )
    return {
        "head_dim": args.head_dim,
        "sliding_window": _uniform_window(args, "mixtral"),
        "num_local_experts": moe.num_experts,
        "router_jitter_noise": 0.0,
        **_moe_entries(moe),
    }


# --- gpt_oss ---------------------------------------------------------------------------------------------------------


def _gpt_oss_read(cfg: Mapping[str, Any]) -> dict[str, Any]:
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    bias = bool(cfg.get("attention_bias", True))
    heads = int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim", 64) or int(cfg["hidden_size"]) // heads
    experts = _experts(
        cfg,
        count_key="num_local_experts",
        size_key="intermediate_size",
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
    )
    out: dict[str, Any] = {
        "attention_bias": bias,
        "o_proj_bias": bias,
        "head_dim": int(head_dim),
        "n_kv_heads": int(cfg.get("num_key_value_heads", 8) or heads),
        "sliding_window": int(cfg.get("sliding_window") or 128),
        "layer_types": list(types),
        "max_seq_len": int(cfg.get("max_position_embeddings", 131072)),
        **experts,
    }
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        out["rope_scaling"] = dict(GPT_OSS_YARN)  # transformers' GptOssConfig default
    return out


def _gpt_oss_write(args: ModelArgs) -> dict[str, Any]:
    _require(args, "gpt_oss", o_proj_bias=args.attention_bias, mlp_bias=False)
    moe = _every_layer_experts(
        args,
        "model_type 'gpt_oss' has experts of intermediate_size in every layer with softmaxed top-k logits: set "
        "MoeArgs(intermediate_size=ModelArgs.intermediate_size, norm_topk_prob=False, fp32_scores=False) without "
        "mlp_only_layers",
        norm_topk_prob=False,
        fp32_scores=False,
    )
    if args.sliding_window is None:
        raise ValueError("model_type 'gpt_oss' needs sliding_window (use layer_types to make every layer full)")
    return {
        "attention_bias": args.attention_bias,
        "head_dim": args.head_dim,
        "sliding_window": args.sliding_window,
        "layer_types": list(args.layer_types or ()),
        "num_local_experts": moe.num_experts,
        "swiglu_limit": moe.swiglu_limit,
        "swiglu_alpha": moe.swiglu_alpha,
        **_moe_entries(moe),
    }


_FUSED = {
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
}
_GEMMA: dict[str, Any] = {
    "gemma_norm": True,
    "sandwich_norm": True,
    "act_key": "hidden_activation",
    "default_act": "gelu_pytorch_tanh",
    "default_tie": True,
}

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama", "LlamaForCausalLM", _llama_read, _llama_write),
        Family("mistral", "MistralForCausalLM", _mistral_read, _mistral_write),
        Family("qwen2", "Qwen2ForCausalLM", _qwen2_read, _qwen2_write),
        Family("qwen3", "Qwen3ForCausalLM", _qwen3_read, _qwen3_write, qk_norm=True),
        Family(
            "phi3",
            "Phi3ForCausalLM",
            _phi3_read,
            _phi3_write,
            fused_qkv=True,
            fused_gate_up=True,
            default_eps=1e-5,
            lora_aliases=_FUSED,
            rope_type_aliases={"su": "longrope", "yarn": "longrope"},
        ),
        Family("gemma2", "Gemma2ForCausalLM", _gemma2_read, lambda a: _gemma_write(a, "gemma2"), **_GEMMA),
        Family(
            "gemma3_text",
            "Gemma3ForCausalLM",
            _gemma3_read,
            lambda a: _gemma_write(a, "gemma3_text"),
            qk_norm=True,
            default_theta=1_000_000.0,
            default_local_theta=10_000.0,
            **_GEMMA,
        ),
        Family("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3_moe_read, _qwen3_moe_write, qk_norm=True, moe=True),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            _mixtral_read,
            _mixtral_write,
            default_theta=1_000_000.0,
            default_eps=1e-5,
            moe=True,
        ),
        Family(
            "gpt_oss",
            "GptOssForCausalLM",
            _gpt_oss_read,
            _gpt_oss_write,
            default_theta=150_000.0,
            default_eps=1e-5,
            moe=True,
            clamped_swiglu=True,
        ),
    )
}


def supported_model_types() -> list[str]:
    """HF ``model_type`` values shardtune builds."""
    return list(FAMILIES)


def family_of(args: ModelArgs) -> Family:
    """The spec of ``args.model_type``, checked against ``args``: experts (``args.moe``) exactly
    for mixture-of-experts families. ``ValueError`` naming the model type otherwise."""
    family = get_family(args.model_type)
    if family.moe != (args.moe is not None):
        raise ValueError(
            f"ModelArgs.moe must be set exactly for mixture-of-experts model types; model_type "
            f"{args.model_type!r} {'needs' if args.moe is None else 'has no'} experts"
        )
    if args.moe is not None and family.clamped_swiglu != (args.moe.swiglu_limit is not None):
        raise ValueError(
            "MoeArgs.swiglu_limit must be set exactly for model types with clamped-SwiGLU experts (gpt_oss); "
            f"model_type {args.model_type!r} "
            + ("needs it" if family.clamped_swiglu else "has none: leave swiglu_limit None")
        )
    return family


def get_family(model_type: str) -> Family:
    """The spec for ``model_type``; a ``ValueError`` listing the supported ones otherwise."""
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported model types: {supported_model_types()}"
        ) from None
