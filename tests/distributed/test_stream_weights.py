"""``stream_weights``: a sharded model streamed as HF tensors, against ``transformers`` and ``peft``.

On 2 ranks, after each training step, a ``transformers`` model loaded from the base directory and
updated with ``load_state_dict`` from the stream (bucket by bucket) gives shardtune's logits: full
weights, LoRA (attention + MLP, merged), QLoRA (NF4 base dequantized and merged) and a tiny
Qwen3-MoE with LoRA on its fused experts and router. The adapter-only stream equals the PEFT save's
file and ``peft`` loads it with shardtune's logits. Each rank's new memory while streaming (counted at
torch's dispatcher, :mod:`tests.memory_probe`) stays within one bucket plus the largest tensor. An
error on one rank mid-stream, a rank leaving early, and bad or differing arguments raise the same
error on every rank, without a hang. Everything under NCCL's rules.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from shardtune.checkpoint import (
    load_hf_checkpoint,
    save_peft_adapter,
    stream_adapter_weights,
    stream_weights,
)
from shardtune.models import build_model, from_hf_config
from shardtune.peft import apply_lora, init_lora_parameters
from shardtune.ranks.faults import set_fault
from shardtune.ranks.mesh import make_mesh
from shardtune.ranks.sharding import shard_model
from shardtune.training import load_from_full_model_state_dict
from tests.memory_probe import new_memory
from tests.nccl_rules import nccl_rules

pytestmark = pytest.mark.timeout(240)

TOKENS = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(5))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BUCKET = 48 << 10  # several buckets for the ~0.3 MB model; larger than any tensor but the embeddings


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> str:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.1 if "norm" in name else 0.02))
    path = tmp_path_factory.mktemp("stream") / "base"
    model.save_pretrained(path)
    return str(path)


def _hf(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()


def _rel(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).abs().max() / expected.abs().max()).item()


def _step(model, opt) -> None:
    model(TOKENS).float().square().mean().backward()
    opt.step()
    opt.zero_grad()


def _update_from_stream(stream, hf, rules) -> tuple[set[str], int]:
    """Load every bucket into ``hf`` (the consumer keeps nothing); the names seen and the new memory's peak."""
    seen: set[str] = set()
    with new_memory() as probe, stream:
        for bucket in stream.buckets():
            rules.host(bucket)  # what a consumer holds is host memory to the rules from here on
            result = hf.load_state_dict(dict(bucket), strict=False)
            if result.unexpected_keys:
                raise AssertionError(f"names transformers lacks: {result.unexpected_keys}")
            seen.update(name for name, _ in bucket)
            del bucket
    return seen, probe.peak


def _dense(base: str, kind: str, to: str):
    model = build_model(base, device="meta")
    if kind != "full":
        # small NF4 blocks: each rank's rows of a 64-wide projection are whole scaler blocks
        apply_lora(
            model,
            rank=4,
            alpha=8.0,
            target_modules=TARGETS,
            quantize_base=kind == "qlora",
            block_size=16,
            scaler_block_size=16,
        )
    shard_model(model)
    load_hf_checkpoint(model, base, device="cpu")
    model.init_buffers("cpu")
    if kind != "full":
        init_lora_parameters(model, device="cpu")
    hf = _hf(base)
    names = set(hf.state_dict())
    with torch.no_grad():
        before = hf(TOKENS).logits
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    steps = []
    with nccl_rules() as rules:
        rules.host(model, hf, opt)
        for _ in range(2):
            _step(model, opt)
            stream = stream_weights(model, to=to, bucket_bytes=BUCKET)
            seen, peak = _update_from_stream(stream, hf, rules)
            with torch.no_grad():
                ours, theirs = model(TOKENS), hf(TOKENS).logits
            receives = to == "all" or dist.get_rank() == 0
            largest = max(t.nbytes for t in hf.state_dict().values())
            steps.append(
                {
                    "logits": _rel(theirs, ours) if receives else None,
                    "moved": _rel(before, ours),  # the step changed the logits
                    "names": seen == names if receives else seen == set(),
                    "buckets": stream.num_buckets,
                    "peak": peak,
                    "bound": stream.largest_bucket_bytes + largest,
                }
            )
    return steps


@pytest.mark.parametrize(("kind", "to"), [("full", "rank0"), ("lora", "all"), ("qlora", "all")])
def test_transformers_updated_from_the_stream_gives_our_logits(pool2, base, kind, to):
    for rank, steps in enumerate(pool2.run_ok(_dense, base, kind, to, timeout=200)):
        for step in steps:
            assert step["names"], (rank, step)
            if step["logits"] is not None:
                assert step["logits"] < 1e-5 and step["moved"] > 1e-3, (rank, step)
            assert step["buckets"] > 3, step
            # one bucket (the tensors, or a sender's blocks) plus one tensor's transform (merge, NF4)
            assert 0 < step["peak"] <= step["bound"], (rank, step)


def _adapters(base: str, out: str):
    import peft

    model = build_model(base, device="meta")
    apply_lora(model, rank=4, alpha=8.0, target_modules=TARGETS)
    shard_model(model)
    load_hf_checkpoint(model, base, device="cpu")
    model.init_buffers("cpu")
    init_lora_parameters(model, device="cpu")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _step(model, opt)
    save_peft_adapter(model, Path(out))
    with nccl_rules() as rules, stream_adapter_weights(model, to="all", bucket_bytes=4 << 10) as stream:
        rules.host(model, opt)
        streamed = {name: t.clone() for name, t in stream}
    with torch.no_grad():
        ours = model(TOKENS)
    pm = peft.PeftModel.from_pretrained(_hf(base), out)
    loaded = peft.set_peft_model_state_dict(pm, streamed)
    with torch.no_grad():
        theirs = pm(TOKENS).logits
    saved = load_file(Path(out) / "adapter_model.safetensors")
    return {
        "equal": sorted(saved) == sorted(streamed) and all(torch.equal(saved[k], streamed[k]) for k in saved),
        "unexpected": loaded.unexpected_keys,
        "logits": _rel(theirs, ours),
        "buckets": stream.num_buckets,
    }


def test_adapter_stream_equals_the_peft_save_and_peft_loads_it(pool2, base, tmp_path):
    for r in pool2.run_ok(_adapters, base, str(tmp_path / "adapter"), timeout=200):
        assert r["equal"] and not r["unexpected"], r
        assert r["logits"] < 1e-5 and r["buckets"] > 1, r


def _moe_lora(hf, parameters: list[str]):
    """The sharded LoRA model of ``hf``: attention adapters and ``parameters`` (experts, router)."""
    from tests.unit.test_lora_moe import ALPHA, MODULES, RANK

    with torch.device("meta"):
        model = from_hf_config(hf.config.to_dict())
        apply_lora(model, rank=RANK, alpha=ALPHA, target_modules=MODULES, target_parameters=parameters)
    shard_model(model, mesh=make_mesh())
    load_from_full_model_state_dict(model, hf.state_dict() if dist.get_rank() == 0 else {}, "cpu", strict=False)
    model.init_buffers("cpu")
    init_lora_parameters(model, device="cpu")
    return model


def _moe(name: str, changes: dict, parameters: list[str], out: str):
    from tests.unit.test_models_moe import batch, hf_moe_model

    hf = hf_moe_model(name, **changes)
    tokens = batch()[0]
    with torch.no_grad():
        before = hf(tokens).logits
    with nccl_rules() as rules:
        rules.host(hf)
        model = _moe_lora(hf, parameters)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        rules.host(model, opt)
        names = set(hf.state_dict())
        model(tokens).square().mean().backward()
        opt.step()
        opt.zero_grad()
        stream = stream_weights(model, to="all", bucket_bytes=BUCKET)
        seen, peak = _update_from_stream(stream, hf, rules)
        bound = stream.largest_bucket_bytes + max(t.nbytes for t in hf.state_dict().values())
        with torch.no_grad():
            ours, theirs = model(tokens), hf(tokens).logits
        with stream_weights(model, to="rank0", bucket_bytes=BUCKET, expert_layout="per_expert") as stream:
            per_expert = {name: t.clone() for name, t in stream if ".experts." in name}
    result = {"logits": _rel(theirs, ours), "moved": _rel(before, ours), "names": seen == names}
    result |= {"peak": peak, "bound": bound, "buckets": stream.num_buckets}
    result["placement"] = str(model.model.layers[0].mlp.experts.gate_up_proj.placements[0])
    if dist.get_rank() == 0:  # transformers writes experts per expert by default: its reverse conversion
        hf.save_pretrained(out)
        saved = {k: v for k, v in load_file(Path(out) / "model.safetensors").items() if ".experts." in k}
        result["per_expert"] = sorted(saved) == sorted(per_expert) and all(
            torch.equal(v, per_expert[k]) for k, v in saved.items()
        )
        result["experts"] = len(saved)
    return result


MOE_CASES = [
    # 8 experts on 2 ranks: Shard(0), each rank's experts contiguous; experts, router and attention adapted
    ("qwen3_moe", {}, ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"], "S(0)"),
    # 5 experts: Shard(1), blocks not contiguous in the tensor (the merged down_proj is staged, the
    # unadapted gate_up_proj goes expert by expert)
    ("mixtral", {"num_local_experts": 5}, ["mlp.experts.down_proj"], "S(1)"),
]


@pytest.mark.parametrize(("name", "changes", "parameters", "placement"), MOE_CASES)
def test_moe_with_expert_lora_streams_fused_and_per_expert(pool2, tmp_path, name, changes, parameters, placement):
    rank0, rank1 = pool2.run_ok(_moe, name, changes, parameters, str(tmp_path / "hf"), timeout=200)
    for r in (rank0, rank1):
        assert r["names"] and r["logits"] < 1e-5 and r["moved"] > 1e-3, r
        assert r["placement"] == placement, r
        assert r["buckets"] > 3 and 0 < r["peak"] <= r["bound"], r
    assert rank0["per_expert"] and rank0["experts"] > 8, rank0


# --- errors: the same on every rank, no hang ------------------------------------------------


def _error(base: str, case: str):
    model = shard_model(build_model(base, device="meta"))
    load_hf_checkpoint(model, base, device="cpu")
    got = []
    kwargs: dict = {"to": "all", "bucket_bytes": BUCKET}
    if case == "dtype_differs":
        kwargs["dtype"] = torch.bfloat16 if dist.get_rank() == 0 else None
    elif case == "bad_dtype":
        kwargs["dtype"] = torch.int8
    elif case == "fault":
        set_fault("stream:bucket:1:raise:2")
    try:
        with nccl_rules() as rules:
            rules.host(model)
            with stream_weights(model, **kwargs) as stream:
                for bucket in stream.buckets():
                    got.append(len(bucket))
                    if case == "leaves" and dist.get_rank() == 1:
                        break
                    if case == "consumer_raises" and dist.get_rank() == 1:
                        raise ValueError("engine refused the bucket")
    except Exception as exc:  # noqa: BLE001 - the test reports what each rank raised
        return {"error": f"{type(exc).__name__}: {exc}", "buckets": len(got)}
    finally:
        set_fault(None)
    return {"error": None, "buckets": len(got)}


ERRORS = {
    "fault": (["bucket 2 of", "[rank 1] bucket 2: InjectedFault", "stream:bucket on rank 1"], 1),
    "leaves": (["[rank 1] rank 1 left the stream before its end", "bucket 2 of"], 1),
    "consumer_raises": (["rank 1 left the stream on ValueError: engine refused the bucket"], 1),
    "dtype_differs": (["differ between ranks", "[1]"], 0),
    "bad_dtype": (["dtype=torch.int8", "floating"], 0),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_raise_the_same_on_every_rank(pool2, base, case):
    needles, buckets = ERRORS[case]
    outcomes = pool2.run_ok(_error, base, case, timeout=60)
    messages = {o["error"] for o in outcomes}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert message is not None and message.startswith("StateDictError"), message
    for needle in needles:
        assert needle in message, (needle, message)
    assert [o["buckets"] for o in outcomes] == [buckets, buckets], outcomes
