"""The two halves of a request's accounting, which may run on different processes.

- `Ticket`: what the routing decision claimed (an in-flight lease, the user's active count),
  held by the routing stream and released when that stream ends, on the process that
  routed the request, exactly once.
- `RecordAccounting`: what the response was, from the request's access-log record, on
  whatever process Envoy sent the record to: status, tokens, fairness charges, per-pod
  latency and throughput, stall detection's answers. Every input it needs is in the record.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.accounting.inflight import InflightTracker, Lease
from extproc.accounting.podstats import PodStatsTracker
from extproc.director.api import AccessRecord, Outcome, RoutedRequest
from extproc.types import TokenUsage

__all__ = ["CLIENT_CLOSED_STATUS", "RecordAccounting", "Ticket"]

log = logging.getLogger("extproc.accounting")

CLIENT_CLOSED_STATUS = 499  # the client went away before the response ended (nginx's code)


class Ticket:
    """Implements `extproc.director.api.RequestTicket`."""

    __slots__ = ("_closed", "_fairness", "_lease", "_metrics", "_model", "_user")

    def __init__(
        self,
        lease: Lease,
        *,
        user: str | None,
        model: str,
        fairness: FairnessCounters,
        metrics: GatewayMetrics,
    ) -> None:
        self._lease = lease
        self._user = user
        self._model = model
        self._fairness = fairness
        self._metrics = metrics
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lease.finish()
        if self._user:
            self._fairness.request_finished(self._user)
        self._metrics.child(self._metrics.routed_requests, self._model).inc()


class RecordAccounting:
    """Accounts access-log records. `account` never raises for any record."""

    def __init__(
        self,
        *,
        metrics: GatewayMetrics,
        fairness: FairnessCounters,
        podstats: PodStatsTracker,
        inflight: InflightTracker,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._metrics = metrics
        self._fairness = fairness
        self._podstats = podstats
        self._inflight = inflight
        self._clock = clock
        self._wall = wall_clock

    def account(self, record: AccessRecord) -> None:
        routed = record.routed
        if routed is None:
            # Rejected by the gateway (counted when it answered) or accounting off for its route.
            self._metrics.child(self._metrics.access_records, "unrouted").inc()
            return
        self._metrics.child(self._metrics.access_records, "accounted").inc()
        model = routed.model
        endpoint = record.upstream or routed.endpoint
        status = record.status
        if record.outcome is Outcome.CLIENT_ABORTED:
            status = CLIENT_CLOSED_STATUS
        if record.outcome is not Outcome.COMPLETE:
            self._metrics.child(self._metrics.aborted_responses, model, record.outcome.value).inc()
        self._metrics.observe_request(model, status or 502, routed.strategy)
        usage = record.usage
        if usage.counted:
            self._metrics.child(self._metrics.usage_counted, model).inc()
        if usage.prompt_tokens is None and usage.completion_tokens is None:
            if record.outcome is Outcome.COMPLETE and 200 <= status < 300:
                self._metrics.child(self._metrics.usage_unknown, model).inc()
        else:
            self._metrics.observe_usage(model, endpoint, usage)
        self._charge_user(routed, usage)
        self._pod_samples(record, model, endpoint, usage, ok=200 <= status < 400)

    def _charge_user(self, routed: RoutedRequest, usage: TokenUsage) -> None:
        if not routed.user:
            return
        prompt = usage.prompt_tokens if usage.prompt_tokens is not None else routed.prompt_tokens
        # The gateway's prompt count was charged at admission; correct it with the engine's.
        self._fairness.charge(
            routed.user,
            input_tokens=max(0, prompt - routed.prompt_tokens),
            output_tokens=usage.completion_tokens or 0,
        )

    def _pod_samples(
        self, record: AccessRecord, model: str, endpoint: str, usage: TokenUsage, *, ok: bool
    ) -> None:
        now = self._clock()
        done = record.upstream_done_s
        if done is not None and record.start_time > 0:
            # Wall-clock time of the last upstream byte, on this tracker's monotonic clock.
            ago = max(0.0, self._wall() - (record.start_time + done))
            self._inflight.answered(endpoint, now - ago)
        if not ok or record.outcome is not Outcome.COMPLETE:
            return
        sent = record.upstream_sent_s
        ttft = latency = decode = None
        if sent is not None:
            if done is not None:
                latency = done - sent
            if record.first_token_s is not None:
                ttft = record.first_token_s - sent
                if done is not None:
                    decode = done - record.first_token_s
        if ttft is not None:
            self._metrics.observe_ttft(model, max(0.0, ttft))
        self._podstats.observe_response(
            endpoint,
            now=now,
            latency_s=latency,
            ttft_s=ttft,
            decode_s=decode,
            tokens=usage.total_tokens or usage.completion_tokens,
            completion_tokens=usage.completion_tokens,
        )
