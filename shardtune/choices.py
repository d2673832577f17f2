"""The names a config key chooses from, written once as plain data.

Rule: each list lives here and nowhere else; the config schemas (:mod:`shardtune.recipes.schemas`) offer
it as a key's choices and the module that implements the names imports it from here. This module imports
nothing, so ``shardtune ls/cp/validate`` check a config without importing torch.
"""

from __future__ import annotations

# ``optimizer.name``: built by ``shardtune.training.optim.build_optimizer``.
OPTIMIZERS = ("adamw", "adamw_fused", "adamw8bit", "adamw4bit", "sgd")

# ``lora.block_size`` / ``lora.scaler_block_size`` defaults: the QLoRA paper's NF4 block sizes (values per scale,
# scales per second-level scale), used by ``shardtune.peft.nf4``.
NF4_BLOCK_SIZE = 64
NF4_SCALER_BLOCK_SIZE = 256

# ``lora.quantize_base``: how the frozen LoRA bases are held (``true`` is ``"nf4"``: QLoRA; ``"block_fp8"``: a
# block-FP8 checkpoint's weights kept in FP8), by ``shardtune.peft.lora.apply_lora``.
QUANTIZE_BASE = (False, True, "nf4", "block_fp8")

# ``weight_format`` (and ``shardtune convert --weight-format``): how an HF save writes the weights, in the training
# (or ``dtype``) dtype or in the source's block FP8, by ``shardtune.checkpoint.formats.block_fp8_save``.
WEIGHT_FORMATS = ("dtype", "block_fp8")

# ``context_parallel_mode``: how an attention layer sees the whole rows of a split row, by
# ``shardtune.models.context_parallel.split_batch`` (all_gather: every rank gathers the keys and values of all heads;
# all_to_all: ranks trade tokens for heads, ``shardtune.models.context_heads``).
CONTEXT_PARALLEL_MODES = ("all_gather", "all_to_all")

# ``lr_scheduler.name``: built by ``shardtune.training.optim.build_lr_scheduler``.
LR_SCHEDULES = ("cosine", "linear", "constant")

# ``lora.target_modules``: PEFT's module names for every family (``qkv_proj``/``gate_up_proj`` are Phi-3's
# fused projections, ``in_proj_*``/``out_proj`` Qwen3.5's linear-attention ones, ``shared_expert_gate`` the sigmoid
# gate of Qwen3.5-MoE's shared expert, whose projections are ``gate_proj``/``up_proj``/``down_proj``; ``q_a_proj``,
# ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj`` DeepSeek-V3's latent attention ones); applied by
# ``shardtune.peft.lora``.
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "qkv_proj",
    "o_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "down_proj",
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_a",
    "in_proj_b",
    "out_proj",
    "shared_expert_gate",
    "lm_head",
)

# ``lora.target_parameters``: PEFT's parameter names of mixture-of-experts layers (fused expert weights, the
# router); applied by ``shardtune.peft.param_lora``.
LORA_TARGET_PARAMETERS = (
    "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj",
    "mlp.gate.weight",
    "mlp.router.weight",  # gpt-oss's router
    "experts.gate_up_proj",  # Gemma 4's experts, beside the layer's mlp
    "experts.down_proj",
)

# ``dtype``: the compute dtype of the recipes (``shardtune.recipes.builders`` maps each to a torch dtype).
DTYPES = ("bf16", "fp32")

# ``dpo.loss``: computed by ``shardtune.losses.preference``.
PREFERENCE_LOSSES = ("sigmoid", "ipo", "simpo")

# ``layer_dropout.schedule``: how the skip probability grows with depth (``shardtune.models.layer_dropout``).
LAYER_DROPOUT_SCHEDULES = ("uniform", "linear", "exponential")

# ``output_dir_policy``: what a fresh run does in an output_dir holding another run's outputs
# (``shardtune.checkpoint.safety.run_dir``).
OUTPUT_DIR_POLICIES = ("refuse", "new_run", "overwrite")

# ``loggers``: metric sinks besides ``metrics.jsonl``, opened by ``shardtune.training.trackers``; the package each
# needs (``pip install`` name).
LOGGERS = ("tensorboard", "wandb", "mlflow")
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
