"""Building blocks the recipes share: model, data, optimizer, checkpointer, the loop.

Each function does one setup job from the validated config; a recipe calls them top to bottom
(:func:`~shardtune.recipes.run.start`, :func:`base_model_dir`, :func:`build_model`, :func:`build_training`) and hands
the :class:`~shardtune.training.loop.Training` it built, with its loss (built from the config by
:mod:`shardtune.losses.from_config`), to :func:`fit`.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import Dataset

from shardtune.checkpoint import (
    Checkpointer,
    CheckpointOptions,
    CheckpointStates,
    TrainingProgress,
    load_hf_checkpoint,
)
from shardtune.checkpoint.formats.block_fp8 import fp8_block_of
from shardtune.checkpoint.formats.hf_load import fp8_linears
from shardtune.checkpoint.formats.tiny_base import create_tiny_base
from shardtune.checkpoint.layout import CONFIG_FILE
from shardtune.config import Config
from shardtune.data import build_dataloader, build_dataset, collate, load_tokenizer
from shardtune.data.checks import build_training_dataset, check_one_step
from shardtune.data.from_config import chat_entries, is_preference
from shardtune.data.preference import collate_pairs
from shardtune.data.tokenizer import HFTokenizer
from shardtune.data.trained_template import TrainedTemplate, trained_chat_template
from shardtune.losses.from_config import validation_loss_of
from shardtune.model_presets import TINY_PRESETS
from shardtune.models import (
    LlamaForCausalLM,
    ModelArgs,
    get_model_args,
    llama_from_hf_config,
    model_args_from_hf_config,
)
from shardtune.models.context_heads import check_attention_heads, check_heads
from shardtune.models.context_parallel import ALL_GATHER, ALL_TO_ALL
from shardtune.peft import apply_lora, init_lora_parameters, is_lora
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import decoder_layers, shard_model
from shardtune.recipes import _resume
from shardtune.recipes.run import DTYPES, Run
from shardtune.recipes.run import start as start  # a recipe's first step: setup.start(cfg)
from shardtune.recipes.summary import log_start_summary
from shardtune.run_command import continue_command, this_command
from shardtune.run_errors import download_hint
from shardtune.training.activation_offload import offload_layer_activations
from shardtune.training.evaluate import Evaluator
from shardtune.training.flops import flops_per_token_fn, peak_tflops
from shardtune.training.loop import LoopSettings, LossFn, PrepareStep, Training, run_training, steps_per_epoch
from shardtune.training.metrics import MetricLogger
from shardtune.training.optim import LrSchedule, build_lr_scheduler, build_optimizer, continue_schedule
from shardtune.training.trackers import tracked_run

log = logging.getLogger("shardtune")


def base_model_dir(
    cfg: Config, run: Run, *, key: str = "checkpoint_dir", preset_key: str = "model", seed: int | None = None
) -> Path:
    """The HF model directory to start from.

    A model already in ``cfg.<key>`` (its ``config.json``) is the one trained. The preset
    ``cfg.<preset_key>`` only names the base to create when the directory holds none (only
    ``model_presets.TINY_PRESETS`` can be created); a preset of another shape than the directory's model is
    reported with a warning on rank 0, not an error, so a bundled tiny config pointed at a user's own model
    with ``checkpoint_dir=...`` alone trains that model. Collective (a barrier) when the tiny base is created.
    """
    directory = getattr(cfg, key)
    preset = getattr(cfg, preset_key)
    if directory is None:
        directory = str(Path(cfg.output_dir).parent / f"{preset}_base")
    path = Path(directory)
    if (path / CONFIG_FILE).is_file():
        if preset is not None and run.is_rank_zero:
            _warn_if_preset_differs(path, preset, key=key, preset_key=preset_key)
        return path
    if preset not in TINY_PRESETS:
        raise FileNotFoundError(
            f"{key}={directory} has no config.json; download the HF model there: {download_hint('<repo>', directory)}"
        )
    if run.is_rank_zero:
        log.info("creating the %s base model in %s", preset, path)
        # rank 0 alone draws the base's weights: its random state must stay the other ranks' (fresh adapters
        # replicated over expert-parallel ranks are drawn on each of them)
        with torch.random.fork_rng(devices=[]):
            create_tiny_base(path, preset=preset) if seed is None else create_tiny_base(path, seed=seed, preset=preset)
    dist.barrier()
    return path


def _warn_if_preset_differs(path: Path, preset: str, *, key: str, preset_key: str) -> None:
    try:
        have, want = model_args_from_hf_config(path), get_model_args(preset)
    except (OSError, ValueError, KeyError):
        return  # build_model reports an unreadable config.json on every rank; the schema an unknown preset
    if _shape(have) != _shape(want):
        warnings.warn(
            f"{preset_key}={preset} ({_describe(want)}) is not the model in {key}={path} ({_describe(have)}); "
            f"training the model in {key}. {preset_key} only names the preset that creates a missing base: "
            f"drop {preset_key} ({preset_key}=null) or point {key} at another directory.",
            stacklevel=3,
        )


def _shape(args: ModelArgs) -> tuple[int | None, ...]:
    return (args.dim, args.n_layers, args.n_heads, args.n_kv_heads, args.intermediate_size, args.vocab_size)


def _describe(args: ModelArgs) -> str:
    return (
        f"hidden size {args.dim}, {args.n_layers} layers, {args.n_heads} heads ({args.n_kv_heads} kv), "
        f"intermediate size {args.intermediate_size}, vocab {args.vocab_size}"
    )


def build_model(
    base_dir: Path, run: Run, cfg: Config, *, lora: Config | None = None, frozen: bool = False
) -> LlamaForCausalLM:
    """The model on the meta device (optionally with LoRA), sharded with FSDP2; weights come later.
    ``frozen``: a model that only runs no-grad forwards (a reference or teacher; see ``shard_model``)."""
    with torch.device("meta"):
        model = llama_from_hf_config(base_dir, dtype=run.dtype)
    if lora is not None:
        fp8_block = fp8_block_of(base_dir, key="lora.quantize_base") if lora.quantize_base == "block_fp8" else None
        # the rest of the frozen base the checkpoint ships in FP8 stays in it too
        kept = fp8_linears(model, base_dir, shared_filesystem=cfg.shared_filesystem) if fp8_block else []
        with torch.device("meta"):
            apply_lora(
                model,
                rank=lora.rank,
                alpha=lora.alpha,
                dropout=lora.dropout,
                target_modules=list(lora.target_modules),
                target_parameters=list(lora.target_parameters),
                quantize_base=lora.quantize_base,
                block_size=lora.block_size,
                scaler_block_size=lora.scaler_block_size,
                fp8_block=fp8_block,
                fp8_linears=kept,
            )
    cp = getattr(cfg, "context_parallel", 1)
    if model.args.linear_attention is not None:  # before any weight moves; the same on every rank
        check_heads(model.args.linear_attention, cp)
    if getattr(cfg, "context_parallel_mode", ALL_GATHER) == ALL_TO_ALL:
        check_attention_heads(model.args.n_heads, cp)
    # a frozen dense model (a KD teacher, a DPO reference) beside an expert-parallel MoE model has no experts to split
    ep = 1 if frozen and model.args.moe is None else cfg.expert_parallel
    shard_model(
        model,
        mesh=make_mesh(replicate=cfg.data_parallel_replicate, expert_parallel=ep, device=run.device.type),
        cpu_offload=cfg.fsdp_cpu_offload,
        reshard_after_forward=cfg.reshard_after_forward,
        activation_checkpointing=cfg.enable_activation_checkpointing,
        mp_policy=_mixed_precision(cfg),
        compile=cfg.compile,
        frozen=frozen,
    )
    if cfg.enable_activation_offloading:
        offload_layer_activations(decoder_layers(model))
    return model


def build_frozen_model(model_dir: Path, run: Run, cfg: Config) -> LlamaForCausalLM:
    """The model in ``model_dir``, sharded and loaded for no-grad forwards only (a DPO or GRPO
    reference, a KD teacher): loaded again from the same directory on resume, so it is the same model."""
    model = build_model(model_dir, run, cfg, frozen=True)
    load_hf_checkpoint(model, model_dir, device=run.device, strict=True, cpu_offload=cfg.fsdp_cpu_offload)
    model.init_buffers(run.device)
    model.requires_grad_(False).eval()
    return model


def _mixed_precision(cfg: Config) -> MixedPrecisionPolicy | None:
    """bf16 compute over fp32 master weights, gradients reduced in fp32; None: compute in the params' dtype."""
    if not cfg.mixed_precision:
        return None
    return MixedPrecisionPolicy(param_dtype=DTYPES[cfg.dtype], reduce_dtype=torch.float32)


def build_data(cfg: Config, run: Run, base_dir: Path):
    """Tokenizer, dataset(s), loader and resumable sampler for this rank (preference pairs are
    batched as their chosen rows, then their rejected rows)."""
    tokenizer = load_tokenizer(cfg.tokenizer, checkpoint_dir=base_dir)
    vocab_size = model_args_from_hf_config(base_dir).vocab_size
    dataset = build_training_dataset(
        cfg, tokenizer, vocab_size=vocab_size, model=str(base_dir), report=run.is_rank_zero
    )
    batcher = collate_pairs if is_preference(dataset_specs(cfg.dataset)) else collate
    loader, sampler = build_loader(
        cfg, run, dataset, collate_fn=lambda batch: batcher(batch, pad_id=tokenizer.pad_id), packed=cfg.packed
    )
    return tokenizer, loader, sampler


def build_loader(cfg: Config, run: Run, dataset: Dataset, *, collate_fn: Callable, packed: bool = False):
    """The loader of ``dataset`` (``cfg.dataset``'s samples, in whatever form a recipe made them) and
    its resumable sampler for this rank, after checking that the data fills one optimizer step."""
    loader, sampler = build_dataloader(
        dataset,
        batch_size=cfg.batch_size,
        rank=run.data_rank,  # the ranks of a context-parallel group read the same rows
        world_size=run.data_world,
        seed=cfg.seed,
        shuffle=cfg.shuffle,
        collate_fn=collate_fn,
        pin_memory=run.device.type == "cuda",  # so on_device's copies can overlap compute
    )
    check_one_step(
        len(dataset),  # type: ignore[arg-type]  # torch's Dataset declares no __len__; ours have one
        sources=[spec.get("path", "<dataset>") for spec in dataset_specs(cfg.dataset)],
        batch_size=cfg.batch_size,
        world_size=run.data_world,
        accumulation=cfg.gradient_accumulation_steps,
        packed=packed,
    )
    return loader, sampler


def loop_settings(cfg: Config) -> LoopSettings:
    return LoopSettings(
        epochs=cfg.epochs,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        max_steps_per_epoch=cfg.max_steps_per_epoch,
        clip_grad_norm=cfg.clip_grad_norm,
        log_every_n_steps=cfg.log_every_n_steps,
        save_every_n_steps=cfg.save_every_n_steps,
        eval_every_n_steps=cfg.eval_every_n_steps,
        max_nonfinite_steps=cfg.max_nonfinite_steps,
        router_bias_update_rate=cfg.router_bias_update_rate,
    )


def build_optimization(cfg: Config, model: nn.Module, n_batches: int):
    """Optimizer over trainable params and the lr schedule sized for the whole run, in optimizer
    steps of this run's global batch (what a resume on another global batch adapts it from)."""
    opt = build_optimizer(
        model,
        name=cfg.optimizer.name,
        lr=cfg.optimizer.lr,
        weight_decay=cfg.optimizer.weight_decay,
        decay_norms_and_biases=cfg.optimizer.decay_norms_and_biases,
        betas=tuple(cfg.optimizer.betas),
        momentum=cfg.optimizer.momentum,
        eps=cfg.optimizer.eps,
    )
    total = steps_per_epoch(n_batches, loop_settings(cfg)) * cfg.epochs
    world = dist.get_world_size() if dist.is_initialized() else 1
    world //= getattr(cfg, "context_parallel", 1)  # ranks that read different rows
    sched = build_lr_scheduler(
        opt,
        name=cfg.lr_scheduler.name,
        warmup_steps=cfg.lr_scheduler.warmup_steps,
        total_steps=total,
        samples_per_step=cfg.batch_size * world * cfg.gradient_accumulation_steps,
        length=f"epochs={cfg.epochs}, max_steps_per_epoch={cfg.max_steps_per_epoch}",
    )
    return opt, sched


def build_checkpointer(
    cfg: Config,
    run: Run,
    model,
    opt,
    sched,
    base_dir: Path,
    *,
    sampler,
    loader,
    adapter_weights_only: bool = False,
    frozen: dict[str, Path] | None = None,
    chat_template: str | None = None,
) -> Checkpointer:
    """The Checkpointer, every object a checkpoint holds registered, with a fingerprint of what
    a resume must match (see :func:`~shardtune.recipes._resume.resume_fingerprint`; ``frozen``: the directories of frozen
    models the recipe loads, by fingerprint part, e.g. ``{"teacher_weights": teacher_dir}``; ``chat_template``:
    the Jinja text of the chat template trained, saved with every checkpoint)."""
    marks = _resume.resume_fingerprint(
        cfg, run, base_dir, dataset=loader.dataset, lora=getattr(cfg, "lora", None), frozen=frozen or {}
    )
    options = CheckpointOptions(
        output_dir=Path(run.output_dir or cfg.output_dir),
        base_dir=base_dir,
        adapter_weights_only=adapter_weights_only,
        keep_last_n=cfg.keep_last_n,
        fingerprint=marks,
        seed=cfg.seed,
        device=run.device,
        cpu_offload=cfg.fsdp_cpu_offload,
        checkpoint_format=cfg.checkpoint_format,
        async_save=cfg.async_save,
        keep_staging_memory=cfg.keep_staging_memory,
        shared_filesystem=cfg.shared_filesystem,
        expert_layout=cfg.expert_layout,
        weight_format=cfg.weight_format,
        chat_template=chat_template,
    )
    states = CheckpointStates(model=model, optimizer=opt, lr_scheduler=sched, sampler=sampler)
    return Checkpointer(states=states, options=options)


def load_weights(cfg: Config, run: Run, model: LlamaForCausalLM, checkpointer: Checkpointer) -> TrainingProgress:
    """Resume when asked and possible, else load the base (and initialise fresh adapters);
    returns the progress registered with ``checkpointer`` (restored, or a fresh start's)."""
    progress = checkpointer.resume() if cfg.resume_from_checkpoint else None
    if progress is None:
        if cfg.resume_from_checkpoint and run.is_rank_zero:
            log.warning(
                "resume_from_checkpoint=true but %s holds no checkpoint: starting from the base model %s",
                checkpointer.options.output_dir,
                checkpointer.options.base_dir,
            )
        checkpointer.load_base()
        if is_lora(model):
            init_lora_parameters(model, device=run.device)
    elif isinstance(checkpointer.states.lr_scheduler, LrSchedule):
        changes = continue_schedule(
            checkpointer.states.lr_scheduler,
            remaining_steps=_resume.remaining_steps(
                cfg, checkpointer.states.sampler, progress, settings=loop_settings(cfg)
            ),
        )
        if changes and run.is_rank_zero:
            log.warning("resuming with this run's lr schedule:\n  %s", "\n  ".join(changes))
    model.init_buffers(run.device)
    return checkpointer.progress


def build_training(
    cfg: Config,
    run: Run,
    model: LlamaForCausalLM,
    base_dir: Path,
    *,
    frozen: dict[str, Path] | None = None,
    data: tuple[HFTokenizer, Any, Any] | None = None,
) -> Training:
    """Everything the loop trains ``model`` with but the loss: data, optimizer and lr schedule,
    the Checkpointer (``frozen`` as :func:`build_checkpointer` takes it), the weights loaded
    (resumed, or the base's) and the validation evaluator. ``data``: ``(tokenizer, loader,
    sampler)`` of a recipe that reads ``cfg.dataset`` its own way (e.g. with :func:`build_loader`);
    None: :func:`build_data`'s."""
    tokenizer, loader, sampler = build_data(cfg, run, base_dir) if data is None else data
    template = chat_template_of(cfg, run, tokenizer, loader.dataset)
    optimizer, lr_scheduler = build_optimization(cfg, model, len(loader))
    checkpointer = build_checkpointer(
        cfg,
        run,
        model,
        optimizer,
        lr_scheduler,
        base_dir,
        sampler=sampler,
        loader=loader,
        adapter_weights_only=getattr(cfg, "adapter_weights_only", False),  # a LoRA recipe's key
        frozen=frozen,
        chat_template=None if template is None else template.text,
    )
    progress = load_weights(cfg, run, model, checkpointer)
    log_start_summary(
        cfg,
        run,
        model,
        samples=len(loader.dataset),
        steps_per_epoch=steps_per_epoch(len(loader), loop_settings(cfg)),
        start_step=progress.step,
        template=template,
    )
    evaluate = build_evaluator(cfg, run, model, tokenizer)
    return Training(model, loader, sampler, optimizer, lr_scheduler, checkpointer, evaluate=evaluate)


def chat_template_of(cfg: Config, run: Run, tokenizer: HFTokenizer, dataset: Dataset) -> TrainedTemplate | None:
    """The chat template ``cfg.dataset``'s chat data (``dataset``: built from it) trains with (None: no chat
    data; the start summary names it), with a warning on rank 0 for chat datasets trained with another
    template than the one saved."""
    specs = dataset_specs(cfg.dataset)
    template, others = trained_chat_template(specs, tokenizer, chat=chat_entries(specs, dataset))
    if run.is_rank_zero:
        for line in others:
            log.warning("%s: generate and serve it with care", line)
    return template


def fit(
    cfg: Config, run: Run, recipe: str, training: Training, *, loss_fn: LossFn, prepare: PrepareStep | None = None
) -> None:
    """The shared loop over ``training`` (metrics to ``<output_dir>/metrics.jsonl``; ``prepare``: the
    phase before each step's micro-batches, as :func:`~shardtune.training.loop.run_training` takes it),
    then the closing message."""
    checkpointer = training.checkpointer
    output_dir, start_step = Path(checkpointer.options.output_dir), checkpointer.progress.step
    logger = MetricLogger(
        output_dir,
        enabled=run.is_rank_zero,
        loggers=tuple(cfg.loggers),
        start_step=start_step,
        tracked=tracked_run(cfg, recipe=recipe, output_dir=output_dir, resumed=start_step > 0),
    )
    settings = dataclasses.replace(
        loop_settings(cfg),
        flops_per_token=flops_per_token_fn(training.model),
        peak_tflops=peak_tflops(run.device, configured=cfg.peak_tflops),
        context_parallel=run.context_parallel,
    )
    try:
        run_training(training, loss_fn=loss_fn, logger=logger, settings=settings, prepare=prepare)
    except BaseException:
        logger.close()  # the rows logged so far reach every sink: a failed rank ends without atexit hooks
        if run.lock is not None:  # a signal stop published its pending checkpoint; a failure ends this run too
            run.lock.release()
        raise
    finish(cfg, run, checkpointer, recipe, logger)


def build_evaluator(cfg: Config, run: Run, model: nn.Module, tokenizer) -> Evaluator | None:
    """The validation-loss evaluator of ``validation_dataset`` (next-token cross-entropy, unpacked), or None.

    A mixture-of-experts model's validation loss adds ``router_aux_loss_coef`` times each batch's
    load-balancing loss, as its fine-tuning ``loss`` does (and TRL's ``eval_loss``, transformers'
    ``out.loss`` with ``output_router_logits=True``): ``val_loss`` and ``loss`` compare. With
    ``context_parallel`` > 1 every row is split over the rank's ``cp`` group, as in training."""
    if cfg.validation_dataset is None:
        return None
    dataset = build_dataset(dataset_specs(cfg.validation_dataset), tokenizer, max_seq_len=cfg.max_seq_len, packed=False)
    return Evaluator(
        dataset,
        batch_size=cfg.batch_size,
        collate_fn=lambda batch: collate(batch, pad_id=tokenizer.pad_id),
        loss_sum=validation_loss_of(cfg, run, model),
        context_parallel=run.context_parallel,
    )


def dataset_specs(value) -> list[dict]:
    """A ``dataset`` (or ``validation_dataset``) config value, one spec or a list, as a list of plain dicts."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return [d.to_dict() if hasattr(d, "to_dict") else dict(d) for d in items]


def finish(cfg: Config, run: Run, checkpointer: Checkpointer, recipe: str, logger: MetricLogger) -> None:
    logger.close()
    if run.is_rank_zero:
        again = continue_command(
            this_command(),
            output_dir=str(checkpointer.options.output_dir),
            resume_from_checkpoint="true",
            epochs=f"{cfg.epochs + 1}",
        )
        log.info(
            "done: %s's outputs are in %s (checkpoint %s); to train more epochs (here one more): %s",
            recipe,
            checkpointer.options.output_dir,
            checkpointer.last_saved,
            again,
        )
    if run.lock is not None:
        run.lock.release()
    dist.destroy_process_group()
