"""Every process's capture, joined into one trace: a line per request in the Mooncake trace
format (`timestamp`, `input_length`, `output_length`, `hash_ids`: bench/traces.py reads it)
extended with what a replay of the operator's own traffic needs.

A request's decision half is on the process that routed it, its outcome half on the process
that received its access record (maybe another, or another replica); both are keyed by the
request id's keyed hash. A request with one half only is still a line: a decision without an
outcome (still running, its record lost or aged out) has null outcome fields; an outcome
without a decision (that process was not reached, or its half aged out) has no blocks.

`hash_ids` mean what they mean in the Mooncake traces: one id per 512-token block of the prompt,
`ceil(input_length / 512)` of them, numbered from 0 in order of first appearance, equal
leading ids meaning a shared prefix. A block's id comes from the prompt's chained hash, so two
requests share an id exactly when their prompts agree up to that block's last full routing
block (a partial block of fewer tokens than the routing's block size is not hashed: it gets an
id of its own). `fine_ids` say the same per `fine_tokens` (16: a routing block) tokens, in an
id space of their own: what `extproc tune` replays (a conversation's next turn shares its
previous prompt up to the block where they part, where `hash_ids` would show only whole
512-token windows). The
first line also carries `pods`: each scraped pod's model, block size and number of KV blocks,
as its engine publishes them; and `gateway`: the settings of the gateway's config that a replay
runs it under (flow control, saturation, KV events, polling, the rules' parameters); and
`latency_models`: where the gateway's per-pod latency models stood when the capture was taken
(`LatencyModels.rows`, each pod's from the process whose model learned the most), so that a
replay's `predicted-latency` starts where a switch to it would. Where the
routing rule computed no hashes (`"blocks": "none"`), every block gets an id of its own: the
replay then shares nothing it cannot prove.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TextIO

from extproc.accounting.latency_model import fullest_rows
from extproc.capture.records import FINE_TOKENS, WINDOW_TOKENS

__all__ = ["Capture", "CaptureFormatError", "merge", "parse_since", "write_capture"]


class CaptureFormatError(ValueError):
    """A process answered something that is not a capture export."""


@dataclass
class Capture:
    """The joined trace and how complete it is."""

    lines: list[dict[str, Any]] = field(default_factory=list)
    processes: list[str] = field(default_factory=list)  # the replicas whose exports were read
    joined: int = 0  # both halves
    decision_only: int = 0
    outcome_only: int = 0

    def summary(self) -> str:
        n = len(self.lines)
        return (
            f"{n} request{'' if n == 1 else 's'} from {len(self.processes)} process"
            f"{'' if len(self.processes) == 1 else 'es'} ({self.joined} with both halves, "
            f"{self.decision_only} without an outcome yet, {self.outcome_only} without their "
            "decision)"
        )


_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*(s|m|h|d)?\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_since(text: str) -> float:
    """`--since`: a duration back from now (`90s`, `10m`, `2h`, `1d`; bare: seconds), in
    seconds. ValueError names what was wrong."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"--since {text!r}: expected a duration such as 90s, 10m, 2h or 1d")
    return float(m.group(1)) * _UNIT_S[m.group(2) or "s"]


def write_capture(capture: Capture, output: str | None) -> str:
    """The trace, one JSON object per line in arrival order, to the file `output` (None or
    "-": stdout); returns what to tell the user (the summary, and where it went)."""
    if output in (None, "-"):
        _write(capture, sys.stdout)
        return capture.summary()
    with open(output, "w", encoding="utf-8") as out:
        _write(capture, out)
    return f"{capture.summary()} -> {output}"


def _write(capture: Capture, out: TextIO) -> None:
    for line in capture.lines:
        out.write(json.dumps(line, separators=(", ", ": ")) + "\n")


class _Ids:
    """Block keys to Mooncake ids: 0, 1, 2, ... in order of first appearance."""

    def __init__(self) -> None:
        self._by_key: dict[str, int] = {}
        self._next = 0

    def fresh(self) -> int:
        self._next += 1
        return self._next - 1

    def of(self, key: str | None) -> int:
        if key is None:
            return self.fresh()
        found = self._by_key.get(key)
        if found is None:
            found = self._by_key[key] = self.fresh()
        return found


def _halves(export: Mapping[str, Any], kind: str) -> list[Mapping[str, Any]]:
    items = export.get(kind)
    if not isinstance(items, list) or not all(
        isinstance(h, dict) and isinstance(h.get("rid"), str) for h in items
    ):
        raise CaptureFormatError(f"{kind}: expected a list of records with a `rid`")
    return items


def _num(half: Mapping[str, Any] | None, key: str) -> float | None:
    if half is None:
        return None
    value = half.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000.0, 3)


def merge(exports: Iterable[Mapping[str, Any]], *, since: float | None = None) -> Capture:
    """The requests of every export (`CaptureStore.export`), joined by request, in arrival
    order, as trace lines; with `since` (wall clock, s), only requests that arrived then or
    later."""
    out = Capture()
    decisions: dict[str, Mapping[str, Any]] = {}
    outcomes: dict[str, Mapping[str, Any]] = {}
    pods: dict[str, Any] = {}
    gateway: Mapping[str, Any] | None = None
    models: list[Any] = []
    for export in exports:
        if not isinstance(export, Mapping) or export.get("format") != 1:
            raise CaptureFormatError("not a capture export (format 1)")
        out.processes.append(str(export.get("replica", "")))
        if gateway is None and isinstance(settings := export.get("gateway"), Mapping):
            gateway = settings
        if isinstance(rows := export.get("latency_models"), list):
            models += rows
        facts = export.get("pods")
        if isinstance(facts, Mapping):
            for address, fact in facts.items():
                if isinstance(address, str) and isinstance(fact, Mapping):
                    pods.setdefault(address, dict(fact))
        for half in _halves(export, "decisions"):
            decisions.setdefault(half["rid"], half)
        for half in _halves(export, "outcomes"):
            outcomes.setdefault(half["rid"], half)
    pairs: list[tuple[float, Mapping[str, Any] | None, Mapping[str, Any] | None]] = []
    for rid in sorted(decisions.keys() | outcomes.keys()):  # ties in arrival: one order
        d, o = decisions.get(rid), outcomes.get(rid)
        start = _num(o, "start")
        arrival = start if start is not None and start > 0 else _num(d, "at")
        if arrival is None or (since is not None and arrival < since):
            continue
        pairs.append((arrival, d, o))
    pairs.sort(key=lambda p: p[0])
    ids, fine = _Ids(), _Ids()
    for arrival, d, o in pairs:
        if d is not None and o is not None:
            out.joined += 1
        elif d is not None:
            out.decision_only += 1
        else:
            out.outcome_only += 1
        out.lines.append(_line(arrival, arrival - pairs[0][0], d, o, ids, fine))
    if out.lines and pods:
        # The pods' published cache config, once, on the first line (a key a Mooncake reader
        # ignores): what `extproc tune` sizes each pod's engine by.
        out.lines[0]["pods"] = {a: pods[a] for a in sorted(pods)}
    if out.lines and gateway is not None:
        # The gateway's settings a replay runs it under (one process's: every process of a
        # deployment runs the same config), once, on the first line.
        out.lines[0]["gateway"] = dict(gateway)
    if out.lines and (fullest := fullest_rows(models)):
        out.lines[0]["latency_models"] = fullest
    return out


def _line(
    arrival: float,
    offset_s: float,
    d: Mapping[str, Any] | None,
    o: Mapping[str, Any] | None,
    ids: _Ids,
    fine: _Ids,
) -> dict[str, Any]:
    first = d if d is not None else o
    assert first is not None
    prompt = int(_num(first, "prompt_tokens") or 0)
    input_length = max(1, prompt)  # the format has no empty prompt
    windows = math.ceil(input_length / WINDOW_TOKENS)
    per = WINDOW_TOKENS // FINE_TOKENS
    blocks = d.get("blocks") if d is not None else None
    if isinstance(blocks, list) and len(blocks) == math.ceil(input_length / FINE_TOKENS):
        keys = [b if isinstance(b, str) else None for b in blocks]
        fine_ids = [fine.of(k) for k in keys]
        # A 512-token window's hash: the last block hash inside it (its last fine window's
        # that has one).
        hash_ids = []
        for w in range(windows):
            inside = [k for k in keys[w * per : (w + 1) * per] if k is not None]
            hash_ids.append(ids.of(inside[-1] if inside else None))
        known = "hashed"
    else:
        hash_ids = [ids.fresh() for _ in range(windows)]
        fine_ids = [fine.fresh() for _ in range(math.ceil(input_length / FINE_TOKENS))]
        known = "none"
    output = _num(o, "output_tokens")
    output_tokens = None if output is None else int(output)
    return {
        "timestamp": round(offset_s * 1000.0),
        "input_length": input_length,
        # The format has no empty answer: a request that got none (an error, an embedding, a
        # client that left) is replayed as one token; `output_tokens` says what really came.
        "output_length": max(1, output_tokens or 0),
        "hash_ids": hash_ids,
        "fine_ids": fine_ids,
        "fine_tokens": FINE_TOKENS,
        "start_time": round(arrival, 6),
        "model": first.get("model"),
        "route": first.get("route") or None,
        "api": d.get("api") if d is not None else None,
        "user": first.get("user"),
        "tenant": d.get("tenant") if d is not None else None,
        "session": d.get("session") if d is not None else None,
        "session_answer": d.get("session_answer") if d is not None else None,
        "priority": d.get("priority") if d is not None else None,
        "max_tokens": d.get("max_tokens") if d is not None else None,
        "stream": first.get("stream"),
        "input_estimated": bool(first.get("estimated")),
        "tokenize_ms": _ms(_num(d, "tokenize_s")),
        "blocks": known,
        "endpoint": first.get("endpoint"),
        "served_by": o.get("served_by") if o is not None else None,
        "strategy": first.get("strategy"),
        "status": o.get("status") if o is not None else None,
        "outcome": o.get("outcome") if o is not None else None,
        "output_tokens": output_tokens,
        "output_counted": bool(o.get("counted")) if o is not None else None,
        "input_tokens": o.get("input_tokens") if o is not None else None,
        "cached_tokens": o.get("cached_tokens") if o is not None else None,
        "ttft_ms": _ms(_num(o, "ttft_s")),
        "tpot_ms": _ms(_num(o, "tpot_s")),
        "latency_ms": _ms(_num(o, "done_s")),
        "halves": "both"
        if d is not None and o is not None
        else ("decision" if o is None else "outcome"),
    }
