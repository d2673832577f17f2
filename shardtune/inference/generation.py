"""Text generation from an HF model directory (a shardtune checkpoint, merged or base + adapter).

Rule: every rank runs the same forwards. The prompt fills a KV cache in one forward, then each
new token is one forward of one token; the next token is picked on the CPU from the last
position's logits (greedy by default; temperature and top-p with a seeded CPU generator), so
every rank picks the same token and FSDP's per-layer all-gathers stay in step when the model
is sharded. Only the last position's logits are made. Generation stops after
``max_new_tokens`` or at a stop token (the tokenizer's EOS and the model's
``eos_token_id``/``generation_config.json``), as ``transformers``' ``generate`` does.

:func:`generate_batch` completes many prompts at once (RL rollouts): rows left-padded over one KV
cache, each rank its own prompts, every rank stepping until all ranks' rows are done.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from shardtune.checkpoint.layout import CONFIG_FILE
from shardtune.data.jinja_templates import JinjaChatTemplate, default_chat_template
from shardtune.data.tokenizer import HFTokenizer, load_tokenizer
from shardtune.models import from_hf_config
from shardtune.models.kv_cache import KVCache
from shardtune.ranks import comm

__all__ = ["Generator", "check_options", "generate", "generate_batch", "load_generator", "sample_tokens", "stop_ids"]

log = logging.getLogger(__name__)


def sample_tokens(
    logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator | Sequence[torch.Generator]
) -> torch.Tensor:
    """The next token of each row of ``logits [rows, vocab]`` (a CPU ``[rows]`` int64 tensor): argmax, or a
    top-p sample at ``temperature`` drawn from ``generator`` (a CPU generator: the same draws on every device),
    or with one generator per row from row ``i``'s own (rows past the generators take the argmax)."""
    if temperature <= 0:
        return logits.argmax(dim=-1).cpu()
    probs = torch.softmax(logits.float().cpu() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # keep the smallest set reaching top_p
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    if isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    # a row's draws then depend on its own generator only, not on which rows share the batch
    drawn = [torch.multinomial(probs[i : i + 1], 1, generator=g)[0] for i, g in enumerate(generator)]
    return torch.cat([*drawn, probs[len(drawn) :].argmax(dim=-1)])


def _pick(logits: torch.Tensor, *, temperature: float, top_p: float, generator: torch.Generator) -> int:
    """The next token from one position's logits ``[vocab]``."""
    return int(sample_tokens(logits[None], temperature=temperature, top_p=top_p, generator=generator)[0])


def _last_logits(hidden: torch.Tensor, head) -> torch.Tensor:
    """The model's ``head_loss`` for generation: logits of the last position only."""
    return head(hidden[:, -1])


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt_ids: Sequence[int],
    *,
    max_new_tokens: int,
    device: torch.device | str,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    stop: Sequence[int] = (),
) -> list[int]:
    """The new token ids after ``prompt_ids`` (the stop token included when one ends it).

    Collective when ``model`` is sharded: call on all ranks with the same arguments; every rank
    returns the same ids."""
    check_options(max_new_tokens, top_p, temperature)
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token (e.g. BOS)")
    max_new_tokens = _within_positions(model, len(prompt_ids), max_new_tokens)
    cache = KVCache()
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    out: list[int] = []
    prompt = torch.tensor([list(prompt_ids)], device=device)
    chunk = _prefill_chunk(len(prompt_ids))
    for start in range(0, len(prompt_ids), chunk):  # the prompt in chunks: masks of chunk x prompt, never prompt^2
        logits = model(prompt[:, start : start + chunk], kv_cache=cache, head_loss=_last_logits)[0]
    for _ in range(max_new_tokens):
        out.append(_pick(logits, temperature=temperature, top_p=top_p, generator=generator))
        if out[-1] in stop or len(out) == max_new_tokens:
            break
        logits = model(torch.tensor([[out[-1]]], device=device), kv_cache=cache, head_loss=_last_logits)[0]
    model.train(was_training)
    return out


# prompt tokens times prompt tokens one prefill chunk may score at once (its mask and each head's scores)
PREFILL_SCORES = 1 << 24


def _prefill_chunk(prompt_tokens: int) -> int:
    """Tokens per prefill forward: the whole prompt while its ``tokens x tokens`` mask is small, else chunks
    whose ``chunk x tokens`` stays within :data:`PREFILL_SCORES` (a 100k-token prompt: 167 at a time)."""
    return max(1, min(prompt_tokens, PREFILL_SCORES // prompt_tokens))


def _within_positions(model: nn.Module, prompt_tokens: int, max_new_tokens: int) -> int:
    """``max_new_tokens``, lowered (with a warning) so prompt and completion stay within the model's positions;
    a prompt that fills them already is refused naming the limit."""
    args = getattr(model, "args", None)
    limit = getattr(args, "max_seq_len", None)
    if not isinstance(limit, int):
        return max_new_tokens
    if prompt_tokens >= limit:
        raise ValueError(
            f"the prompt has {prompt_tokens} tokens and the model's max_position_embeddings is {limit}: no position "
            "is left to generate at; shorten the prompt"
        )
    if prompt_tokens + max_new_tokens > limit:
        log.warning(
            "max_new_tokens=%d would run past the model's %d positions after a %d-token prompt: at most %d new tokens",
            max_new_tokens,
            limit,
            prompt_tokens,
            limit - prompt_tokens,
        )
        return limit - prompt_tokens
    return max_new_tokens


def check_options(max_new_tokens: int, top_p: float, temperature: float = 0.0) -> None:
    """Raises ValueError, its message starting with the argument's name, for an option out of range."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0: greedy), got {temperature}")


@torch.no_grad()
def generate_batch(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    device: torch.device | str,
    generator: torch.Generator | Sequence[torch.Generator],
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    stop: Sequence[int] = (),
    group: dist.ProcessGroup | None = None,
) -> list[list[int]]:
    """Complete every prompt of ``prompts`` at once (left-padded rows over one KV cache); row ``i``'s new
    ids, its stop token included when one ends it. Tokens are drawn from the CPU ``generator`` (greedy
    with ``temperature`` 0), so its state after the call is what a resume needs to draw the same ones;
    with one generator per prompt, row ``i`` draws from its own only (whatever rows share the batch).

    Collective over ``group`` (the default group when the process group is up): each rank may give its
    own prompts (another count too, none included); every rank runs the same number of forwards, until
    every rank's rows have stopped or made ``max_new_tokens``, as a sharded (FSDP2, expert-parallel)
    model needs. Each rank returns its own prompts' completions."""
    check_options(max_new_tokens, top_p, temperature)
    if any(not p for p in prompts):
        raise ValueError("a prompt is empty: give every prompt at least one token (e.g. BOS)")
    if not isinstance(generator, torch.Generator) and len(generator) != len(prompts):
        raise ValueError(f"{len(generator)} generators for {len(prompts)} prompts: give one per prompt, or one")
    longest = max((len(p) for p in prompts), default=1)
    rows = [[pad_id] * (longest - len(p)) + list(p) for p in prompts] or [[pad_id]]
    tokens = torch.tensor(rows, device=device)
    pad = torch.tensor([longest - len(p) for p in prompts] or [0])
    cache = KVCache(pad=pad)
    out: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    stops = set(stop)
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        if _all_ranks_done(all(done), group=group):
            break
        picked = sample_tokens(
            model(tokens, kv_cache=cache, head_loss=_last_logits),
            temperature=temperature,
            top_p=top_p,
            generator=generator,
        ).tolist()
        for i, token in enumerate(picked[: len(prompts)]):
            if not done[i]:
                out[i].append(token)
                done[i] = token in stops
        tokens = torch.tensor(
            [[t if i >= len(done) or not done[i] else pad_id] for i, t in enumerate(picked)], device=device
        )
    model.train(was_training)
    return out


def _all_ranks_done(done: bool, *, group: dist.ProcessGroup | None) -> bool:
    """Whether every rank of ``group`` is done (``done`` itself without a process group).

    Collective: call on all ranks of ``group``; each returns the same answer."""
    if not dist.is_initialized():
        return done
    flag = torch.tensor([0 if done else 1], device=comm.comm_device(None))
    dist.all_reduce(flag, group=group)
    return int(flag.item()) == 0


def stop_ids(model_dir: str | Path, tokenizer: HFTokenizer) -> list[int]:
    """Token ids that end generation: the tokenizer's EOS and the model's ``eos_token_id`` (config.json,
    then generation_config.json, which wins in ``transformers``)."""
    ids = {tokenizer.eos_id} if tokenizer.eos_id is not None else set()
    for name in (CONFIG_FILE, "generation_config.json"):
        path = Path(model_dir) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(value if isinstance(value, list) else [] if value is None else [value])
    return sorted(ids)


@dataclass
class Generator:
    """A loaded model with its tokenizer, ready to complete prompts."""

    model: nn.Module
    tokenizer: HFTokenizer
    device: torch.device
    stop: list[int]
    chat_template: JinjaChatTemplate | None

    def prompt_ids(self, prompt: str, *, chat: bool) -> list[int]:
        """Token ids of ``prompt``: as a user turn through the model's chat template (``chat``, which
        places BOS itself), else the text after BOS."""
        if not chat:
            return self.tokenizer.encode(prompt, add_bos=True)
        if self.chat_template is None:
            raise ValueError(
                f"--chat needs a chat template, but {self.tokenizer.source} has none (no chat_template in "
                "tokenizer_config.json, no chat_template.jinja); drop --chat to complete the raw text"
            )
        text = self.chat_template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
        return self.tokenizer.encode(text, add_bos=False)

    def complete(self, prompt: str, *, chat: bool = False, **options) -> str:
        """Collective when the model is sharded. The generated text (special tokens dropped)."""
        ids = generate(self.model, self.prompt_ids(prompt, chat=chat), device=self.device, stop=self.stop, **options)
        return self.tokenizer.decode([i for i in ids if i not in self.stop])


def load_generator(
    model_dir: str | Path,
    *,
    adapter_dir: str | Path | None = None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    sharded: bool = False,
) -> Generator:
    """Load ``model_dir`` (and a PEFT ``adapter_dir``) for generation; ``sharded``: FSDP2 over the
    process group (collective: call on all ranks)."""
    from shardtune.checkpoint import load_hf_checkpoint, load_peft_adapter
    from shardtune.checkpoint.formats.peft_format import peft_target_modules, read_adapter_config
    from shardtune.peft import apply_lora
    from shardtune.ranks.sharding import shard_model

    model_dir, device = Path(model_dir), torch.device(device)
    with torch.device("meta"):
        model = from_hf_config(model_dir, dtype=dtype)
        if adapter_dir is not None:
            adapter = read_adapter_config(Path(adapter_dir))
            apply_lora(
                model,
                rank=adapter["r"],
                alpha=adapter["lora_alpha"],
                target_modules=peft_target_modules(Path(adapter_dir)),
                target_parameters=list(adapter.get("target_parameters") or []),
            )
    if sharded:
        shard_model(model, frozen=True)
    load_hf_checkpoint(model, model_dir, device=device, strict=adapter_dir is None)
    if adapter_dir is not None:
        load_peft_adapter(model, Path(adapter_dir), device=device)
    model.init_buffers(device)
    _check_finite(model, model_dir=model_dir, adapter_dir=adapter_dir)
    tokenizer = load_tokenizer(None, checkpoint_dir=model_dir)
    template = None
    if tokenizer.chat_templates:
        text, where = default_chat_template(tokenizer.chat_templates, source=tokenizer.source)
        template = JinjaChatTemplate(text, name=where, variables=tokenizer.special_tokens)
    return Generator(model, tokenizer, device, stop_ids(model_dir, tokenizer), template)


def _check_finite(model: nn.Module, *, model_dir: Path, adapter_dir: str | Path | None) -> None:
    """Refuse weights holding NaN or inf, naming the first such parameter and where it came from (a NaN adapter
    used to print an empty completion and exit 0). Collective when sharded: each rank checks its shards and
    every rank raises the same error."""
    from shardtune.state_dict.layout import local_tensor

    bad = next((n for n, p in model.named_parameters() if not torch.isfinite(local_tensor(p.detach())).all()), None)
    found = [n for n in comm.all_gather_objects(bad) if n is not None]
    if found:
        source = adapter_dir if "lora_" in found[0] and adapter_dir is not None else model_dir
        raise ValueError(
            f"{found[0]} holds NaN or inf (from {source}): those weights cannot generate; use a finite checkpoint"
        )
