"""Parameter-efficient fine-tuning: LoRA / QLoRA modules and adapter state-dict helpers."""

from shardtune.peft.adapters import (
    PEFT_PREFIX,
    from_peft_adapter_state_dict,
    get_adapter_state_dict,
    get_merged_state_dict,
    is_adapter_key,
    merge_lora_weight,
    peft_adapter_config,
    to_peft_adapter_state_dict,
)
from shardtune.peft.lora import (
    LORA_TARGETS,
    LoRAConfig,
    LoRALinear,
    adapters_disabled,
    apply_lora,
    build_lora_model,
    get_adapter_params,
    init_lora_parameters,
    is_lora,
    lora_config_of,
    merge_lora,
    resolve_targets,
)

__all__ = [
    "LORA_TARGETS",
    "PEFT_PREFIX",
    "LoRAConfig",
    "LoRALinear",
    "adapters_disabled",
    "apply_lora",
    "build_lora_model",
    "from_peft_adapter_state_dict",
    "get_adapter_params",
    "get_adapter_state_dict",
    "get_merged_state_dict",
    "init_lora_parameters",
    "is_adapter_key",
    "is_lora",
    "lora_config_of",
    "merge_lora",
    "merge_lora_weight",
    "peft_adapter_config",
    "resolve_targets",
    "to_peft_adapter_state_dict",
]
