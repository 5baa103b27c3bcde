"""deploy/overlays/observability: the Grafana dashboard, the alerts and the PodMonitors.

Every PromQL expression of the dashboard and of the PrometheusRule names only series that the
local stack exports (the two router processes, the simulated engines and Envoy, scraped
after some traffic); each alert has a runbook heading in docs/operations.md; the ConfigMap is
generated from the dashboard JSON; the PodMonitor finds the router's pods and port.
"""

from __future__ import annotations

import copy
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema  # type: ignore[import-untyped]
import pytest

from tests.deploy._dashboard import DASHBOARD, OVERLAY, dashboard, dashboard_exprs, panels
from tests.deploy._manifests import REPO, find, pod_labels, render, validate
from tests.deploy.promql import metric_names, series_names
from tests.e2e.harness import running_stack, stack_options, wait_for

OPERATIONS = REPO / "docs" / "operations.md"
RUNBOOK_BASE = "https://github.com/extproc-lb/extproc/blob/main/docs/operations.md#"


def alert_rules() -> list[dict[str, Any]]:
    rule = find(render(OVERLAY), "PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def every_expr() -> list[tuple[str, str]]:
    return dashboard_exprs() + [(f"alert {r['alert']}", r["expr"]) for r in alert_rules()]


# -- static checks -------------------------------------------------------------------------


def test_config_map_is_the_dashboard_json_with_the_sidecar_label() -> None:
    configmap = find(render(OVERLAY), "ConfigMap", "extproc-grafana-dashboard")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["data"] == {"extproc-dashboard.json": DASHBOARD.read_text()}


def test_dashboard_is_well_formed() -> None:
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    assert board["uid"] and board["title"]
    variables = {v["name"] for v in board["templating"]["list"]}
    assert "datasource" in variables
    for p in panels():
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        assert {t["refId"] for t in p["targets"]} == {chr(65 + i) for i in range(len(p["targets"]))}
    # No two panels overlap on Grafana's 24-column grid.
    cells: dict[tuple[int, int], str] = {}
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]


@pytest.mark.parametrize(
    "topic",
    [
        "extproc_requests_total",  # traffic and errors per model
        "envoy_cluster_upstream_rq",  # per route
        "extproc_prompt_tokens_total",
        "extproc_completion_tokens_total",
        "extproc_cached_tokens_total",
        "vllm:time_to_first_token_seconds_bucket",  # TTFT per pod
        "vllm:inter_token_latency_seconds_bucket",  # time per output token per pod
        "vllm:prefix_cache_hits_total",  # prefix hit rate
        "extproc_routing_decision_seconds_bucket",
        "extproc_tokenization_seconds_bucket",
        "extproc_in_flight_requests",
        "vllm:num_requests_waiting",  # queue per pod
        "extproc_endpoint_ready",  # stale pods
        "extproc_endpoint_stalled",
        "extproc_kv_events_healthy",
        "extproc_shed_requests_total",  # 429
        "extproc_sync_peers",
        "extproc_sync_lag_seconds_bucket",
        "extproc_sync_connected",
    ],
)
def test_dashboard_shows_what_the_issue_lists(topic: str) -> None:
    assert any(topic in metric_names(expr) for _, expr in dashboard_exprs())


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_alert_has_a_runbook_heading_in_operations_md() -> None:
    anchors = {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", OPERATIONS.read_text(), re.M)}
    rules = alert_rules()
    assert len(rules) >= 6
    for rule in rules:
        url = rule["annotations"]["runbook_url"]
        assert url.startswith(RUNBOOK_BASE), url
        anchor = url.removeprefix(RUNBOOK_BASE)
        assert anchor == rule["alert"].lower()
        assert anchor in anchors, f"docs/operations.md has no heading for {rule['alert']}"
        assert rule["labels"]["severity"] in ("critical", "warning")
        assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


@pytest.mark.parametrize(
    "wanted",
    [
        "extproc_endpoint_ready",  # no ready endpoint / pods stale
        "extproc_endpoint_stalled",
        "extproc_routing_decision_seconds_bucket",  # decision latency p99
        "extproc_routed_requests_total",  # accounting loss
        "extproc_access_records_total",
        "extproc_kv_events_healthy",  # KV events down
        "extproc_sync_lag_seconds_bucket",  # sync lag
        "extproc_sync_peers",
        "extproc_sync_connected",
    ],
)
def test_alerts_cover_what_the_issue_lists(wanted: str) -> None:
    assert any(wanted in metric_names(r["expr"]) for r in alert_rules())


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_the_validator_rejects_a_misspelt_rule() -> None:
    rule = copy.deepcopy(find(render(OVERLAY), "PrometheusRule"))
    rule["spec"]["groups"][0]["rules"][0]["fro"] = "5m"
    with pytest.raises(jsonschema.ValidationError):
        validate(rule)
    monitor = copy.deepcopy(find(render(OVERLAY), "PodMonitor", "extproc"))
    monitor["spec"]["podMetricsEndpoints"][0]["honorLabel"] = True
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)


def test_pod_monitor_scrapes_the_router_pods_on_their_metrics_port() -> None:
    monitor = find(render(OVERLAY), "PodMonitor", "extproc")
    deployment = find(render("envoy-gateway"), "Deployment", "extproc")
    assert monitor["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels(deployment).items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports[endpoint["port"]] == 9090 and endpoint["path"] == "/metrics"
    # Our `endpoint` and `pod` labels must not be renamed to exported_endpoint / exported_pod.
    assert endpoint["honorLabels"] is True
    engines = find(render(OVERLAY), "PodMonitor", "extproc-engines")
    sim = find(render("sim"), "Deployment", "vllm-sim")
    assert engines["spec"]["selector"]["matchLabels"].items() <= pod_labels(sim).items()
    sim_ports = {p["name"] for p in sim["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert engines["spec"]["podMetricsEndpoints"][0]["port"] in sim_ports


def test_the_name_check_fails_for_a_metric_we_do_not_export() -> None:
    exported = series_names(
        "# TYPE extproc_requests_total counter\nextproc_requests_total 1\n"
        "# TYPE extproc_routing_decision_seconds histogram\n"
    )
    assert _unknown([("ok", "rate(extproc_requests_total[5m])")], exported) == []
    bad = [
        ("counter without _total", "rate(extproc_requests[5m])"),
        ("histogram without _bucket", "histogram_quantile(0.9, extproc_routing_decision_seconds)"),
        ("typo", "extproc_request_total"),
    ]
    assert [where for where, _ in _unknown(bad, exported)] == [w for w, _ in bad]


def _unknown(exprs: list[tuple[str, str]], exported: set[str]) -> list[tuple[str, str]]:
    return [(where, n) for where, expr in exprs for n in sorted(metric_names(expr) - exported)]


# -- against a live scrape of the local stack ------------------------------------------------

CHAT = {"model": "qwen3", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[set[str]]:
    """Series names from every process of a 2-process stack with replica sync, KV events
    and Envoy, after traffic (streamed and not) and one refused request."""
    opts = stack_options(
        tmp_path_factory.mktemp("observability"), extproc_processes=2, flow_control=True
    )
    with (
        running_stack(opts) as stack,
        httpx.Client(timeout=30, headers=stack.options.admin_headers()) as client,
    ):
        url = f"{stack.base_url}/v1/chat/completions"
        for i in range(12):
            body = {
                **CHAT,
                "stream": i % 2 == 0,
                "messages": [{"role": "user", "content": f"q {i % 3}"}],
            }
            assert client.post(url, json=body).status_code == 200
        assert client.post(url, json={"model": "qwen3"}).status_code == 400
        processes = range(opts.extproc_processes)
        admin = [f"http://{opts.host}:{opts.metrics_port + i}" for i in processes]
        # predicted-latency's error histogram: tokenized streams warm the models, more check them.
        learn = {**CHAT, "stream": True}
        tokenized = {"routing-strategy": "predicted-latency"}

        def stream(i: int) -> None:
            body = {**learn, "messages": [{"role": "user", "content": f"learn {i}"}]}
            with client.stream("POST", url, json=body, headers=tokenized) as r:
                assert r.status_code == 200
                r.read()

        for i in range(30):
            stream(i)

        def some_pod_warm() -> bool:
            state = client.get(f"{admin[0]}/debug/latency-model").json()
            return any(m["warm"] for m in state["models"].get("qwen3", {}).values())

        assert wait_for(some_pod_warm, 10)
        for i in range(30, 36):
            stream(i)

        def accounted() -> bool:
            text = "".join(client.get(f"{a}/metrics").text for a in admin)
            return 'extproc_access_records_total{result="accounted"}' in text

        assert wait_for(accounted, 10)
        time.sleep(1.0)  # a sync tick and a metrics poll after the traffic
        names: set[str] = set()
        urls = [f"{a}/metrics" for a in admin]
        urls += [f"http://{opts.sim_address(i)}/metrics" for i in range(opts.sims)]
        urls.append(f"http://{opts.host}:{opts.admin_port}/stats/prometheus")
        for scrape in urls:
            resp = client.get(scrape)
            assert resp.status_code == 200, scrape
            names |= series_names(resp.text)
        yield names


@pytest.mark.e2e
def test_every_expression_names_only_exported_series(scraped: set[str]) -> None:
    exprs = every_expr()
    assert len(exprs) > 50
    unknown = _unknown(exprs, scraped)
    assert unknown == [], f"not exported by the local stack: {unknown}"


@pytest.mark.e2e
def test_every_series_the_router_exports_is_on_the_dashboard_or_an_alert(
    scraped: set[str],
) -> None:
    # A new metric gets a panel (or a conscious entry here): the dashboard stays complete.
    shown = {n for _, expr in every_expr() for n in metric_names(expr)}
    ours = {
        n
        for n in scraped
        if n.startswith("extproc_") and not n.endswith(("_created", "_sum", "_count"))
    }
    assert sorted(ours - shown) == []


@pytest.mark.e2e
def test_the_scrape_saw_every_process(scraped: set[str]) -> None:
    # Router, replica sync, KV events, engines and Envoy: a scrape that missed one would make
    # the check above vacuous for that part.
    for name in (
        "extproc_requests_total",
        "extproc_sync_peers",
        "extproc_kv_events_healthy",
        "vllm:num_requests_running",
        "envoy_cluster_upstream_rq",
    ):
        assert name in scraped
