"""The gateway's own Prometheus metrics, all on one injected CollectorRegistry.

Labels stay bounded, whatever clients send: `model` is a configured model name (a request
for any other is a 404, counted with model ""), `endpoint` an address from discovery (series
of removed endpoints are dropped by `forget_endpoint`), `status` an HTTP status code,
`strategy` a registered strategy or configured profile name, or "adhoc" for every weighted
spec a client writes in the `routing-strategy` header (`strategy_label`), `kind` hf|estimate,
`result` one of SCRAPE_RESULTS, `plugin` a registered plugin type name. Users and session ids
are never labels.
"""

from __future__ import annotations

import contextlib
from typing import Any, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from extproc.metrics.poller import SCRAPE_RESULTS
from extproc.metrics.store import EndpointStore
from extproc.routing.base import PluginTiming
from extproc.routing.registry import ADHOC_STRATEGY
from extproc.types import Endpoint, TokenUsage

ShedReason = Literal["overloaded", "saturated", "slo"]  # the `reason` label: bounded

__all__ = ["DECISION_BUCKETS", "GatewayMetrics", "strategy_label"]


def strategy_label(strategy: str) -> str:
    """The `strategy` label of a strategy name or `routing-strategy` value: a strategy or
    profile name keeps it (the config bounds them: neither may contain ',' or ':'), an ad hoc
    weighted spec (`least-request:1,random:0.3`, a client's free text) is "adhoc"."""
    name = strategy.strip()
    return ADHOC_STRATEGY if "," in name or ":" in name else name


# Routing decisions take tens of microseconds to a few milliseconds: fine below 1 ms.
DECISION_BUCKETS = (
    0.00005, 0.0001, 0.0002, 0.0003, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003,
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
# One filter, scorer or picker takes a microsecond to tens of microseconds at 64 pods.
PLUGIN_BUCKETS = (
    0.000001, 0.0000025, 0.000005, 0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.01,
)  # fmt: skip
PREFIX_TOKEN_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, *, namespace: str = "extproc") -> None:
        self.registry = registry
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._ready_last: dict[tuple[str, str], bool] = {}  # what the ready gauges say
        self._stalled_last: frozenset[str] = frozenset()
        ns = namespace
        self.prompt_tokens = Counter(
            "prompt_tokens", "Prompt tokens reported by engines", ["model", "endpoint"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.completion_tokens = Counter(
            "completion_tokens", "Completion tokens reported or counted", ["model", "endpoint"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.cached_tokens = Counter(
            "cached_tokens", "Prompt tokens served from the engine's prefix cache",
            ["model", "endpoint"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.usage_unknown = Counter(
            "usage_unknown", "Responses whose token usage could not be determined", ["model"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.usage_counted = Counter(
            "usage_counted", "Responses without the engine's usage whose completion tokens were "
            "counted from content events (an estimate)", ["model"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.routed_requests = Counter(
            "routed_requests", "Routed requests whose lease ended on this process "
            "(sum over processes minus accounted access records = records lost)", ["model"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.lease_ends = Counter(
            "lease_ends", "In-flight leases by how they ended: record (its access record, here), "
            "peer (its record reached another process, which told this one over the bus), "
            "expired (no record within the bound), undelivered (the routing answer never "
            "reached Envoy), stream (held stream ended: no access log), handed_off (to a peer "
            "at shutdown)", ["how"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.access_records = Counter(
            "access_records", "Access-log records received, by result (accounted: a routed "
            "request; unrouted: rejected by the gateway or accounting off)", ["result"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.aborted_responses = Counter(
            "aborted_responses", "Responses that did not complete, by outcome "
            "(client_aborted, upstream_failed)", ["model", "outcome"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.requests = Counter(
            "requests", "Requests by final HTTP status and routing strategy",
            ["model", "status", "strategy"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.decision_seconds = Histogram(
            "routing_decision_seconds", "Last request byte in to routing answer out",
            ["strategy"], buckets=DECISION_BUCKETS, namespace=ns, registry=registry,
        )  # fmt: skip
        self.plugin_seconds = Histogram(
            "routing_plugin_seconds", "Time one routing plugin took in a decision, by kind "
            "(filter, scorer, picker, strategy) and type name",
            ["kind", "plugin"], buckets=PLUGIN_BUCKETS, namespace=ns, registry=registry,
        )  # fmt: skip
        self.tokenization_seconds = Histogram(
            "tokenization_seconds", "Prompt tokenization time", ["kind"],
            buckets=DECISION_BUCKETS, namespace=ns, registry=registry,
        )  # fmt: skip
        self.tokenizer_estimates = Counter(
            "tokenizer_estimate", "Requests whose prompt tokens were estimated, not tokenized",
            ["model"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.in_flight = Gauge(
            "in_flight_requests", "Requests routed and not yet finished", ["endpoint"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.endpoint_stalled = Gauge(
            "endpoint_stalled",
            "1 while the endpoint holds a request past routing.hang_after_s with no progress "
            "in its scrapes or answers for as long, or unanswered past routing.stall_after_s "
            "with nothing answered for as long (left out of the candidates)",
            ["endpoint"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.endpoint_ready = Gauge(
            "endpoint_ready", "1 when the endpoint is routable (fresh metrics)",
            ["model", "endpoint"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.scrapes = Counter(
            "metrics_scrapes", "Engine /metrics scrapes by result", ["endpoint", "result"],
            namespace=ns, registry=registry,
        )  # fmt: skip
        self.request_hold_seconds = Histogram(
            "request_hold_seconds",
            "Envoy held the request for the gateway: its last byte received to the first sent "
            "upstream (the ext_proc hop with the decision, and the upstream connect)",
            ["model"], buckets=DECISION_BUCKETS, namespace=ns, registry=registry,
        )  # fmt: skip
        self.upstream_ttft_seconds = Histogram(
            "upstream_ttft_seconds", "Request sent upstream to first content token", ["model"],
            buckets=TTFT_BUCKETS, namespace=ns, registry=registry,
        )  # fmt: skip
        self.prefix_match_tokens = Histogram(
            "prefix_match_tokens", "Cached prefix length on the chosen endpoint",
            ["model", "exact"], buckets=PREFIX_TOKEN_BUCKETS, namespace=ns, registry=registry,
        )  # fmt: skip
        self.shed = Counter(
            "shed_requests", "Requests refused with 429 before routing, by reason: "
            "overloaded (server.max_pending_requests), saturated (a sheddable request, every "
            "pod over its thresholds), slo (a sheddable request no pod is predicted to serve "
            "within its SLO headers)", ["model", "reason"], namespace=ns, registry=registry,
        )  # fmt: skip
        # llm-d's model_rewrite_decisions_total; no requested-model label: with a catch-all
        # rule that would be whatever clients send (unbounded).
        self.model_rewrites = Counter(
            "model_rewrite_decisions", "Requests a model rewrite sent to a target, by rewrite "
            "(the resource's name, or route-model-map) and target model",
            ["rewrite", "target"], namespace=ns, registry=registry,
        )  # fmt: skip
        self.pd_fallbacks = Counter(
            "pd_fallbacks", "pd requests served by a decode pod without a prefill pod",
            ["model"], namespace=ns, registry=registry,
        )  # fmt: skip

    def child(self, metric: Any, *labels: str) -> Any:
        """`metric.labels(*labels)`, cached: prometheus_client's `labels()` costs ~10 µs
        (validation, locking) and every per-request and per-scrape update goes through here.
        The cache holds only label values the module's bounds allow (see above); a removed
        endpoint's children go with `forget_endpoint`."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def observe_usage(self, model: str, endpoint: str, usage: TokenUsage) -> None:
        """Count a response's tokens; unknown counts are counted as unknown, never as 0."""
        if usage.prompt_tokens is not None:
            self.child(self.prompt_tokens, model, endpoint).inc(usage.prompt_tokens)
        if usage.completion_tokens is not None:
            self.child(self.completion_tokens, model, endpoint).inc(usage.completion_tokens)
        if usage.cached_tokens is not None:
            self.child(self.cached_tokens, model, endpoint).inc(usage.cached_tokens)
        if usage.prompt_tokens is None or usage.completion_tokens is None:
            self.child(self.usage_unknown, model).inc()

    def observe_request(self, model: str, status: int, strategy: str) -> None:
        self.child(self.requests, model, str(status), strategy_label(strategy)).inc()

    def observe_decision(self, strategy: str, seconds: float) -> None:
        self.child(self.decision_seconds, strategy_label(strategy)).observe(seconds)

    def observe_plugins(self, timings: tuple[PluginTiming, ...]) -> None:
        """Each plugin's time in one decision (`Decision.timings`), labelled by type name."""
        for ref, ns in timings:
            self.child(self.plugin_seconds, ref.kind, ref.type_name).observe(ns / 1e9)

    def observe_tokenization(self, kind: str, seconds: float) -> None:
        self.child(self.tokenization_seconds, kind).observe(seconds)

    def observe_estimate(self, model: str) -> None:
        self.child(self.tokenizer_estimates, model).inc()

    def observe_hold(self, model: str, seconds: float) -> None:
        self.child(self.request_hold_seconds, model).observe(seconds)

    def observe_ttft(self, model: str, seconds: float) -> None:
        self.child(self.upstream_ttft_seconds, model).observe(seconds)

    def observe_prefix_match(self, model: str, tokens: int, *, exact: bool) -> None:
        self.child(self.prefix_match_tokens, model, "true" if exact else "false").observe(tokens)

    def observe_shed(self, model: str, reason: ShedReason) -> None:
        self.child(self.shed, model, reason).inc()

    def observe_rewrite(self, rewrite: str, target: str) -> None:
        self.child(self.model_rewrites, rewrite, target).inc()

    def observe_pd_fallback(self, model: str) -> None:
        self.child(self.pd_fallbacks, model).inc()

    def set_in_flight(self, endpoint: str, count: int) -> None:
        self.child(self.in_flight, endpoint).set(count)

    def set_stalled(self, endpoint: str, stalled: bool) -> None:
        """A series only while the endpoint is stalled (1): a thousand pods would otherwise
        export a thousand zeros. `max by (endpoint) (...) == 1` reads it the same."""
        if stalled:
            self.endpoint_stalled.labels(endpoint).set(1)
        else:
            _remove(self.endpoint_stalled, endpoint)

    def set_ready(self, model: str, endpoint: str, ready: bool) -> None:
        self.child(self.endpoint_ready, model, endpoint).set(1 if ready else 0)

    def refresh_ready(self, store: EndpointStore, now: float) -> None:
        """Set the ready gauge of every endpoint in `store` (call after each poll); only the
        ones that changed are written (a thousand endpoints five times a second cost 4 ms a
        pass when every gauge was set)."""
        seen: dict[tuple[str, str], bool] = {}
        last = self._ready_last
        for model in store.models():
            ready = {ep.address for ep, _ in store.ready(model, now)}
            for ep in store.endpoints(model):
                key = (model, ep.address)
                value = seen[key] = ep.address in ready
                if last.get(key) is not value:
                    self.set_ready(model, ep.address, value)
        gone = [key for key in last if key not in seen]
        if gone:  # endpoints discovery removed: their series go too (bounded by the fleet)
            live = {address for _, address in seen}
            for model, address in gone:
                if address in live:  # still serving another model: only this gauge goes
                    _remove(self.endpoint_ready, model, address)
                else:
                    self.forget_endpoint(model, address)
        self._ready_last = seen

    def refresh_stalled(self, stalled: frozenset[str]) -> None:
        """The stalled endpoints now (`InflightTracker.stalled_addresses`): a series for each,
        none for the others."""
        for address in stalled - self._stalled_last:
            self.set_stalled(address, True)
        for address in self._stalled_last - stalled:
            self.set_stalled(address, False)
        self._stalled_last = stalled

    def scrape_result(self, endpoint: Endpoint, result: str) -> None:
        """`extproc.metrics.ScrapeObserver`: one scrape's outcome."""
        self.child(self.scrapes, endpoint.address, result).inc()

    def forget_endpoint(self, model: str, endpoint: str) -> None:
        """Drop an endpoint's series after discovery removed it (bounded cardinality)."""
        self._children.clear()  # removed children must not keep receiving counts
        for metric in (self.prompt_tokens, self.completion_tokens, self.cached_tokens):
            _remove(metric, model, endpoint)
        _remove(self.endpoint_ready, model, endpoint)
        _remove(self.in_flight, endpoint)
        _remove(self.endpoint_stalled, endpoint)
        for result in SCRAPE_RESULTS:
            _remove(self.scrapes, endpoint, result)

    def render(self) -> bytes:
        """The exposition text of the registry (for the metrics HTTP handler)."""
        data: bytes = generate_latest(self.registry)
        return data


def _remove(metric: Counter | Gauge, *labels: str) -> None:
    with contextlib.suppress(KeyError):  # the series was never created
        metric.remove(*labels)
