"""Token-id files: a JSON list of non-negative integers."""

from __future__ import annotations

import json
from pathlib import Path

from harness.errors import UsageError


def read_token_file(path: str | Path, vocab_size: int | None = None, what: str = "token file") -> list[int]:
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise UsageError(f"{what} {p} does not exist") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{what} {p}: not valid JSON ({e.msg}, line {e.lineno} column {e.colno})") from None
    if not isinstance(raw, list):
        raise UsageError(f"{what} {p}: expected a JSON list of token ids, got {type(raw).__name__}")
    for i, t in enumerate(raw):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise UsageError(f"{what} {p}: entry [{i}] = {t!r} is not a non-negative integer token id")
        if vocab_size is not None and t >= vocab_size:
            raise UsageError(f"{what} {p}: entry [{i}] = {t} is outside the vocabulary (size {vocab_size})")
    return raw
