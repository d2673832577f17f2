"""JSON files a user hands over (``config.json``, tokenizer configs, data files), read as data.

Rule: a JSON file from a model or data directory is read through :func:`read_json`, so a byte
that is not UTF-8 or a syntax error is reported as ``path:line`` with the fix, never as a bare
decoder traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, *, fix: str, utf8_fix: str | None = None) -> Any:
    """The JSON value in ``path``; ValueError naming ``path:line`` and ``fix`` (``utf8_fix`` for
    text that is not UTF-8, when given) if it cannot be decoded."""
    raw = path.read_bytes()
    try:
        return json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line} is not UTF-8 text (byte {raw[e.start : e.start + 1]!r}); {utf8_fix or fix}"
        ) from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno} is not valid JSON ({e.msg} at column {e.colno}); {fix}") from None
