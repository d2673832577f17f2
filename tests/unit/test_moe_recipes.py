"""Every recipe's loss on a mixture-of-experts model adds the routers' load-balancing loss as its
reference does: DPO as TRL's ``DPOTrainer`` (``router_aux_loss_coef * outputs.aux_loss`` of the
policy's concatenated chosen+rejected forward with its ``attention_mask``; the reference forward
has none), KD for a MoE student as its fine-tuning loss (a MoE teacher only forwards), early exit
over the sparse layers, packed rows over their real tokens (transformers on each sample alone),
and the validation loss as transformers' ``out.loss`` with ``output_router_logits=True``.

References are transformers' tiny random models (tests/unit/test_models_moe.py) and hand-written
formulas; gradients are compared too, so the aux loss's gradient reaching the routers is checked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from shardtune.data import collate
from shardtune.data.packing import PackedDataset
from shardtune.data.preference import collate_pairs
from shardtune.losses.distillation import distillation_loss_fn
from shardtune.losses.dpo import dpo_loss_fn
from shardtune.losses.early_exit import early_exit_loss_fn
from shardtune.losses.next_token import next_token_loss
from tests.unit.test_models_moe import batch, hf_moe_model, ours_from

CPU = torch.device("cpu")
COEF = 0.05  # the tiny models' router_aux_loss_coef (test_models_moe.COMMON)


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def _assert_grads_equal(ours, hf, hf_name=lambda name: name) -> None:
    hf_params = dict(hf.named_parameters())
    routers = 0
    for name, p in ours.named_parameters():
        if not p.requires_grad:
            continue
        expected = hf_params[hf_name(name)].grad
        assert p.grad is not None and expected is not None, name
        assert _rel(p.grad, expected) < 1e-4, name
        routers += name.endswith("mlp.gate.weight")
    assert routers


def _assert_equal_to_reference(loss, metrics, units: int, expected, aux, ours, hf, **names) -> None:
    """Loss, logged ``aux_loss`` (a sum over ``units``) and every gradient equal the reference's."""
    assert abs(metrics["aux_loss"].item() / units - aux.item()) < 1e-6 * aux.item()
    assert abs(loss.item() - expected.item()) < 1e-5 * expected.item()
    loss.backward()
    expected.backward()
    _assert_grads_equal(ours, hf, **names)


def _token_batch() -> dict[str, torch.Tensor]:
    tokens, mask, labels = batch()
    return {"tokens": tokens, "labels": labels, "attention_mask": mask}


def _shifted_ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100, reduction="sum")


def _pairs_batch() -> dict[str, torch.Tensor]:
    """Two pairs of different lengths; the prompt's labels are ignored, as the preference data makes them."""
    gen = torch.Generator().manual_seed(5)

    def sample(prompt: int, response: int) -> dict[str, list[int]]:
        tokens = torch.randint(1, 128, (prompt + response,), generator=gen).tolist()
        return {"tokens": tokens, "labels": [-100] * prompt + tokens[prompt:]}

    pairs = [{"chosen": sample(9, 14), "rejected": sample(9, 6)}, {"chosen": sample(5, 21), "rejected": sample(5, 17)}]
    return collate_pairs(pairs, pad_id=0)


def _trl_dpo_loss(policy, reference, data: dict[str, torch.Tensor], beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``DPOTrainer._compute_loss`` (sigmoid; read at huggingface/trl f2cd577, trl is not installed
    here): summed completion log-probs of the concatenated forward, ``-logsigmoid(beta * delta)``
    averaged over pairs, plus ``router_aux_loss_coef * outputs.aux_loss`` of the policy forward."""
    tokens, mask, labels = data["tokens"], data["attention_mask"], data["labels"]

    def logps(logits: torch.Tensor) -> torch.Tensor:
        shift, completion = labels[:, 1:], labels[:, 1:] != -100
        per_token = torch.gather(logits[:, :-1].log_softmax(-1), 2, shift.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        return (per_token * completion).sum(-1)

    out = policy(tokens, attention_mask=mask, output_router_logits=True)
    with torch.no_grad():
        ref = logps(reference(tokens, attention_mask=mask).logits)
    pol = logps(out.logits)
    pc, pr = pol.chunk(2)
    rc, rr = ref.chunk(2)
    loss = -F.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()
    return loss + policy.config.router_aux_loss_coef * out.aux_loss, out.aux_loss


def test_dpo_loss_of_a_moe_policy_equals_trl_with_the_aux_loss():
    hf_policy, hf_reference = hf_moe_model("qwen3_moe", seed=0), hf_moe_model("qwen3_moe", seed=2).eval()
    policy, reference = ours_from(hf_policy), ours_from(hf_reference).eval()
    dpo = {"loss": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "simpo_gamma": 0.5, "reference_free": False}
    loss_fn = dpo_loss_fn(
        policy,
        reference=lambda tokens, head_loss: reference(tokens, head_loss=head_loss),
        device=CPU,
        dpo=dpo,
        chunk_tokens=16,
    )
    data = _pairs_batch()
    loss, pairs, metrics = loss_fn(data)
    expected, aux = _trl_dpo_loss(hf_policy, hf_reference, data, beta=0.1)
    assert pairs == 2
    _assert_equal_to_reference(loss, metrics, pairs, expected, aux, policy, hf_policy)


def test_kd_moe_student_adds_its_aux_loss_and_a_moe_teacher_only_forwards():
    hf_student, hf_teacher = hf_moe_model("qwen3_moe", seed=0), hf_moe_model("mixtral", seed=3).eval()
    student, teacher = ours_from(hf_student), ours_from(hf_teacher).eval()
    kd_ratio = 0.3
    loss_fn = distillation_loss_fn(student, teacher, device=CPU, kd_ratio=kd_ratio, chunk_tokens=16)
    data = _token_batch()
    loss, n_tokens, metrics = loss_fn(data)
    tokens, mask, labels = data["tokens"], data["attention_mask"], data["labels"]
    out = hf_student(tokens, attention_mask=mask, output_router_logits=True)
    with torch.no_grad():
        teacher_prob = hf_teacher(tokens, attention_mask=mask).logits[:, :-1].softmax(-1)
    trained = labels[:, 1:] != -100
    kd = -((teacher_prob * out.logits[:, :-1].log_softmax(-1)).sum(-1) * trained).sum()
    ce = _shifted_ce_sum(out.logits, labels)
    expected = ((1 - kd_ratio) * ce + kd_ratio * kd) / int(trained.sum()) + COEF * out.aux_loss
    assert n_tokens == int(trained.sum())
    _assert_equal_to_reference(loss, metrics, n_tokens, expected, out.aux_loss, student, hf_student)


def test_early_exit_loss_of_a_moe_model_adds_the_aux_loss():
    hf = hf_moe_model("qwen3_moe")
    ours = ours_from(hf)
    loss_fn = early_exit_loss_fn(ours, device=CPU, exits=lambda: [0, 1], scale_type="one", scale=1.0, chunk_tokens=16)
    data = _token_batch()
    loss, n_tokens, metrics = loss_fn(data)
    tokens, mask, labels = data["tokens"], data["attention_mask"], data["labels"]
    out = hf(tokens, attention_mask=mask, output_router_logits=True, output_hidden_states=True)
    exits = [_shifted_ce_sum(hf.lm_head(hf.model.norm(out.hidden_states[i + 1])), labels) for i in (0, 1)]
    # scale_type "one": the exits weigh 1 each, normalized to sum to 1
    expected = (_shifted_ce_sum(out.logits, labels) + 0.5 * exits[0] + 0.5 * exits[1]) / n_tokens + COEF * out.aux_loss
    _assert_equal_to_reference(loss, metrics, n_tokens, expected, out.aux_loss, ours, hf)


def test_packed_rows_aux_loss_counts_every_sample_token_and_no_padding():
    """A packed batch (3 samples and a pad tail in row 0, 1 sample and a longer tail in row 1): the loss
    is transformers' on each sample alone, and the aux loss ``load_balancing_loss_func`` over the router
    logits of every sample token (each sample run alone; no padding), the padding-free batch's value."""
    hf = hf_moe_model("qwen3_moe").eval()
    ours = ours_from(hf)
    gen = torch.Generator().manual_seed(7)
    samples = []
    for n in (11, 9, 14, 25):
        tokens = torch.randint(1, 128, (n,), generator=gen).tolist()
        samples.append({"tokens": tokens, "labels": tokens})
    packs = PackedDataset(samples, max_seq_len=40, pad_id=0)
    data = collate([packs[0], packs[1]], pad_id=0)
    assert data["attention_mask"].sum().item() == 59 and data["attention_mask"].numel() == 80
    loss, n_tokens, metrics = next_token_loss(ours, device=CPU, chunk_tokens=16)(data)
    ce, routers = torch.zeros(()), []
    for sample in samples:
        tokens = torch.tensor([sample["tokens"]])
        out = hf(tokens, output_router_logits=True)
        ce = ce + _shifted_ce_sum(out.logits, tokens)
        routers.append([r for r in out.router_logits if r is not None])
    per_layer = tuple(torch.cat(layer) for layer in zip(*routers, strict=True))
    aux = load_balancing_loss_func(per_layer, hf.config.num_experts, hf.config.num_experts_per_tok)
    assert n_tokens == sum(len(s["tokens"]) - 1 for s in samples)
    assert abs(metrics["aux_loss"].item() / n_tokens - aux.item()) < 1e-5 * aux.item()
    expected = ce / n_tokens + COEF * aux
    assert abs(loss.item() - expected.item()) < 1e-5 * expected.item()


def test_validation_loss_of_a_moe_model_adds_the_aux_loss_as_transformers_out_loss(tmp_path):
    """``val_loss``: per validation batch transformers' ``out.loss`` with ``output_router_logits=True``
    (cross-entropy + coef * aux_loss of its real tokens), weighted by the batch's label tokens."""
    import transformers
    from safetensors.torch import load_file

    from shardtune.checkpoint.formats.tiny_base import create_tiny_base
    from shardtune.config import load_config
    from shardtune.data import build_dataset, load_tokenizer
    from shardtune.models import from_hf_config
    from shardtune.recipes.builders import build_evaluator
    from shardtune.recipes.registry import get_recipe
    from shardtune.recipes.run import Run

    base = create_tiny_base(tmp_path / "moe_base", preset="tiny_moe")
    overrides = [
        f"output_dir={tmp_path / 'run'}",
        f"checkpoint_dir={base}",
        "batch_size=2",
        "router_aux_loss_coef=0.1",
        "validation_dataset.path=asset:tiny_instruct.jsonl",
        "validation_dataset.format=instruct",
        "validation_dataset.template=simple",
        "validation_dataset.max_samples=5",
    ]
    cfg = load_config("tiny/moe_full", overrides, schema=get_recipe("full_finetune_distributed").schema)
    tokenizer = load_tokenizer(cfg.tokenizer, checkpoint_dir=base)
    ours = from_hf_config(base)
    ours.load_state_dict(load_file(base / "model.safetensors"), strict=True)
    run = Run(rank=0, world_size=1, device=CPU, dtype=torch.float32)
    evaluator = build_evaluator(cfg, run, ours, tokenizer)
    assert evaluator is not None
    got = evaluator(ours)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, experts_implementation="eager").eval()
    dataset = build_dataset([cfg.validation_dataset.to_dict()], tokenizer, max_seq_len=cfg.max_seq_len)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(dataset), 2):
            data = collate([dataset[i] for i in range(start, min(start + 2, len(dataset)))], pad_id=tokenizer.pad_id)
            out = hf(data["tokens"], attention_mask=data["attention_mask"], output_router_logits=True)
            n = int((data["labels"][:, 1:] != -100).sum())
            total += _shifted_ce_sum(out.logits, data["labels"]).item() + 0.1 * out.aux_loss.item() * n
            tokens += n
    assert abs(got - total / tokens) < 1e-5 * got


def test_early_exit_layer_dropout_of_a_sparse_layer_leaves_its_router_out_of_the_aux_loss():
    """Layer dropout that always skips layer 0: the loss is transformers' ``out.loss`` (cross-entropy +
    coef * aux_loss) of the same model without layer 0, whose router then routes nothing."""
    hf = hf_moe_model("qwen3_moe")
    ours = ours_from(hf)
    ours.set_layer_dropout(max_prob=1.0, layers=[0])
    data = _token_batch()
    loss, n_tokens, metrics = early_exit_loss_fn(
        ours, device=CPU, exits=list, scale_type="one", scale=1.0, chunk_tokens=16
    )(data)
    hf.model.layers = torch.nn.ModuleList(list(hf.model.layers)[1:])
    hf.config.num_hidden_layers = 2
    hf.config.mlp_only_layers = [0]  # the dense layer 1 is now the first
    tokens, mask, labels = data["tokens"], data["attention_mask"], data["labels"]
    out = hf(tokens, attention_mask=mask, labels=labels, output_router_logits=True, use_cache=False)
    assert len([r for r in out.router_logits if r is not None]) == 1
    skipped = ours.model.layers[0]
    skipped.requires_grad_(False)  # it ran nowhere: no gradient to compare
    shifted = {f"model.layers.{i}.": f"model.layers.{i - 1}." for i in (1, 2)}

    def hf_name(name: str) -> str:
        prefix = next((p for p in shifted if name.startswith(p)), None)
        return name if prefix is None else shifted[prefix] + name[len(prefix) :]

    _assert_equal_to_reference(loss, metrics, n_tokens, out.loss, out.aux_loss, ours, hf, hf_name=hf_name)
    assert all(p.grad is None for p in skipped.parameters())
