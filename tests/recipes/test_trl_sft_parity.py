"""SFT against TRL's ``SFTTrainer`` as the oracle: the same job (a tiny Llama with biases made here
by transformers, the same JSONL of prompt-completion records, the same samples per step in the same
order, fp32, AdamW with weight decay, cosine schedule with warmup, gradient clipping, gradient
accumulation over micro-batches with uneven label counts) gives the same loss at every step and
the same weights after the last one, per tensor. TRL runs in this process on one rank
(``per_device_train_batch_size=2``, 2 accumulation steps, ``train_sampling_strategy="sequential"``);
shardtune runs on 2 ranks of ``recipe_pool`` (``batch_size=1``, 2 accumulation steps,
``shuffle=false``): both take the global order's next 4 samples each step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from shardtune.data.tokenizer import save_byte_tokenizer
from tests.recipes.conftest import losses

pytestmark = pytest.mark.timeout(600)

STEPS, WARMUP, LR, WD, CLIP = 5, 2, 3e-3, 0.1, 1.0
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Prompts and completions of uneven lengths, so the micro-batches of a step hold uneven label counts.
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _records() -> list[dict[str, str]]:
    return [
        {
            "instruction": " ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + (i * 5) % 7)),
            "output": " ".join(WORDS[(3 * i + k) % len(WORDS)] for k in range(1 + (i * 3) % 9)),
        }
        for i in range(4 * STEPS)
    ]


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama (random weights, nonzero q/k/v/o biases, norm weights away from 1) with the byte
    tokenizer, and the instruct JSONL."""
    import transformers

    root = tmp_path_factory.mktemp("trl_sft")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attention_bias=True,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn_like(p))
    model.save_pretrained(root / "model")
    save_byte_tokenizer(root / "model")
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _records()))
    return {"model": root / "model", "data": data, "root": root}


def _trl_run(
    job: dict[str, Path], *, adapter_init: Path | None, **overrides
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """TRL's per-step losses (the sum of a step's micro-batch losses, as ``Trainer`` logs them
    before rounding) and the trained weights; with ``adapter_init`` (a PEFT adapter file), LoRA
    from those adapters, and the trained adapters in PEFT's file keys. ``overrides``: SFTConfig's."""
    import datasets
    import transformers
    from trl import SFTConfig, SFTTrainer

    class Recorded(SFTTrainer):
        micro: list[float]  # each micro-batch's loss: its label sum over the step's label count

        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            self.micro.append(loss.item())
            return loss

    model = transformers.AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(job["model"])
    records = [json.loads(line) for line in job["data"].read_text().splitlines()]
    # shardtune's `simple` template: the prompt is "Q: {instruction}\nA: ", the completion the output.
    dataset = datasets.Dataset.from_list(
        [{"prompt": f"Q: {r['instruction']}\nA: ", "completion": r["output"]} for r in records]
    )
    if adapter_init is not None:
        import peft

        config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS)
        model = peft.get_peft_model(model, config)
        peft.set_peft_model_state_dict(model, load_file(str(adapter_init)))
    settings = {
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": STEPS,
        "warmup_steps": WARMUP,
        "max_length": 128,
        "bf16": False,
        **overrides,
    }
    args = SFTConfig(
        output_dir=str(job["root"] / f"trl_{'full' if adapter_init is None else 'lora'}"),
        learning_rate=LR,
        weight_decay=WD,
        lr_scheduler_type="cosine",
        max_grad_norm=CLIP,
        train_sampling_strategy="sequential",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        fp16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        seed=0,
        dataset_num_proc=None,
        **settings,
    )
    trainer = Recorded(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
    trainer.micro = []
    trainer.train()
    per_step = settings["gradient_accumulation_steps"]
    steps = [sum(trainer.micro[per_step * s : per_step * (s + 1)]) for s in range(settings["max_steps"])]
    if adapter_init is not None:
        import peft

        state = peft.get_peft_model_state_dict(trainer.model)
    else:
        state = trainer.model.state_dict()
    return steps, {k: v.detach().clone() for k, v in state.items()}


def _shardtune_run(job, recipe_pool, out: Path, *extra_overrides: str, lora: bool = False, nproc: int = 2) -> None:
    recipe, config = ("lora_finetune_distributed", "tiny/lora") if lora else ("full_finetune_distributed", "tiny/full")
    extra = [f"lora.target_modules=[{', '.join(LORA_TARGETS)}]", "lora.rank=8", "lora.alpha=16"] if lora else []
    recipe_pool.run(
        recipe,
        config,
        f"output_dir={out}",
        f"checkpoint_dir={job['model']}",
        f"dataset=[{{path: {job['data']}, format: instruct, template: simple}}]",
        "epochs=1",
        f"max_steps_per_epoch={STEPS}",
        "batch_size=1",
        "gradient_accumulation_steps=2",
        "shuffle=false",
        "seed=0",
        "model=null",
        f"optimizer.lr={LR}",
        f"optimizer.weight_decay={WD}",
        "lr_scheduler.name=cosine",
        f"lr_scheduler.warmup_steps={WARMUP}",
        f"clip_grad_norm={CLIP}",
        "max_seq_len=128",
        "log_every_n_steps=1",
        # LoRA: a checkpoint after step 1, which runs at lr 0 (transformers' warmup), holds the initial adapters.
        f"save_every_n_steps={1 if lora else 'null'}",
        "keep_last_n=null",
        *extra,
        *extra_overrides,
        nproc=nproc,
    )


@pytest.fixture(scope="module")
def full_runs(job, recipe_pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("st_full") / "run"
    _shardtune_run(job, recipe_pool, out, lora=False)
    return _trl_run(job, adapter_init=None), out


@pytest.fixture(scope="module")
def lora_runs(job, recipe_pool, tmp_path_factory):
    out = tmp_path_factory.mktemp("st_lora") / "run"
    _shardtune_run(job, recipe_pool, out, lora=True)
    # The same distribution as PEFT's init but another draw (the default generator is in another state
    # when shardtune creates the adapters), so PEFT starts from shardtune's initial adapters.
    init = out / "step_1" / "adapter" / "adapter_model.safetensors"
    assert all(not t.any() for k, t in load_file(str(init)).items() if "lora_B" in k)  # an init: B = 0
    return _trl_run(job, adapter_init=init), out


def _assert_losses(trl_losses: list[float], out: Path) -> None:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(row["grad_norm"] > CLIP for row in rows)  # every step is clipped
    ours = losses(out)
    assert sorted(ours) == list(range(1, STEPS + 1))
    for step, expected in enumerate(trl_losses, start=1):
        assert math.isclose(ours[step], expected, rel_tol=1e-5), (step, ours[step], expected)


def _assert_tensors(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], *, atol: float) -> None:
    assert sorted(got) == sorted(expected)
    worst = {name: (got[name] - t).abs().max().item() for name, t in expected.items()}
    bad = {name: d for name, d in worst.items() if d > atol}
    assert not bad, bad


def test_full_sft_losses_equal_trl_at_every_step(full_runs):
    (trl_losses, _), out = full_runs
    _assert_losses(trl_losses, out)


def test_full_sft_weights_equal_trl_per_tensor(full_runs):
    """Every tensor, norms and biases included (weight decay skips them in both)."""
    (_, trl_state), out = full_runs
    # Observed: a k_proj bias 2.7e-7 (its gradient is rounding noise, which Adam normalizes), others <= 6e-8.
    _assert_tensors(trl_state, load_file(str(out / "epoch_1" / "model.safetensors")), atol=5e-6)


def test_lora_sft_losses_equal_trl_at_every_step(lora_runs):
    (trl_losses, _), out = lora_runs
    _assert_losses(trl_losses, out)


def test_lora_sft_adapters_equal_peft_per_tensor(lora_runs):
    (_, trl_state), out = lora_runs
    _assert_tensors(trl_state, load_file(str(out / "epoch_1" / "adapter" / "adapter_model.safetensors")), atol=5e-6)


def test_packed_first_step_equals_trl_padding_free(job, recipe_pool, tmp_path):
    """``packed: true`` (samples back to back, positions restarting per sample, attention within
    each) against TRL's ``padding_free=True`` (one flattened row, ``position_ids`` restarting per
    sample): one step over every sample, so the arrangement into rows does not matter; the same
    loss, and the same weights after the step."""
    from shardtune.data import build_dataset, load_tokenizer

    tokenizer = load_tokenizer(None, checkpoint_dir=job["model"])
    spec = {"path": str(job["data"]), "format": "instruct", "template": "simple"}
    rows = len(build_dataset([spec], tokenizer, max_seq_len=128, packed=True))
    out = tmp_path / "packed"
    _shardtune_run(
        job,
        recipe_pool,
        out,
        "packed=true",
        f"batch_size={rows}",
        "gradient_accumulation_steps=1",
        "max_steps_per_epoch=1",
        "lr_scheduler.warmup_steps=0",
        nproc=1,
    )
    trl_losses, trl_state = _trl_run(
        job,
        adapter_init=None,
        padding_free=True,
        max_length=None,  # every sample is shorter than shardtune's max_seq_len=128
        per_device_train_batch_size=len(_records()),
        gradient_accumulation_steps=1,
        max_steps=1,
        warmup_steps=0,
    )
    ours = losses(out)
    assert math.isclose(ours[1], trl_losses[0], rel_tol=1e-5), (ours[1], trl_losses[0])
    # Adam's first step moves a weight by lr * g / (|g| + eps): where a gradient is as small as eps,
    # rounding differences of summing it over another arrangement of the samples become a fraction of
    # lr (observed: 5e-6, 0.2% of lr, in one element); a wrong gradient moves weights by ~lr.
    _assert_tensors(trl_state, load_file(str(out / "epoch_1" / "model.safetensors")), atol=1e-2 * LR)


def test_bf16_first_step_loss_equals_trl_within_bf16_noise(job, recipe_pool, tmp_path, full_runs):
    """``dtype: bf16`` with ``mixed_precision: true`` (FSDP2 casts the fp32 masters to bf16 for the
    forward) against TRL's ``bf16=True`` (autocast over fp32 weights: matmuls in bf16, the rest in
    fp32): the same first-step loss within bf16 noise, each near the fp32 loss."""
    out = tmp_path / "bf16"
    _shardtune_run(job, recipe_pool, out, "dtype=bf16", "mixed_precision=true", "max_steps_per_epoch=1")
    trl_losses, _ = _trl_run(job, adapter_init=None, bf16=True, max_steps=1)
    (fp32_losses, _), _ = full_runs
    ours, theirs, fp32 = losses(out)[1], trl_losses[0], fp32_losses[0]
    # Observed: 1.4e-5 relative apart, each 1.5e-4 from the fp32 loss (bf16 keeps 8 significant bits: 4e-3).
    assert math.isclose(ours, theirs, rel_tol=1e-3), (ours, theirs, fp32)
    assert math.isclose(ours, fp32, rel_tol=2e-3) and math.isclose(theirs, fp32, rel_tol=2e-3), (ours, theirs, fp32)
