"""GatewayMetrics on an injected registry: values, unknown usage, bounded series."""

from __future__ import annotations

import random

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from extproc.accounting import DECISION_BUCKETS, GatewayMetrics
from extproc.metrics import EndpointStore, MetricsPoller
from extproc.routing import PodState, RoutingRequest, Snapshot, default_registry
from extproc.types import Endpoint, EngineMetrics, TokenUsage

EP = "10.0.0.1:8000"


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def gm(registry: CollectorRegistry) -> GatewayMetrics:
    return GatewayMetrics(registry)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    return registry.get_sample_value(name, labels)


def test_usage_counters(registry: CollectorRegistry, gm: GatewayMetrics) -> None:
    gm.observe_usage("m", EP, TokenUsage(prompt_tokens=100, completion_tokens=20, cached_tokens=64))
    gm.observe_usage("m", EP, TokenUsage(prompt_tokens=10, completion_tokens=5, cached_tokens=0))
    labels = {"model": "m", "endpoint": EP}
    assert value(registry, "extproc_prompt_tokens_total", **labels) == 110
    assert value(registry, "extproc_completion_tokens_total", **labels) == 25
    assert value(registry, "extproc_cached_tokens_total", **labels) == 64
    assert value(registry, "extproc_usage_unknown_total", model="m") is None


def test_unknown_usage_is_not_counted_as_zero(
    registry: CollectorRegistry, gm: GatewayMetrics
) -> None:
    gm.observe_usage("m", EP, TokenUsage(completion_tokens=3, counted=True))
    assert value(registry, "extproc_prompt_tokens_total", model="m", endpoint=EP) is None
    assert value(registry, "extproc_completion_tokens_total", model="m", endpoint=EP) == 3
    assert value(registry, "extproc_usage_unknown_total", model="m") == 1


def test_plugin_latency_by_kind_and_type(registry: CollectorRegistry, gm: GatewayMetrics) -> None:
    # A real decision's timings: the profile times each scorer and its picker.
    profile = default_registry().resolve("gaie")
    pods = tuple(
        PodState(endpoint=Endpoint(address=a, model="m"), metrics=None)
        for a in (EP, "10.0.0.2:8000")
    )
    d = profile.route(RoutingRequest("r", "m"), Snapshot(now=0.0, pods=pods), random.Random(0))
    gm.observe_plugins(d.timings)
    gm.observe_plugins(d.timings)
    name = "extproc_routing_plugin_seconds"
    for scorer in ("queue", "kv-cache-utilization", "prefix"):
        assert value(registry, f"{name}_count", kind="scorer", plugin=scorer) == 2
    assert value(registry, f"{name}_count", kind="picker", plugin="max-score") == 2
    total = sum(ns for _, ns in d.timings) * 2 / 1e9
    summed = sum(
        value(registry, f"{name}_sum", kind=r.kind, plugin=r.type_name) or 0.0
        for r in {r for r, _ in d.timings}
    )
    assert summed == pytest.approx(total)


def test_requests_and_histograms(registry: CollectorRegistry, gm: GatewayMetrics) -> None:
    gm.observe_request("m", 200, "least-request")
    gm.observe_request("m", 200, "least-request")
    gm.observe_request("m", 503, "least-request")
    assert (
        value(registry, "extproc_requests_total", model="m", status="200", strategy="least-request")
        == 2
    )
    gm.observe_decision("random", 0.00004)
    gm.observe_decision("random", 0.0004)
    name = "extproc_routing_decision_seconds_bucket"
    assert value(registry, name, strategy="random", le="5e-05") == 1
    assert value(registry, name, strategy="random", le="0.0005") == 2
    assert sum(1 for b in DECISION_BUCKETS if b < 0.001) >= 5  # fine resolution below 1 ms
    gm.observe_tokenization("hf", 0.002)
    gm.observe_tokenization("estimate", 0.00001)
    assert value(registry, "extproc_tokenization_seconds_count", kind="hf") == 1
    gm.observe_estimate("m")
    gm.observe_ttft("m", 0.3)
    gm.observe_prefix_match("m", 512, exact=True)
    gm.observe_shed("m", "slo")
    gm.observe_pd_fallback("m")
    assert value(registry, "extproc_tokenizer_estimate_total", model="m") == 1
    assert value(registry, "extproc_upstream_ttft_seconds_sum", model="m") == pytest.approx(0.3)
    assert (
        value(registry, "extproc_prefix_match_tokens_bucket", model="m", exact="true", le="512.0")
        == 1
    )
    assert value(registry, "extproc_shed_requests_total", model="m", reason="slo") == 1
    assert value(registry, "extproc_pd_fallbacks_total", model="m") == 1


def test_forget_endpoint_drops_its_series(registry: CollectorRegistry, gm: GatewayMetrics) -> None:
    ep = Endpoint(EP, "m")
    gm.observe_usage("m", EP, TokenUsage(prompt_tokens=1, completion_tokens=1))
    gm.set_ready("m", EP, True)
    gm.set_in_flight(EP, 2)
    gm.scrape_result(ep, "ok")
    gm.scrape_result(ep, "timeout")
    assert EP in gm.render().decode()
    gm.forget_endpoint("m", EP)
    gm.forget_endpoint("m", EP)  # twice: no error
    assert EP not in gm.render().decode()


def test_cached_children_follow_a_forgotten_endpoint(
    registry: CollectorRegistry, gm: GatewayMetrics
) -> None:
    """Every per-request and per-scrape update goes through cached label children: after
    forget_endpoint the next update must create a live series again, not write to a child
    the registry no longer holds."""
    ep = Endpoint(EP, "m")
    gm.set_in_flight(EP, 3)
    gm.set_ready("m", EP, True)
    gm.set_stalled(EP, True)
    gm.scrape_result(ep, "ok")
    gm.observe_tokenization("skipped", 0.0)
    gm.observe_shed("m", "overloaded")
    gm.forget_endpoint("m", EP)
    gm.set_in_flight(EP, 1)
    gm.set_ready("m", EP, False)
    gm.scrape_result(ep, "ok")
    assert value(registry, "extproc_in_flight_requests", endpoint=EP) == 1
    assert value(registry, "extproc_endpoint_ready", model="m", endpoint=EP) == 0
    assert value(registry, "extproc_metrics_scrapes_total", endpoint=EP, result="ok") == 1
    assert value(registry, "extproc_endpoint_stalled", endpoint=EP) is None
    gm.observe_tokenization("skipped", 0.0)
    gm.observe_shed("m", "overloaded")
    assert value(registry, "extproc_tokenization_seconds_count", kind="skipped") == 2
    assert value(registry, "extproc_shed_requests_total", model="m", reason="overloaded") == 2


def test_render_is_valid_exposition(gm: GatewayMetrics) -> None:
    gm.observe_request("m", 200, "random")
    families = {f.name for f in text_string_to_metric_families(gm.render().decode())}
    assert "extproc_requests" in families
    assert "extproc_routing_decision_seconds" in families


def test_separate_registries_do_not_collide() -> None:
    a, b = CollectorRegistry(), CollectorRegistry()
    GatewayMetrics(a).observe_shed("m", "saturated")
    GatewayMetrics(b)
    labels = {"model": "m", "reason": "saturated"}
    assert a.get_sample_value("extproc_shed_requests_total", labels) == 1
    assert b.get_sample_value("extproc_shed_requests_total", labels) is None


async def test_is_the_pollers_scrape_observer(
    registry: CollectorRegistry, gm: GatewayMetrics
) -> None:
    ok = Endpoint("10.0.0.1:8000", "m", metrics_url="http://10.0.0.1:8000/metrics")
    bad = Endpoint("10.0.0.2:8000", "m", metrics_url="http://10.0.0.2:8000/metrics")

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "10.0.0.1":
            return httpx.Response(200, text="vllm:num_requests_running 1\n")
        return httpx.Response(503)

    store = EndpointStore(stale_after=5.0)
    store.set_endpoints({"m": [ok, bad]})
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        poller = MetricsPoller(store, client, observer=gm)
        await poller.poll_once()
        await poller.poll_once()
    assert value(registry, "extproc_metrics_scrapes_total", endpoint=ok.address, result="ok") == 2
    assert (
        value(registry, "extproc_metrics_scrapes_total", endpoint=bad.address, result="http_error")
        == 2
    )


def test_refresh_ready(registry: CollectorRegistry, gm: GatewayMetrics) -> None:
    fresh = Endpoint("10.0.0.1:8000", "m", metrics_url="http://10.0.0.1:8000/metrics")
    never = Endpoint("10.0.0.2:8000", "m", metrics_url="http://10.0.0.2:8000/metrics")
    store = EndpointStore(stale_after=5.0, clock=lambda: 10.0)
    store.set_endpoints({"m": [fresh, never]})
    store.record_success(fresh, EngineMetrics(updated_at=10.0))
    gm.refresh_ready(store, 10.0)
    assert value(registry, "extproc_endpoint_ready", model="m", endpoint=fresh.address) == 1
    assert value(registry, "extproc_endpoint_ready", model="m", endpoint=never.address) == 0
    gm.refresh_ready(store, 20.0)  # fresh went stale
    assert value(registry, "extproc_endpoint_ready", model="m", endpoint=fresh.address) == 0


def test_endpoints_that_left_take_their_series_with_them(
    registry: CollectorRegistry, gm: GatewayMetrics
) -> None:
    a = Endpoint("10.0.0.1:8000", "m", metrics_url="http://10.0.0.1:8000/metrics")
    b = Endpoint("10.0.0.2:8000", "m", metrics_url="http://10.0.0.2:8000/metrics")
    shared = Endpoint("10.0.0.2:8000", "n", metrics_url="http://10.0.0.2:8000/metrics")
    store = EndpointStore(stale_after=5.0, clock=lambda: 10.0)
    store.set_endpoints({"m": [a, b], "n": [shared]})
    gm.refresh_ready(store, 10.0)
    gm.observe_usage("m", a.address, TokenUsage(prompt_tokens=5, completion_tokens=2))
    gm.scrape_result(a, "ok")
    store.set_endpoints({"n": [shared]})  # pool m went; 10.0.0.2 still serves n
    gm.refresh_ready(store, 10.0)
    assert value(registry, "extproc_endpoint_ready", model="m", endpoint=a.address) is None
    assert value(registry, "extproc_endpoint_ready", model="m", endpoint=b.address) is None
    assert value(registry, "extproc_prompt_tokens_total", model="m", endpoint=a.address) is None
    assert value(registry, "extproc_metrics_scrapes_total", endpoint=a.address, result="ok") is None
    assert value(registry, "extproc_endpoint_ready", model="n", endpoint=shared.address) == 0


def test_stalled_series_exist_only_while_stalled(
    registry: CollectorRegistry, gm: GatewayMetrics
) -> None:
    gm.refresh_stalled(frozenset({"10.0.0.1:8000", "10.0.0.2:8000"}))
    assert value(registry, "extproc_endpoint_stalled", endpoint="10.0.0.1:8000") == 1
    gm.refresh_stalled(frozenset({"10.0.0.2:8000"}))
    assert value(registry, "extproc_endpoint_stalled", endpoint="10.0.0.1:8000") is None
    assert value(registry, "extproc_endpoint_stalled", endpoint="10.0.0.2:8000") == 1
    gm.refresh_stalled(frozenset())
    assert value(registry, "extproc_endpoint_stalled", endpoint="10.0.0.2:8000") is None
