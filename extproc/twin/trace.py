"""A capture (`extproc capture`) or a plain Mooncake trace, read as the requests a twin replays.

Each line is one request: `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (one
id per 512-token window, equal leading ids meaning an equal prompt prefix), and, in a capture,
what the gateway saw of it (model, route, tenant / session / user hashes, priority, the pod
that served it, its TTFT and TPOT, its cached tokens). A plain Mooncake line has only the four
keys: its requests go to the twin's default model and nothing is known of how they fared.

A capture's lines also carry `fine_ids`, the same per `fine_tokens` tokens (16, a routing
block; 64 in captures before 2026-12-07): the twin replays those when present (a
conversation's next turn then shares its last prompt up to the block where they part; at 512
it would share only whole windows, and most of a multi-turn conversation's reuse would be
lost).

A replay needs token ids, never text: every window id becomes its window's token ids drawn by
a generator seeded with the id, so equal ids give equal tokens and a prompt's ids are its
windows' concatenation (a partial last window is a prefix of the same window in full). The
routing hashes, the engines' block hashes and their caches then see exactly the sharing the
capture recorded, at the capture's granularity: prompts that agree for part of a window only
share nothing there.
"""

from __future__ import annotations

import bisect
import dataclasses
import gzip
import json
import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "WINDOW_TOKENS",
    "CaptureError",
    "TwinRequest",
    "link_clients",
    "link_continuations",
    "load_gateway_settings",
    "load_latency_models",
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
# Prompts kept built (a continuation's parent is usually a recent request).
_RECENT = 512
# A closed-loop client's next request arrives this soon after its last one ended (seconds,
# from the end the access record gives: the response's last byte may be timed a few ms after
# the client had it); `link_clients`.
_CLIENT_GAP_S = (-0.005, 0.020)
# How much more often real ends must precede arrivals than ends moved this much later.
_CLIENT_EXCESS = 0.5
_NULL_SHIFT_S = 0.1


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
    # The session id the gateway answered with (keyed, as `session`): a client that echoes it
    # sends it as its next turn's `session` (AIBrix's contract).
    session_answer: str | None = None
    priority: int = 0
    stream: bool = False
    pod: str | None = None  # the pod that served it (else the pick)
    strategy: str | None = None  # the rule that picked it
    status: int | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float | None = None
    cached_tokens: int | None = None
    # What the gateway took to tokenize its prompt (0: the rule that ran read none), part of
    # its captured TTFT: the twin charges it again only under a rule that tokenizes.
    tokenize_s: float = 0.0
    # The earlier request this one continues (`link_continuations`): its prompt, then its
    # answer, are this prompt's first `continues` tokens.
    parent: int | None = None
    continues: int = 0
    # The earlier request whose end this one waited for (its conversation's last turn, or its
    # closed-loop client's last request: `link_clients`): the replay sends it when that one
    # has ended in the twin, after the pause its client took in the capture.
    after: int | None = None
    # Its session is the answer its parent got (`parent`'s `session_answer`): the replay sends
    # the twin's answer to the parent instead, as the client would have.
    echoes: bool = False

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
                session_answer=_opt_str(row, "session_answer"),
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
                tokenize_s=min(max(_opt_float(row, "tokenize_ms", 1e-3) or 0.0, 0.0), 10.0),
            )
        )
    return link_clients(link_continuations(out))


def _chain(ids: Sequence[int]) -> list[int]:
    """Keys of every leading run of window ids (a 64-bit hash: collisions negligible)."""
    out, key = [], 0
    for h in ids:
        key = hash((key, h))
        out.append(key)
    return out


def link_continuations(requests: Sequence[TwinRequest]) -> list[TwinRequest]:
    """Mark each request that continues an earlier one (a conversation's next turn): its
    windows start with every whole window of the earlier prompt, which it is at least as
    long as, and either both name the same session (or it sends the session id the earlier
    one was answered with: `echoes`), or the engine found more of it cached
    than those whole windows hold (the earlier prompt's tail and its answer: what a next turn
    resends). The latest such earlier request with the most whole windows is the parent; the
    replay then builds this prompt as the parent's prompt, the parent's answer, then its own
    windows (`PromptIds`), so the engines see the reuse a conversation really has. Without
    such evidence (a plain trace, another session) a request shares its whole windows only."""
    by_key: dict[tuple[int, int], int] = {}  # (unit, key of its whole windows) -> latest
    out: list[TwinRequest] = []
    for r in requests:
        keys = _chain(r.hash_ids)
        whole = r.input_length // r.unit
        parent = None
        for k in range(min(whole, len(keys)), 0, -1):
            found = by_key.get((r.unit, keys[k - 1]))
            if found is None:
                continue
            a = out[found]
            if a.input_length // a.unit != k or a.input_length > r.input_length:
                continue
            same_session = r.session is not None and r.session in (a.session, a.session_answer)
            cached_beyond = r.cached_tokens is not None and r.cached_tokens > (k + 1) * r.unit
            if same_session or cached_beyond:
                parent = a
            break
        if parent is not None:
            continues = min(parent.input_length + parent.output_length, r.input_length)
            echoes = r.session is not None and r.session == parent.session_answer
            r = dataclasses.replace(
                r, parent=parent.index, continues=continues, after=parent.index, echoes=echoes
            )
        if whole:
            by_key[r.unit, keys[whole - 1]] = r.index
        out.append(r)
    return out


def _follow(requests: Sequence[TwinRequest], shift_s: float) -> dict[int, int]:
    """Each request matched to an earlier one that ended (+ `shift_s`) just before it arrived,
    within `_CLIENT_GAP_S`, nearest first; an ended request is matched once (its client sent one
    next request)."""
    ends = sorted(
        (r.at_s + r.latency_s + shift_s, r.index) for r in requests if r.latency_s is not None
    )
    times = [e for e, _ in ends]
    claimed: set[int] = set()
    out: dict[int, int] = {}
    lo_gap, hi_gap = _CLIENT_GAP_S
    for r in requests:
        lo = bisect.bisect_left(times, r.at_s - hi_gap)
        hi = bisect.bisect_right(times, r.at_s - lo_gap)
        found = min(
            (
                (abs(r.at_s - times[k]), ends[k][1])
                for k in range(lo, hi)
                if ends[k][1] not in claimed and ends[k][1] < r.index
            ),
            default=None,
        )
        if found is not None:
            claimed.add(found[1])
            out[r.index] = found[1]
    return out


def link_clients(requests: Sequence[TwinRequest]) -> list[TwinRequest]:
    """Mark the requests of closed-loop clients (each sends its next request when its last one
    has been answered: a benchmark's concurrency, an agent's loop) with the request they
    waited for (`after`), so the twin offers a slower rule less load, as those clients would.

    The capture says nothing of clients; their loop shows in the times: such a request arrives
    within milliseconds of an earlier one's end. Arrivals at random also land near some end
    now and then, the more often the busier the gateway, so the capture's matches are set
    against a null: the same matching with every end moved `_NULL_SHIFT_S` later. Only when
    the real times match at least `_CLIENT_EXCESS` more of the requests than the shifted ones
    is the capture taken for closed-loop clients, and its matches kept; a conversation's next
    turn keeps its own link (`link_continuations`)."""
    if not requests:
        return list(requests)
    real = _follow(requests, 0.0)
    null = _follow(requests, _NULL_SHIFT_S)
    if (len(real) - len(null)) / len(requests) < _CLIENT_EXCESS:
        return list(requests)
    return [
        dataclasses.replace(r, after=real[r.index]) if r.after is None and r.index in real else r
        for r in requests
    ]


def _open_text(path: Path) -> Any:
    """A capture's lines, gunzipped where its name ends in `.gz`."""
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def load_requests(path: Path) -> list[TwinRequest]:
    """The requests of a capture or trace file (gzipped too: `.gz`)."""
    with _open_text(path) as f:
        return parse_requests(f, source=str(path))


def _first_line_key(path: Path, key: str) -> object:
    """`key` of a capture's first line (where it carries `pods` and `gateway`); None when the
    line is not a JSON object or has no such key."""
    with _open_text(path) as f:
        first = next((line for line in f if line.strip()), "")
    try:
        row = json.loads(first) if first else {}
    except json.JSONDecodeError:
        return None
    return row.get(key) if isinstance(row, dict) else None


def load_pod_facts(path: Path) -> dict[str, dict[str, int]]:
    """The pods' published cache config a capture's first line carries (`pods`): by address,
    `block_size` and `num_gpu_blocks` where known; empty for a plain trace."""
    pods = _first_line_key(path, "pods")
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


def load_gateway_settings(path: Path) -> dict[str, Any]:
    """The gateway's settings a capture's first line carries (`gateway`: the config sections a
    replay runs the gateway under, as YAML data for `TwinSetup.base_config`); empty when it
    carries none (a plain trace, a capture from before they were recorded)."""
    settings = _first_line_key(path, "gateway")
    return dict(settings) if isinstance(settings, dict) else {}


def load_latency_models(path: Path) -> list[Any]:
    """Where the gateway's latency models stood when the capture was taken (its first line's
    `latency_models`: `LatencyModels.rows`, adopted as a replica adopts its peers', a malformed
    row refused there); empty when it carries none (a plain trace, an older capture)."""
    rows = _first_line_key(path, "latency_models")
    return list(rows) if isinstance(rows, list) else []


def _window(unit: int, hash_id: int) -> list[int]:
    rng = np.random.default_rng((unit, hash_id))
    return [int(t) for t in rng.integers(_TOKEN_LOW, _TOKEN_HIGH, size=unit)]


class PromptIds:
    """Token ids of the requests' prompts and answers: one window's ids computed once per id;
    a continuation's prompt is its parent's prompt and answer, then its own windows."""

    def __init__(self, requests: Sequence[TwinRequest] = ()) -> None:
        self._windows: dict[tuple[int, int], list[int]] = {}
        self._requests = {r.index: r for r in requests}
        self._recent: OrderedDict[int, list[int]] = OrderedDict()  # prompts parents may need

    def _own(self, req: TwinRequest, start: int) -> list[int]:
        out: list[int] = []
        unit = req.unit
        for w in range(start // unit, len(req.hash_ids)):
            window = self._windows.get((unit, req.hash_ids[w]))
            if window is None:
                window = self._windows[unit, req.hash_ids[w]] = _window(unit, req.hash_ids[w])
            lo = max(start - w * unit, 0)
            hi = min(req.input_length - w * unit, unit)
            out.extend(window[lo:hi])
        return out

    def answer(self, req: TwinRequest) -> list[int]:
        """The tokens the engine answers `req` with (what a continuation resends)."""
        rng = np.random.default_rng((req.unit, 1, req.index))
        return [int(t) for t in rng.integers(_TOKEN_LOW, _TOKEN_HIGH, size=req.output_length)]

    def __call__(self, req: TwinRequest) -> list[int]:
        found = self._recent.get(req.index)
        if found is not None:
            return found
        parent = self._requests.get(req.parent) if req.parent is not None else None
        if parent is None:
            out = self._own(req, 0)
        else:
            head = self(parent) + self.answer(parent)
            out = head[: req.continues] + self._own(req, req.continues)
        self._recent[req.index] = out
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        return out


def prompt_ids(requests: Sequence[TwinRequest]) -> list[list[int]]:
    """Every request's prompt token ids (shared windows built once)."""
    ids = PromptIds(requests)
    return [ids(r) for r in requests]
