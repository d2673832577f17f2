"""Llama-family models with HF-compatible ``state_dict`` keys, presets, builders and losses."""

from shardtune.models.args import (
    ModelArgs,
    load_hf_config,
    model_args_from_hf_config,
    model_args_to_hf_config,
)
from shardtune.models.layer_dropout import layer_dropout_probs
from shardtune.models.llama import Attention, DecoderLayer, HeadLoss, LlamaForCausalLM, LlamaModel, MLP, RMSNorm, sample_attention_mask
from shardtune.models.losses import (
    cross_entropy_loss,
    early_exit_loss,
    early_exit_loss_scales,
    forward_kl_loss,
)
from shardtune.models.registry import (
    build_model,
    get_model_args,
    list_models,
    llama_from_hf_config,
    register_model_args,
)
from shardtune.models.rope import RotaryEmbedding, compute_inv_freq

__all__ = [
    "Attention",
    "DecoderLayer",
    "HeadLoss",
    "LlamaForCausalLM",
    "LlamaModel",
    "MLP",
    "ModelArgs",
    "RMSNorm",
    "RotaryEmbedding",
    "build_model",
    "compute_inv_freq",
    "cross_entropy_loss",
    "early_exit_loss",
    "early_exit_loss_scales",
    "forward_kl_loss",
    "get_model_args",
    "layer_dropout_probs",
    "list_models",
    "llama_from_hf_config",
    "load_hf_config",
    "model_args_from_hf_config",
    "model_args_to_hf_config",
    "register_model_args",
    "sample_attention_mask",
]
