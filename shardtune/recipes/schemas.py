"""Config schemas of the recipes: the shared ``BASE_SCHEMA`` and per-recipe extensions.

Rule: torch-free. The schemas are plain data in the language of :mod:`shardtune.config_validation`; the names a
key chooses from come from :mod:`shardtune.choices` and the model presets from :mod:`shardtune.model_presets`,
so the registry (:mod:`shardtune.recipes.registry`) and ``shardtune ls/cp/validate`` never import torch.
Extend with ``|``: ``MY_SCHEMA = BASE_SCHEMA | {"my_key": Field(int, default=1, gt=0)}``.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from shardtune.choices import (
    CONTEXT_PARALLEL_MODES,
    DTYPES,
    LAYER_DROPOUT_SCHEDULES,
    LOGGERS,
    LORA_TARGET_PARAMETERS,
    LORA_TARGETS,
    LR_SCHEDULES,
    NF4_BLOCK_SIZE,
    NF4_SCALER_BLOCK_SIZE,
    OPTIMIZERS,
    OUTPUT_DIR_POLICIES,
    PREFERENCE_LOSSES,
    QUANTIZE_BASE,
    WEIGHT_FORMATS,
)
from shardtune.config_validation import Field, OneOrMany, Schema
from shardtune.dataset_schema import DATASET_COLUMNS, DATASET_SCHEMA
from shardtune.model_presets import TINY_PRESETS, preset_names

__all__ = [
    "BASE_SCHEMA",
    "DATASET_COLUMNS",
    "DATASET_SCHEMA",
    "DPO_SECTION",
    "EARLY_EXIT_SCHEMA",
    "FULL_DPO_SCHEMA",
    "FULL_FINETUNE_SCHEMA",
    "GRPO_SCHEMA",
    "GRPO_SECTION",
    "EARLY_EXIT_SECTION",
    "KD_SCHEMA",
    "LAYER_DROPOUT_SECTION",
    "LORA_DPO_SCHEMA",
    "LORA_FINETUNE_SCHEMA",
    "LORA_SCHEMA",
    "LORA_SECTION",
    "TRACKING_SECTION",
]

FP32_MAX = 3.4e38  # the largest float32, rounded down


TRACKING_SECTION = Schema(
    {
        "project": Field(str, "shardtune", help="W&B project / MLflow experiment the run is logged to"),
        "name": Field(
            (str, None),
            None,
            help="run name in W&B and MLflow (null: <output_dir's name>-<recipe>); a resume continues the same run",
        ),
        "tags": Field(list, [], item=str, help="W&B and MLflow tags of the run"),
        "entity": Field((str, None), None, help="W&B team or user (null: your default entity)"),
        "mlflow_tracking_uri": Field(
            (str, None),
            None,
            help="MLflow tracking URI (null: $MLFLOW_TRACKING_URI, else file:<output_dir>/mlruns)",
        ),
    }
)


def _int_over_1(cfg: dict[str, Any], key: str) -> bool:
    value = cfg.get(key, 1)
    return isinstance(value, int) and value > 1


def _check_base(cfg: dict[str, Any]) -> list[str]:
    problems = []
    model, checkpoint_dir = cfg.get("model", ""), cfg.get("checkpoint_dir", "")
    if model is None and checkpoint_dir is None:
        problems.append(
            "model: null means 'read checkpoint_dir/config.json', but checkpoint_dir is not set; "
            "set model=<preset> (e.g. tiny) or checkpoint_dir=<HF model dir>"
        )
    if cfg.get("tokenizer", "") is None and checkpoint_dir is None:
        problems.append(
            "tokenizer: null means 'checkpoint_dir's tokenizer', but checkpoint_dir is not set; "
            "set tokenizer=byte or tokenizer=<dir or tokenizer.json>"
        )
    if cfg.get("eval_every_n_steps") is not None and cfg.get("validation_dataset") is None:
        problems.append(
            "eval_every_n_steps is set but there is no validation_dataset; add validation_dataset=<a dataset "
            "mapping, as for dataset> or set eval_every_n_steps=null"
        )
    if cfg.get("mixed_precision") and cfg.get("dtype") == "fp32":
        problems.append(
            "mixed_precision: true computes in `dtype` and keeps fp32 master weights, but dtype is fp32; "
            "set dtype=bf16 (or mixed_precision=false for pure fp32)"
        )
    optimizer = cfg.get("optimizer")
    name = optimizer.get("name") if isinstance(optimizer, dict) else None
    if (
        name in ("adamw8bit", "adamw4bit")
        and isinstance(cfg.get("expert_parallel"), int)
        and cfg["expert_parallel"] > 1
    ):
        problems.append(
            f"optimizer.name: {name} does not run with expert_parallel > 1 yet (torchao's compiled step does not "
            "take the experts' two-mesh placements); set optimizer.name=adamw or expert_parallel=1"
        )
    for key in ("model", "teacher_model"):
        preset = cfg.get(key)
        if isinstance(preset, str):
            names = preset_names()
            if preset not in names:
                close = difflib.get_close_matches(preset, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                problems.append(f"{key}: {preset!r} is not a model preset {names}{hint}")
    return problems


BASE_SCHEMA = Schema(
    {
        "output_dir": Field(str, help="where checkpoints and logs go (one run at a time: locked by rank 0)"),
        "output_dir_policy": Field(
            str,
            "refuse",
            choices=OUTPUT_DIR_POLICIES,
            help="a fresh run in an output_dir holding another run's outputs: refuse (with the fixes), new_run "
            "(write to <output_dir>/run_<n>) or overwrite (remove them first)",
        ),
        "checkpoint_dir": Field((str, None), None, help="HF model directory to start from"),
        "model": Field(
            (str, None),
            None,
            help="the preset that creates a missing base (only "
            + ", ".join(TINY_PRESETS)
            + " can be created); when checkpoint_dir holds a "
            "model (config.json), that model trains and a preset of another shape is warned about; null: always "
            "checkpoint_dir's",
        ),
        "tokenizer": Field((str, None), None, help="byte, a dir or tokenizer.json; null: checkpoint_dir"),
        "resume_from_checkpoint": Field(bool, False),
        "seed": Field(int, 0),
        "epochs": Field(int, 1, gt=0),
        "max_steps_per_epoch": Field((int, None), None, gt=0),
        "batch_size": Field(int, 2, gt=0),
        "gradient_accumulation_steps": Field(int, 1, gt=0),
        "optimizer": Schema(
            {
                "name": Field(str, "adamw", choices=OPTIMIZERS),
                # 0: an evaluation or sanity run, weights left unchanged; at most fp32's largest value, which the
                # fused optimizers hold it in (1e39 overflowed there with a raw RuntimeError)
                "lr": Field(float, ge=0, le=FP32_MAX),
                "weight_decay": Field(float, 0.0, ge=0, le=FP32_MAX),
                "decay_norms_and_biases": Field(
                    bool,
                    False,
                    help="false: weight_decay skips every bias and norm weight (transformers' Trainer); "
                    "true: it decays every param (torchtune's behaviour, one param group)",
                ),
                "betas": Field(list, [0.9, 0.999], item=float, length=2),
                "eps": Field(float, 1e-8, gt=0),
                "momentum": Field(float, 0.0, ge=0),
            }
        ),
        "lr_scheduler": Schema(
            {
                "name": Field(str, "constant", choices=LR_SCHEDULES),
                "warmup_steps": Field(int, 0, ge=0),
            }
        ),
        "clip_grad_norm": Field((float, None), None, gt=0),
        "max_nonfinite_steps": Field(
            int,
            0,
            ge=0,
            help="steps with a non-finite loss or grad norm to skip (no optimizer step) before the run stops; "
            "0: stop at the first (>0 adds one host sync per step)",
        ),
        "dtype": Field(str, "bf16", choices=DTYPES),
        "dataset": OneOrMany(DATASET_SCHEMA),
        "validation_dataset": OneOrMany(DATASET_SCHEMA, nullable=True),
        "eval_every_n_steps": Field(
            (int, None), None, gt=0, help="validation loss every N steps (null: at the end of each epoch)"
        ),
        "max_seq_len": Field(int, 2048, gt=0),
        "packed": Field(
            bool,
            False,
            help="pack samples into max_seq_len rows; positions restart and attention stays within each sample",
        ),
        "shuffle": Field(bool, True),
        "log_every_n_steps": Field(int, 1, gt=0),
        "peak_tflops": Field(
            (float, None),
            None,
            gt=0,
            help="the device's peak TFLOP/s for the logged mfu (null: known GPUs' dense bf16 peak; no mfu elsewhere)",
        ),
        "enable_activation_checkpointing": Field(
            (bool, str),
            False,
            choices=(False, True, "selective"),
            help="true: each layer recomputes its forward in backward (least memory); selective: layers keep "
            "matmul and attention outputs and recompute only the cheap ops (faster, more memory)",
        ),
        "enable_activation_offloading": Field(
            bool, False, help="keep what each layer saves for backward in pinned CPU memory (copied on a side stream)"
        ),
        "loss_chunk_tokens": Field(
            (int, None),
            1024,
            gt=0,
            help="tokens per chunk of the output projection + loss (no full-vocabulary logits); null: unchunked",
        ),
        # read by every recipe's loss (losses/step.RouterAux) and the validation loss
        "router_aux_loss_coef": Field(
            (float, None),
            None,
            ge=0,
            help="mixture-of-experts models: weight of the routers' load-balancing loss in the training and validation "
            "loss (logged as aux_loss; DPO: of the policy, as TRL's DPOTrainer); null: config.json's "
            "router_aux_loss_coef; 0: logged only. Dense models ignore it",
        ),
        # read by the fine-tuning loop (training/router_balance.py)
        "router_bias_update_rate": Field(
            float,
            0.0,
            ge=0,
            help="group-limited sigmoid routers (glm4_moe): aux-loss-free balancing, each step every router's "
            "e_score_correction_bias moves this much towards even expert load (DeepSeek-V3: 0.001); 0: frozen, "
            "as transformers keeps it",
        ),
        "compile": Field(
            bool, False, help="torch.compile each decoder layer and the loss's chunks (first steps are slower)"
        ),
        "mixed_precision": Field(
            bool,
            False,
            help="keep fp32 master weights, optimizer state and gradient reduction; compute in `dtype` (bf16)",
        ),
        "fsdp_cpu_offload": Field(
            bool, False, help="FSDP2 CPUOffloadPolicy: params, grads and the optimizer step on CPU (needs a GPU)"
        ),
        "data_parallel_replicate": Field(
            int, 1, gt=0, help="HSDP: shard within groups of world/N ranks, replicate across N groups"
        ),
        "expert_parallel": Field(
            int,
            1,
            gt=0,
            help="mixture-of-experts models: split the experts over groups of N data-parallel ranks, tokens sent "
            "to their experts' ranks (must divide world/data_parallel_replicate and the number of experts)",
        ),
        "reshard_after_forward": Field(
            bool, True, help="free gathered params after forward (false: keep them until backward, more memory)"
        ),
        "loggers": Field(
            list,
            [],
            item=str,
            choices=LOGGERS,
            help="metric sinks besides metrics.jsonl: tensorboard (<output_dir>/tensorboard, with the hyperparameters), "
            "wandb, mlflow (each run named and given the whole config; see tracking)",
        ),
        "tracking": TRACKING_SECTION,
        "process_group_timeout_s": Field(float, 1800.0, gt=0),
        "save_every_n_steps": Field((int, None), None, gt=0),
        "keep_last_n": Field((int, None), None, gt=0, help="checkpoints to keep; null keeps all"),
        "checkpoint_format": Field(str, "hf", choices=("hf", "dcp"), help="format of intermediate checkpoints"),
        "expert_layout": Field(
            str,
            "auto",
            choices=("auto", "per_expert", "fused"),
            help="how HF checkpoints hold MoE experts: auto (as the base came in), per_expert (transformers' "
            "save_pretrained) or fused (save_original_format=False)",
        ),
        "weight_format": Field(
            str,
            "dtype",
            choices=WEIGHT_FORMATS,
            help="how the final HF checkpoint holds the weights: dtype (the training dtype) or block_fp8 (the "
            "block-FP8 format the base model came in)",
        ),
        "shared_filesystem": Field(
            bool,
            True,
            help="false: output_dir is only on rank 0's node (node-local disks); rank 0 reads the base weights and "
            "reads/writes every checkpoint file, one tensor at a time (every rank still reads config.json and the tokenizer)",
        ),
        "async_save": Field(
            bool, False, help="write intermediate checkpoints (HF or DCP) in the background from a CPU copy"
        ),
        "keep_staging_memory": Field(
            bool,
            True,
            help="with async_save: keep the CPU copy's memory (each rank's shards) for the next save, which then skips allocating it",
        ),
    },
    checks=(_check_base,),
)

CONTEXT_PARALLEL = {
    "context_parallel": Field(
        int,
        1,
        gt=0,
        help="split every row over groups of N ranks (each a head and a tail chunk), attention exact over the "
        "whole rows (context_parallel_mode); must divide the world size (full and LoRA fine-tuning, DPO, "
        "distillation, early exit; a mixture-of-experts load-balancing loss over the whole rows; combines "
        "with expert_parallel)",
    ),
    "context_parallel_mode": Field(
        str,
        "all_gather",
        choices=CONTEXT_PARALLEL_MODES,
        help="how attention layers see a split row: all_gather (every rank gathers the keys and values of all "
        "heads) or all_to_all (DeepSpeed-Ulysses style: ranks trade their tokens for a share of the heads, two "
        "all-to-alls per layer; context_parallel must divide the attention heads). Gated DeltaNet layers trade "
        "tokens for heads in both modes",
    ),
}

FULL_FINETUNE_SCHEMA = BASE_SCHEMA | CONTEXT_PARALLEL

LORA_SECTION = Schema(
    {
        "rank": Field(int, 8, gt=0),
        "alpha": Field(float, 16.0, gt=0),
        "dropout": Field(float, 0.0, ge=0, lt=1),
        "target_modules": Field(list, ["q_proj", "v_proj"], item=str, choices=LORA_TARGETS),
        "target_parameters": Field(list, [], item=str, choices=LORA_TARGET_PARAMETERS),
        "quantize_base": Field(
            (bool, str),
            False,
            choices=QUANTIZE_BASE,
            help='true or "nf4": QLoRA (NF4 bases); "block_fp8": a block-FP8 checkpoint\'s bases kept in FP8',
        ),
        "block_size": Field(
            int,
            NF4_BLOCK_SIZE,
            gt=0,
            help="values per NF4 scale (with quantize_base); a weight's element count "
            "must be a multiple of block_size * scaler_block_size",
        ),
        "scaler_block_size": Field(
            int, NF4_SCALER_BLOCK_SIZE, gt=0, help="NF4 scales per second-level scale (with quantize_base)"
        ),
    }
)
LORA_SCHEMA = BASE_SCHEMA | {
    "lora": LORA_SECTION,
    "adapter_weights_only": Field(bool, False, help="LoRA checkpoints hold only the PEFT adapter (no merged model)"),
}

LORA_FINETUNE_SCHEMA = LORA_SCHEMA | CONTEXT_PARALLEL

KD_SCHEMA = (
    LORA_SCHEMA
    | CONTEXT_PARALLEL
    | {
        "teacher_checkpoint_dir": Field(str, help="HF model directory of the teacher"),
        "teacher_model": Field(
            (str, None),
            None,
            help="the preset that creates a missing teacher (only tiny); a model in teacher_checkpoint_dir wins, as for "
            "model",
        ),
        "kd_ratio": Field(float, 0.5, ge=0, le=1),
    }
)

_SCALE_TYPES = ("one", "l", "sum_l", "sqrt_l", "sum_sqrt_l", "inv_l", "sum_inv_l")
EARLY_EXIT_SECTION = Schema(
    {
        "layers": Field((str, list), ":", item=int, help="slice string like '0::2' or a list of layer ids"),
        "scale_type": Field(str, "sum_l", choices=_SCALE_TYPES),
        "scale": Field(float, 1.0, gt=0),
        "curriculum": Field(str, "none", choices=("none", "rotational", "gradual")),
    }
)
LAYER_DROPOUT_SECTION = Schema(
    {
        "max_prob": Field(float, 0.2, ge=0, le=1),
        "schedule": Field(str, "uniform", choices=LAYER_DROPOUT_SCHEDULES),
        "layers": Field((str, list, None), None, item=int, help="null for all, a slice string or layer ids"),
    },
    nullable=True,
)

EARLY_EXIT_SCHEMA = (
    BASE_SCHEMA | CONTEXT_PARALLEL | Schema({"early_exit": EARLY_EXIT_SECTION, "layer_dropout": LAYER_DROPOUT_SECTION})
)


def _check_preference_data(cfg: dict[str, Any]) -> list[str]:
    datasets = cfg.get("dataset")
    items = datasets if isinstance(datasets, list) else [datasets]
    problems = []
    if any(isinstance(d, dict) and d.get("format") != "preference" for d in items):
        problems.append(
            "dataset: DPO recipes train on preference pairs; set dataset.format=preference (prompt/chosen/rejected)"
        )
    if cfg.get("validation_dataset") is not None:
        problems.append("validation_dataset: the DPO recipes do not evaluate a validation set yet; remove it")
    return problems


DPO_SECTION = Schema(
    {
        "loss": Field(str, "sigmoid", choices=PREFERENCE_LOSSES, help="sigmoid (DPO), ipo, simpo"),
        "beta": Field(float, 0.1, gt=0),
        "label_smoothing": Field(float, 0.0, ge=0, lt=0.5, help="conservative DPO (sigmoid and simpo)"),
        "simpo_gamma": Field(float, 0.5, ge=0, help="SimPO's target reward margin"),
        "reference_free": Field(bool, False, help="compare the policy with 0 instead of a reference (simpo always)"),
    }
)
LORA_DPO_SCHEMA = LORA_SCHEMA | CONTEXT_PARALLEL | Schema({"dpo": DPO_SECTION}, checks=(_check_preference_data,))
FULL_DPO_SCHEMA = (
    BASE_SCHEMA
    | CONTEXT_PARALLEL
    | Schema(
        {
            "dpo": DPO_SECTION,
            "reference_checkpoint_dir": Field(
                (str, None), None, help="HF model directory of the frozen reference (null: the starting checkpoint_dir)"
            ),
        },
        checks=(_check_preference_data,),
    )
)


def _check_grpo(cfg: dict[str, Any]) -> list[str]:
    grpo, problems = cfg.get("grpo") or {}, []
    datasets = cfg.get("dataset")
    if any(
        isinstance(d, dict) and d.get("format") not in ("instruct", "chat")
        for d in (datasets if isinstance(datasets, list) else [datasets])
    ):
        problems.append(
            "dataset: grpo_distributed reads prompts from format: instruct or format: chat records (messages "
            "ending with a user turn); set dataset.format=instruct or chat"
        )
    if cfg.get("validation_dataset") is not None:
        problems.append("validation_dataset: grpo_distributed does not evaluate a validation set; remove it")
    if cfg.get("packed"):
        problems.append("packed: grpo_distributed makes its own rows from rollouts; set packed=false")
    if cfg.get("router_bias_update_rate"):
        problems.append("router_bias_update_rate: grpo_distributed keeps the routers' correction bias; set it to 0")
    problems += _reward_problems(grpo, cfg.get("process_group_timeout_s"))
    iterations = grpo.get("num_iterations", 1)
    for key in ("save_every_n_steps", "max_steps_per_epoch"):
        if isinstance(iterations, int) and iterations > 1 and isinstance(cfg.get(key), int) and cfg[key] % iterations:
            problems.append(
                f"{key}={cfg[key]} with grpo.num_iterations={iterations}: a checkpoint must fall between cycles of "
                f"{iterations} steps on one generation batch (a resume cannot recompute its sampling log-probs); "
                f"set {key} to a multiple of {iterations}"
            )
    return problems


# ``package.module:function`` (the function may be a dotted attribute path): Python names only, so no path
# (``..``, ``/``) and nothing but a name reaches the import
_REWARD_SPEC = re.compile(
    r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
)


def _reward_problems(grpo: dict[str, Any], group_timeout: Any) -> list[str]:
    """The reward specs' spelling, their weights' count, and a per-call time limit the collectives outlast
    (checked before any rank starts; importing the modules is left to the ranks)."""
    specs, weights, problems = grpo.get("rewards"), grpo.get("reward_weights"), []
    if isinstance(specs, list) and not specs:
        problems.append("grpo.rewards: empty; name one or more reward functions as 'package.module:function'")
    for i, spec in enumerate(specs if isinstance(specs, list) else []):
        if isinstance(spec, str) and not _REWARD_SPEC.fullmatch(spec):
            problems.append(
                f"grpo.rewards[{i}]: {spec!r} is not 'package.module:function' (Python names joined by dots, e.g. "
                "shardtune.rl.math_rewards:math_answer); a file path is not accepted: put its directory on "
                "PYTHONPATH and name the module"
            )
    if isinstance(specs, list) and specs and isinstance(weights, list) and len(weights) != len(specs):
        problems.append(
            f"grpo.reward_weights: {len(weights)} weights for {len(specs)} rewards; give one per reward (or null)"
        )
    limit = grpo.get("reward_timeout_s")
    if isinstance(limit, (int, float)) and isinstance(group_timeout, (int, float)) and limit >= group_timeout:
        problems.append(
            f"grpo.reward_timeout_s={limit} is not below process_group_timeout_s={group_timeout}: a reward that "
            "blocks on one rank would end the run as a collective timeout blamed on the others; lower it"
        )
    return problems


GRPO_SECTION = Schema(
    {
        "rewards": Field(list, item=str, help="reward functions as 'package.module:function' (TRL's signature)"),
        "reward_weights": Field((list, None), None, item=(float, int), help="one weight per reward (null: all 1)"),
        "reward_timeout_s": Field(
            float,
            60.0,
            gt=0,
            help="seconds one reward function call may take on a rank before the run stops, naming it",
        ),
        "num_generations": Field(
            int, 4, gt=1, help="completions sampled per prompt (a group; at least 2: advantages compare them)"
        ),
        "max_completion_tokens": Field(int, 64, gt=0, help="a completion stops there or at a stop token (EOS)"),
        "temperature": Field(float, 1.0, gt=0, help="sampling temperature (the log-probs divide logits by it too)"),
        "top_p": Field(float, 1.0, gt=0, le=1, help="nucleus sampling"),
        "gather_for_generation": Field(
            bool, True, help="rollouts gather the weights once (a rank holds the model), not once per token"
        ),
        "loss_type": Field(str, "dapo", choices=("grpo", "dr_grpo", "dapo", "bnpo")),
        "epsilon": Field(float, 0.2, ge=0, help="lower clip: the ratio is kept above 1 - epsilon"),
        "epsilon_high": Field((float, None), None, help="upper clip 1 + epsilon_high (null: epsilon)"),
        "importance_sampling_level": Field(str, "token", choices=("token", "sequence"), help="sequence: GSPO"),
        "beta": Field(float, 0.0, ge=0, help="k3 KL weight against the reference (0: no reference forward)"),
        "scale_rewards": Field(
            str, "group", choices=("group", "batch", "none"), help="advantages divided by the std of"
        ),
        "num_iterations": Field(
            int, 1, gt=0, help="optimizer steps per generation batch (TRL's mu); checkpoints fall between them"
        ),
    }
)
GRPO_SCHEMA = BASE_SCHEMA | Schema(
    {
        "grpo": GRPO_SECTION,
        "lora": LORA_SECTION.as_nullable(),
        "adapter_weights_only": Field(
            bool, False, help="LoRA checkpoints hold only the PEFT adapter (no merged model)"
        ),
    },
    checks=(_check_grpo,),
)
