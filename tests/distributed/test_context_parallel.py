"""Context parallel (``shardtune.models.context_parallel``) on gloo ranks against one process: packed rows of
six uneven samples, split over ``cp`` ranks under FSDP2, give the loss and every gradient of the unsplit
model in one process (fp32, 1e-5 relative), for every dense family's attention (full causal, sliding
windows, alternating windows with soft-capping, dynamic rope, Phi-3's longrope with short and long
factors); at cp 2, cp 4 and dp 2 x cp 2, and under full and selective activation checkpointing; LoRA and
QLoRA (loss and every adapter gradient) and the chunked loss likewise; LoRA DPO and the early-exit loss;
mixture-of-experts models with their load-balancing loss over the whole rows; multi-head latent attention (keys
and values of different widths). The K/V all-gather and the aux loss's sums obey NCCL's rules. What
cannot be split exactly is refused on every rank by name."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardtune.losses.chunked import chunked_cross_entropy
from shardtune.models import context_overlap, from_hf_config
from shardtune.models.context_parallel import context_group, split_batch
from shardtune.peft import apply_lora
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(300)

TOL = 1e-5
# Two rows per batch, each six samples of uneven lengths; 61 tokens, so every cp pads its rows.
LENGTHS = ([13, 7, 20, 3, 11, 7], [5, 17, 9, 12, 4, 14])
# Rows whose longest sample (40, at row positions 16-55) passes phi3_longrope's original_max_position_embeddings
# (32): long factors. At cp 2 rank 1 holds row positions 16-47, only that sample's positions 0-31.
LONG_LENGTHS = ([3, 6, 7, 40, 5], [7, 4, 5, 40, 5])
FAMILIES = ["llama_yarn", "llama_dynamic", "mistral", "qwen2_sliding", "qwen3", "phi3", "gemma2", "gemma3_text"]


# Qwen3.5 hybrids (linear and full layers, value head dim 8 != key head dim 16) whose 4 key heads split at cp 4
HYBRIDS = {"qwen3_5_cp4": {"linear_num_key_heads": 4, "linear_num_value_heads": 8}}


@contextlib.contextmanager
def overlapped_backwards() -> Iterator[list[int]]:
    """Counts the backwards of all-gather attention computed while the keys travel (each gathers the keys
    again): the list grows by one per such backward while the block runs."""
    seen: list[int] = []
    original = context_overlap._Overlapped.backward

    def counted(ctx, grad):
        seen.append(1)
        return original(ctx, grad)

    context_overlap._Overlapped.backward = staticmethod(counted)  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        context_overlap._Overlapped.backward = staticmethod(original)  # type: ignore[method-assign]


def _any_hf_model(name: str):
    """A tiny transformers model of a dense family, of a mixture-of-experts one (``MOE_CONFIGS``) or a hybrid
    (``HYBRIDS``)."""
    from tests.unit import test_qwen3_5
    from tests.unit.test_models_families import VOCAB, hf_model
    from tests.unit.test_models_gpt_oss import hf_gpt_oss
    from tests.unit.test_models_moe import MOE_CONFIGS, hf_moe_model

    if name == "gpt_oss":
        return hf_gpt_oss(vocab_size=VOCAB)
    if name in HYBRIDS:
        return test_qwen3_5.hf_model(vocab_size=VOCAB, **HYBRIDS[name])
    return hf_moe_model(name) if name in MOE_CONFIGS else hf_model(name)


def _batch(seed: int, lengths: tuple[list[int], ...] = LENGTHS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens, labels (-100 on each sample's first token and on a few others) and restarting positions."""
    from tests.unit.test_models_families import VOCAB

    gen = torch.Generator().manual_seed(seed)
    seq = sum(lengths[0])
    tokens = torch.randint(0, VOCAB, (len(lengths), seq), generator=gen)
    labels = tokens.clone()
    labels[torch.rand(labels.shape, generator=gen) < 0.1] = -100
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])
    labels[positions == 0] = -100
    return tokens, labels, positions


def _adapt(model: torch.nn.Module, adapters: str | None) -> torch.nn.Module:
    """``model`` with LoRA (``"lora"``) or QLoRA (``"qlora"``: NF4 bases) on every projection, every adapter
    weight drawn from one seed (so the split and the reference models hold the same); None: as it is."""
    if adapters is None:
        return model
    from tests.unit.test_models_families import LLAMA_TARGETS

    quantize = {"quantize_base": True, "block_size": 32, "scaler_block_size": 8} if adapters == "qlora" else {}
    apply_lora(model, rank=4, alpha=8.0, target_modules=LLAMA_TARGETS, **quantize)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
    return model


def _reference(
    name: str, seeds: list[int], adapters: str | None = None, lengths: tuple[list[int], ...] = LENGTHS
) -> tuple[float, dict[str, torch.Tensor]]:
    """The global-token mean loss over every batch and its gradients (of what trains), one unsplit model in one
    process (full logits, no chunking)."""
    from tests.unit.test_models_families import ours_from_hf

    model = _adapt(ours_from_hf(_any_hf_model(name)), adapters).train()
    total, count = torch.zeros(()), 0
    for seed in seeds:
        tokens, labels, positions = _batch(seed, lengths)
        logits = model(tokens, position_ids=positions)
        total = total + F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum")
        count += int((labels[:, 1:] != -100).sum())
    loss = total / count
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def _cp_step(
    name: str,
    cp: int,
    checkpointing: bool | str = False,
    adapters: str | None = None,
    chunk: int | None = None,
    lengths: tuple[list[int], ...] = LENGTHS,
    mode: str = "all_gather",
) -> dict:
    """One forward and backward with rows split over ``cp`` ranks (each ``cp`` group its own batch, seed = its
    data-parallel index) in context-parallel ``mode``, FSDP2 over every rank, the loss in chunks of ``chunk``
    tokens (None: whole); the global-token mean loss and rank 0's full gradients (of what trains)."""
    hf = _any_hf_model(name)
    model = from_hf_config(hf.config.to_dict()).train()
    model.load_state_dict(hf.state_dict(), strict=True)
    _adapt(model, adapters)
    shard_model(model, mesh=make_mesh(), activation_checkpointing=checkpointing)
    group = context_group(cp, device="cpu")
    tokens, labels, positions = _batch(dist.get_rank() // cp, lengths)
    with nccl_rules() as rules, overlapped_backwards() as overlapped:
        rules.host(tokens, labels, positions)
        part = split_batch(tokens, labels, group=group, position_ids=positions, context_parallel_mode=mode)
        loss_sum = model(
            part.tokens,
            position_ids=part.position_ids,
            context=part.shard,
            head_loss=lambda hidden, head: chunked_cross_entropy(hidden, head, part.targets, chunk_tokens=chunk),
        )
        totals = torch.stack([loss_sum.detach(), (part.targets != -100).sum().float()])
        dist.all_reduce(totals)
        (loss_sum * dist.get_world_size() / totals[1]).backward()  # FSDP2 averages the gradients over ranks
    wrapped = "._checkpoint_wrapped_module"  # activation checkpointing's wrapper, not in state_dict names
    grads = {n.replace(wrapped, ""): p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
    return {
        "loss": (totals[0] / totals[1]).item(),
        "grads": grads if dist.get_rank() == 0 else None,
        "local": tuple(part.tokens.shape),
        "rope_seq_len": part.shard.rope_seq_len,
        "max_position": int(part.position_ids.max()),
        "gathers": rules.counts["funcol.all_gather_into_tensor"],
        "overlapped": len(overlapped),
        "scatters": rules.counts["funcol.reduce_scatter_tensor"],
        "all_to_alls": rules.counts["funcol.all_to_all_single"],
    }


def _families(
    names: list[str],
    cp: int,
    checkpointing: bool | str = False,
    adapters: str | None = None,
    chunk: int | None = None,
    lengths: tuple[list[int], ...] = LENGTHS,
    mode: str = "all_gather",
) -> dict:
    return {name: _cp_step(name, cp, checkpointing, adapters, chunk, lengths, mode) for name in names}


def _check(
    results: list,
    name: str,
    seeds: list[int],
    *,
    layers: int = 3,
    gathers: int = 1,
    adapters: str | None = None,
    lengths: tuple[list[int], ...] = LENGTHS,
    tol: float = TOL,
) -> None:
    _check_equal(results, name, seeds, adapters=adapters, lengths=lengths, tol=tol)
    first = results[0][name]
    # one K/V all-gather per attention layer (and recompute), and one more in each backward that gathers again
    assert first["overlapped"] <= layers
    assert first["gathers"] == layers * gathers + first["overlapped"]
    assert first["scatters"] >= layers  # and its backward's reduce-scatter (FSDP2 adds its own)


def _check_equal(
    results: list,
    name: str,
    seeds: list[int],
    *,
    adapters: str | None = None,
    lengths: tuple[list[int], ...] = LENGTHS,
    tol: float = TOL,
) -> None:
    """Every rank's loss is the same and equals one process's; rank 0's gradients equal its gradients."""
    loss, grads = _reference(name, seeds, adapters, lengths)
    first = results[0][name]
    assert {r[name]["loss"] for r in results} == {first["loss"]}  # every rank logs the same loss
    assert abs(first["loss"] - loss) <= TOL * abs(loss), (name, first["loss"], loss)
    assert first["grads"].keys() == grads.keys()
    for key, expected in grads.items():
        got = first["grads"][key]
        diff = ((got - expected).abs().max() / expected.abs().max()).item()
        assert diff <= tol, f"{name} {key}: gradient rel diff {diff:.2e}"


def test_cp2_equals_one_process_for_every_dense_family(pool2):
    results = [o.value for o in pool2.run(_families, FAMILIES, 2, timeout=240)]
    for name in FAMILIES:
        _check(results, name, [0])
    assert results[0]["llama_yarn"]["local"] == (2, 32)  # 61 tokens padded to 64, half of them per rank
    # full causal layers compute while the keys travel (and gather again in backward); soft-capped ones do not
    assert (results[0]["llama_yarn"]["overlapped"], results[0]["gemma2"]["overlapped"]) == (3, 0)


def test_cp2_gemma4_equals_one_process(pool2):
    """A reusing layer gathers its producer's keys and values again; per-layer inputs and the experts beside each
    MLP act per token. Gemma 4's
    norms scale by weights around 1 (not 1 + w around 1), four of them per layer: fp32 summation order moves
    its gradients by up to ~1.1e-5 of their largest, so the bound is 3e-5 (a missing path moves them by far more)."""
    names = ["gemma4_text_per_layer_inputs", "gemma4_text_moe"]  # the MoE one: experts beside every MLP
    results = pool2.run_ok(_families, names, 2, timeout=240)
    for name in names:
        _check(results, name, [0], tol=3e-5)


def test_cp2_multi_head_latent_attention_equals_one_process(pool2):
    """DeepSeek-V3's latent attention: each head's keys (24 channels) and values (12) are gathered in one
    all-gather though their widths differ; queries through the bottleneck (pairs rotated) or one q_proj
    (halves rotated); routed experts and a dense first layer act per token."""
    names = ["deepseek_v3", "deepseek_v3_q_proj"]
    results = pool2.run_ok(_families, names, 2, timeout=240)
    for name in names:
        _check(results, name, [0])


def test_cp2_phi3_longrope_equals_one_process_with_short_and_long_factors(pool2):
    """Phi-3's longrope picks its factors by the longest position of the whole rows (original max 32): rows
    of samples up to 20 tokens take the short factors, rows with 40-token samples the long ones, also on the
    rank whose own positions stay below 32; both equal one unsplit process."""
    name = "phi3_longrope"
    short = pool2.run_ok(_families, [name], 2, timeout=240)
    long = pool2.run_ok(_families, [name], 2, False, None, None, LONG_LENGTHS, timeout=240)
    assert short[0][name]["rope_seq_len"] == 20 and long[0][name]["rope_seq_len"] == 40
    assert long[1][name]["max_position"] == 31  # alone, this rank would have chosen the short factors
    _check(short, name, [0])
    _check(long, name, [0], lengths=LONG_LENGTHS)


def test_cp4_and_dp2_cp2_equal_one_process(pool4):
    cp4 = [o.value for o in pool4.run(_families, ["gemma2", "qwen2_sliding", "gpt_oss"], 4, timeout=240)]
    for name in ("gemma2", "qwen2_sliding", "gpt_oss"):
        _check(cp4, name, [0])
    assert cp4[0]["gemma2"]["local"] == (2, 16)
    dp2 = [o.value for o in pool4.run(_families, ["llama_dynamic"], 2, timeout=240)]
    _check(dp2, "llama_dynamic", [0, 1])  # two cp groups, each its own batch: the mean over both


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_cp2_with_activation_checkpointing_equals_one_process(pool2, mode):
    results = [o.value for o in pool2.run(_families, ["gemma2", "qwen3"], 2, mode, timeout=240)]
    for name in ("gemma2", "qwen3"):  # the eager soft-capped kernel, and SDPA's maskless prefix merge
        _check(results, name, [0], gathers=2)  # backward recomputes the gather too (not kept by selective yet)


@pytest.mark.parametrize(("adapters", "name"), [("lora", "gemma2"), ("qlora", "mistral")])
def test_cp2_lora_and_qlora_equal_one_process(pool2, adapters, name):
    """Only the adapters train; every adapter gradient (and none of the frozen, NF4 or not) equals the unsplit
    model's, with the loss in chunks of 8 tokens (a rank's 32 tokens a row split across rows and segments)."""
    results = pool2.run_ok(_families, [name], 2, False, adapters, 8, timeout=240)
    assert results[0][name]["grads"] and all("lora_" in key for key in results[0][name]["grads"])
    _check(results, name, [0], adapters=adapters)


DPO = {"loss": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "simpo_gamma": 0.5, "reference_free": False}


def _pairs() -> dict[str, torch.Tensor]:
    """Two preference pairs (chosen rows, then rejected rows) of 27 tokens: prompts and right padding unlabeled."""
    from tests.unit.test_models_families import VOCAB

    tokens = torch.randint(0, VOCAB, (4, 27), generator=torch.Generator().manual_seed(7))
    labels = tokens.clone()
    for row, (prompt, end) in enumerate([(5, 27), (9, 20), (5, 24), (9, 27)]):
        labels[row, :prompt] = -100
        labels[row, end:] = -100
    return {"tokens": tokens, "labels": labels}


def _dpo_loss_fn(model: torch.nn.Module, group: dist.ProcessGroup | None):
    from shardtune.losses.dpo import dpo_loss_fn
    from shardtune.peft import adapters_disabled

    def reference(tokens, head_loss, **forward):
        with adapters_disabled(model):
            return model(tokens, head_loss=head_loss, **forward)

    return dpo_loss_fn(model, reference=reference, device=torch.device("cpu"), dpo=DPO, chunk_tokens=8, group=group)


def _dpo_step(name: str) -> dict:
    """LoRA DPO with both sequences of every pair split over the 2 ranks (FSDP2 over both): the loss, the
    reward sums and rank 0's adapter gradients of the loss over the pairs."""
    hf = _any_hf_model(name)
    model = from_hf_config(hf.config.to_dict()).train()
    model.load_state_dict(hf.state_dict(), strict=True)
    _adapt(model, "lora")
    shard_model(model, mesh=make_mesh())
    loss_fn = _dpo_loss_fn(model, context_group(2, device="cpu"))
    batch = _pairs()
    with nccl_rules() as rules:
        rules.host(batch)
        loss, pairs, metrics = loss_fn(batch)
        (loss * pairs).backward()  # every rank the same loss: FSDP2's mean over ranks is the pairs' sum
    grads = {n: p.grad.full_tensor() / pairs for n, p in model.named_parameters() if p.requires_grad}
    return {
        "loss": loss.item(),
        "metrics": {k: v.tolist() for k, v in metrics.items()},
        "grads": grads if dist.get_rank() == 0 else None,
        "reduces": rules.counts["all_reduce"],
    }


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_cp2_lora_dpo_equals_one_process(pool2, name):
    """The loss, ``reward_*`` sums and every adapter gradient of LoRA DPO (policy and adapter-off reference) at
    cp 2 equal one unsplit process (1e-5); the label tokens are each rank's own (their sum: the pairs'). A
    mixture-of-experts policy's loss holds its aux loss over the whole pairs (TRL's DPOTrainer's)."""
    from tests.unit.test_models_families import ours_from_hf

    results = pool2.run_ok(_dpo_step, name, timeout=240)
    model = _adapt(ours_from_hf(_any_hf_model(name)), "lora").train()
    loss, _, metrics = _dpo_loss_fn(model, None)(_pairs())
    loss.backward()
    first = results[0]
    assert {r["loss"] for r in results} == {first["loss"]}
    assert abs(first["loss"] - loss.item()) <= TOL * abs(loss.item())
    assert sum(r["metrics"]["tokens"] for r in results) == metrics["tokens"].item()
    # a reward is beta times a difference of fp32 sums of ~100 log-probs: its rounding is absolute (MoE: 1.9e-6)
    for key in ("reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy"):
        assert abs(first["metrics"][key] - metrics[key].item()) <= 4e-6, (key, first["metrics"][key], metrics[key])
    assert abs(metrics["reward_margin"].item()) > 1e-3  # the adapters move the policy from the reference
    if "aux_loss" in metrics:  # the whole pairs' on every rank; their tokens routed to each expert summed
        assert abs(first["metrics"]["aux_loss"] - metrics["aux_loss"].item()) <= TOL * metrics["aux_loss"].item()
        counts = [sum(c) for c in zip(*(r["metrics"]["tokens_per_expert"] for r in results), strict=True)]
        assert counts == metrics["tokens_per_expert"].tolist()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert first["grads"].keys() == grads.keys()
    for key, expected in grads.items():
        diff = ((first["grads"][key] - expected).abs().max() / expected.abs().max()).item()
        assert diff <= TOL, f"{key}: gradient rel diff {diff:.2e}"
    assert first["reduces"] >= 3  # policy and reference log-prob sums, and the policy's backward


EXITS = [0, 1]  # of 3 layers: "sum_l" weighs them 1 and 1 + 2, times scale 0.5 for both (neither is the last)
EXIT_WEIGHTS = [1 / 4, 3 / 4]


def _early_exit_batch() -> dict[str, torch.Tensor]:
    tokens, labels, positions = _batch(0)
    return {"tokens": tokens, "labels": labels, "position_ids": positions}


def _early_exit_reference(name: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One unsplit process, full logits: the final layer's summed cross-entropy plus each exit's (its hidden
    state through the final norm and ``lm_head``) weighted by hand, per label token, and every gradient."""
    from tests.unit.test_models_families import hf_model, ours_from_hf

    model = ours_from_hf(hf_model(name)).train()
    batch = _early_exit_batch()
    logits, hidden = model(batch["tokens"], position_ids=batch["position_ids"], output_hidden_states=EXITS)
    labels = batch["labels"][:, 1:].flatten()

    def ce_sum(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out[:, :-1].flatten(0, 1), labels, ignore_index=-100, reduction="sum")

    total = ce_sum(logits)
    for layer, weight in zip(EXITS, EXIT_WEIGHTS, strict=True):
        total = total + weight * ce_sum(model.lm_head(model.model.norm(hidden[layer])))
    loss = total / int((labels != -100).sum())
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _early_exit_cp_step(name: str) -> dict:
    """The early-exit recipe's loss with every row split over 2 ranks (FSDP2 over both), in chunks of 8 tokens,
    weighed and scaled as the training loop does: the global loss and rank 0's full gradients."""
    from shardtune.losses.early_exit import early_exit_loss_fn
    from tests.unit.test_models_families import hf_model

    hf = hf_model(name)
    model = from_hf_config(hf.config.to_dict()).train()
    model.load_state_dict(hf.state_dict(), strict=True)
    shard_model(model, mesh=make_mesh())
    loss_fn = early_exit_loss_fn(
        model, device=torch.device("cpu"), exits=lambda: EXITS, scale_type="sum_l", scale=0.5, chunk_tokens=8,
        group=context_group(2, device="cpu"),
    )  # fmt: skip
    batch = _early_exit_batch()
    with nccl_rules() as rules:
        rules.host(batch)
        loss, n_tokens = loss_fn(batch)
        (loss * n_tokens).backward()
        totals = torch.stack([loss.detach() * n_tokens, torch.tensor(float(n_tokens))])
        dist.all_reduce(totals)
    scale = dist.get_world_size() / totals[1].item()  # the loop's: FSDP2 averaged over ranks, the loss per token
    grads = {n: p.grad.full_tensor() * scale for n, p in model.named_parameters()}  # full_tensor: collective
    return {"loss": (totals[0] / totals[1]).item(), "grads": grads if dist.get_rank() == 0 else None}


def test_cp2_early_exit_loss_and_grads_equal_one_process(pool2):
    """The early-exit loss (the final layer's and two exits' cross-entropies, weighted) of packed rows split
    over 2 ranks: the loss and every gradient equal one unsplit process with full logits (1e-5)."""
    name = "qwen3"
    loss, grads = _early_exit_reference(name)
    results = pool2.run_ok(_early_exit_cp_step, name, timeout=240)
    first = results[0]
    assert {r["loss"] for r in results} == {first["loss"]}
    assert abs(first["loss"] - loss) <= TOL * loss, (first["loss"], loss)
    assert first["grads"].keys() == grads.keys()
    for key, expected in grads.items():
        assert expected.abs().max() > 0, key
        diff = ((first["grads"][key] - expected).abs().max() / expected.abs().max()).item()
        assert diff <= TOL, f"{key}: gradient rel diff {diff:.2e}"


MOE_PAD = 4  # the second row's last sample ends in this many padding tokens (attention_mask 0, no labels)


def _moe_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """The packed rows of :func:`_batch` as the loader gives them, the second row's pad tail masked."""
    tokens, labels, positions = _batch(seed)
    mask = torch.ones_like(tokens)
    mask[1, -MOE_PAD:] = 0
    labels[1, -MOE_PAD:] = -100
    return {"tokens": tokens, "labels": labels, "position_ids": positions, "attention_mask": mask}


def _moe_reference(
    name: str, seeds: tuple[int, ...] = (0,), hf: Callable | None = None, coef: float | None = None
) -> tuple[float, list[float], dict[str, torch.Tensor]]:
    """One unsplit process over the batches of ``seeds``: their token-weighted mean of each batch's
    cross-entropy plus ``coef`` (None: the config's) times transformers' load-balancing loss of its real tokens
    (the loop's global mean), each batch's aux loss, and every gradient of that mean (full logits)."""
    from shardtune.models.moe_aux import Routing
    from tests.unit.test_models_moe import hf_moe_model, ours_from

    reference = hf_moe_model(name) if hf is None else hf()
    model = ours_from(reference).train()
    coef = reference.config.router_aux_loss_coef if coef is None else coef
    total, count, auxes = torch.zeros(()), 0, []
    for seed in seeds:
        batch = _moe_batch(seed)
        routing = Routing(mask=batch["attention_mask"])
        logits = model(batch["tokens"], position_ids=batch["position_ids"], routing=routing)
        ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
        n = int((batch["labels"][:, 1:] != -100).sum())
        total, count = total + routing.add_to(ce, coef) * n, count + n
        auxes.append(routing.aux_loss().item())
    loss = total / count
    loss.backward()
    return loss.item(), auxes, {n: p.grad.clone() for n, p in model.named_parameters()}


def _moe_cp_step(
    name: str,
    cp: int = 2,
    ep: int = 1,
    *,
    hf: Callable | None = None,
    coef: float | None = None,
    mode: str = "all_gather",
) -> dict:
    """The full recipes' split loss (:func:`next_token_loss` with ``group``, aux loss in it, weighted by ``coef``:
    None for the config's) on ``cp``-rank groups under FSDP2 (each group its own batch, seed = its index), the
    experts over ``ep`` ranks, weighed and scaled as the training loop does: the global loss, this rank's
    group's aux loss, rank 0's full gradients and the collectives counted. ``hf`` makes the transformers model
    (default: ``hf_moe_model(name)``); ``mode``: the context-parallel mode."""
    from shardtune.losses.next_token import next_token_loss
    from tests.unit.test_models_moe import hf_moe_model, ours_from

    model = ours_from(hf_moe_model(name) if hf is None else hf()).train()
    shard_model(model, mesh=make_mesh(expert_parallel=ep))
    group = context_group(cp, device="cpu")
    loss_fn = next_token_loss(
        model,
        group=group,
        context_parallel_mode=mode,
        device=torch.device("cpu"),
        chunk_tokens=None,
        router_aux_loss_coef=coef,
    )
    batch = _moe_batch(dist.get_rank() // cp)
    with nccl_rules() as rules, overlapped_backwards() as overlapped:
        rules.host(batch)
        loss, n_tokens, metrics = loss_fn(batch)
        (loss * n_tokens).backward()
        totals = torch.stack([loss.detach() * n_tokens, torch.tensor(float(n_tokens))])
        dist.all_reduce(totals)
        group_totals = torch.stack([metrics["aux_loss"], torch.tensor(float(n_tokens))])  # the aux metric per token
        dist.all_reduce(group_totals, group=group)
    scale = dist.get_world_size() / totals[1].item()  # the loop's: FSDP2 averaged over ranks, the loss per token
    grads = {n: p.grad.full_tensor() * scale for n, p in model.named_parameters()}  # full_tensor: collective
    return {
        "loss": (totals[0] / totals[1]).item(),
        "aux": (group_totals[0] / group_totals[1]).item(),
        "grads": grads if dist.get_rank() == 0 else None,
        "reduces": rules.counts["all_reduce"],
        "all_to_alls": rules.counts["all_to_all_single"] + rules.counts["funcol.all_to_all_single"],
        "gathers": rules.counts["funcol.all_gather_into_tensor"],
        "overlapped": len(overlapped),
    }


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_cp2_moe_loss_aux_loss_and_grads_equal_one_process(pool2, name):
    """Qwen3-MoE (a dense layer among sparse ones) and Mixtral (sliding windows), E = 8, top-2, 2I != H: the
    loss with the load-balancing loss in it, the aux loss and every gradient (routers and experts included) at
    cp 2 equal one unsplit process (1e-5). The aux loss counts the rows' real tokens over both ranks: the
    split's padding (61 tokens -> 64) and the batch's pad tail are left out of it."""
    loss, (aux,), grads = _moe_reference(name)
    results = pool2.run_ok(_moe_cp_step, name, timeout=240)
    first = results[0]
    assert {(r["loss"], r["aux"]) for r in results} == {(first["loss"], first["aux"])}
    assert abs(first["aux"] - aux) <= TOL * aux, (first["aux"], aux)
    assert abs(first["loss"] - loss) <= TOL * loss, (first["loss"], loss)
    assert first["grads"].keys() == grads.keys()
    for key, expected in grads.items():
        assert expected.abs().max() > 0, key
        diff = ((first["grads"][key] - expected).abs().max() / expected.abs().max()).item()
        assert diff <= TOL, f"{name} {key}: gradient rel diff {diff:.2e}"
    assert first["reduces"] >= 2  # the aux loss's totals and, in backward, its weights


def _unbound_routing(name: str) -> str:
    from shardtune.models.moe_aux import Routing
    from tests.unit.test_models_moe import hf_moe_model

    hf = hf_moe_model(name, num_hidden_layers=1)
    model = from_hf_config(hf.config.to_dict())
    tokens, labels, positions = _batch(0)
    part = split_batch(tokens % hf.config.vocab_size, labels, group=dist.group.WORLD, position_ids=positions)
    try:
        model(part.tokens, position_ids=part.position_ids, context=part.shard, routing=Routing(mask=part.mask))
    except ValueError as e:
        return str(e)
    return "not refused"


def test_routing_not_summed_over_the_cp_group_is_refused_on_every_rank(pool2):
    messages = {o.value for o in pool2.run(_unbound_routing, "qwen3_moe", timeout=120)}
    assert len(messages) == 1
    assert "the Routing must sum over the cp group" in messages.pop()
