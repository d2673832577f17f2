"""LoRA and full DPO end to end on 2 CPU ranks: first-step losses against an independent
computation from transformers log-probs on the same global batch (every loss variant), a
margin that training raises, exact resume, and outputs that transformers/peft load. The runs a test
compares run in-process (``recipe_pool``); every resume is a ``shardtune run`` job of its own."""

from __future__ import annotations

import json
import math
from pathlib import Path

import peft
import pytest
import torch
import torch.nn.functional as F
import transformers

from shardtune.config import load_config
from shardtune.data import build_dataset, load_tokenizer
from shardtune.data.datasets import CROSS_ENTROPY_IGNORE_IDX
from shardtune.data.preference import collate_pairs
from shardtune.data.sampler import ResumableDistributedSampler
from shardtune.recipes.registry import get_recipe
from tests.recipes.conftest import losses, resume_copy, run_recipe

pytestmark = pytest.mark.timeout(900)

BATCH = 4  # pairs per rank
CASES = {"lora": ("lora_dpo_distributed", "tiny/lora_dpo"), "full": ("full_dpo_distributed", "tiny/full_dpo")}


def _overrides(dirs, out: Path, *extra: str, epochs: int = 1, steps: int = 2) -> list[str]:
    return [
        f"output_dir={out}",
        f"checkpoint_dir={dirs['base']}",
        f"epochs={epochs}",
        f"max_steps_per_epoch={steps}",
        f"batch_size={BATCH}",
        "log_every_n_steps=1",
        "keep_last_n=null",
        *extra,
    ]


def _pairs(config: str, base: Path) -> list[tuple[dict, dict]]:
    """(tokens, labels) of the chosen and rejected sequence of every pair of the first global batch."""
    recipe = get_recipe(CASES["lora" if "lora" in config else "full"][0])
    cfg = load_config(config, ["output_dir=/unused", f"checkpoint_dir={base}"], schema=recipe.schema)
    tokenizer = load_tokenizer(cfg.tokenizer, checkpoint_dir=base)
    dataset = build_dataset([d.to_dict() for d in cfg.dataset], tokenizer, max_seq_len=cfg.max_seq_len)
    order = ResumableDistributedSampler(len(dataset), num_replicas=1, rank=0, seed=cfg.seed).global_order(0)
    return [(dataset[i]["chosen"], dataset[i]["rejected"]) for i in order[: 2 * BATCH]]


def _logp(model, sample: dict) -> tuple[float, int]:
    """Summed log p(label) of the response tokens and their count, from transformers' logits."""
    tokens, labels = torch.tensor([sample["tokens"]]), torch.tensor(sample["labels"][1:])
    with torch.no_grad():
        logprobs = F.log_softmax(model(tokens).logits[0, :-1].double(), -1)
    trained = labels != -100
    return logprobs[trained.nonzero().flatten(), labels[trained]].sum().item(), int(trained.sum())


def _hand_loss(kind: str, beta: float, pc, pr, rc, rr, nc, nr, gamma: float = 0.5) -> float:
    if kind == "ipo":
        z = (pc / nc - pr / nr) - (rc / nc - rr / nr)
        return (z - 1 / (2 * beta)) ** 2
    if kind == "simpo":
        m = beta * (pc / nc - pr / nr) - gamma
        return math.log1p(math.exp(-m))
    z = (pc - pr) - (rc - rr)
    return math.log1p(math.exp(-beta * z))


@pytest.mark.parametrize(
    ("case", "kind", "extra"),
    [
        ("lora", "sigmoid", ()),  # policy = reference at step 1: ln 2
        ("lora", "ipo", ()),
        ("lora", "simpo", ("dpo.beta=2.0",)),
        ("lora", "sigmoid", ("dpo.reference_free=true",)),
        ("full", "sigmoid", ("reference_checkpoint_dir={teacher}",)),  # a reference unlike the policy
    ],
)
def test_first_step_loss_equals_an_independent_computation(tiny_dirs, tmp_path, recipe_pool, case, kind, extra):
    recipe, config = CASES[case]
    extra = [e.format(teacher=tiny_dirs["teacher"]) for e in extra]
    out = tmp_path / "run"
    recipe_pool.run(recipe, config, *_overrides(tiny_dirs, out, f"dpo.loss={kind}", *extra, steps=1))
    beta = 2.0 if kind == "simpo" else 0.1
    policy = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["base"], dtype=torch.float32).eval()
    ref_dir = tiny_dirs["teacher"] if any("reference_checkpoint_dir" in e for e in extra) else tiny_dirs["base"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    free = any("reference_free" in e for e in extra) or kind == "simpo"
    total = 0.0
    pairs = _pairs(config, tiny_dirs["base"])
    for chosen, rejected in pairs:
        (pc, nc), (pr, nr) = _logp(policy, chosen), _logp(policy, rejected)
        rc, rr = (0.0, 0.0) if free else (_logp(reference, chosen)[0], _logp(reference, rejected)[0])
        total += _hand_loss(kind, beta, pc, pr, rc, rr, nc, nr)
    want = total / len(pairs)
    if kind == "sigmoid" and not free and case == "lora":
        assert want == pytest.approx(math.log(2), rel=1e-12)
    assert losses(out)[1] == pytest.approx(want, rel=1e-5)


def test_lora_dpo_raises_the_margin_resumes_exactly_and_loads_in_peft(tiny_dirs, tmp_path, recipe_pool):
    recipe, config = CASES["lora"]
    out = tmp_path / "run"
    recipe_pool.run(recipe, config, *_overrides(tiny_dirs, out, "optimizer.lr=0.003", epochs=2, steps=4))
    resumed = resume_copy(out, "epoch_1", tmp_path / "resumed")
    run_recipe(
        recipe,
        config,
        *_overrides(tiny_dirs, resumed, "optimizer.lr=0.003", epochs=2, steps=4),
        "resume_from_checkpoint=true",
    )
    full, again = losses(out), losses(resumed)
    assert sorted(again) == [5, 6, 7, 8] and [again[s] for s in again] == [full[s] for s in again]  # bitwise

    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["base"], dtype=torch.float32).eval()
    margin = 0.0
    pairs = _pairs(config, tiny_dirs["base"])
    reference = [(_logp(base, c)[0], _logp(base, r)[0]) for c, r in pairs]
    trained = peft.PeftModel.from_pretrained(base, out / "epoch_2" / "adapter").eval()
    for (c, r), (rc, rr) in zip(pairs, reference, strict=True):
        margin += (_logp(trained, c)[0] - rc) - (_logp(trained, r)[0] - rr)
    assert margin > 0.0  # the trained policy prefers the chosen answers more than the base does
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "epoch_2", dtype=torch.float32).eval()
    x = torch.tensor([pairs[0][0]["tokens"]])
    with torch.no_grad():
        assert torch.allclose(merged(x).logits, trained(input_ids=x).logits, rtol=1e-4, atol=1e-4)


def test_full_dpo_resumes_exactly_with_the_same_reference(tiny_dirs, tmp_path, recipe_pool):
    recipe, config = CASES["full"]
    out = tmp_path / "run"
    recipe_pool.run(recipe, config, *_overrides(tiny_dirs, out, epochs=2, steps=2))
    resumed = resume_copy(out, "epoch_1", tmp_path / "resumed")
    run_recipe(recipe, config, *_overrides(tiny_dirs, resumed, epochs=2, steps=2), "resume_from_checkpoint=true")
    full, again = losses(out), losses(resumed)
    assert sorted(again) == [3, 4] and [again[s] for s in again] == [full[s] for s in again]
    assert transformers.AutoModelForCausalLM.from_pretrained(out / "epoch_2") is not None


def test_chat_pairs_save_the_template_they_trained_with(tiny_dirs, tmp_path):
    """Chat preference pairs on a base without a chat template train with the built-in one; the
    checkpoint's tokenizer renders, through transformers, the prompt and the conversation trained."""
    records = [
        {
            "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"What is {i}+{i}?"}],
            "chosen": [{"role": "assistant", "content": str(2 * i)}],
            "rejected": [{"role": "assistant", "content": f"Maybe {2 * i + 1}"}],
        }
        for i in range(4)
    ]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    spec = {"path": str(data), "format": "preference"}
    out = tmp_path / "run"
    proc = run_recipe(
        "lora_dpo_distributed",
        "tiny/lora_dpo",
        *_overrides(tiny_dirs, out, f"dataset=[{json.dumps(spec)}]", "batch_size=2", steps=1),
        nproc=1,
    )
    assert "chat template: the built-in 'chat' template" in proc.stderr
    assert transformers.AutoTokenizer.from_pretrained(tiny_dirs["base"]).chat_template is None  # the base has none
    hf = transformers.AutoTokenizer.from_pretrained(out / "epoch_1")
    trained = build_dataset(spec, load_tokenizer(None, checkpoint_dir=tiny_dirs["base"]), max_seq_len=128)
    for i, record in enumerate(records):
        for side in ("chosen", "rejected"):
            sample = trained[i][side]
            n = next(j for j, label in enumerate(sample["labels"]) if label != CROSS_ENTROPY_IGNORE_IDX)
            prompt = hf.apply_chat_template(
                record["prompt"], tokenize=True, add_generation_prompt=True, return_dict=False
            )
            assert list(prompt) == sample["tokens"][:n], (i, side)  # the prompt ids the run gave the model
            whole = hf.apply_chat_template(record["prompt"] + record[side], tokenize=True, return_dict=False)
            assert list(whole) == sample["tokens"], (i, side)


def test_batch_of_pairs_is_chosen_rows_then_rejected_rows():
    pairs = [
        {"chosen": {"tokens": [1, 2, 3], "labels": [-100, 2, 3]}, "rejected": {"tokens": [1, 4], "labels": [-100, 4]}},
        {"chosen": {"tokens": [1, 5], "labels": [-100, 5]}, "rejected": {"tokens": [1, 6, 7], "labels": [-100, 6, 7]}},
    ]
    batch = collate_pairs(pairs, pad_id=0)
    assert batch["tokens"].tolist() == [[1, 2, 3], [1, 5, 0], [1, 4, 0], [1, 6, 7]]
    assert batch["labels"][:, 1:].ne(-100).sum(-1).tolist() == [2, 1, 1, 2]
