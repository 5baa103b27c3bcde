"""Whole-conversation reuse: the ids of a chat's rendered prefix, found by its messages.

A chat client resends the whole conversation with every turn. The previous request's
rendered text, up to its last added token (`<|im_end|>`, `<|im_start|>`, ...), is then
usually a prefix of this request's text, and its ids are already known: the next turn only
splits, looks up and encodes the text after it, and copies the rest as one array.

Keys only find a candidate. The caller checks that the candidate's text is a prefix of its
own rendering (the template may render earlier messages differently once more follow), and
that text ends where no added token can continue past it (`AddedTokenSplitter.closed_at`),
so a reused prefix always has the ids a full encode gives.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import orjson
from xxhash import xxh3_64_intdigest

from extproc.tokenization._segments import SegmentCacheStats

__all__ = ["ChatPrefix", "ChatPrefixCache", "ChatPrefixStats", "message_keys"]

_ROOT = xxh3_64_intdigest(b"extproc-chat-prefix")
_ENTRY_OVERHEAD = 200  # dict slot, OrderedDict links, object headers (approximate bytes)


def message_keys(messages: Sequence[Mapping[str, object]]) -> list[int] | None:
    """Key of each message prefix: keys[j] names messages[: j + 1] (chained 64-bit hashes).

    None when a message is not plain JSON data (the caller then renders without reuse).
    """
    keys: list[int] = []
    h = _ROOT
    try:
        for message in messages:
            h = xxh3_64_intdigest(orjson.dumps(message), h)
            keys.append(h)
    except TypeError:  # orjson.JSONEncodeError: not a dict of JSON values
        return None
    return keys


@dataclass(frozen=True, slots=True)
class ChatPrefix:
    """A rendered text prefix that ends a piece, and its token ids, stored under `key`."""

    key: int
    text: str
    ids: array[int]


# The same counters as the segment cache's: one type for both.
ChatPrefixStats = SegmentCacheStats


class ChatPrefixCache:
    """Thread-safe LRU from a message-prefix key to a ChatPrefix, bounded by bytes.

    An entry costs its text plus 4 bytes per id: ~60 KB for an 8k-token conversation, so
    the default 64 MiB holds the latest turn of about a thousand such conversations. An
    entry that a later turn's longer entry supersedes moves to the cold end: it stays only
    for a client that branches from the same point, and goes first when space runs out.
    """

    def __init__(self, *, max_bytes: int = 64 * 1024 * 1024) -> None:
        if max_bytes < 0:
            raise ValueError("max_bytes must be >= 0")
        self._max_bytes = max_bytes
        self._entries: OrderedDict[int, ChatPrefix] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    @staticmethod
    def _cost(entry: ChatPrefix) -> int:
        return sys.getsizeof(entry.text) + entry.ids.itemsize * len(entry.ids) + _ENTRY_OVERHEAD

    def find(self, keys: Sequence[int], text: str) -> ChatPrefix | None:
        """The longest-keyed entry whose text starts `text` (keys tried last to first)."""
        with self._lock:
            entries = self._entries
            for key in reversed(keys):
                entry = entries.get(key)
                if entry is not None and text.startswith(entry.text):
                    entries.move_to_end(key)
                    self._hits += 1
                    return entry
            self._misses += 1
            return None

    def put(self, entry: ChatPrefix, *, supersedes: ChatPrefix | None = None) -> None:
        """Store `entry`; `supersedes` (the entry it extends) becomes the first to evict."""
        cost = self._cost(entry)
        if cost > self._max_bytes:
            return
        with self._lock:
            if supersedes is not None and supersedes.key in self._entries:
                self._entries.move_to_end(supersedes.key, last=False)
            old = self._entries.pop(entry.key, None)
            if old is not None:
                self._bytes -= self._cost(old)
            self._entries[entry.key] = entry
            self._bytes += cost
            while self._bytes > self._max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= self._cost(evicted)

    def stats(self) -> ChatPrefixStats:
        with self._lock:
            return ChatPrefixStats(
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
