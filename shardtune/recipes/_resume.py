"""What a resume must match, and how far the resumed run goes.

Rule: a resume is checked against what the run's inputs are (their content, read once at
setup), never against where they were read; the lr schedule continues over the optimizer steps
the loop will actually take (counted by :func:`shardtune.training.loop.remaining_steps`).
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from shardtune.checkpoint import TrainingProgress, fingerprint
from shardtune.checkpoint.resume.identity import Identity, samples_identity, weights_identity
from shardtune.config import Config
from shardtune.data import load_tokenizer
from shardtune.models import model_args_from_hf_config
from shardtune.ranks.comm import Problems, agree, all_gather_objects
from shardtune.recipes.run import Run
from shardtune.training import loop
from shardtune.training.loop import LoopSettings


def resume_fingerprint(
    cfg: Config, run: Run, base_dir: Path, *, dataset, lora: Config | None, frozen: dict[str, Path]
) -> dict[str, str]:
    """Collective. What a resume must match, by content (a moved copy of the same files matches):
    the model architecture (config.json's fields), the tokenizer as loaded, the training samples
    (:func:`~shardtune.checkpoint.resume.identity.samples_identity`), the weights of the ``frozen``
    models and, for LoRA, the LoRA settings and the base weights (each
    :func:`~shardtune.checkpoint.resume.identity.weights_identity`, read on rank 0): a LoRA resume loads
    the base again, and its adapter means something only on that base. A full fine-tune's
    checkpoint holds every weight and never reads the base, so its base weights are not part of
    it. Every rank computes the same or every rank raises."""
    problems, weights = Problems(), {}
    reads = {**({"base_weights": base_dir} if lora is not None else {}), **frozen}
    if run.is_rank_zero:
        for part, directory in reads.items():
            with problems.guard(f"{part} ({directory})"):
                weights[part] = weights_identity(directory)
    local = fingerprint(
        model=dataclasses.asdict(model_args_from_hf_config(base_dir)),
        tokenizer=_tokenizer_identity(load_tokenizer(cfg.tokenizer, checkpoint_dir=base_dir)),
        dataset=samples_identity(dataset),
        lora=lora.to_dict() if lora is not None else None,
    )
    agree(
        local,
        what="the model config, tokenizer or training data differ between ranks",
        fix="give every node the same checkpoint_dir, tokenizer and data files",
        header="Cannot start the run:",
        problems=problems,
        error=ValueError,
    )
    return {**local, **fingerprint(**all_gather_objects(weights)[0])}


def _tokenizer_identity(tokenizer) -> Identity:
    """The tokenizer by what it does: its serialized vocabulary and rules, special tokens and
    chat templates (their text, not where they were read)."""
    value = {
        "tokenizer": tokenizer.tokenizer.to_str(),
        "special": [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token, tokenizer.special_tokens],
        "chat_templates": {name: source for name, (source, _where) in tokenizer.chat_templates.items()},
    }
    return Identity(value, f"vocab {tokenizer.vocab_size}")


def remaining_steps(cfg: Config, sampler, progress: TrainingProgress, *, settings: LoopSettings) -> int:
    """Optimizer steps the loop takes from ``progress`` (``sampler`` restored with it) to the
    end of training (:func:`~shardtune.training.loop.remaining_steps` counts them)."""
    if progress.epoch >= cfg.epochs:
        return 0
    fresh = copy.copy(sampler)
    fresh.set_epoch(sampler.epoch + 1)  # a whole epoch's share of this rank
    return loop.remaining_steps(
        batches_left=len(sampler) // cfg.batch_size,
        batches_done=progress.batches_in_epoch if progress.sampler else 0,
        batches_per_epoch=len(fresh) // cfg.batch_size,
        later_epochs=cfg.epochs - progress.epoch - 1,
        settings=settings,
    )
