"""Token accounting of one response; ends the request's in-flight lease exactly once."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.accounting.inflight import Lease
from extproc.protocol.usage import StreamUsageAccumulator
from extproc.types import TokenUsage

__all__ = ["MAX_JSON_BYTES", "ResponseAccounting"]

log = logging.getLogger("extproc.accounting")

MAX_JSON_BYTES = 4 * 1024 * 1024  # a non-streamed body larger than this is not parsed for usage


class ResponseAccounting:
    """Implements `extproc.director.api.ResponseObserver`."""

    def __init__(
        self,
        *,
        request_id: str,
        model: str,
        endpoint: str,
        strategy: str,
        stream: bool,
        lease: Lease,
        user: str | None,
        prompt_tokens_estimate: int,
        metrics: GatewayMetrics,
        fairness: FairnessCounters,
        on_done: Callable[[str], None],
        clock: Callable[[], float],
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.endpoint = endpoint
        self.strategy = strategy
        self._stream = stream
        self._lease = lease
        self._user = user
        self._prompt_estimate = prompt_tokens_estimate
        self._metrics = metrics
        self._fairness = fairness
        self._on_done = on_done
        self._clock = clock
        self.started_at = clock()
        self.last_activity = self.started_at
        self.status = 0
        self._body = StreamUsageAccumulator(clock=clock, max_json_bytes=MAX_JSON_BYTES)
        self._first_byte_seen = False
        self.usage: TokenUsage | None = None
        self.attached = False  # a response (observability) stream has claimed this request

    def rebind(self, on_done: Callable[[str], None]) -> None:
        self._on_done = on_done

    def on_headers(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        self.last_activity = self._clock()

    def on_body(self, chunk: bytes, end_of_stream: bool) -> None:
        self.last_activity = self._clock()
        if chunk and not self._first_byte_seen:
            self._first_byte_seen = True
            self._lease.first_byte()
            self._metrics.observe_ttft(self.model, self._clock() - self.started_at)
        self._body.feed(chunk)

    def finish(self, *, complete: bool) -> Mapping[str, float]:
        if self.usage is not None or self._lease.finished:
            return {}
        usage = self._body.finish()
        self.usage = usage
        ok = complete and 200 <= self.status < 400
        self._lease.finish(usage, success=ok)
        self._metrics.observe_request(self.model, self.status or 499, self.strategy)
        if usage.prompt_tokens is None and usage.completion_tokens is None:
            if self.status == 200:
                self._metrics.usage_unknown.labels(self.model).inc()
        else:
            self._metrics.observe_usage(self.model, self.endpoint, usage)
        if self._user:
            prompt = usage.prompt_tokens if usage.prompt_tokens is not None else 0
            # The prompt estimate was charged at admission; correct it with the engine's count.
            self._fairness.charge(self._user, input_tokens=max(0, prompt - self._prompt_estimate))
            self._fairness.request_finished(self._user, usage.completion_tokens or 0)
        self._on_done(self.request_id)
        if not ok or usage.prompt_tokens is None or usage.completion_tokens is None:
            return {}
        meta = {
            "llm_input_token": float(usage.prompt_tokens),
            "llm_output_token": float(usage.completion_tokens),
            "llm_total_token": float(usage.prompt_tokens + usage.completion_tokens),
        }
        if usage.cached_tokens is not None:
            meta["llm_cached_input_token"] = float(usage.cached_tokens)
        return meta
