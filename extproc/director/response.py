"""The two halves of a request's accounting, which may run on different processes.

- the ticket (`leases.py`): what the routing decision claimed (an in-flight lease, the user's
  active count), held in the routing process's lease book until the request's record ends it;
- `RecordAccounting`: what the response was, from the request's access-log record, on
  whatever process Envoy sent the record to. It runs the response-complete steps
  (`CountResponse`: status and tokens; `ChargeUser`: fairness charges; `PodSamples`: per-pod
  latency and throughput, stall detection's answers). Every input they need is in the record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.accounting.inflight import InflightTracker
from extproc.accounting.podstats import PodStatsTracker
from extproc.director.api import AccessRecord, Outcome
from extproc.director.lifecycle import Completed, ResponseCompleteStep

__all__ = [
    "CLIENT_CLOSED_STATUS",
    "ChargeUser",
    "CountResponse",
    "PodSamples",
    "RecordAccounting",
]

log = logging.getLogger("extproc.accounting")

CLIENT_CLOSED_STATUS = 499  # the client went away before the response ended (nginx's code)


class RecordAccounting:
    """Accounts access-log records: runs the response-complete steps (the composition root
    lists them: `CountResponse`, `ChargeUser`, `PodSamples`, then the latency models') on each
    routed request's record. `account` never raises for any record."""

    def __init__(self, steps: Sequence[ResponseCompleteStep], *, metrics: GatewayMetrics) -> None:
        self._steps = tuple(steps)
        self._metrics = metrics

    def account(self, record: AccessRecord) -> None:
        routed = record.routed
        if routed is None:
            # Rejected by the gateway (counted when it answered) or accounting off for its route.
            self._metrics.child(self._metrics.access_records, "unrouted").inc()
            return
        self._metrics.child(self._metrics.access_records, "accounted").inc()
        status = record.status
        if record.outcome is Outcome.CLIENT_ABORTED:
            status = CLIENT_CLOSED_STATUS
        done = Completed(record, routed, endpoint=record.upstream or routed.endpoint, status=status)
        for step in self._steps:
            step.complete(done)


class CountResponse:
    """Requests by status and strategy, aborted responses, tokens (or their absence)."""

    def __init__(self, metrics: GatewayMetrics) -> None:
        self._metrics = metrics

    def complete(self, done: Completed) -> None:
        m, record, model = self._metrics, done.record, done.routed.model
        if record.outcome is not Outcome.COMPLETE:
            m.child(m.aborted_responses, model, record.outcome.value).inc()
        m.observe_request(model, done.status or 502, done.routed.strategy)
        usage = record.usage
        if usage.counted:
            m.child(m.usage_counted, model).inc()
        if usage.prompt_tokens is None and usage.completion_tokens is None:
            if record.outcome is Outcome.COMPLETE and 200 <= done.status < 300:
                m.child(m.usage_unknown, model).inc()
        else:
            m.observe_usage(model, done.endpoint, usage)


class ChargeUser:
    """The user's fair-share charge: output tokens, and the engine's correction of the
    gateway's prompt count (charged at admission)."""

    def __init__(self, fairness: FairnessCounters) -> None:
        self._fairness = fairness

    def complete(self, done: Completed) -> None:
        routed, usage = done.routed, done.record.usage
        if not routed.user:
            return
        prompt = usage.prompt_tokens if usage.prompt_tokens is not None else routed.prompt_tokens
        self._fairness.charge(
            routed.user,
            input_tokens=max(0, prompt - routed.prompt_tokens),
            output_tokens=usage.completion_tokens or 0,
        )


class PodSamples:
    """Per-pod facts from the record: when the pod last answered (stall detection), whether
    the pick served it (failing pods), and on a complete success its TTFT, latency and
    throughput samples."""

    def __init__(
        self,
        *,
        metrics: GatewayMetrics,
        podstats: PodStatsTracker,
        inflight: InflightTracker,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._metrics = metrics
        self._podstats = podstats
        self._inflight = inflight
        self._clock = clock
        self._wall = wall_clock

    def complete(self, done: Completed) -> None:
        record, endpoint, usage = done.record, done.endpoint, done.record.usage
        now = self._clock()
        pick = done.routed.endpoint
        if record.outcome is not Outcome.CLIENT_ABORTED:
            if (endpoint != pick and record.attempts > 1) or (
                endpoint == pick and done.status >= 500
            ):
                self._inflight.pick_failed(pick, now)  # Envoy retried it elsewhere, or a 5xx
            elif endpoint == pick and 200 <= done.status < 500:
                self._inflight.pick_served(pick)
        last = record.upstream_done_s
        if last is not None and record.start_time > 0:
            # Wall-clock time of the last upstream byte, on this tracker's monotonic clock.
            ago = max(0.0, self._wall() - (record.start_time + last))
            self._inflight.answered(endpoint, now - ago)
        if not 200 <= done.status < 400 or record.outcome is not Outcome.COMPLETE:
            return
        sent = record.upstream_sent_s
        if sent is not None and record.received_s is not None:
            self._metrics.observe_hold(done.routed.model, max(0.0, sent - record.received_s))
        ttft = latency = decode = None
        if sent is not None:
            if last is not None:
                latency = last - sent
            if record.first_token_s is not None:
                ttft = record.first_token_s - sent
                if last is not None:
                    decode = last - record.first_token_s
        if ttft is not None:
            self._metrics.observe_ttft(done.routed.model, max(0.0, ttft))
        self._podstats.observe_response(
            endpoint,
            now=now,
            latency_s=latency,
            ttft_s=ttft,
            decode_s=decode,
            tokens=usage.total_tokens or usage.completion_tokens,
            completion_tokens=usage.completion_tokens,
        )
