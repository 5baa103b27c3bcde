"""Access-log records as Envoy would send them for a routed request (test builder)."""

from __future__ import annotations

import time

from extproc.director.api import AccessRecord, Outcome, RouteResult
from extproc.types import TokenUsage


def record_for(
    result: RouteResult,
    *,
    status: int = 200,
    usage: TokenUsage | None = None,
    outcome: Outcome = Outcome.COMPLETE,
    started_ago_s: float = 0.5,
    first_token_s: float | None = 0.1,
    done_s: float | None = 0.4,
    upstream: str | None = None,
    wall_now: float | None = None,
) -> AccessRecord:
    """The record of `result`'s request: it started `started_ago_s` before `wall_now` (the
    wall clock, default the real one), was sent upstream 1 ms after, got its first token and
    its last byte at the given offsets."""
    return AccessRecord(
        request_id="r",
        status=status,
        outcome=outcome,
        routed=result.routed,
        upstream=upstream or result.destinations[0],
        usage=usage if usage is not None else TokenUsage(9, 4, 0),
        start_time=(time.time() if wall_now is None else wall_now) - started_ago_s,
        upstream_sent_s=0.001,
        upstream_first_byte_s=0.002 if status else None,
        first_token_s=first_token_s,
        upstream_done_s=done_s,
        attempts=1,
        lease=result.ticket.key if result.ticket is not None else None,
    )
