"""Exact incremental tokenization: split at added tokens, cache each segment's ids.

HF `tokenizers` extracts added (special) tokens from the input *before* normalisation and
pre-tokenisation, so the text between two added tokens is tokenized independently of
everything around it. A multi-turn chat rendered by its template is mostly such segments
(`<|im_start|>user\n...<|im_end|>`), so turn N+1 only has to tokenize its new messages.
"""

from __future__ import annotations

import re
import sys
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
        # Every proper prefix of an added token: text ending in one may continue into a token.
        self._open = frozenset(t[:i] for t in ordered for i in range(1, len(t)))
        self._longest = len(ordered[0]) if ordered else 0

    def split(self, text: str, start: int = 0) -> list[tuple[str, int | None]]:
        """The pieces of `text[start:]`; `start` must be 0 or the end of an added token."""
        if self._pattern is None:
            return [(text[start:], None)] if len(text) > start else []
        out: list[tuple[str, int | None]] = []
        pos = start
        for m in self._pattern.finditer(text, start):
            begin, end = m.span()
            if begin > pos:
                out.append((text[pos:begin], None))
            token = m.group()
            out.append((token, self._ids[token]))
            pos = end
        if pos < len(text):
            out.append((text[pos:], None))
        return out

    def closed_at(self, text: str, end: int) -> bool:
        """True if no added token can start before `end` and run past it, whatever follows.

        Then every text that starts with `text[:end]` splits into the same pieces before
        `end` (each match decision before `end` reads only characters before it), so the
        ids of `text[:end]` can be reused for any such text when `end` ends a piece.
        """
        return not any(
            text[i:end] in self._open for i in range(max(0, end - self._longest + 1), end)
        )


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
        # getsizeof: the string's real size (1, 2 or 4 bytes a character), in O(1).
        return sys.getsizeof(key) + 4 * len(ids) + _ENTRY_OVERHEAD

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
