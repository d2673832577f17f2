"""Decoder models of the supported HF families with HF-identical ``state_dict`` keys, presets, builders."""

from shardtune.models.args import ModelArgs
from shardtune.models.families import FAMILIES, Family, get_family, supported_model_types
from shardtune.models.hf_config import load_hf_config, model_args_from_hf_config, model_args_to_hf_config
from shardtune.models.layer_dropout import layer_dropout_probs
from shardtune.models.llama import (
    MLP,
    Attention,
    DecoderForCausalLM,
    DecoderLayer,
    HeadLoss,
    LlamaForCausalLM,
    LlamaModel,
    RMSNorm,
)
from shardtune.models.moe_args import MoeArgs
from shardtune.models.moe_aux import Routing
from shardtune.models.packed_attention import sample_lengths
from shardtune.models.registry import (
    build_model,
    from_hf_config,
    get_model_args,
    list_models,
    llama_from_hf_config,
    register_model_args,
)
from shardtune.models.rope import RotaryEmbedding, compute_inv_freq
from shardtune.models.spec import AttentionSpec, Blocks, MlpSpec, SparseSpec

__all__ = [
    "FAMILIES",
    "MLP",
    "Attention",
    "AttentionSpec",
    "Blocks",
    "DecoderForCausalLM",
    "DecoderLayer",
    "Family",
    "HeadLoss",
    "LlamaForCausalLM",
    "LlamaModel",
    "MlpSpec",
    "ModelArgs",
    "MoeArgs",
    "RMSNorm",
    "RotaryEmbedding",
    "Routing",
    "SparseSpec",
    "build_model",
    "compute_inv_freq",
    "from_hf_config",
    "get_family",
    "get_model_args",
    "layer_dropout_probs",
    "list_models",
    "llama_from_hf_config",
    "load_hf_config",
    "model_args_from_hf_config",
    "model_args_to_hf_config",
    "register_model_args",
    "sample_lengths",
    "supported_model_types",
]
