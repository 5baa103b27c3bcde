"""Exact incremental tokenization: split at added tokens, cache each segment's ids.

HF `tokenizers` extracts added (special) tokens from the input *before* normalisation and
pre-tokenisation, so the text between two added tokens is tokenized independently of
everything around it. A multi-turn chat rendered by its template is mostly such segments
(`<|im_start|>user\n...<|im_end|>`), so turn N+1 only has to tokenize its new messages.
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["AddedTokenSplitter", "SegmentCache", "SegmentCacheStats"]


class AddedTokenSplitter:
    """Splits text at added tokens with HF's leftmost-longest matching.

    `split` yields `(segment, None)` for ordinary text and `(token, id)` for an added token.
    """

    def __init__(self, tokens: dict[str, int]) -> None:
        self._ids = dict(tokens)
        # Longest first: Python's alternation is leftmost-first, which then equals
        # the leftmost-longest match of the Aho-Corasick automaton HF uses.
        ordered = sorted(self._ids, key=len, reverse=True)
        self._pattern = re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None

    def split(self, text: str) -> list[tuple[str, int | None]]:
        if self._pattern is None:
            return [(text, None)] if text else []
        out: list[tuple[str, int | None]] = []
        pos = 0
        for m in self._pattern.finditer(text):
            start, end = m.span()
            if start > pos:
                out.append((text[pos:start], None))
            token = m.group()
            out.append((token, self._ids[token]))
            pos = end
        if pos < len(text):
            out.append((text[pos:], None))
        return out


@dataclass(frozen=True, slots=True)
class SegmentCacheStats:
    hits: int
    misses: int
    entries: int
    bytes_used: int
    bytes_budget: int


# Approximate per-entry overhead (dict slot, OrderedDict links, array header) in bytes.
_ENTRY_OVERHEAD = 200


class SegmentCache:
    """Thread-safe LRU from segment text to token ids, bounded by an approximate byte budget.

    Ids are stored as `array('I')` (4 bytes per token instead of ~36 for a list of ints).
    """

    def __init__(self, *, max_bytes: int = 64 * 1024 * 1024, min_chars: int = 1) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self._max_bytes = max_bytes
        self._min_chars = min_chars
        self._entries: OrderedDict[str, array[int]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    @staticmethod
    def _cost(key: str, ids: array[int]) -> int:
        # len(key) underestimates non-ASCII str storage; good enough for a budget.
        return len(key) + 4 * len(ids) + _ENTRY_OVERHEAD

    def get(self, key: str) -> array[int] | None:
        with self._lock:
            ids = self._entries.get(key)
            if ids is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return ids

    def put(self, key: str, ids: Iterable[int]) -> None:
        if len(key) < self._min_chars:
            return
        value = array("I", ids)
        cost = self._cost(key, value)
        if cost > self._max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= self._cost(key, old)
            self._entries[key] = value
            self._bytes += cost
            while self._bytes > self._max_bytes and self._entries:
                k, v = self._entries.popitem(last=False)
                self._bytes -= self._cost(k, v)

    def stats(self) -> SegmentCacheStats:
        with self._lock:
            return SegmentCacheStats(
                hits=self._hits,
                misses=self._misses,
                entries=len(self._entries),
                bytes_used=self._bytes,
                bytes_budget=self._max_bytes,
            )

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
