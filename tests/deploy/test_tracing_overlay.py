"""The tracing overlay: Envoy Gateway's EnvoyProxy runs the OpenTelemetry tracer, and the
server, with the base config plus `tracing:`, exports to the same collector."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import yaml

from extproc.config import load_config_text
from tests.deploy._manifests import DEPLOY, find, render

OVERLAY = "envoy-gateway-tracing"


def server_config_map(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    (cm,) = (
        d for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("extproc-config-")
    )  # fmt: skip
    return cm


def test_envoy_and_the_server_trace_to_one_collector() -> None:
    docs = render(OVERLAY)
    tracing = find(docs, "EnvoyProxy", "llm-gateway")["spec"]["telemetry"]["tracing"]
    provider = tracing["provider"]
    assert provider["type"] == "OpenTelemetry"
    (backend,) = provider["backendRefs"]
    assert backend["kind"] == "Service"
    config = load_config_text(server_config_map(docs)["data"]["config.yaml"]).tracing
    assert config.enabled
    endpoint = urlsplit(config.endpoint)
    assert (endpoint.hostname, endpoint.port) == (backend["name"], backend["port"])
    assert 0 < tracing["samplingRate"] <= 100


def test_the_overlay_keeps_the_access_log() -> None:
    """Tracing is added to the EnvoyProxy's telemetry, not put in place of the accounting."""
    telemetry = find(render(OVERLAY), "EnvoyProxy", "llm-gateway")["spec"]["telemetry"]
    base = find(render("envoy-gateway"), "EnvoyProxy", "llm-gateway")["spec"]["telemetry"]
    assert telemetry["accessLog"] == base["accessLog"]


def test_the_overlay_config_is_the_base_config_plus_tracing() -> None:
    base = yaml.safe_load((DEPLOY / "base" / "config.yaml").read_text())
    overlay = yaml.safe_load(server_config_map(render(OVERLAY))["data"]["config.yaml"])
    assert overlay.pop("tracing")["enabled"] is True
    assert overlay == base, "copy deploy/base/config.yaml into the overlay's config.yaml"
