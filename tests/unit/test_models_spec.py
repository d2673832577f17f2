"""A family is a declarative spec: one declared from existing blocks alone builds, and computes, what it says.

The toy family below exists nowhere else: gpt-oss's sink attention (with Gemma's QK-norm) on its sliding
layers and plain attention on its full ones, gpt-oss's biased top-k-then-softmax router in front of
Qwen3-MoE's fused experts on the sparse layers and a gated MLP on the dense one, all in Gemma's sandwich
of ``(1 + w)`` norms. Its keys are checked against a hand-written list and its logits against a
hand computation from those keys (float64), so a block the decoder took from anywhere but the spec
changes either. The shared decoder code also names no family.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import shardtune.models
from shardtune.models import FAMILIES, AttentionSpec, Blocks, ModelArgs, MoeArgs, SparseSpec, build_model
from shardtune.models.args import FULL, SLIDING
from shardtune.models.spec import Family

DIM, HEADS, KV_HEADS, HEAD_DIM, VOCAB, WINDOW, EPS, THETA = 16, 2, 1, 8, 32, 3, 1e-6, 10000.0
EXPERTS, TOP_K, EXPERT_SIZE, DENSE_SIZE = 4, 2, 6, 12


def _never(_: object) -> dict:
    raise AssertionError("the toy family converts no config.json")


TOY = Family(
    "toy",
    "ToyForCausalLM",
    _never,
    _never,
    blocks=Blocks(
        attention=AttentionSpec(kind="sink_attention", qk_norm=True),
        attention_by_type={FULL: AttentionSpec()},
        sparse=SparseSpec(router="topk_softmax", experts="gated", router_name="router", router_first=True),
        norm_offset=True,
        sandwich_norm=True,
    ),
)


def toy_args() -> ModelArgs:
    moe = MoeArgs(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=EXPERT_SIZE, mlp_only_layers=(1,))
    return ModelArgs(vocab_size=VOCAB, dim=DIM, n_layers=2, n_heads=HEADS, n_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                     intermediate_size=DENSE_SIZE, norm_eps=EPS, rope_theta=THETA, sliding_window=WINDOW,
                     layer_types=[SLIDING, FULL], model_type="toy", moe=moe)  # fmt: skip


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(FAMILIES, "toy", TOY)
    torch.manual_seed(0)
    model = build_model(toy_args(), dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)  # norms and sinks away from their init too
    return model


ATTENTION_KEYS = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"]
NORM_KEYS = ["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]


def test_toy_family_has_the_blocks_and_keys_its_spec_declares(toy):
    layer0 = ["sinks", *ATTENTION_KEYS, "q_norm.weight", "k_norm.weight"]  # a module's own parameters come first
    want = ["model.embed_tokens.weight"]
    want += [f"model.layers.0.self_attn.{k}" for k in layer0]
    want += [f"model.layers.0.mlp.{k}" for k in ("router.weight", "router.bias", "experts.gate_up_proj")]
    want += ["model.layers.0.mlp.experts.down_proj"] + [f"model.layers.0.{n}.weight" for n in NORM_KEYS]
    want += [f"model.layers.1.self_attn.{k}" for k in ATTENTION_KEYS]
    want += [f"model.layers.1.mlp.{k}_proj.weight" for k in ("gate", "up", "down")]
    want += [f"model.layers.1.{n}.weight" for n in NORM_KEYS] + ["model.norm.weight", "lm_head.weight"]
    state = toy.state_dict()
    assert list(state) == want
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (EXPERTS, 2 * EXPERT_SIZE, DIM)
    assert state["model.layers.1.mlp.gate_proj.weight"].shape == (DENSE_SIZE, DIM)


def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Gemma's RMSNorm, in fp32 as transformers computes it whatever the activations' dtype."""
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * (1 + w.float())).to(x.dtype)


def _rope(x: torch.Tensor) -> torch.Tensor:
    """``x [s, heads, d]`` rotated by position (rotate-half convention; angles in fp32, as transformers)."""
    s, d = x.shape[0], x.shape[-1]
    inv = 1.0 / THETA ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(s, dtype=torch.float32)[:, None] * inv[None, :]
    both = torch.cat([angles, angles], -1)
    cos, sin = both.cos().to(x.dtype)[:, None], both.sin().to(x.dtype)[:, None]
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def _attention(x: torch.Tensor, w: dict, window: int | None, sinks: bool) -> torch.Tensor:
    s = x.shape[0]
    q = (x @ w["q_proj.weight"].T).view(s, HEADS, HEAD_DIM)
    k = (x @ w["k_proj.weight"].T).view(s, KV_HEADS, HEAD_DIM)
    v = (x @ w["v_proj.weight"].T).view(s, KV_HEADS, HEAD_DIM)
    if "q_norm.weight" in w:
        q, k = _norm(q, w["q_norm.weight"]), _norm(k, w["k_norm.weight"])
    q, k = _rope(q), _rope(k)
    out = torch.empty(s, HEADS, HEAD_DIM, dtype=x.dtype)
    for h in range(HEADS):
        kv = h * KV_HEADS // HEADS
        for i in range(s):
            seen = [j for j in range(i + 1) if window is None or i - j < window]
            scores = torch.stack([q[i, h] @ k[j, kv] / math.sqrt(HEAD_DIM) for j in seen])
            if sinks:
                scores = torch.cat([scores, w["sinks"][h : h + 1]])
            probs = torch.softmax(scores, 0)[: len(seen)]
            out[i, h] = sum(p * v[j, kv] for p, j in zip(probs, seen, strict=True))
    return out.reshape(s, -1) @ w["o_proj.weight"].T


def _gated(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (F.silu(x @ gate.T) * (x @ up.T)) @ down.T


def _sparse(x: torch.Tensor, w: dict) -> torch.Tensor:
    logits = x @ w["router.weight"].T + w["router.bias"]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top, chosen = torch.topk(logits[t], TOP_K)
        for weight, e in zip(torch.softmax(top, 0), chosen.tolist(), strict=True):
            gate, up = w["experts.gate_up_proj"][e].split(EXPERT_SIZE)
            out[t] += weight * _gated(x[t], gate, up, w["experts.down_proj"][e])
    return out


def _hand_logits(state: dict, tokens: torch.Tensor) -> torch.Tensor:
    def sub(prefix: str) -> dict:
        return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}

    h = state["model.embed_tokens.weight"][tokens]
    for i, (window, sinks) in enumerate(((WINDOW, True), (None, False))):
        layer = sub(f"model.layers.{i}.")
        attn = _attention(_norm(h, layer["input_layernorm.weight"]), sub(f"model.layers.{i}.self_attn."), window, sinks)
        h = h + _norm(attn, layer["post_attention_layernorm.weight"])
        x, mlp = _norm(h, layer["pre_feedforward_layernorm.weight"]), sub(f"model.layers.{i}.mlp.")
        ff = (
            _sparse(x, mlp)
            if i == 0
            else _gated(x, mlp["gate_proj.weight"], mlp["up_proj.weight"], mlp["down_proj.weight"])
        )
        h = h + _norm(ff, layer["post_feedforward_layernorm.weight"])
    return _norm(h, state["model.norm.weight"]) @ state["lm_head.weight"].T


def test_toy_family_computes_what_its_spec_declares(toy):
    tokens = torch.randint(0, VOCAB, (7,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = toy(tokens[None])[0]
    want = _hand_logits(toy.state_dict(), tokens)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_an_unknown_block_kind_is_named(monkeypatch):
    monkeypatch.setitem(FAMILIES, "toy", Family("toy", "ToyForCausalLM", _never, _never, blocks=Blocks(
        attention=AttentionSpec(kind="linear_attention"))))  # fmt: skip
    with pytest.raises(ValueError, match=r"unknown attention block kind 'linear_attention'.*'sink_attention'"):
        build_model(toy_args().replace(moe=None), device="meta")


def test_shared_decoder_code_names_no_family():
    """Families are data: the decoder, its blocks and the config conversion hold no model_type literal."""
    root = Path(shardtune.models.__file__).parent
    shared = [root / "llama.py", root / "decoder_layer.py", root / "hf_config.py", root / "spec.py"]
    shared += sorted((root / "blocks").glob("*.py"))
    named = {
        (path.name, node.value)
        for path in shared
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in FAMILIES
    }
    assert not named
