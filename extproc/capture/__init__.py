"""A capture of the operator's own traffic, for a replay (docs/operations.md, "Capture your
traffic").

A layer of its own, as tracing is: opt-in (`capture.enabled`), bounded (two rings per process,
`max_records` and `max_age_s`), private (no text; ids as keyed hashes, HMAC-SHA256). The
director records a request's decision where it routes it and its outcome where its access
record arrives (`extproc.director.capture`); `/debug/capture` exports a process's rings;
`extproc capture` and `kubectl extproc capture` fetch every process's and `merge` joins them
into one Mooncake-format trace. Knows nothing of Envoy, requests or routing.
"""

from __future__ import annotations

from extproc.capture.join import Capture, CaptureFormatError, merge, parse_since, write_capture
from extproc.capture.records import (
    FINE_TOKENS,
    NO_BLOCK,
    WINDOW_TOKENS,
    DecisionHalf,
    KeyedHash,
    OutcomeHalf,
    pack_windows,
    prefix_windows,
)
from extproc.capture.store import CAPTURE_FORMAT, CaptureStore

__all__ = [
    "CAPTURE_FORMAT",
    "FINE_TOKENS",
    "NO_BLOCK",
    "WINDOW_TOKENS",
    "Capture",
    "CaptureFormatError",
    "CaptureStore",
    "DecisionHalf",
    "KeyedHash",
    "OutcomeHalf",
    "merge",
    "pack_windows",
    "parse_since",
    "prefix_windows",
    "write_capture",
]
