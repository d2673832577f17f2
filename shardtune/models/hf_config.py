"""``ModelArgs`` to and from Hugging Face ``config.json`` dicts, for every supported family.

Rule: the keys every family shares (sizes, heads, eps, rope, tied embeddings) are read and
written here once; a family's own keys are its ``Family.read``/``write`` (``families/``).
Both rope styles HF has used are read: the published Llama 3.x style (top-level
``rope_theta`` plus a ``rope_scaling`` dict) and the transformers >= 5 style (one
``rope_parameters`` dict). Nothing here imports ``transformers``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch

from shardtune.json_files import read_json
from shardtune.models.args import FULL, SLIDING, ModelArgs
from shardtune.models.families import Family, family_of, get_family, supported_model_types
from shardtune.models.multimodal import text_config as multimodal_text_config
from shardtune.models.multimodal import wrap_text_config
from shardtune.models.spec import OPTIONAL_FIELDS

__all__ = ["load_hf_config", "model_args_from_hf_config", "model_args_to_hf_config"]


def load_hf_config(config: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """Return a config dict from a dict, a ``config.json`` path, or a model directory.

    A file that is not UTF-8, not JSON or not a JSON object raises ``ValueError`` naming it (and the line)."""
    if isinstance(config, Mapping):
        return dict(config)
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no HF config at {path}; pass a config.json path, a model directory or a dict")
    fix = "re-copy config.json from the model repository (or re-save it with transformers' save_pretrained)"
    data = read_json(path, fix=fix)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object of config keys, got a {type(data).__name__}; {fix}")
    return data


# key -> (its JSON types, whether null is allowed: the readers take it as absent) for the config.json keys this
# module and ``families`` read. A wrong type would otherwise be cast silently (``true`` layers -> 1 layer).
_INT, _NUMBER, _BOOL, _STR, _BOOL_OR_STR = (int,), (int, float), (bool,), (str,), (bool, str)
_CONFIG_TYPES: dict[str, tuple[tuple[type, ...], bool]] = {
    **dict.fromkeys(
        ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"), (_INT, False)
    ),
    **dict.fromkeys(("max_position_embeddings", "max_window_layers", "sliding_window_pattern"), (_INT, False)),
    **dict.fromkeys(
        ("num_key_value_heads", "head_dim", "sliding_window", "original_max_position_embeddings"), (_INT, True)
    ),
    **dict.fromkeys(("rms_norm_eps", "rope_theta"), (_NUMBER, False)),
    **dict.fromkeys(
        (
            "partial_rotary_factor",
            "rope_local_base_freq",
            "query_pre_attn_scalar",
            "attn_logit_softcapping",
            "final_logit_softcapping",
        ),
        (_NUMBER, True),
    ),
    **dict.fromkeys(
        ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window"),
        (_BOOL, True),
    ),
    "use_bidirectional_attention": (_BOOL_OR_STR, True),  # Gemma 4 names what attends both ways: "all", "vision"
    "model_type": (_STR, False),
    **dict.fromkeys(("hidden_act", "hidden_activation"), (_STR, True)),
    **dict.fromkeys(("rope_scaling", "rope_parameters"), ((dict,), True)),
    "layer_types": ((list,), True),
    **dict.fromkeys(
        (
            "num_experts",
            "num_local_experts",
            "num_experts_per_tok",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "decoder_sparse_step",
            "n_routed_experts",
            "n_shared_experts",
            "first_k_dense_replace",
            "n_group",
            "topk_group",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "num_nextn_predict_layers",
        ),
        (_INT, True),
    ),
    **dict.fromkeys(("norm_topk_prob", "use_qk_norm", "rope_interleave"), (_BOOL, True)),
    **dict.fromkeys(
        ("router_aux_loss_coef", "router_jitter_noise", "swiglu_limit", "swiglu_alpha", "routed_scaling_factor"),
        (_NUMBER, True),
    ),
    "mlp_only_layers": ((list,), True),
}
_TYPE_NAMES: dict[tuple[type, ...], str] = {
    _INT: "an integer",
    _NUMBER: "a number",
    _BOOL: "true or false",
    _STR: "a string",
    _BOOL_OR_STR: "true, false or a string",
}


def _check_config_types(cfg: Mapping[str, Any], source: str) -> None:
    """Raise naming ``source`` and every key whose value has the wrong JSON type, or a missing ``model_type``."""
    problems = []
    if "model_type" not in cfg:
        problems.append(
            f'no model_type key, so the architecture is unknown; add the model\'s one, e.g. "model_type": "llama" '
            f"(supported: {', '.join(supported_model_types())})"
        )
    for key, (types, nullable) in _CONFIG_TYPES.items():
        if key not in cfg or (cfg[key] is None and nullable):
            continue
        value = cfg[key]
        ok = isinstance(value, types) and (bool in types or not isinstance(value, bool))
        if key == "layer_types" and ok:
            ok = all(isinstance(t, str) for t in value)
        if key == "mlp_only_layers" and ok:
            ok = all(isinstance(i, int) and not isinstance(i, bool) for i in value)
        if not ok:
            items = "integers" if key == "mlp_only_layers" else "strings"
            expected = _TYPE_NAMES.get(types) or f"a JSON {'object' if types == (dict,) else 'list of ' + items}"
            shown = json.dumps(value, default=repr)[:60]
            problems.append(f"{key} must be {expected}{' or null' if nullable else ''}, got {shown}")
    if problems:
        raise ValueError(
            f"{source}: "
            + "; ".join(problems)
            + ". Fix config.json (the model repository's, as transformers writes it)"
        )


def _config_path(config: str | os.PathLike) -> Path:
    path = Path(config)
    return path / "config.json" if path.is_dir() else path


def _rope_from_hf(cfg: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling``, ``partial_rotary_factor``, ``rope_local_theta`` from either HF rope style.

    Per-layer-type ``rope_parameters`` (Gemma 3) give the full-attention layers' rope and the
    sliding layers' base; top-level ``original_max_position_embeddings`` wins, as in transformers.
    """
    params = cfg.get("rope_parameters")
    local_theta = cfg.get("rope_local_base_freq")
    if params and FULL in params:
        sliding = params.get(SLIDING) or {}
        if sliding.get("rope_type", "default") != "default":
            raise ValueError("rope_parameters.sliding_attention: only rope_type 'default' is supported")
        local_theta = sliding.get("rope_theta", local_theta)
        params = params[FULL]
    if params:
        if not isinstance(params, Mapping) or ("rope_theta" not in params and "rope_type" not in params):
            raise ValueError("config 'rope_parameters' must be a dict with 'rope_type'/'rope_theta'")
        theta = params.get("rope_theta", cfg.get("rope_theta", family.default_theta))
        scaling: dict[str, Any] | None = dict(params)
    else:
        theta = cfg.get("rope_theta", family.default_theta)
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    partial = (scaling or {}).get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        scaling["rope_type"] = family.rope_type_aliases.get(rope_type, rope_type)
        if scaling["rope_type"] in ("llama3", "yarn", "longrope") and cfg.get("original_max_position_embeddings"):
            scaling["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    return {
        "rope_theta": float(theta),
        "rope_scaling": scaling,
        "partial_rotary_factor": float(partial if partial is not None else 1.0),
        "rope_local_theta": None
        if family.default_local_theta is None
        else float(local_theta or family.default_local_theta),
    }


def model_args_from_hf_config(config: Mapping[str, Any] | str | os.PathLike) -> ModelArgs:
    """``ModelArgs`` from an HF ``config.json`` (dict, file or model directory) of a supported family."""
    cfg = load_hf_config(config)
    source = "HF config dict" if isinstance(config, Mapping) else str(_config_path(config))
    multimodal, text = None, multimodal_text_config(cfg, source)
    if text is not None:  # a multimodal checkpoint: its text tower is the model
        multimodal, cfg, source = cfg, text, f"{source} (text_config)"
    _check_config_types(cfg, source)
    family = get_family(cfg["model_type"])
    act = cfg.get(family.act_key) or cfg.get("hidden_act") or family.default_act
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"config {family.act_key} {act!r} is not supported; only 'silu' and 'gelu_pytorch_tanh' are")
    missing = [
        k
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", family.size_key)
        if cfg.get(k) is None  # a nullable size key (shared_expert_intermediate_size) may be null
    ]
    if missing:
        raise ValueError(
            f"{source} lacks required keys {missing}; give the model's config.json as transformers writes it"
        )
    kept = ("bos_token_id", "eos_token_id", "pad_token_id", *filter(None, [family.carried_layers_key]))
    extra = {k: cfg[k] for k in kept if cfg.get(k) is not None}
    kwargs: dict[str, Any] = {
        "vocab_size": int(cfg["vocab_size"]),
        "dim": int(cfg["hidden_size"]),
        "n_layers": int(cfg["num_hidden_layers"]),
        "n_heads": int(cfg["num_attention_heads"]),
        "n_kv_heads": int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
        "intermediate_size": int(cfg[family.size_key]),
        "head_dim": int(cfg["head_dim"]) if cfg.get("head_dim") else None,
        "norm_eps": float(cfg.get("rms_norm_eps", family.default_eps)),
        "max_seq_len": int(cfg.get("max_position_embeddings", 2048)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", family.default_tie)),
        "model_type": family.model_type,
        "hidden_act": act,
        "extra": extra,
        "multimodal": multimodal,
        **_rope_from_hf(cfg, family),
    }
    kwargs.update(family.read(cfg))
    return ModelArgs(**kwargs)


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype


def _check_family_features(args: ModelArgs) -> None:
    """Raise when ``args`` uses a feature the family's HF config cannot say (it would load differently)."""
    family = family_of(args)
    unsupported = [
        k for k, unused in OPTIONAL_FIELDS.items() if k not in family.config_fields and getattr(args, k) != unused
    ]
    if unsupported:
        raise ValueError(
            f"model_type {args.model_type!r} has no config.json keys for ModelArgs {unsupported}; "
            "pick the model_type whose architecture has them"
        )


def _local_theta(args: ModelArgs) -> float:
    """The sliding layers' rope base as the model uses it (the global one when unset)."""
    return args.rope_theta if args.rope_local_theta is None else args.rope_local_theta


def _rope_entries(args: ModelArgs, family: Family, rope_style: str) -> dict[str, Any]:
    scaling = dict(args.rope_scaling) if args.rope_scaling else None
    if rope_style == "legacy" and not family.rope_parameters_only:
        out: dict[str, Any] = {"rope_theta": args.rope_theta, "rope_scaling": scaling}
        if family.local_rope:
            out["rope_local_base_freq"] = _local_theta(args)
        return out
    if rope_style not in ("legacy", "rope_parameters"):
        raise ValueError(f"rope_style must be 'legacy' or 'rope_parameters', got {rope_style!r}")
    params: dict[str, Any] = {"rope_type": "default", **(scaling or {}), "rope_theta": args.rope_theta}
    if args.partial_rotary_factor != 1.0:
        params["partial_rotary_factor"] = args.partial_rotary_factor
    if family.local_rope:
        local = {"rope_type": "default", "rope_theta": _local_theta(args)}
        return {"rope_parameters": {FULL: params, SLIDING: local}}
    return {"rope_parameters": params}


def model_args_to_hf_config(
    args: ModelArgs,
    *,
    dtype: torch.dtype | str | None = None,
    rope_style: Literal["legacy", "rope_parameters"] = "legacy",
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``config.json`` dict that ``transformers`` loads as the family's ``*ForCausalLM``.

    ``rope_style="legacy"`` writes ``rope_theta``/``rope_scaling`` (readable by transformers 4
    and 5); ``"rope_parameters"`` writes the transformers >= 5 form. ``extra`` entries are
    merged last (e.g. ``bos_token_id``). The text tower of a multimodal checkpoint
    (``args.multimodal``) gives that checkpoint's config with this one as its ``text_config``.
    """
    if args.multimodal is not None:
        text = model_args_to_hf_config(args.replace(multimodal=None), rope_style="rope_parameters")
        wrapped = wrap_text_config(args, text)
        if dtype is not None:
            wrapped["torch_dtype"] = wrapped["dtype"] = _dtype_name(dtype)
        return {**wrapped, **(extra or {})}
    family = get_family(args.model_type)
    _check_family_features(args)
    cfg: dict[str, Any] = {"architectures": [family.architecture], "model_type": family.model_type}
    cfg.update(family.write(args))
    cfg.update(
        vocab_size=args.vocab_size,
        hidden_size=args.dim,
        **{family.size_key: args.intermediate_size},
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=args.max_seq_len,
        rms_norm_eps=args.norm_eps,
        tie_word_embeddings=args.tie_word_embeddings,
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
    )
    cfg[family.act_key] = args.hidden_act
    cfg.update(_rope_entries(args, family, rope_style))
    if dtype is not None:
        # transformers 4 reads torch_dtype, 5 writes dtype (and still reads torch_dtype).
        cfg["torch_dtype"] = cfg["dtype"] = _dtype_name(dtype)
    cfg.update(args.extra)
    cfg.update(extra or {})
    return cfg
