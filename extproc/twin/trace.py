"""A capture (`extproc capture`) or a plain Mooncake trace, read as the requests a twin replays.

Each line is one request: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one
id per 512-token window, equal leading ids meaning an equal prompt prefix), and, in a capture,
what the gateway saw of it (model, route, tenant / session / user hashes, priority, the pod
that served it, its TTFT and TPOT, its cached tokens). A plain Mooncake line has only the four
keys: its requests go to the twin's default model and nothing is known of how they fared.

A capture's lines also carry `fine_ids`, the same per `fine_tokens` (64) tokens: the twin
replays those when present (a conversation's next turn then shares its last prompt up to the
last 64-token boundary; at 512 it would share only whole windows, and most of a multi-turn
conversation's reuse would be lost).

A replay needs token ids, never text: every window id becomes its window's token ids drawn by
a generator seeded with the id, so equal ids give equal tokens and a prompt's ids are its
windows' concatenation (a partial last window is a prefix of the same window in full). The
routing hashes, the engines' block hashes and their caches then see exactly the sharing the
capture recorded, at the capture's granularity: prompts that agree for part of a window only
share nothing there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "WINDOW_TOKENS",
    "CaptureError",
    "TwinRequest",
    "load_pod_facts",
    "load_requests",
    "parse_requests",
    "prompt_ids",
]

WINDOW_TOKENS = 512
# Token ids drawn for the synthetic prompts: clear of the special tokens at both ends of an
# ordinary vocabulary.
_TOKEN_LOW, _TOKEN_HIGH = 1000, 100_000
_REQUIRED = ("timestamp", "input_length", "output_length", "hash_ids")


class CaptureError(ValueError):
    """A line that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TwinRequest:
    """One request to replay, and what the capture says became of it (None: not known)."""

    index: int  # position in arrival order
    at_s: float  # arrival, seconds from the first request
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]  # one id per `unit` tokens
    unit: int = WINDOW_TOKENS
    model: str | None = None
    route: str | None = None
    user: str | None = None
    tenant: str | None = None
    session: str | None = None
    priority: int = 0
    stream: bool = False
    pod: str | None = None  # the pod that served it (else the pick)
    strategy: str | None = None  # the rule that picked it
    status: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    cached_tokens: int | None = None

    @property
    def measured(self) -> bool:
        """Served with a success the capture timed (a fit and a fidelity check can use it)."""
        return (
            self.status is not None
            and 200 <= self.status < 300
            and self.ttft_s is not None
            and self.pod is not None
        )


def _int(row: dict[str, Any], key: str, where: str, *, minimum: int) -> int:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise CaptureError(f"{where}: `{key}` must be a number >= {minimum}, got {value!r}")
    return int(value)


def _opt_float(row: dict[str, Any], key: str, scale: float = 1.0) -> float | None:
    value = row.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) * scale


def _opt_str(row: dict[str, Any], key: str) -> str | None:
    value = row.get(key)
    return value if isinstance(value, str) and value else None


def parse_requests(lines: Iterable[str], *, source: str = "<capture>") -> list[TwinRequest]:
    """The requests of a capture's lines, in arrival order; CaptureError names a bad line."""
    rows: list[tuple[float, int, dict[str, Any]]] = []
    for n, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        where = f"{source}:{n}"
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise CaptureError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise CaptureError(f"{where}: expected a JSON object")
        missing = [k for k in _REQUIRED if k not in row]
        if missing:
            raise CaptureError(f"{where}: missing {', '.join(missing)}")
        ts = row["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts):
            raise CaptureError(f"{where}: `timestamp` must be a number (ms), got {ts!r}")
        rows.append((float(ts), n, row))
    rows.sort(key=lambda r: (r[0], r[1]))
    out: list[TwinRequest] = []
    first = rows[0][0] if rows else 0.0
    for i, (ts, n, row) in enumerate(rows):
        where = f"{source}:{n}"
        length = _int(row, "input_length", where, minimum=1)
        ids = row["hash_ids"]
        windows = math.ceil(length / WINDOW_TOKENS)
        if (
            not isinstance(ids, list)
            or len(ids) != windows
            or not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids)
        ):
            raise CaptureError(
                f"{where}: `hash_ids` must be {windows} non-negative integers "
                f"(one per {WINDOW_TOKENS}-token window of {length} tokens)"
            )
        unit = WINDOW_TOKENS
        fine, fine_tokens = row.get("fine_ids"), row.get("fine_tokens")
        if (
            isinstance(fine_tokens, int)
            and not isinstance(fine_tokens, bool)
            and fine_tokens > 0
            and isinstance(fine, list)
            and len(fine) == math.ceil(length / fine_tokens)
            and all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in fine)
        ):
            ids, unit = fine, fine_tokens
        priority = row.get("priority")
        status = row.get("status")
        cached = row.get("cached_tokens")
        out.append(
            TwinRequest(
                index=i,
                at_s=(ts - first) / 1000.0,
                input_length=length,
                output_length=_int(row, "output_length", where, minimum=1),
                hash_ids=tuple(ids),
                unit=unit,
                model=_opt_str(row, "model"),
                route=_opt_str(row, "route"),
                user=_opt_str(row, "user"),
                tenant=_opt_str(row, "tenant"),
                session=_opt_str(row, "session"),
                priority=priority
                if isinstance(priority, int) and not isinstance(priority, bool)
                else 0,
                stream=row.get("stream", True) is True,  # a plain trace: streamed
                pod=_opt_str(row, "served_by") or _opt_str(row, "endpoint"),
                strategy=_opt_str(row, "strategy"),
                status=status if isinstance(status, int) and not isinstance(status, bool) else None,
                ttft_s=_opt_float(row, "ttft_ms", 1e-3),
                tpot_s=_opt_float(row, "tpot_ms", 1e-3),
                latency_s=_opt_float(row, "latency_ms", 1e-3),
                cached_tokens=cached
                if isinstance(cached, int) and not isinstance(cached, bool)
                else None,
            )
        )
    return out


def load_requests(path: Path) -> list[TwinRequest]:
    with path.open(encoding="utf-8") as f:
        return parse_requests(f, source=str(path))


def load_pod_facts(path: Path) -> dict[str, dict[str, int]]:
    """The pods' published cache config a capture's first line carries (`pods`): by address,
    `block_size` and `num_gpu_blocks` where known; empty for a plain trace."""
    with path.open(encoding="utf-8") as f:
        first = next((line for line in f if line.strip()), "")
    try:
        row = json.loads(first) if first else {}
    except json.JSONDecodeError:
        return {}
    pods = row.get("pods") if isinstance(row, dict) else None
    out: dict[str, dict[str, int]] = {}
    for address, fact in (pods or {}).items() if isinstance(pods, dict) else ():
        if not isinstance(address, str) or not isinstance(fact, dict):
            continue
        out[address] = {
            k: v
            for k in ("block_size", "num_gpu_blocks")
            if isinstance(v := fact.get(k), int) and not isinstance(v, bool) and v > 0
        }
    return out


def _window(unit: int, hash_id: int) -> list[int]:
    rng = np.random.default_rng((unit, hash_id))
    return [int(t) for t in rng.integers(_TOKEN_LOW, _TOKEN_HIGH, size=unit)]


class PromptIds:
    """Token ids of the requests' prompts, one window's ids computed once per id."""

    def __init__(self) -> None:
        self._windows: dict[tuple[int, int], list[int]] = {}

    def __call__(self, req: TwinRequest) -> list[int]:
        out: list[int] = []
        left, unit = req.input_length, req.unit
        for h in req.hash_ids:
            window = self._windows.get((unit, h))
            if window is None:
                window = self._windows[unit, h] = _window(unit, h)
            out.extend(window[: min(left, unit)])
            left -= unit
        return out


def prompt_ids(requests: Sequence[TwinRequest]) -> list[list[int]]:
    """Every request's prompt token ids (shared windows built once)."""
    ids = PromptIds()
    return [ids(r) for r in requests]
