"""Every recipe end to end on 2 CPU ranks: first-step loss against an independent single-process
reference (transformers), exact resume at epoch and mid-epoch, resume on 4 ranks, and outputs
that transformers/peft load. The runs a test compares run in-process (``recipe_pool``); every
resume is a job of its own through ``shardtune run``, a fresh process that has only the checkpoint."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from shardtune.config import load_config
from shardtune.data import build_dataset, collate, load_tokenizer
from shardtune.data.sampler import ResumableDistributedSampler
from shardtune.recipes.registry import get_recipe
from tests.recipes.conftest import losses, resume_copy, run_recipe

pytestmark = pytest.mark.timeout(900)

STEPS, EPOCHS, BATCH = 3, 2, 4
CASES = {
    "full": ("full_finetune_distributed", "tiny/full"),
    "lora": ("lora_finetune_distributed", "tiny/lora"),
    "qlora": ("lora_finetune_distributed", "tiny/qlora"),
    "kd": ("knowledge_distillation_distributed", "tiny/kd"),
    "early_exit": ("early_exit_finetune_distributed", "tiny/early_exit"),
}


def _overrides(
    dirs, case: str, out: Path, *, batch: int = BATCH, epochs: int = EPOCHS, steps: int = STEPS
) -> list[str]:
    extra = [f"teacher_checkpoint_dir={dirs['teacher']}"] if case == "kd" else []
    return [
        f"output_dir={out}",
        f"checkpoint_dir={dirs['base']}",
        f"epochs={epochs}",
        f"max_steps_per_epoch={steps}",
        f"batch_size={batch}",
        "log_every_n_steps=1",
        "keep_last_n=null",
        "save_every_n_steps=2",
        *extra,
    ]


@pytest.fixture(scope="module")
def runs(tiny_dirs, tmp_path_factory, recipe_pool) -> dict[str, Path]:
    """One uninterrupted 2-epoch run per case (checkpoints at step 2, epoch 1, step 4, epoch 2)."""
    out = {}
    for case, (recipe, config) in CASES.items():
        out[case] = tmp_path_factory.mktemp(case) / "run"
        recipe_pool.run(recipe, config, *_overrides(tiny_dirs, case, out[case]))
    return out


# --- an independent reference for the first step: transformers on the same global batch -----


def _first_global_batch(config: str, base: Path, *, packed: bool = False) -> list[dict]:
    cfg = load_config(
        config, ["output_dir=/unused", f"checkpoint_dir={base}"], schema=get_recipe(CASES_BY_CONFIG[config]).schema
    )
    tokenizer = load_tokenizer(cfg.tokenizer, checkpoint_dir=base)
    datasets = cfg.dataset if isinstance(cfg.dataset, (list, tuple)) else [cfg.dataset]
    dataset = build_dataset([d.to_dict() for d in datasets], tokenizer, max_seq_len=cfg.max_seq_len, packed=packed)
    order = ResumableDistributedSampler(len(dataset), num_replicas=1, rank=0, seed=cfg.seed).global_order(0)
    per_rank = [[dataset[i] for i in order[: 2 * BATCH][r::2]] for r in range(2)]
    return [collate(samples, pad_id=tokenizer.pad_id) for samples in per_rank]


CASES_BY_CONFIG = {config: recipe for recipe, config in CASES.values()}


def _samples(batch: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) ``[1, n]`` of every sample: whole rows, or for packed rows each run of
    positions from a 0 to the next (the last one with the padding, which comes after it)."""
    if "position_ids" not in batch:
        return [(batch["tokens"], batch["labels"])]
    out = []
    for row, positions in enumerate(batch["position_ids"]):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
        out += [
            (batch["tokens"][row : row + 1, a:b], batch["labels"][row : row + 1, a:b])
            for a, b in itertools.pairwise(starts)
        ]
    return out


def _ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")
    return ce.item(), int((labels != -100).sum())


def _kd_sum(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor) -> float:
    """torchtune's "forward KL": the cross-entropy -sum p_teacher log p_student (KL + teacher entropy)."""
    s, t, labels = student[:, :-1].float(), teacher[:, :-1].float(), labels[:, 1:]
    per_token = -(F.softmax(t, -1) * F.log_softmax(s, -1)).sum(-1)
    return (per_token * (labels != -100)).sum().item()


def _quantized(model, targets: list[str]):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

    with torch.no_grad():
        for name, module in model.named_modules():
            if name.split(".")[-1] in targets and hasattr(module, "weight"):
                module.weight.copy_(to_nf4(module.weight.detach()).get_original_weight())
    return model


def _reference_first_loss(case: str, dirs, *, packed: bool = False) -> float:
    import transformers

    _, config = CASES[case]
    model = transformers.AutoModelForCausalLM.from_pretrained(dirs["base"], torch_dtype=torch.float32).eval()
    if case == "qlora":
        _quantized(model, ["q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    teacher = transformers.AutoModelForCausalLM.from_pretrained(dirs["teacher"]).eval() if case == "kd" else None
    total, tokens = 0.0, 0
    with torch.no_grad():
        # Packed samples each run alone here: none may see another (a packed row's first label
        # of a sample is -100, so summing per sample equals summing the row).
        samples = [x for batch in _first_global_batch(config, dirs["base"], packed=packed) for x in _samples(batch)]
        for sample_tokens, labels in samples:
            out = model(sample_tokens, output_hidden_states=True)
            ce, n = _ce_sum(out.logits, labels)
            loss_sum = ce
            if case == "kd":
                kl = _kd_sum(out.logits, teacher(sample_tokens).logits, labels)
                loss_sum = 0.5 * ce + 0.5 * kl
            if case == "early_exit":
                # rotational curriculum, step 0: the first candidate (layer 1) with weight 1
                hidden = out.hidden_states[2]  # output of layer 1
                early = model.lm_head(model.model.norm(hidden))
                loss_sum = ce + _ce_sum(early, labels)[0]
            total += loss_sum
            tokens += n
    return total / tokens


@pytest.mark.parametrize("case", list(CASES))
def test_first_step_loss_equals_transformers_reference(runs, tiny_dirs, tmp_path, recipe_pool, case):
    if case == "early_exit":  # a run without layer dropout, whose skips the reference cannot replay
        recipe, config = CASES[case]
        recipe_pool.run(
            recipe,
            config,
            *_overrides(tiny_dirs, case, tmp_path / "run", epochs=1, steps=1),
            "layer_dropout.max_prob=0.0",
        )
        logged = losses(tmp_path / "run")[1]
    else:
        logged = losses(runs[case])[1]
    expected = _reference_first_loss(case, tiny_dirs)
    assert math.isclose(logged, expected, rel_tol=1e-5), (logged, expected)


def test_qlora_on_one_rank_first_step_loss_equals_transformers_reference(tiny_dirs, tmp_path, recipe_pool):
    """One rank (a single GPU): FSDP2 skips its all-gather there, so the NF4 base must still be whole."""
    recipe, config = CASES["qlora"]
    recipe_pool.run(
        recipe, config, *_overrides(tiny_dirs, "qlora", tmp_path / "run", batch=2 * BATCH, epochs=1, steps=1), nproc=1
    )
    assert math.isclose(losses(tmp_path / "run")[1], _reference_first_loss("qlora", tiny_dirs), rel_tol=1e-5)


@pytest.mark.parametrize("case", ["full", "kd", "early_exit"])
def test_packed_first_step_loss_equals_transformers_on_each_sample_alone(tiny_dirs, tmp_path, recipe_pool, case):
    """packed=true: each packed sample's loss is what transformers gives that sample by itself
    (positions restart per sample, attention stays inside it)."""
    recipe, config = CASES[case]
    extra = ["layer_dropout.max_prob=0.0"] if case == "early_exit" else []
    recipe_pool.run(
        recipe, config, *_overrides(tiny_dirs, case, tmp_path / "run", epochs=1, steps=1), "packed=true", *extra
    )
    expected = _reference_first_loss(case, tiny_dirs, packed=True)
    assert math.isclose(losses(tmp_path / "run")[1], expected, rel_tol=1e-5), (losses(tmp_path / "run")[1], expected)


# --- resume ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(CASES))
def test_epoch_resume_continues_with_identical_losses(runs, tiny_dirs, tmp_path, case):
    recipe, config = CASES[case]
    resumed = resume_copy(runs[case], "epoch_1", tmp_path / "resumed")
    run_recipe(recipe, config, *_overrides(tiny_dirs, case, resumed), "resume_from_checkpoint=True")
    full, again = losses(runs[case]), losses(resumed)
    assert sorted(again) == [4, 5, 6]
    assert [again[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]  # bitwise
    _assert_same_final_weights(runs[case] / "epoch_2", resumed / "epoch_2")


def _assert_same_final_weights(a: Path, b: Path) -> None:
    files = sorted(p.relative_to(a) for p in a.rglob("*.safetensors"))
    assert files and files == sorted(p.relative_to(b) for p in b.rglob("*.safetensors"))
    for rel in files:
        if rel.parts[0] == "training_state":
            continue
        x, y = load_file(str(a / rel)), load_file(str(b / rel))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), rel


def test_mid_epoch_resume_continues_with_identical_losses(runs, tiny_dirs, tmp_path):
    recipe, config = CASES["lora"]
    resumed = resume_copy(runs["lora"], "step_2", tmp_path / "resumed")
    run_recipe(recipe, config, *_overrides(tiny_dirs, "lora", resumed), "resume_from_checkpoint=True")
    full, again = losses(runs["lora"]), losses(resumed)
    assert sorted(again) == [3, 4, 5, 6]
    assert [again[s] for s in again] == [full[s] for s in again]


@pytest.mark.parametrize("case", list(CASES))
def test_resume_on_four_ranks_from_a_two_rank_checkpoint(runs, tiny_dirs, tmp_path, case):
    """Same global batch (2 x 4 = 4 x 2 samples): the losses agree up to reduction order.

    Early exit draws layer-dropout decisions from the RNG, which a resume on another world
    size re-derives (seed, step) instead of restoring: it must run and stay finite, not match.
    """
    recipe, config = CASES[case]
    resumed = resume_copy(runs[case], "epoch_1", tmp_path / "resumed")
    run_recipe(
        recipe, config, *_overrides(tiny_dirs, case, resumed, batch=BATCH // 2), "resume_from_checkpoint=True", nproc=4
    )
    full, again = losses(runs[case]), losses(resumed)
    assert sorted(again) == [4, 5, 6]
    for step in (4, 5, 6):
        if case == "early_exit":
            assert math.isfinite(again[step])
        else:
            assert math.isclose(again[step], full[step], rel_tol=1e-4), (step, again[step], full[step])


# --- outputs ---------------------------------------------------------------------------------


def test_lora_outputs_load_in_transformers_and_peft(runs, tiny_dirs):
    import peft
    import transformers

    final = runs["lora"] / "epoch_2"
    tokens = torch.arange(3, 40).reshape(1, -1)
    merged = transformers.AutoModelForCausalLM.from_pretrained(final).eval()
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["base"]).eval()
    adapted = peft.PeftModel.from_pretrained(base, final / "adapter").eval()
    with torch.no_grad():
        a, b = merged(tokens).logits, adapted(tokens).logits
        plain = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["base"]).eval()(tokens).logits
    assert (a - b).abs().max() < 1e-4
    assert (a - plain).abs().max() > 1e-3  # the adapters changed the model


def test_full_output_loads_in_transformers(runs):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(runs["full"] / "epoch_2").eval()
    saved = load_file(str(runs["full"] / "epoch_2" / "model.safetensors"))
    assert all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())
    assert (runs["full"] / "epoch_2" / "tokenizer.json").is_file()


def test_multi_dataset_config_draws_from_both(tiny_dirs):
    cfg = load_config(
        "tiny/lora_multi_dataset",
        [f"checkpoint_dir={tiny_dirs['base']}"],
        schema=get_recipe("lora_finetune_distributed").schema,
    )
    tokenizer = load_tokenizer(cfg.tokenizer, checkpoint_dir=tiny_dirs["base"])
    dataset = build_dataset([d.to_dict() for d in cfg.dataset], tokenizer, max_seq_len=cfg.max_seq_len)
    sizes = [len(d) for d in dataset.datasets]
    assert len(sizes) == 2 and all(sizes)
    first_epoch = ResumableDistributedSampler(len(dataset), num_replicas=2, rank=0, seed=cfg.seed).global_order(0)[:64]
    assert any(i < sizes[0] for i in first_epoch) and any(i >= sizes[0] for i in first_epoch)


def test_cli_reports_bad_config_with_suggestions(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardtune.cli",
            "run",
            "lora_finetune_distributed",
            "--config",
            "tiny/lora",
            "optimizer.lrr=1",
            "lora.rank=-2",
            f"output_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr  # reported once, before torchrun starts
    assert "did you mean 'optimizer.lr'" in proc.stderr and "lora.rank" in proc.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_async_dcp_intermediate_checkpoints_resume_exactly(runs, tiny_dirs, tmp_path, recipe_pool):
    """checkpoint_format=dcp + async_save: intermediate saves are DCP shards written in the
    background; resuming from one continues with the uninterrupted run's losses; the final
    checkpoint is HF format."""
    recipe, config = CASES["lora"]
    first = tmp_path / "first"
    recipe_pool.run(recipe, config, *_overrides(tiny_dirs, "lora", first), "checkpoint_format=dcp", "async_save=true")
    assert (first / "step_2" / "dcp").is_dir() and not (first / "step_2" / "adapter").exists()
    assert (first / "epoch_2" / "adapter" / "adapter_model.safetensors").is_file()
    assert losses(first) == losses(runs["lora"])  # the format does not change training
    resumed = resume_copy(first, "step_2", tmp_path / "resumed")
    run_recipe(
        recipe,
        config,
        *_overrides(tiny_dirs, "lora", resumed),
        "checkpoint_format=dcp",
        "async_save=true",
        "resume_from_checkpoint=True",
    )
    again = losses(resumed)
    assert sorted(again) == [3, 4, 5, 6] and all(again[s] == losses(first)[s] for s in again)


def test_node_local_checkpoints_train_and_resume_like_shared_ones(runs, tiny_dirs, tmp_path, recipe_pool):
    """shared_filesystem=false (rank 0 does all checkpoint file I/O): the same losses as the
    default run, and a mid-epoch resume continues them exactly."""
    recipe, config = CASES["full"]
    first = tmp_path / "first"
    recipe_pool.run(recipe, config, *_overrides(tiny_dirs, "full", first), "shared_filesystem=false")
    assert losses(first) == losses(runs["full"])
    assert (first / "step_2" / "training_state" / "rng" / "rank_1.safetensors").is_file()
    resumed = resume_copy(first, "step_2", tmp_path / "resumed")
    run_recipe(
        recipe,
        config,
        *_overrides(tiny_dirs, "full", resumed),
        "shared_filesystem=false",
        "resume_from_checkpoint=True",
    )
    again = losses(resumed)
    assert sorted(again) == [3, 4, 5, 6] and all(again[s] == losses(first)[s] for s in again)
    _assert_same_final_weights(first / "epoch_2", resumed / "epoch_2")


def test_bf16_qlora_with_activation_checkpointing_trains_and_exports_bf16(tiny_dirs, tmp_path, recipe_pool):
    import json

    import transformers

    recipe, config = CASES["qlora"]
    out = tmp_path / "bf16"
    recipe_pool.run(
        recipe,
        config,
        *_overrides(tiny_dirs, "qlora", out, epochs=1, steps=3),
        "dtype=bf16",
        "enable_activation_checkpointing=true",
    )
    logged = losses(out)
    assert sorted(logged) == [1, 2, 3] and all(math.isfinite(v) for v in logged.values())
    assert logged[3] < logged[1]
    final = out / "epoch_1"
    assert (
        json.loads((final / "config.json").read_text()).get(
            "torch_dtype", json.loads((final / "config.json").read_text()).get("dtype")
        )
        == "bfloat16"
    )
    model = transformers.AutoModelForCausalLM.from_pretrained(final)
    assert next(model.parameters()).dtype == torch.bfloat16
