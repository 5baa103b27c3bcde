"""deploy/overlays/envoy-gateway-fleet: one server attached to every labelled HTTPRoute, serving
every InferencePool that names it. Schema validation of every object is in test_manifests.py
(the overlay is in its OVERLAYS); here, that the pieces fit: the policies select the routes,
each route names a pool that names our Service, and the embedded config finds those pools."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from extproc.config import load_config_text
from extproc.discovery.pools import PoolSelection, parse_pool, route_backend_pools

OVERLAY = Path(__file__).resolve().parents[2] / "deploy" / "overlays" / "envoy-gateway-fleet"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(OVERLAY)], check=True, capture_output=True, text=True, timeout=30
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def of(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def labels_match(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_both_policies_attach_to_every_labelled_route_and_only_by_label(
    docs: list[dict[str, Any]],
) -> None:
    routes = of(docs, "HTTPRoute")
    assert len(routes) >= 2 and "llm-route" not in {r["metadata"]["name"] for r in routes}
    for kind in ("EnvoyExtensionPolicy", "BackendTrafficPolicy"):
        (policy,) = of(docs, kind)
        assert "targetRefs" not in policy["spec"], kind
        (selector,) = policy["spec"]["targetSelectors"]
        assert selector["kind"] == "HTTPRoute"
        for route in routes:
            assert labels_match(selector, route["metadata"].get("labels") or {}), (kind, route)


def test_each_route_names_a_pool_the_server_serves(docs: list[dict[str, Any]]) -> None:
    (cm,) = [d for d in of(docs, "ConfigMap") if d["metadata"]["name"].startswith("extproc-config")]
    cfg = load_config_text(cm["data"]["config.yaml"])
    assert cfg.pools.enabled and not cfg.models
    (service,) = of(docs, "Service")
    assert service["metadata"]["name"] in cfg.pools.picker_names
    selection = PoolSelection(
        picker_names=frozenset(cfg.pools.picker_names), namespaces=tuple(cfg.pools.namespaces)
    )
    pools = {}
    for obj in of(docs, "InferencePool"):
        spec = parse_pool(obj)
        assert spec.problems == ()  # every annotation understood
        assert selection.selects(spec), spec.key
        pools[spec.key] = spec
    for route in of(docs, "HTTPRoute"):
        (pool,) = route_backend_pools(route)
        assert pool in pools, route["metadata"]["name"]
    assert len({m for p in pools.values() for m in p.models}) == len(pools)
