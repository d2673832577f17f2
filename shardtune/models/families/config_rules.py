"""What several families' config.json conversions share: checks of what a config can say, windows, experts.

Rule: a helper lives here once two families use it; one family's own rules stay in its module."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from shardtune.models.args import SLIDING, ModelArgs
from shardtune.models.moe_args import MoeArgs

__all__ = [
    "every_layer_experts",
    "grouped_expert_entries",
    "moe_entries",
    "read_experts",
    "read_grouped_experts",
    "read_partial_rotary",
    "read_window",
    "require",
    "uniform_window",
]


def require(args: ModelArgs, family: str, **expected: Any) -> None:
    """Raise when ``args`` has a value the family's HF class has no config key for."""
    for name, want in expected.items():
        if getattr(args, name) != want:
            raise ValueError(
                f"model_type {family!r} cannot express ModelArgs.{name}={getattr(args, name)!r} in config.json "
                f"(needs {want!r}); pick a model_type that has it (see shardtune.models.supported_model_types())"
            )


def uniform_window(args: ModelArgs, family: str) -> int | None:
    """The window of families whose sliding window applies to every layer (Mistral, Phi-3)."""
    if args.sliding_window is None:
        return None
    if set(args.layer_types or ()) != {SLIDING}:
        raise ValueError(f"model_type {family!r} slides every layer or none; got layer_types={args.layer_types}")
    return args.sliding_window


def read_window(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``sliding_window`` as a positive int or None (0 and null: no window)."""
    window = cfg.get("sliding_window")
    return {"sliding_window": int(window) if window else None}


def read_partial_rotary(cfg: Mapping[str, Any], default: float) -> float:
    """``partial_rotary_factor`` from the rope dict or the top level, ``default`` (the family's) when absent."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default))
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 1:
        raise ValueError(f"config partial_rotary_factor must be a number in (0, 1], got {value!r}")
    return float(value)


def read_experts(
    cfg: Mapping[str, Any], *, count_key: str, size_key: str, default_aux_loss_coef: float = 0.001, **fixed: Any
) -> dict[str, Any]:
    """``{"moe": MoeArgs}`` from the experts' count under ``count_key``, their size under ``size_key``, and ``fixed``
    (``default_aux_loss_coef``: the family's ``router_aux_loss_coef`` when the config has none)."""
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
            router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", default_aux_loss_coef)),
            **fixed,
        )
    }


def _get(cfg: Mapping[str, Any], key: str, default: Any) -> Any:
    """``cfg[key]``, or transformers' ``default`` when absent or null."""
    value = cfg.get(key)
    return default if value is None else value


def read_grouped_experts(
    cfg: Mapping[str, Any], *, n_group: int, topk_group: int, routed_scaling_factor: float, first_dense: int
) -> dict[str, Any]:
    """``{"moe": MoeArgs}`` of DeepSeek-V3's sparse layers (GLM-4.5's too): ``n_routed_experts`` experts routed by
    group-limited sigmoid scores, an ungated shared MLP ``n_shared_experts`` experts wide, the first
    ``first_k_dense_replace`` layers dense; the keyword arguments are the family's defaults for absent keys."""
    shared = _get(cfg, "n_shared_experts", 1)
    if shared < 1:
        raise ValueError(
            f"config n_shared_experts must be >= 1 for {cfg.get('model_type')!r} (it always has shared_experts), "
            f"got {shared}"
        )
    size = cfg.get("moe_intermediate_size")
    return read_experts(
        cfg,
        count_key="n_routed_experts",
        size_key="moe_intermediate_size",
        default_aux_loss_coef=0.0,  # transformers adds no load-balancing loss for these families
        norm_topk_prob=bool(_get(cfg, "norm_topk_prob", True)),
        fp32_scores=True,
        mlp_only_layers=tuple(range(_get(cfg, "first_k_dense_replace", first_dense))),
        shared_expert_intermediate_size=shared * size if isinstance(size, int) else None,
        n_group=_get(cfg, "n_group", n_group),
        topk_group=_get(cfg, "topk_group", topk_group),
        routed_scaling_factor=float(_get(cfg, "routed_scaling_factor", routed_scaling_factor)),
    )


def grouped_expert_entries(args: ModelArgs, family: str) -> dict[str, Any]:
    """The config.json entries of :func:`read_grouped_experts`' experts; raises when ``args.moe`` has a layout
    those keys cannot say."""
    moe = args.moe
    assert moe is not None  # family_of requires it for these families
    dense = len(moe.mlp_only_layers)
    shared = moe.shared_expert_intermediate_size or 0
    if (
        moe.mlp_only_layers != tuple(range(dense))
        or moe.decoder_sparse_step != 1
        or not moe.fp32_scores
        or shared % moe.intermediate_size
    ):
        raise ValueError(
            f"model_type {family!r} has dense layers first (first_k_dense_replace), then sparse ones with fp32 "
            "routing weights and a shared MLP of n_shared_experts experts: set MoeArgs(mlp_only_layers=(0, ..., k-1), "
            "decoder_sparse_step=1, fp32_scores=True, shared_expert_intermediate_size=n * intermediate_size)"
        )
    return {
        "n_routed_experts": moe.num_experts,
        "moe_intermediate_size": moe.intermediate_size,
        "n_shared_experts": shared // moe.intermediate_size,
        "first_k_dense_replace": dense,
        "norm_topk_prob": moe.norm_topk_prob,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.routed_scaling_factor,
        **moe_entries(moe),
    }


def moe_entries(moe: MoeArgs) -> dict[str, Any]:
    """The router entries every mixture-of-experts config.json writes."""
    return {"num_experts_per_tok": moe.top_k, "router_aux_loss_coef": moe.router_aux_loss_coef}


def every_layer_experts(args: ModelArgs, problem: str, **fixed: Any) -> MoeArgs:
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
