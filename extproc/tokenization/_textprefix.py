"""Reuse inside one segment: a long text that starts like one encoded recently.

A RAG or document-QA prompt is one user message: a long document, then a question. The
segment cache (`_segments.py`) misses, since the text differs from last time at its end,
and the chat-prefix cache (`_prefix.py`) stops at the last added token. This cache keeps
recently encoded long segments with their ids and *cut points*, finds one sharing a long
text prefix with the new segment, and encodes only the text after the last safe cut.

Why a cut is exact. The regex pre-tokenizer (`Split`, Isolated) scans left to right; every
character starts a match, and a match is decided only by the characters the regex engine
reads. Encoding is then per pre-token (byte-level BPE), so if the new text B is scanned
exactly like the cached text A up to a match boundary `c`, B's ids before `c` are A's,
and B's scan from `c` is a scan of `B[c:]` (the pattern has no lookbehind or anchors).
A cut `c` is kept only where all of this holds (`cut_allowed`):

* `c` is a pre-token boundary of A: tokens i-1 and i have different word ids and meet at
  `c` (`offsets[i][0] == offsets[i-1][1] == c`).
* The character before the cut is a letter or digit and both it and the one at the cut are
  in `_CUT_CHARS` (ASCII, CJK ideographs and punctuation, fullwidth forms). For the audited
  patterns (`_AUDITED_PATTERNS`) this bounds what the scan reads: every run the pattern
  consumes greedily (letters, whitespace, punctuation + newlines) stops at a letter or
  digit, a letter run or a digit match ending at `c` reads `text[c]` at most, and the
  contraction alternatives read at most three characters from a quote, which cannot be at
  `c - 1`. So no match before `c` reads past `text[c]`, whatever follows: long whitespace
  runs and `\\s+(?!\\S)` lookaheads never straddle such a cut.
* `c + margin <= L` (L = common prefix length), `margin` = 1: the one character the scan may
  read at the cut must be shared. With margin 0, A = "x hello" and B = "x helloworld" would
  reuse " hello" where B has one pre-token " helloworld".
* NFC (Qwen3's normalizer) cannot reach across the cut: characters in `_CUT_CHARS` have
  combining class 0 and are never the second character of a composition, so
  NFC(B) = NFC(B[:c]) + NFC(B[c:]) and NFC(B[:c]) = NFC(A[:c]). In B, `text[c]` may still
  compose with what follows (e + U+0301 -> é), but only into a character of the same class
  (letter, digit, space, other), which is all the scan reads there (tests check this over
  the Unicode tables).

Any other normalizer or pattern disables the path (`text_prefix_unsafe_reason`), and so
does a failed self-check at load (`HFTokenizer`).
"""

from __future__ import annotations

import sys
import threading
from array import array
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import orjson
from tokenizers import Tokenizer
from tokenizers.models import BPE

__all__ = [
    "LongSegment",
    "Reuse",
    "TailEncoding",
    "TextPrefixCache",
    "TextPrefixStats",
    "common_prefix_len",
    "cut_allowed",
    "cut_points",
    "text_prefix_unsafe_reason",
]

# Qwen2/Qwen3's pattern, and Llama 3's / cl100k's (digits in runs of up to three).
_AUDITED_PATTERNS = frozenset(
    {
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    }
)

_MARGIN = 1  # see the module docstring: the scan reads at most text[c] past a cut

# Characters allowed on either side of a cut: NFC-inert starters (no composition with a
# preceding character, class preserved by any composition with the next).
_CUT_RANGES = (
    (0x0000, 0x007F),  # ASCII
    (0x3000, 0x3029),  # CJK symbols and punctuation (U+302A-302F are combining marks)
    (0x3030, 0x303F),
    (0x4E00, 0x9FCC),  # CJK unified ideographs (Unicode 6.1: older regex tables know them)
    (0xFF01, 0xFF5E),  # fullwidth ASCII forms
)


def in_cut_chars(ch: str) -> bool:
    """True if `ch` is in one of `_CUT_RANGES`."""
    cp = ord(ch)
    return any(lo <= cp <= hi for lo, hi in _CUT_RANGES)


def cut_allowed(text: str, c: int) -> bool:
    """The character rule for a cut before `text[c]` (see the module docstring)."""
    before, at = text[c - 1], text[c]
    if before.isascii():
        if not before.isalnum():
            return False
    elif not (in_cut_chars(before) and before.isalnum()):
        return False
    return at.isascii() or in_cut_chars(at)


def _state(component: object) -> object:
    """A tokenizer component's JSON (None when absent)."""
    getstate = getattr(component, "__getstate__", None)
    state = getstate() if component is not None and getstate is not None else None
    return orjson.loads(state) if isinstance(state, bytes | str) else None


def text_prefix_unsafe_reason(tokenizer: Tokenizer) -> str | None:
    """Why cutting a segment inside its text could change the ids, or None when audited."""
    normalizer = _state(tokenizer.normalizer)
    if normalizer is not None and not (
        isinstance(normalizer, Mapping) and normalizer.get("type") == "NFC"
    ):
        return "text prefix: normalizer is not NFC or none"
    if any(t.normalized for t in tokenizer.get_added_tokens_decoder().values()):
        return "text prefix: normalized added tokens match inside segments"
    if not isinstance(tokenizer.model, BPE) or tokenizer.model.dropout:
        return "text prefix: model is not BPE without dropout"
    pre = _state(tokenizer.pre_tokenizer)
    steps = pre.get("pretokenizers") if isinstance(pre, Mapping) else None
    if not isinstance(steps, list) or len(steps) != 2:
        return "text prefix: pre-tokenizer is not Split + ByteLevel"
    split, byte_level = steps
    pattern = split.get("pattern") if isinstance(split, Mapping) else None
    if not (
        isinstance(split, Mapping)
        and split.get("type") == "Split"
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and isinstance(pattern, Mapping)
    ):
        return "text prefix: pre-tokenizer is not an isolating regex Split"
    if pattern.get("Regex") not in _AUDITED_PATTERNS:
        return "text prefix: pre-tokenizer regex not audited for cuts"
    if not (
        isinstance(byte_level, Mapping)
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("add_prefix_space")
        and not byte_level.get("use_regex")
    ):
        return "text prefix: ByteLevel step adds a prefix space or splits again"
    return None


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix, by binary search over slice equality.

    Each step compares and copies at most the remaining half, so the work is C-speed and
    linear in the answer, with ~log2(n) Python steps.
    """
    hi = min(len(a), len(b))
    if b.startswith(a[:hi]):
        return hi
    lo = 0  # invariant: a[:lo] == b[:lo] and a[:hi + 1] != b[:hi + 1]
    hi -= 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if b.startswith(a[lo:mid], lo):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True, slots=True)
class TailEncoding:
    """A fresh encode of a long piece's uncached text, with its own cut points."""

    ids: list[int]
    cuts: array[int]
    cut_tokens: array[int]


def cut_points(
    text: str,
    offsets: Sequence[tuple[int, int]],
    word_ids: Sequence[int | None],
    *,
    gap: int,
) -> tuple[array[int], array[int]]:
    """Allowed cuts of `text`'s encoding, at least `gap` characters apart.

    Returns (char positions, ids before each): ascending, position 0 excluded.
    """
    cuts: array[int] = array("I")
    tokens: array[int] = array("I")
    if not offsets:
        return cuts, tokens
    next_ok = gap
    prev_word, prev_end = word_ids[0], offsets[0][1]
    for i in range(1, len(offsets)):
        word = word_ids[i]
        start, end = offsets[i]
        if (
            start >= next_ok
            and word != prev_word
            and start == prev_end
            and cut_allowed(text, start)
        ):
            cuts.append(start)
            tokens.append(i)
            next_ok = start + gap
        prev_word, prev_end = word, end
    return cuts, tokens


@dataclass(frozen=True, slots=True)
class LongSegment:
    """A long segment's text, its ids, and its allowed cuts (positions, ids before each)."""

    text: str
    ids: array[int]
    cuts: array[int]
    cut_tokens: array[int]


@dataclass(frozen=True, slots=True)
class Reuse:
    """Where a new segment cuts a cached one: `base.ids[:tokens]` encode `text[:cut]`."""

    base: LongSegment
    cut: int
    tokens: int
    shared: int  # the common prefix length


@dataclass(frozen=True, slots=True)
class TextPrefixStats:
    hits: int
    misses: int
    entries: int
    reused_chars: int
    bytes_used: int
    bytes_budget: int


_ENTRY_OVERHEAD = 300  # object headers, list slot, OrderedDict links (approximate bytes)


class TextPrefixCache:
    """Thread-safe LRU of recently encoded long segments, bounded by bytes.

    Segments of at least `min_chars` characters are indexed by their first `key_chars`
    characters; each key holds up to `per_key` segments, and `find` takes the one sharing
    the longest prefix. A new segment replaces the one it was cut from when they share at
    least half of it (document QA: one entry per document, with its latest question).
    """

    def __init__(
        self,
        *,
        max_bytes: int = 32 * 1024 * 1024,
        min_chars: int = 2048,
        key_chars: int = 256,
        per_key: int = 4,
        cut_gap: int = 32,
        margin: int = _MARGIN,
    ) -> None:
        if max_bytes < 0 or key_chars < 1 or per_key < 1 or cut_gap < 1 or margin < 0:
            raise ValueError("max_bytes, margin >= 0; key_chars, per_key, cut_gap >= 1")
        if min_chars < key_chars:
            raise ValueError("min_chars must be >= key_chars")
        self.min_chars = min_chars
        self.cut_gap = cut_gap
        self.margin = margin  # tests lower it to show that the load-time self-check fails
        self._key_chars = key_chars
        self._per_key = per_key
        self._max_bytes = max_bytes
        self._buckets: OrderedDict[str, list[LongSegment]] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._reused = 0
        self._lock = threading.Lock()

    @staticmethod
    def _cost(seg: LongSegment) -> int:
        arrays = 4 * (len(seg.ids) + len(seg.cuts) + len(seg.cut_tokens))
        return sys.getsizeof(seg.text) + arrays + _ENTRY_OVERHEAD

    def find(self, text: str) -> Reuse | None:
        """The cut of a cached segment with the longest common prefix, if any is allowed."""
        if len(text) < self.min_chars:
            return None
        with self._lock:
            bucket = self._buckets.get(text[: self._key_chars])
            best: Reuse | None = None
            for seg in bucket or ():
                shared = common_prefix_len(seg.text, text)
                if best is not None and shared <= best.shared:
                    continue
                reuse = self.cut(seg, shared)
                if reuse is not None:
                    best = reuse
            if best is None:
                self._misses += 1
                return None
            self._buckets.move_to_end(text[: self._key_chars])
            self._hits += 1
            self._reused += best.cut
            return best

    def cut(self, seg: LongSegment, shared: int) -> Reuse | None:
        """The last allowed cut of `seg` at most `shared - margin`, or None."""
        j = bisect_right(seg.cuts, shared - self.margin) - 1
        if j < 0:
            return None
        return Reuse(seg, seg.cuts[j], seg.cut_tokens[j], shared)

    @staticmethod
    def extend(reuse: Reuse | None, text: str, tail: TailEncoding) -> LongSegment:
        """The segment `text` from a reused head (if any) and the encode of the rest."""
        if reuse is None:
            return LongSegment(text, array("I", tail.ids), tail.cuts, tail.cut_tokens)
        base, c, i = reuse.base, reuse.cut, reuse.tokens
        ids = base.ids[:i]
        ids.extend(array("I", tail.ids))
        j = bisect_right(base.cuts, c)  # the base's cuts up to and including c
        cuts = base.cuts[:j]
        cut_tokens = base.cut_tokens[:j]
        cuts.extend(array("I", [c + x for x in tail.cuts]))
        cut_tokens.extend(array("I", [i + x for x in tail.cut_tokens]))
        return LongSegment(text, ids, cuts, cut_tokens)

    def put(self, seg: LongSegment, *, reuse: Reuse | None = None) -> None:
        """Store `seg`; it replaces `reuse.base` when they share at least half of it."""
        if len(seg.text) < self.min_chars:
            return
        cost = self._cost(seg)
        if cost > self._max_bytes:
            return
        key = seg.text[: self._key_chars]
        with self._lock:
            bucket = self._buckets.pop(key, [])
            kept = []
            for old in bucket:
                replaced = old.text == seg.text or (
                    reuse is not None and old is reuse.base and 2 * reuse.shared >= len(old.text)
                )
                if replaced:
                    self._bytes -= self._cost(old)
                else:
                    kept.append(old)
            kept.append(seg)
            self._bytes += cost
            while len(kept) > self._per_key:
                self._bytes -= self._cost(kept.pop(0))
            self._buckets[key] = kept
            while self._bytes > self._max_bytes and self._buckets:
                _, evicted = self._buckets.popitem(last=False)
                self._bytes -= sum(self._cost(s) for s in evicted)

    def stats(self) -> TextPrefixStats:
        with self._lock:
            return TextPrefixStats(
                hits=self._hits,
                misses=self._misses,
                entries=sum(len(b) for b in self._buckets.values()),
                reused_chars=self._reused,
                bytes_used=self._bytes,
                bytes_budget=self._max_bytes,
            )

    def clear(self) -> None:
        with self._lock:
            self._buckets.clear()
            self._bytes = 0
