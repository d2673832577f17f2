"""Config key names people bring from other fine-tuning tools, and the shardtune key each means.

Rule: plain data, torch-free, imported by :mod:`shardtune.config_validation` alone: an unknown key
spelled as TRL, axolotl or the Hugging Face ``Trainer`` spell it is answered with shardtune's key
(and how its meaning differs, when it does) instead of a guess from the spelling.
"""

from __future__ import annotations

__all__ = ["FOREIGN_KEYS"]

# name in another tool -> (shardtune key path, how to convert the value; "" when it is the same)
FOREIGN_KEYS: dict[str, tuple[str, str]] = {
    "learning_rate": ("optimizer.lr", ""),
    "lr_scheduler_type": ("lr_scheduler.name", ""),
    "weight_decay": ("optimizer.weight_decay", ""),
    "optim": ("optimizer.name", ""),
    "optimizer_name": ("optimizer.name", ""),
    "warmup_steps": ("lr_scheduler.warmup_steps", ""),
    "warmup_ratio": ("lr_scheduler.warmup_steps", "a number of optimizer steps, not a fraction of the run"),
    "base_model": ("checkpoint_dir", "a local model directory (download a hub model first)"),
    "model_name_or_path": ("checkpoint_dir", "a local model directory (download a hub model first)"),
    "micro_batch_size": ("batch_size", "sequences per rank per micro-batch"),
    "per_device_train_batch_size": ("batch_size", "sequences per rank per micro-batch"),
    "num_epochs": ("epochs", ""),
    "num_train_epochs": ("epochs", ""),
    "gradient_accumulation": ("gradient_accumulation_steps", ""),
    "max_seq_length": ("max_seq_len", ""),
    "sequence_len": ("max_seq_len", ""),
    "max_length": ("max_seq_len", ""),
    "max_grad_norm": ("clip_grad_norm", ""),
    "logging_steps": ("log_every_n_steps", ""),
    "save_steps": ("save_every_n_steps", ""),
    "eval_steps": ("eval_every_n_steps", ""),
    "save_total_limit": ("keep_last_n", ""),
    "sample_packing": ("packed", ""),
    "packing": ("packed", ""),
    "bf16": ("dtype", "set dtype=bf16"),
    "gradient_checkpointing": ("enable_activation_checkpointing", ""),
    "datasets": ("dataset", "a mapping or a list of {path, format, ...}"),
    "val_set_size": ("validation_dataset", "a dataset of its own, not a fraction"),
    "lora_r": ("lora.rank", ""),
    "r": ("lora.rank", ""),
    "lora_alpha": ("lora.alpha", ""),
    "lora_dropout": ("lora.dropout", ""),
    "lora_target_modules": ("lora.target_modules", ""),
    "target_modules": ("lora.target_modules", ""),
}
