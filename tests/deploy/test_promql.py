"""The PromQL metric-name extractor and the exposition's series names, table-driven."""

from __future__ import annotations

import pytest

from tests.deploy.promql import PromQLError, Token, metric_names, series_names, tokenize


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("up", {"up"}),
        ("vllm:num_requests_running", {"vllm:num_requests_running"}),
        ('extproc_endpoint_ready{model="qwen3"} == 0', {"extproc_endpoint_ready"}),
        # functions and aggregations are not names; label names and values are not either
        ("sum by (model, status) (rate(extproc_requests_total[5m]))", {"extproc_requests_total"}),
        ("sum(rate(extproc_requests_total[5m])) by (model)", {"extproc_requests_total"}),
        ("max without (instance) (extproc_sync_peers)", {"extproc_sync_peers"}),
        ("count(sum by (le) (x_bucket))", {"x_bucket"}),
        (
            "histogram_quantile(0.99, sum by (le, strategy) "
            "(rate(extproc_routing_decision_seconds_bucket[$__rate_interval])))",
            {"extproc_routing_decision_seconds_bucket"},
        ),
        # a label called like a metric stays a label, in matchers and in label lists
        ('a{le="0.1", sum="x", by=~"y"} / on (model) group_left (endpoint) b', {"a", "b"}),
        ("a and on(pod) b unless ignoring(kind) c or d", {"a", "b", "c", "d"}),
        ("a > bool 1", {"a"}),
        ("a atan2 b", {"a", "b"}),
        # Grafana variables, strings, durations, subqueries, offsets, @
        ('rate(a{model=~"$model"}[${__rate_interval}])', {"a"}),
        ("max_over_time(a[10m:1m] offset 5m)", {"a"}),
        ("a @ end()", {"a"}),
        ("rate(a[1h30m]) * 1e3 - 0x1F + .5 + Inf", {"a"}),
        ('label_replace(a, "dst", "$1", "src", "(.*)")', {"a"}),
        ('{__name__="extproc_sync_connected", job="x"}', {"extproc_sync_connected"}),
        (
            "absent(extproc_in_flight_requests) # a comment naming fake_metric",
            {"extproc_in_flight_requests"},
        ),
        # a metric named like an aggregation is still a metric when not called
        ("count", {"count"}),
        ("vector(1)", set()),
        ("time() - process_start_time_seconds", {"process_start_time_seconds"}),
    ],
)
def test_metric_names(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


@pytest.mark.parametrize("expr", ["sum(rate(a[5m])", "a{b='c'", "a)", "a[5m}", "a ; b"])
def test_malformed_expressions_are_errors(expr: str) -> None:
    with pytest.raises(PromQLError):
        metric_names(expr)


def test_tokenize_kinds() -> None:
    assert tokenize('rate(a{b!~"x"}[5m]) >= 0.5') == [
        Token("ident", "rate"),
        Token("punct", "("),
        Token("ident", "a"),
        Token("punct", "{"),
        Token("ident", "b"),
        Token("op", "!~"),
        Token("string", '"x"'),
        Token("punct", "}"),
        Token("punct", "["),
        Token("duration", "5m"),
        Token("punct", "]"),
        Token("punct", ")"),
        Token("op", ">="),
        Token("number", "0.5"),
    ]


EXPOSITION = """\
# HELP c_total A counter
# TYPE c_total counter
c_total{m="x"} 1.0
c_created{m="x"} 1.7e9
# HELP h A histogram
# TYPE h histogram
# HELP g A gauge with no series yet
# TYPE g gauge
# HELP labelled_total A counter with no series yet
# TYPE labelled_total counter
# TYPE envoy_cluster_upstream_rq counter
envoy_cluster_upstream_rq{envoy_response_code="200"} 3
# HELP vllm:prompt_tokens_total Prefill tokens
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="q"} 5.0
# TYPE s summary
s{quantile="0.5"} 1
s_sum 2
s_count 3
"""


@pytest.mark.parametrize(
    ("name", "exported"),
    [
        ("c_total", True),
        ("c", False),  # Prometheus stores a counter with its _total suffix
        ("c_created", True),
        ("envoy_cluster_upstream_rq", True),  # a counter as Envoy writes it: no _total
        ("envoy_cluster_upstream_rq_total", False),
        ("h_bucket", True),
        ("h_sum", True),
        ("h_count", True),
        ("h", False),  # a histogram has no series of its bare name
        ("g", True),
        ("labelled_total", True),  # declared, series once a label set is used
        ("labelled", False),
        ("vllm:prompt_tokens_total", True),
        ("s", True),
        ("s_sum", True),
        ("s_bucket", False),
        ("missing", False),
    ],
)
def test_series_names(name: str, exported: bool) -> None:
    assert (name in series_names(EXPOSITION)) is exported
