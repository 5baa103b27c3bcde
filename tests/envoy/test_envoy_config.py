"""The rendered bootstraps: Envoy accepts every variant, envoy-data-plane knows every field
name, and the committed envoy/*.yaml never drift from the renderer."""

from __future__ import annotations

import copy
import importlib
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.stack.envoy_config import (
    EXAMPLES,
    MODELS_CLUSTER,
    ONE_MESSAGE_GATE_LUA,
    ROUTING_HEADERS,
    USAGE_LUA,
    EnvoyOptions,
    HostPort,
    RequestBodyMode,
    ResponseAccounting,
    envoy_binary,
    example_text,
    render_bootstrap,
    render_yaml,
)
from extproc.wire import ACCESS_LOG_NAME

REPO = Path(__file__).resolve().parents[2]

VARIANTS: dict[str, EnvoyOptions] = {
    **{f"example:{name}": opts for name, opts in EXAMPLES.items()},
    "duplex+access-log": EnvoyOptions(
        request_body_mode=RequestBodyMode.FULL_DUPLEX_STREAMED,
        response_accounting=ResponseAccounting.ACCESS_LOG,
        access_log=True,
    ),
    "no-accounting+fail-open+log": EnvoyOptions(
        response_accounting=ResponseAccounting.NONE, failure_mode_allow=True, access_log=True
    ),
    "one-message+access-log": EnvoyOptions(one_message=True, access_log=True),
    "three-extproc-processes": EnvoyOptions(
        extproc=tuple(HostPort("127.0.0.1", p) for p in (9002, 9012, 9022)),
    ),
    "no-extproc-override-host-only": EnvoyOptions(extproc=(), num_retries=0),
    "single-endpoint-ipv6-admin": EnvoyOptions(
        endpoints=(HostPort("127.0.0.1", 8001),), admin=HostPort("::1", 9901)
    ),
    "opentelemetry-tracing": EnvoyOptions(
        tracing=HostPort("127.0.0.1", 4317), tracing_sample_percent=10.0
    ),
}


def _validate(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "-l", "warning"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_envoy_validates(name: str, tmp_path: Path) -> None:
    path = tmp_path / "envoy.yaml"
    path.write_text(render_yaml(VARIANTS[name]))
    proc = _validate(path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK" in proc.stdout + proc.stderr


def test_envoy_rejects_a_broken_bootstrap(tmp_path: Path) -> None:
    """The validate check above can fail: a misspelled field is refused."""
    config = render_bootstrap(EnvoyOptions())
    config["static_resources"]["clusters"][0]["conect_timeout"] = "1s"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = _validate(path)
    assert proc.returncode != 0


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_committed_examples_do_not_drift(name: str) -> None:
    committed = (REPO / "envoy" / name).read_text()
    assert committed == example_text(name), (
        f"envoy/{name} is stale: run `python -m extproc.stack.envoy_config envoy`"
    )


def _type_urls(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if "@type" in node:
            yield node["@type"]
        for value in node.values():
            yield from _type_urls(value)
    elif isinstance(node, list):
        for value in node:
            yield from _type_urls(value)


def _data_plane_bootstrap(config: dict[str, Any]) -> Any:
    """Parse with envoy-data-plane's typed messages; unknown keys (also inside Any) raise."""
    for url in set(_type_urls(config)):
        package = url.rsplit("/", 1)[1].rsplit(".", 1)[0]
        importlib.import_module(f"envoy_data_plane.{package}")
    bootstrap = importlib.import_module("envoy_data_plane.envoy.config.bootstrap.v3")
    return bootstrap.Bootstrap.from_dict(config)


# envoy-data-plane's generated pydantic validators warn on import; not our code.
_quiet_data_plane = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@_quiet_data_plane
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_field_names_exist_in_envoy_data_plane(name: str) -> None:
    config = render_bootstrap(VARIANTS[name])
    parsed = _data_plane_bootstrap(config)
    assert parsed.static_resources.listeners[0].name == "gateway"


@_quiet_data_plane
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_envoy_data_plane_rejects_unknown_fields() -> None:
    config = render_bootstrap(EnvoyOptions())
    broken = copy.deepcopy(config)
    hcm = broken["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm["typed_config"]["http_filters"][1]["typed_config"]["observabilty_mode"] = True
    with pytest.raises(KeyError, match="observabilty_mode"):
        _data_plane_bootstrap(broken)


def _filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    filters: list[dict[str, Any]] = hcm["typed_config"]["http_filters"]
    return filters


def _clusters(config: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in config["static_resources"]["clusters"]}


@pytest.mark.parametrize(
    ("opts", "filter_names", "cluster_names"),
    [
        (
            EnvoyOptions(),
            ["header_mutation", "ext_proc", "lua", "router"],
            ["models", "extproc"],
        ),
        (
            EnvoyOptions(response_accounting=ResponseAccounting.NONE),
            ["header_mutation", "ext_proc", "router"],
            ["models", "extproc"],
        ),
        (EnvoyOptions(extproc=()), ["header_mutation", "router"], ["models"]),
        (EnvoyOptions(baseline=True), ["router"], ["models"]),
    ],
)
def test_filter_chain_shape(
    opts: EnvoyOptions, filter_names: list[str], cluster_names: list[str]
) -> None:
    config = render_bootstrap(opts)
    names = [f["name"].removeprefix("envoy.filters.http.") for f in _filters(config)]
    assert names == filter_names
    assert list(_clusters(config)) == cluster_names


@pytest.mark.parametrize(
    ("opts", "request_mode", "response_header", "response_body", "trailer"),
    [
        (EnvoyOptions(), "BUFFERED", "SKIP", "NONE", "SKIP"),
        (
            EnvoyOptions(request_body_mode=RequestBodyMode.FULL_DUPLEX_STREAMED),
            "FULL_DUPLEX_STREAMED",
            "SKIP",
            "NONE",
            "SEND",
        ),
    ],
)
def test_routing_filter_modes(
    opts: EnvoyOptions, request_mode: str, response_header: str, response_body: str, trailer: str
) -> None:
    routing = _filters(render_bootstrap(opts))[1]["typed_config"]
    mode = routing["processing_mode"]
    assert (mode["request_header_mode"], mode["request_body_mode"]) == ("SEND", request_mode)
    assert mode["request_trailer_mode"] == trailer
    assert (mode["response_header_mode"], mode["response_body_mode"]) == (
        response_header,
        response_body,
    )
    assert routing["metadata_options"]["receiving_namespaces"]["untyped"] == [
        "envoy.lb",
        "extproc.request",
    ]
    assert routing["request_attributes"] == ["xds.route_name"]


def test_one_message_skips_request_headers_and_gates_the_request_on_its_body() -> None:
    filters = _filters(render_bootstrap(EnvoyOptions(one_message=True)))
    assert [f["name"] for f in filters] == [
        "envoy.filters.http.header_mutation",
        "envoy.filters.http.ext_proc",
        "extproc.one_message_gate",
        "envoy.filters.http.lua",
        "envoy.filters.http.router",
    ]
    routing = filters[1]["typed_config"]
    mode = routing["processing_mode"]
    assert (mode["request_header_mode"], mode["request_body_mode"]) == ("SKIP", "BUFFERED")
    attributes = routing["request_attributes"]
    assert attributes[:4] == ["xds.route_name", "request.id", "request.method", "request.path"]
    assert attributes[4:] == [f"request.headers['{h}']" for h in ROUTING_HEADERS]
    assert "extproc.headers" in routing["metadata_options"]["receiving_namespaces"]["untyped"]
    gate = filters[2]["typed_config"]["default_source_code"]["inline_string"]
    assert gate == ONE_MESSAGE_GATE_LUA
    assert "request_handle:body()" in gate and "extproc.headers" in gate


def test_one_message_needs_a_buffered_body() -> None:
    with pytest.raises(ValueError, match="BUFFERED"):
        EnvoyOptions(one_message=True, request_body_mode=RequestBodyMode.FULL_DUPLEX_STREAMED)


def test_every_header_the_server_reads_is_carried_in_the_one_message_shape() -> None:
    """The default names the director and the rules read, against the carried list."""
    from extproc.config import RoutingConfig
    from extproc.director.attributes import FAIRNESS_HEADERS, OBJECTIVE_HEADERS
    from extproc.director.steps import EXPLAIN_HEADER
    from extproc.routing import predicted
    from extproc.routing.affinity import SESSION_KEY_HEADER

    r = RoutingConfig()
    read = {
        r.strategy_header, r.priority_header, r.session_header, r.user_header,
        *OBJECTIVE_HEADERS, *FAIRNESS_HEADERS, EXPLAIN_HEADER, SESSION_KEY_HEADER,
        predicted.SLO_TTFT_HEADER, predicted.SLO_TPOT_HEADER,
        predicted.LLMD_SLO_TTFT_HEADER, predicted.LLMD_SLO_TPOT_HEADER,
    }  # fmt: skip
    assert read == set(ROUTING_HEADERS)


def _access_logs(config: dict[str, Any]) -> list[dict[str, Any]]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    logs: list[dict[str, Any]] = hcm["typed_config"].get("access_log", [])
    return logs


def test_accounting_is_a_lua_filter_and_a_grpc_access_log_to_the_extproc_cluster() -> None:
    config = render_bootstrap(EnvoyOptions(extproc_max_requests=12345))
    lua = _filters(config)[2]["typed_config"]
    assert lua["default_source_code"]["inline_string"] == USAGE_LUA.read_text()
    [als] = _access_logs(config)
    common = als["typed_config"]["common_config"]
    assert common["log_name"] == ACCESS_LOG_NAME
    assert common["grpc_service"]["envoy_grpc"]["cluster_name"] == "extproc"
    assert common["buffer_flush_interval"] == "0.1s"  # records end leases: in-flight lags this
    cluster = _clusters(config)["extproc"]
    assert cluster["lb_policy"] == "LEAST_REQUEST"
    assert cluster["circuit_breakers"]["thresholds"][0]["max_requests"] == 12345


@pytest.mark.parametrize(
    "opts",
    [
        EnvoyOptions(response_accounting=ResponseAccounting.NONE),
        EnvoyOptions(extproc=()),
        EnvoyOptions(baseline=True),
    ],
)
def test_no_accounting_log_without_accounting(opts: EnvoyOptions) -> None:
    config = render_bootstrap(opts)
    assert _access_logs(config) == []
    assert "lua" not in {f["name"].removeprefix("envoy.filters.http.") for f in _filters(config)}


def test_extproc_processes_all_in_one_cluster() -> None:
    addrs = tuple(HostPort("127.0.0.1", p) for p in (9002, 9012))
    cluster = _clusters(render_bootstrap(EnvoyOptions(extproc=addrs)))["extproc"]
    lb_endpoints = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"] for e in lb_endpoints]
    assert ports == [9002, 9012]


@pytest.mark.parametrize(
    ("text", "expected"),
    [("127.0.0.1:8001", HostPort("127.0.0.1", 8001)), ("[::1]:80", HostPort("::1", 80))],
)
def test_host_port_parse(text: str, expected: HostPort) -> None:
    assert HostPort.parse(text) == expected
    assert str(expected) == text


@pytest.mark.parametrize("text", ["127.0.0.1", ":80", "host:http", "h:0", "h:70000"])
def test_host_port_parse_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        HostPort.parse(text)


def test_the_models_cluster_lets_thousands_of_streams_through_at_once() -> None:
    """The local shape's limits on the model cluster (tests/e2e/test_concurrent_streams.py runs
    2,000 streams through the Envoy Gateway shape only): far above Envoy's default of 1,024 for
    every kind of limit, and set as asked."""
    for asked in (None, 5000):
        opts = EnvoyOptions() if asked is None else EnvoyOptions(upstream_max_requests=asked)
        cluster = _clusters(render_bootstrap(opts))[MODELS_CLUSTER]
        [limits] = cluster["circuit_breakers"]["thresholds"]
        want = opts.upstream_max_requests
        assert want > 1024 * 4
        for key in ("max_connections", "max_pending_requests", "max_requests", "max_retries"):
            assert limits[key] == want, key
