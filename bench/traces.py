"""Replay request traces in the Mooncake trace format (FAST'25 release, also read by aiperf).

A trace is JSON Lines, one request per line, in arrival order:

    {"timestamp": 27482, "input_length": 655, "output_length": 52, "hash_ids": [46, 47]}

- `timestamp`: arrival in ms (any origin; replay starts at the first kept row);
- `input_length`, `output_length`: prompt and answer length in tokens;
- `hash_ids`: one id per 512-token block of the prompt, `ceil(input_length / 512)` of them
  (the last block is partial when input_length is not a multiple of 512). Two requests that
  start with the same ids share that many blocks of prompt prefix.

Replay turns each block id into deterministic text: `block_tokens` pseudo-words drawn by a
RNG seeded with the id, every word one token of the real Qwen3 tokenizer when it follows a
space. Qwen's pre-tokenizer splits before every " word", so no token straddles two words and
the token ids of a prompt are the concatenation of its blocks' ids: shared block ids give
shared token prefixes, a block is exactly `block_tokens` tokens, and a partial last block is
a prefix of the same block in full. Other keys on a row are ignored (some tools add their own).

Scaling: `input_scale` multiplies the tokens of every block (so the sharing structure is
kept), `output_scale` the answer lengths, `time_scale` the gaps between arrivals (0.5 replays
twice as fast), `skip_requests` drops the first rows (a window later in a long trace: replay
then starts at the first kept row) and `max_requests` keeps the next N rows.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

__all__ = [
    "BLOCK_TOKENS",
    "BlockText",
    "TraceError",
    "TraceRequest",
    "TraceRow",
    "TraceScaling",
    "load_trace",
    "parse_trace",
    "scale_trace",
]

BLOCK_TOKENS = 512  # the block size of the Mooncake traces' hash_ids

_SYLLABLES = (
    "ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pe", "da", "go", "ha", "ji", "ku", "ma",
    "no", "ri", "se", "to", "wa", "be", "ci", "fu", "le", "zo",
)  # fmt: skip
_REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(ValueError):
    """A trace row that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRow:
    line: int  # 1-based line number in the source, for messages
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TraceScaling:
    input_scale: float = 1.0
    output_scale: float = 1.0
    time_scale: float = 1.0
    max_requests: int | None = None
    skip_requests: int = 0

    def __post_init__(self) -> None:
        for name in ("input_scale", "output_scale", "time_scale"):
            if not getattr(self, name) > 0:
                raise ValueError(f"trace {name} must be > 0, got {getattr(self, name)!r}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"trace max_requests must be >= 1, got {self.max_requests!r}")
        if self.skip_requests < 0:
            raise ValueError(f"trace skip_requests must be >= 0, got {self.skip_requests!r}")

    @property
    def block_tokens(self) -> int:
        return max(1, round(BLOCK_TOKENS * self.input_scale))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One scaled request: when to send it and what its prompt is made of."""

    line: int
    start_s: float  # since the first kept row, after time scaling
    hash_ids: tuple[int, ...]
    block_tokens: int  # tokens of every block but the last
    input_tokens: int
    output_tokens: int


def _int_field(raw: dict[str, Any], key: str, where: str, *, minimum: int) -> int:
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise TraceError(f"{where}: {key} must be an integer, got {v!r}")
    if v < minimum:
        raise TraceError(f"{where}: {key} must be >= {minimum}, got {v}")
    return v


def _row(raw: object, where: str, line: int) -> TraceRow:
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: a row must be a JSON object, got {type(raw).__name__}")
    missing = [k for k in _REQUIRED if k not in raw]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}")
    ts = raw["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
        raise TraceError(f"{where}: timestamp must be a number of ms >= 0, got {ts!r}")
    n_in = _int_field(raw, "input_length", where, minimum=1)
    n_out = _int_field(raw, "output_length", where, minimum=1)
    ids = raw["hash_ids"]
    if not isinstance(ids, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers >= 0")
    want = math.ceil(n_in / BLOCK_TOKENS)
    if len(ids) != want:
        raise TraceError(
            f"{where}: input_length {n_in} needs {want} hash_ids "
            f"(one per {BLOCK_TOKENS}-token block), got {len(ids)}"
        )
    return TraceRow(line, float(ts), n_in, n_out, tuple(ids))


def parse_trace(lines: Iterable[str], *, source: str = "<trace>") -> list[TraceRow]:
    """Rows of a Mooncake trace, in order; blank lines are skipped, anything else is checked."""
    rows: list[TraceRow] = []
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{source}:{n}"
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        row = _row(raw, where, n)
        if rows and row.timestamp_ms < rows[-1].timestamp_ms:
            raise TraceError(
                f"{where}: timestamp {row.timestamp_ms:g} is before line {rows[-1].line}'s "
                f"{rows[-1].timestamp_ms:g} (rows must be in arrival order)"
            )
        rows.append(row)
    if not rows:
        raise TraceError(f"{source}: the trace has no requests")
    return rows


def load_trace(path: Path) -> list[TraceRow]:
    with path.open(encoding="utf-8") as f:
        return parse_trace(f, source=str(path))


def scale_trace(rows: Sequence[TraceRow], scaling: TraceScaling) -> list[TraceRequest]:
    """The replay schedule: start times, block sizes and lengths after scaling."""
    rows = rows[scaling.skip_requests :]
    kept = rows[: scaling.max_requests] if scaling.max_requests else rows
    if not kept:
        return []
    t0 = kept[0].timestamp_ms
    block = scaling.block_tokens
    out = []
    for r in kept:
        full = len(r.hash_ids) - 1
        last = r.input_length - full * BLOCK_TOKENS  # tokens of the (maybe partial) last block
        last_scaled = min(block, max(1, round(last * scaling.input_scale)))
        out.append(
            TraceRequest(
                line=r.line,
                start_s=(r.timestamp_ms - t0) / 1000.0 * scaling.time_scale,
                hash_ids=r.hash_ids,
                block_tokens=block,
                input_tokens=full * block + last_scaled,
                output_tokens=max(1, round(r.output_length * scaling.output_scale)),
            )
        )
    return out


def _one_token_words(tokenizer: Tokenizer) -> tuple[str, ...]:
    words = []
    for a, b in itertools.product(_SYLLABLES, ("", *_SYLLABLES)):
        w = a + b
        if len(tokenizer.encode(" " + w, add_special_tokens=False).ids) == 1:
            words.append(w)
    return tuple(sorted(words))


class BlockText:
    """Deterministic text for block ids: the same id always gives the same tokens."""

    def __init__(self, tokenizer: Tokenizer, *, seed: int = 0, cache_blocks: int = 8192) -> None:
        self._words = _one_token_words(tokenizer)
        if len(self._words) < 64:  # too few for block texts to differ meaningfully
            raise RuntimeError(f"only {len(self._words)} one-token words in this tokenizer")
        self._seed = seed
        self._block = lru_cache(maxsize=cache_blocks)(self._block_words)

    @property
    def vocabulary(self) -> tuple[str, ...]:
        return self._words

    def _block_words(self, block_id: int, tokens: int) -> tuple[str, ...]:
        # A str seed is hashed with SHA-512 by `random`: stable across processes and runs.
        rng = random.Random(f"mooncake-block:{self._seed}:{block_id}")
        return tuple(rng.choice(self._words) for _ in range(tokens))

    def block(self, block_id: int, tokens: int, *, of: int) -> str:
        """The first `tokens` tokens of block `block_id` when a full block has `of` tokens."""
        if not 0 < tokens <= of:
            raise ValueError(f"block of {of} tokens has no prefix of {tokens}")
        return "".join(" " + w for w in self._block(block_id, of)[:tokens])

    def prompt(self, req: TraceRequest) -> str:
        """The request's prompt: its blocks in order, the last one cut to length."""
        parts = []
        remaining = req.input_tokens
        for block_id in req.hash_ids:
            n = min(remaining, req.block_tokens)
            parts.append(self.block(block_id, n, of=req.block_tokens))
            remaining -= n
        return "".join(parts)
