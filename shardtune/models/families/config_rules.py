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
    "moe_entries",
    "read_experts",
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
