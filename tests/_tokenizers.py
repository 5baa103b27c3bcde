"""The Qwen3 tokenizer for tests, parsed once per test process: each call returns it with new,
empty caches (`HFTokenizer.with_fresh_caches`), so tests stay independent without paying
~0.6 s to read and parse the files every time."""

from __future__ import annotations

import functools
from pathlib import Path

from extproc.tokenization import HFTokenizer, load_tokenizer


@functools.cache
def _parsed(directory: Path) -> HFTokenizer:
    return load_tokenizer(directory)


def fresh_tokenizer(directory: Path) -> HFTokenizer:
    return _parsed(Path(directory)).with_fresh_caches()
