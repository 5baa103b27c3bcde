"""The capture's two recording steps (`extproc.capture` holds the rings; the composition root
lists these only with `capture.enabled`):

- `CaptureDecision`, a pre-request step: what the routing process knew (the prompt's length and
  the block hashes the rule already computed, never recomputed; `max_tokens`; the pick; the
  user, tenant and session (as sent, and as answered) as keyed hashes; never text);
- `CaptureOutcome`, a response-complete step: what the request's access record said, on
  whatever process received it (status, usage, TTFT, TPOT, the host that served it).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from extproc.capture import (
    FINE_TOKENS,
    CaptureStore,
    DecisionHalf,
    OutcomeHalf,
    pack_windows,
    prefix_windows,
)
from extproc.director.api import AccessRecord
from extproc.director.lifecycle import Completed, Outgoing, Placement, Request
from extproc.routing.base import Decision

__all__ = ["CaptureDecision", "CaptureOutcome", "outcome_half"]


class CaptureDecision:
    """Records each routed request's decision half (O(prompt windows): no hashing of blocks
    here, the ids' keyed hashes only)."""

    def __init__(
        self,
        store: CaptureStore,
        *,
        replica: str,
        session_header: str,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._replica = replica
        self._session_header = session_header  # set on `out` by the session step, run before
        self._wall = wall_clock

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        if req.dry_run:
            return
        keyed, attrs, prompt = self._store.keyed, req.attributes, req.prompt
        rid = keyed.id(req.request_id)
        if rid is None:
            return
        self._store.decided(
            DecisionHalf(
                rid=rid,
                at=self._wall(),
                model=req.runtime.name,
                route=req.head.route_name or "",
                api=str(req.parsed.kind),
                user=keyed.id(attrs.user),
                tenant=keyed.id(attrs.fairness_id),
                session=keyed.id(attrs.session),
                session_answer=keyed.id(out.set_headers.get(self._session_header)),
                priority=attrs.priority,
                prompt_tokens=prompt.tokens,
                estimated=prompt.estimated,
                tokenize_s=prompt.tokenize_s,
                max_tokens=req.parsed.max_tokens,
                stream=req.parsed.stream,
                endpoint=decision.endpoint.address,
                strategy=decision.strategy,
                windows=pack_windows(
                    prefix_windows(
                        prompt.hashes, req.runtime.block_size, prompt.tokens, FINE_TOKENS
                    )
                ),
                replica=self._replica,
            )
        )


def outcome_half(store: CaptureStore, done: Completed) -> OutcomeHalf | None:
    """The record's facts, ids keyed; None for a record without a request id."""
    record: AccessRecord = done.record
    routed, usage = done.routed, record.usage
    rid = store.keyed.id(record.request_id)
    if rid is None:
        return None
    first, last = record.first_token_s, record.upstream_done_s
    out = usage.completion_tokens
    tpot = None
    if first is not None and last is not None and out is not None and out > 1 and last >= first:
        tpot = (last - first) / (out - 1)
    return OutcomeHalf(
        rid=rid,
        start=record.start_time,
        model=routed.model,
        route=routed.route,
        user=store.keyed.id(routed.user),
        prompt_tokens=routed.prompt_tokens,
        estimated=routed.estimated,
        stream=routed.stream,
        endpoint=routed.endpoint,
        served_by=record.upstream,
        strategy=routed.strategy,
        status=done.status,
        outcome=str(record.outcome),
        attempts=record.attempts,
        input_tokens=usage.prompt_tokens,
        output_tokens=out,
        cached_tokens=usage.cached_tokens,
        counted=usage.counted,
        ttft_s=first,
        done_s=last,
        tpot_s=tpot,
        replica=routed.replica,
    )


class CaptureOutcome:
    """Records each routed request's outcome half, from its access record."""

    def __init__(self, store: CaptureStore) -> None:
        self._store = store

    def complete(self, done: Completed) -> None:
        half = outcome_half(self._store, done)
        if half is not None:
            self._store.completed(half)
