"""Tokenizers: a thin wrapper over Hugging Face ``tokenizers`` plus a byte-level tokenizer.

``HFTokenizer`` loads what HF model directories ship (``tokenizer.json`` with
``tokenizer_config.json`` / ``special_tokens_map.json`` naming the bos/eos/pad tokens) and adds
BOS/EOS explicitly: ``encode`` never relies on the tokenizer's own post-processor, so the
same call behaves the same for every model family.

Special-token strings that appear in the text (e.g. ``<|eot_id|>``) are parsed as special
tokens, as ``transformers`` does; chat templates such as ``llama3`` rely on it.

``from_dir`` also reads the directory's chat template (see ``jinja_templates``) and its named
special tokens, which the template sees as variables (``bos_token``, ``eos_token``, ...).

``build_byte_tokenizer`` makes the 256-id tokenizer of the ``tiny`` model preset:

* ids 0, 1, 2: ``<|begin_of_text|>`` (bos), ``<|end_of_text|>`` (eos), ``<|pad|>`` (pad);
* ids 3..245: the 243 byte values that can occur in UTF-8 text, in increasing byte order
  (``0xC0``, ``0xC1`` and ``0xF5``-``0xFF`` never occur in valid UTF-8 and have no id), so
  every ``str`` round-trips losslessly through ``encode``/``decode``;
* ids 246..255: ``<|reserved_special_token_0|>`` .. ``_9|>``, never produced by ``encode``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from shardtune.data.jinja_templates import load_chat_templates
from shardtune.json_files import read_json

__all__ = [
    "BYTE_TOKENIZER_SPECIALS",
    "HFTokenizer",
    "build_byte_tokenizer",
    "load_tokenizer",
    "save_byte_tokenizer",
]

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
BYTE_TOKENIZER_SPECIALS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
_N_RESERVED = 10
_INVALID_UTF8_BYTES = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])

# Fallback special-token names for a bare tokenizer.json, most common first.
_BOS_CANDIDATES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_CANDIDATES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>")
_PAD_CANDIDATES = ("<|pad|>", "<pad>", "<|finetune_right_pad_id|>")
# The named special tokens transformers passes to chat templates.
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` with known bos/eos/pad ids.

    ``pad_id`` falls back to ``eos_id`` when the tokenizer has no pad token. ``bos_id`` may be
    ``None`` (some families have no BOS); ``encode(add_bos=True)`` then adds nothing.
    ``chat_templates`` maps template names to ``(Jinja source, where it was read)`` (empty: none);
    ``special_tokens`` holds the named special tokens the directory's files declare (the
    templates' variables).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str,
        pad_token: str | None = None,
        source: str = "<in memory>",
        chat_templates: dict[str, tuple[str, str]] | None = None,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.source = source
        self.chat_templates = dict(chat_templates or {})
        self.special_tokens = dict(special_tokens or {})
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.pad_token = pad_token
        self.bos_id = None if bos_token is None else self._require_id(bos_token, "bos_token")
        self.eos_id = self._require_id(eos_token, "eos_token")
        self.pad_id = self.eos_id if pad_token is None else self._require_id(pad_token, "pad_token")

    def _require_id(self, token: str, role: str) -> int:
        token_id = self.tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(
                f"{role} {token!r} from {self.source} is not in the tokenizer's vocabulary; "
                f"fix {role} in tokenizer_config.json or pass {role}= explicitly"
            )
        return token_id

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> HFTokenizer:
        """Load a ``tokenizer.json``. Special tokens not given are guessed from common names
        (``<|begin_of_text|>``/``<s>``, ``<|end_of_text|>``/``</s>``, ``<|pad|>``/``<pad>``)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file {path} does not exist; pass the path of a tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises a bare Exception ("expected value at line 1 column 1")
            raise ValueError(
                f"{path} is not a readable tokenizer.json ({e}); re-copy it from the model repository, or "
                "re-save the tokenizer with transformers' AutoTokenizer.from_pretrained(...).save_pretrained(dir)"
            ) from None
        bos_token = bos_token or _first_known(tokenizer, _BOS_CANDIDATES)
        eos_token = eos_token or _first_known(tokenizer, _EOS_CANDIDATES)
        pad_token = pad_token or _first_known(tokenizer, _PAD_CANDIDATES)
        if eos_token is None:
            raise ValueError(
                f"cannot tell the eos token of {path}: none of {list(_EOS_CANDIDATES)} is in its "
                "vocabulary; set eos_token in tokenizer_config.json or pass eos_token="
            )
        return cls(tokenizer, bos_token=bos_token, eos_token=eos_token, pad_token=pad_token, source=str(path))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> HFTokenizer:
        """Load ``model_dir/tokenizer.json`` with the special tokens named by
        ``tokenizer_config.json`` (first) or ``special_tokens_map.json``."""
        model_dir = Path(model_dir)
        tokenizer_file = model_dir / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{model_dir} has no tokenizer.json; shardtune needs the fast-tokenizer file that HF "
                "model directories ship (convert with transformers' AutoTokenizer(...).save_pretrained())"
            )
        specials: dict[str, str] = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later files win
            specials.update(_read_special_tokens(model_dir / name))
        tokenizer = cls.from_file(
            tokenizer_file,
            bos_token=specials.get("bos_token"),
            eos_token=specials.get("eos_token"),
            pad_token=specials.get("pad_token"),
        )
        tokenizer.source = str(model_dir)
        tokenizer.chat_templates = load_chat_templates(model_dir)
        tokenizer.special_tokens = specials
        return tokenizer

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, with BOS/EOS added only as requested."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of ``text`` (no BOS/EOS added) and each token's ``[start, end)`` characters."""
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def save_pretrained(self, directory: str | Path) -> None:
        """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` so
        ``HFTokenizer.from_dir`` and ``transformers.AutoTokenizer.from_pretrained`` load them."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save(str(directory / "tokenizer.json"))
        specials = {"bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token}
        specials = {k: v for k, v in specials.items() if v is not None}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 131072,
            **specials,
        }
        _write_json(directory / "tokenizer_config.json", config)
        _write_json(directory / "special_tokens_map.json", specials)


def _first_known(tokenizer: Tokenizer, candidates: Sequence[str]) -> str | None:
    return next((tok for tok in candidates if tokenizer.token_to_id(tok) is not None), None)


def _token_content(value: Any) -> str | None:
    """A special token as written by transformers: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_special_tokens(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    data = read_json(path, fix="fix or delete it")
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got a {type(data).__name__}; fix or delete it")
    found = {}
    for key in _NAMED_SPECIALS:
        content = _token_content(data.get(key))
        if content:
            found[key] = content
    return found


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_byte_tokenizer() -> HFTokenizer:
    """The 256-id byte-level tokenizer of the ``tiny`` preset (layout in the module docstring)."""
    ordered = _gpt2_byte_chars()
    vocab = {tok: i for i, tok in enumerate(BYTE_TOKENIZER_SPECIALS)}
    for byte in range(256):
        if byte not in _INVALID_UTF8_BYTES:
            vocab[ordered[byte]] = len(vocab)
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(_N_RESERVED)]
    for tok in reserved:
        vocab[tok] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A $B", special_tokens=[(BOS_TOKEN, 0)]
    )
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in (*BYTE_TOKENIZER_SPECIALS, *reserved)]
    )
    return HFTokenizer(
        tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, source="byte tokenizer"
    )


def _gpt2_byte_chars() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what the ByteLevel pre-tokenizer emits)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def save_byte_tokenizer(directory: str | Path) -> HFTokenizer:
    """Build the byte tokenizer, write it to ``directory`` in HF layout and return it."""
    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(directory)
    return tokenizer


def load_tokenizer(spec: str | None, *, checkpoint_dir: str | Path | None) -> HFTokenizer:
    """The tokenizer named by a config's ``tokenizer`` key: ``"byte"`` (the built-in byte
    tokenizer), a directory, a ``tokenizer.json`` path, or ``None`` (``checkpoint_dir``)."""
    if spec == "byte":
        return build_byte_tokenizer()
    if spec is None:
        if checkpoint_dir is None:
            raise ValueError("no tokenizer: set tokenizer=byte, tokenizer=<dir or tokenizer.json> or checkpoint_dir")
        return HFTokenizer.from_dir(checkpoint_dir)
    path = Path(spec)
    return HFTokenizer.from_dir(path) if path.is_dir() else HFTokenizer.from_file(path)
