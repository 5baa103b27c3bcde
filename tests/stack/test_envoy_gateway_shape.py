"""The Envoy Gateway shape: deploy/ read at render time and translated as Envoy Gateway does."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.stack.cli import add_up_arguments, shape_problems
from extproc.stack.envoy_config import EnvoyOptions, HostPort, envoy_binary
from extproc.stack.envoy_gateway import (
    DEPLOY_DIR,
    EG_DEFAULTS,
    GatewayShape,
    OverlayError,
    duration_s,
    eds_path,
    eds_response,
    quantity_bytes,
    translate,
    translate_overlay,
)
from extproc.stack.local import LocalStack, StackError, StackOptions
from extproc.stack.overlay import Overlay, load_overlay
from extproc.wire import ACCESS_LOG_NAME, DESTINATION_HEADER
from tests.deploy._manifests import CRDS, render

OVERLAYS = DEPLOY_DIR / "overlays"
EG = OVERLAYS / "envoy-gateway"
TOKEN_LIMITS = OVERLAYS / "envoy-gateway-token-limits"
OPTS = EnvoyOptions(rate_limit_service=HostPort("127.0.0.1", 8081))
EG_KINDS = {
    "Gateway",
    "HTTPRoute",
    "ClientTrafficPolicy",
    "BackendTrafficPolicy",
    "EnvoyExtensionPolicy",
    "EnvoyProxy",
}


def hcm(bootstrap: Mapping[str, Any]) -> dict[str, Any]:
    (listener,) = bootstrap["static_resources"]["listeners"]
    config: dict[str, Any] = listener["default_filter_chain"]["filters"][0]["typed_config"]
    return config


def the_route(bootstrap: Mapping[str, Any]) -> dict[str, Any]:
    ((vhost,),) = [hcm(bootstrap)["route_config"]["virtual_hosts"]]
    (route,) = vhost["routes"]
    assert isinstance(route, dict)
    return route


def clusters(bootstrap: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in bootstrap["static_resources"]["clusters"]}


def spec(overlay: Overlay, kind: str) -> dict[str, Any]:
    found: dict[str, Any] = overlay.one(kind)["spec"]
    return found


@pytest.mark.parametrize("name", ["envoy-gateway", "envoy-gateway-token-limits"])
def test_the_overlay_reader_gives_what_kubectl_kustomize_gives(name: str) -> None:
    def relevant(docs: Any) -> list[dict[str, Any]]:
        keep = [
            d
            for d in docs
            if d["kind"] in EG_KINDS
            or (d["kind"] == "ConfigMap" and d["metadata"]["name"] == "extproc-usage-lua")
        ]
        return sorted(keep, key=lambda d: (d["kind"], d["metadata"]["name"]))

    ours = relevant(load_overlay(OVERLAYS / name).objects)
    assert {d["kind"] for d in ours} >= EG_KINDS
    assert ours == relevant(render(name))


def test_filters_are_in_envoy_gateways_order_with_its_names() -> None:
    bootstrap = translate_overlay(TOKEN_LIMITS, OPTS).bootstrap
    filters = hcm(bootstrap)["http_filters"]
    policy = "envoyextensionpolicy/extproc/extproc"
    # httpfilters.go: lua 13+i, ext_proc 100+i, ratelimit 303, router 310.
    assert [f["name"] for f in filters] == [
        f"envoy.filters.http.lua/{policy}/lua/0",
        f"envoy.filters.http.ext_proc/{policy}/extproc/0",
        "envoy.filters.http.ratelimit",
        "envoy.filters.http.router",
    ]
    # The policy's filters are off on the listener and on for its route only.
    assert [f.get("disabled", False) for f in filters] == [True, True, False, False]
    enabled = the_route(bootstrap)["typed_per_filter_config"]
    assert set(enabled) == {filters[0]["name"], filters[1]["name"], filters[2]["name"]}
    # No request header_mutation filter: the strip is an early header mutation instead.
    (early,) = hcm(bootstrap)["early_header_mutation_extensions"]
    assert early["typed_config"]["mutations"] == [{"remove": DESTINATION_HEADER}]


def test_names_are_envoy_gateways() -> None:
    translation = translate_overlay(EG, OPTS)
    bootstrap = translation.bootstrap
    (listener,) = bootstrap["static_resources"]["listeners"]
    assert listener["name"] == hcm(bootstrap)["route_config"]["name"] == "extproc/llm-gateway/http"
    assert hcm(bootstrap)["route_config"]["virtual_hosts"][0]["name"] == (
        "extproc/llm-gateway/http/*"
    )
    assert translation.route_names == ("httproute/extproc/llm-route/rule/0/match/0/*",)
    assert the_route(bootstrap)["name"] == translation.route_names[0]
    assert set(clusters(bootstrap)) == {
        "httproute/extproc/llm-route/rule/0",
        "envoyextensionpolicy/extproc/extproc/extproc/0",
        "accesslog_als_0_0",
    }
    assert translation.extproc_cluster == "envoyextensionpolicy/extproc/extproc/extproc/0"
    # The server's route table resolves the route name to these annotations.
    assert translation.server_routes == {"extproc/llm-route": {"strategy": "prefix-cache"}}


def test_the_manifests_values_are_rendered() -> None:
    overlay = load_overlay(EG)
    bootstrap = translate(overlay, OPTS).bootstrap
    ctp, btp = spec(overlay, "ClientTrafficPolicy"), spec(overlay, "BackendTrafficPolicy")
    (ext,) = spec(overlay, "EnvoyExtensionPolicy")["extProc"]
    (rule,) = spec(overlay, "HTTPRoute")["rules"]
    (listener,) = bootstrap["static_resources"]["listeners"]
    assert listener["per_connection_buffer_limit_bytes"] == quantity_bytes(
        ctp["connection"]["bufferLimit"]
    )
    by_name = clusters(bootstrap)
    (model,) = by_name["httproute/extproc/llm-route/rule/0"]["circuit_breakers"]["thresholds"]
    cb = btp["circuitBreaker"]
    assert model == {
        "max_retries": cb["maxParallelRetries"],
        "max_connections": cb["maxConnections"],
        "max_pending_requests": cb["maxPendingRequests"],
        "max_requests": cb["maxParallelRequests"],
    }
    extproc = by_name["envoyextensionpolicy/extproc/extproc/extproc/0"]
    (threshold,) = extproc["circuit_breakers"]["thresholds"]
    assert (
        threshold["max_requests"] == ext["backendSettings"]["circuitBreaker"]["maxParallelRequests"]
    )
    assert threshold["max_retries"] == EG_DEFAULTS["max_retries"]  # the policy sets none
    (check,) = extproc["health_checks"]
    active = ext["backendSettings"]["healthCheck"]["active"]
    assert duration_s(check["interval"]) == duration_s(active["interval"])
    assert check["grpc_health_check"] == {"service_name": active["grpc"]["service"]}
    assert "no_traffic_interval" not in check  # Envoy's 60 s, as on Envoy Gateway
    action = the_route(bootstrap)["route"]
    assert action["retry_policy"]["retry_on"] == ",".join(btp["retry"]["retryOn"]["triggers"])
    assert action["retry_policy"]["num_retries"] == btp["retry"]["numRetries"]
    assert duration_s(action["idle_timeout"]) == duration_s(
        btp["timeout"]["http"]["streamIdleTimeout"]
    )
    assert duration_s(action["timeout"]) == duration_s(rule["timeouts"]["request"])
    routing = hcm(bootstrap)["http_filters"][1]["typed_config"]
    assert duration_s(routing["message_timeout"]) == duration_s(ext["messageTimeout"])
    assert routing["failure_mode_allow"] is ext["failOpen"]
    assert routing["request_attributes"] == ext["processingMode"]["request"]["attributes"]
    assert routing["metadata_options"] == {
        "receiving_namespaces": {"untyped": ext["metadata"]["writableNamespaces"]}
    }
    assert routing["processing_mode"]["request_body_mode"] == "BUFFERED"
    echoed = {
        h["header"]["key"]: h["header"]["value"]
        for h in the_route(bootstrap)["response_headers_to_add"]
    }
    assert echoed == {
        h["name"]: h["value"] for h in rule["filters"][0]["responseHeaderModifier"]["set"]
    }
    lua = hcm(bootstrap)["http_filters"][0]["typed_config"]["default_source_code"]
    assert lua["inline_string"] == (EG / "usage.lua").read_text()
    # The ALS sink: our log name, Envoy's default flush interval (1 s: none set).
    (als, _file) = hcm(bootstrap)["access_log"]
    common = als["typed_config"]["common_config"]
    assert common["log_name"] == ACCESS_LOG_NAME
    assert "buffer_flush_interval" not in common


def copy_overlay(tmp_path: Path) -> Path:
    """deploy/ copied (relative references intact), to edit a manifest."""
    shutil.copytree(DEPLOY_DIR, tmp_path / "deploy")
    return tmp_path / "deploy" / "overlays" / "envoy-gateway"


def edit(path: Path, change: Any) -> None:
    doc = yaml.safe_load(path.read_text())
    change(doc["spec"])
    path.write_text(yaml.safe_dump(doc))


def test_an_edited_manifest_shows_at_the_next_render(tmp_path: Path) -> None:
    overlay = copy_overlay(tmp_path)
    edit(overlay / "clienttrafficpolicy.yaml", lambda s: s["connection"].update(bufferLimit="16Mi"))
    edit(
        overlay / "envoyextensionpolicy.yaml",
        lambda s: s["extProc"][0].update(messageTimeout="60s"),
    )
    bootstrap = translate_overlay(overlay, OPTS).bootstrap
    (listener,) = bootstrap["static_resources"]["listeners"]
    assert listener["per_connection_buffer_limit_bytes"] == 16 * 2**20
    assert hcm(bootstrap)["http_filters"][1]["typed_config"]["message_timeout"] == "60s"


def test_envoy_gateways_defaults_where_the_manifests_set_nothing() -> None:
    full = load_overlay(EG)
    bare = Overlay(
        full.directory,
        tuple(
            o
            for o in full.objects
            if o["kind"] not in {"ClientTrafficPolicy", "BackendTrafficPolicy"}
        ),
    )
    bootstrap = translate(bare, OPTS).bootstrap
    (listener,) = bootstrap["static_resources"]["listeners"]
    assert listener["per_connection_buffer_limit_bytes"] == 32768
    model = clusters(bootstrap)["httproute/extproc/llm-route/rule/0"]
    assert model["circuit_breakers"] == {"thresholds": [{"max_retries": 1024}]}
    assert model["connect_timeout"] == "10s"
    assert model["per_connection_buffer_limit_bytes"] == 32768
    # Without endpointOverride: plain LeastRequest, the header is not honoured.
    policy = model["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert policy["name"] == "envoy.load_balancing_policies.least_request"
    action = the_route(bootstrap)["route"]
    assert "retry_policy" not in action
    # route.go idleTimeout: an unlimited request timeout turns the idle timeout off too.
    assert action["timeout"] == "0s" and action["idle_timeout"] == "0s"
    assert "early_header_mutation_extensions" not in hcm(bootstrap)


def test_a_field_the_shape_does_not_render_is_an_error() -> None:
    overlay = load_overlay(EG)
    overlay.one("BackendTrafficPolicy")["spec"]["compression"] = [{"type": "Gzip"}]
    with pytest.raises(OverlayError, match="compression"):
        translate(overlay, OPTS)


def test_a_global_rate_limit_needs_a_rate_limit_service() -> None:
    with pytest.raises(OverlayError, match="rate limit service"):
        translate_overlay(TOKEN_LIMITS, EnvoyOptions())


def _crd_defaults(crd: str, owner: str) -> Iterator[dict[str, Any]]:
    """Each `properties` of a schema node named `owner` in the CRD file."""
    doc = yaml.safe_load((CRDS / crd).read_text())

    def walk(node: Any) -> Iterator[dict[str, Any]]:
        if isinstance(node, dict):
            for key, value in node.items():
                if key == owner and isinstance(value, dict) and "properties" in value:
                    yield value["properties"]
                yield from walk(value)
        elif isinstance(node, list):
            for item in node:
                yield from walk(item)

    return walk(doc)


@pytest.mark.parametrize("check", ["active", "passive"])
def test_the_health_check_defaults_are_the_crds(check: str) -> None:
    found = list(_crd_defaults("gateway.envoyproxy.io_envoyextensionpolicies.yaml", check))
    assert found
    for properties in found:
        defaults = {k: v["default"] for k, v in properties.items() if "default" in v}
        assert {k: v for k, v in EG_DEFAULTS[check].items() if k in defaults} == {
            k: v for k, v in defaults.items() if k in EG_DEFAULTS[check]
        }
        assert set(EG_DEFAULTS[check]) <= set(defaults) | {"splitExternalLocalOriginErrors"}


def _assert_envoy_validates(tmp_path: Path, bootstrap: dict[str, Any]) -> None:
    """Envoy itself (``--mode validate``) accepts ``bootstrap``."""
    path = tmp_path / "envoy.yaml"
    path.write_text(yaml.safe_dump(bootstrap))
    run = subprocess.run(
        [envoy_binary(), "--mode", "validate", "-c", str(path), "--disable-hot-restart"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("overlay", [EG, TOKEN_LIMITS])
def test_envoy_accepts_the_bootstrap(tmp_path: Path, overlay: Path) -> None:
    _assert_envoy_validates(tmp_path, translate_overlay(overlay, OPTS).bootstrap)


def test_with_an_eds_directory_the_server_clusters_read_their_endpoints_from_files(
    tmp_path: Path,
) -> None:
    eds_dir = tmp_path / "eds"
    opts = dataclasses.replace(OPTS, server_eds_dir=str(eds_dir))
    translation = translate_overlay(EG, opts)
    by_name = clusters(translation.bootstrap)
    server = set(translation.server_clusters)
    assert translation.extproc_cluster in server
    assert any(name.startswith("accesslog_als_") for name in server)
    for name, cluster in by_name.items():
        if name in server:
            assert cluster["type"] == "EDS" and "load_assignment" not in cluster
            source = cluster["eds_cluster_config"]["eds_config"]["path_config_source"]
            assert source == {
                "path": str(eds_path(eds_dir, name)),
                "watched_directory": {"path": str(eds_dir)},
            }
            assert "/" not in eds_path(eds_dir, name).name
        else:  # the model clusters
            assert cluster["type"] == "STATIC"
    static = clusters(translate_overlay(EG, OPTS).bootstrap)
    assert {n for n, c in static.items() if c["type"] == "EDS"} == set()
    # Envoy takes the bootstrap with the files the stack writes beside it.
    eds_dir.mkdir()
    for name in server:
        listed = eds_response(name, opts.extproc, version=1)
        assert listed["resources"][0]["cluster_name"] == name
        eds_path(eds_dir, name).write_text(json.dumps(listed))
    _assert_envoy_validates(tmp_path, translation.bootstrap)


def test_the_stack_gives_the_server_the_clusters_part(tmp_path: Path) -> None:
    stack = LocalStack(StackOptions(gateway_shape=GatewayShape.ENVOY_GATEWAY, workdir=tmp_path))
    cfg = stack.server_config()
    assert cfg["routes"] == {"extproc/llm-route": {"strategy": "prefix-cache"}}
    assert cfg["accounting"]["access_log"] is True
    assert "extproc/llm-gateway/http" in stack.envoy_yaml()
    broken = stack.with_options(gateway_overlay=tmp_path / "nowhere")
    with pytest.raises(StackError, match="nowhere"):
        broken.envoy_yaml()


def _args(*argv: str) -> tuple[argparse.Namespace, dict[str, Any]]:
    parser = argparse.ArgumentParser()
    add_up_arguments(parser)
    return parser.parse_args(list(argv)), vars(parser.parse_args([]))


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (("--gateway-shape", "envoy-gateway", "--fail-open"), "--fail-open"),
        (
            ("--gateway-shape", "envoy-gateway", "--body-mode", "FULL_DUPLEX_STREAMED"),
            "--body-mode",
        ),
        (("--rate-limit-service", "127.0.0.1:8081"), "needs --gateway-shape"),
        (("--gateway-shape", "envoy-gateway", "--rate-limit-service", "x"), "host:port"),
    ],
)
def test_up_refuses_what_the_shape_would_ignore(argv: tuple[str, ...], problem: str) -> None:
    args, defaults = _args(*argv)
    (found,) = shape_problems(args, defaults)
    assert problem in found


def test_up_takes_the_shape_and_its_overlay() -> None:
    args, defaults = _args(
        "--gateway-shape", "envoy-gateway", "--overlay", str(TOKEN_LIMITS),
        "--rate-limit-service", "127.0.0.1:8081",
    )  # fmt: skip
    assert shape_problems(args, defaults) == []


def test_both_shapes_give_a_decision_the_same_time() -> None:
    # One rule in two places: Envoy waits for a decision longer than flow control's queue
    # TTL (the local shape derives it from the server config, the EnvoyExtensionPolicy
    # states it for the default TTL); with flow control off the local shape waits 5 s.
    from extproc.config import FlowControlConfig
    from extproc.stack.local import message_timeout_s

    routing = hcm(translate_overlay(EG, OPTS).bootstrap)["http_filters"][1]["typed_config"]
    on = {"flow_control": {"enabled": True, "ttl_s": FlowControlConfig().ttl_s}}
    assert duration_s(routing["message_timeout"]) == message_timeout_s(on)
    assert message_timeout_s({}) == message_timeout_s(on)  # on by default
    assert (
        message_timeout_s({"flow_control": {"enabled": False}}) == EnvoyOptions().message_timeout_s
    )
