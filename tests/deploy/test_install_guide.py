"""The install guide (docs/operations.md §1, and §4's status page) against what its steps
apply (issue 39 #2, #3): the overlays step 5 applies, rendered with `kubectl kustomize`, hold
what step 6's `kubectl extproc` commands and the status page need, and nothing that needs
CRDs the guide never installs. That the plugin's calls are the ones granted is checked by
running it (tests/kubectl/test_kubectl_plugin.py)."""

from __future__ import annotations

import functools
import re
from typing import Any

import pytest

from extproc.config import load_config_text
from extproc.kubectl import ADMIN_PORT_NAME, ADMIN_SECRET, _parser
from tests.deploy._manifests import REPO, find, render

GUIDE = REPO / "docs" / "operations.md"
# What a cluster has once steps 1-2 ran: the core API, Gateway API, Envoy Gateway and the
# InferencePool CRDs; not prometheus-operator's (deploy/overlays/observability needs those).
INSTALLED_GROUPS = {
    "", "apps", "policy", "rbac.authorization.k8s.io", "networking.k8s.io",
    "gateway.networking.k8s.io", "gateway.envoyproxy.io", "inference.networking.k8s.io",
}  # fmt: skip


def between(text: str, start: str, end: str) -> str:
    return text[text.index(start) : text.index(end, text.index(start))]


@functools.cache
def step(name: str) -> str:
    """A step of §1, from its heading to the next one."""
    text = GUIDE.read_text()
    return between(text, f"### Step {name}", "\n### ")


def applied_overlays() -> list[str]:
    return re.findall(r"^kubectl apply -k deploy/overlays/([\w-]+)$", step("5"), re.M)


def applied() -> list[dict[str, Any]]:
    return [doc for overlay in applied_overlays() for doc in render(overlay)]


def server_config() -> Any:
    docs = render("envoy-gateway")
    (cm,) = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("extproc-config-")
    ]
    return load_config_text(cm["data"]["config.yaml"])


def test_step_5_applies_the_engines_then_the_server() -> None:
    assert applied_overlays() == ["sim", "envoy-gateway"]


def test_what_step_5_applies_needs_no_crd_the_guide_did_not_install() -> None:
    groups = {d["apiVersion"].rpartition("/")[0] for d in applied()}
    assert groups <= INSTALLED_GROUPS, sorted(groups - INSTALLED_GROUPS)


def test_step_6_runs_the_plugin_with_the_roles_step_5_applied() -> None:
    commands = set(re.findall(r"^kubectl extproc (\w+)", step("6"), re.M))
    assert commands == {"status", "explain", "config"}
    # The plugin's way to the admin port: a port-forward, which the NetworkPolicy (only
    # Prometheus reaches the admin port) does not govern; the API server's pod proxy would
    # need a rule the guide never adds.
    assert _parser().parse_args(["status"]).via == "port-forward"
    docs = applied()
    role = find(tuple(docs), "Role", "extproc-operator")
    routes = find(tuple(docs), "ClusterRole", "extproc-operator-routes")
    granted = {
        (verb, resource, name)
        for rule in role["rules"] + routes["rules"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
        for name in rule.get("resourceNames", ["*"])
    }
    needed = {
        ("list", "pods", "*"),  # the replicas
        ("get", "secrets", ADMIN_SECRET),  # the admin token, that one Secret only
        ("get", "pods/portforward", "*"),  # status, explain, config: the admin port
        ("create", "pods/portforward", "*"),
        ("get", "pods", "*"),  # config: the ConfigMap a pod mounts
        ("get", "configmaps", "*"),
        ("list", "httproutes", "*"),  # config: the routes' annotations and their Events
        ("list", "events", "*"),
    }
    assert needed <= granted, sorted(needed - granted)
    assert not any(r == "secrets" and n == "*" for _, r, n in granted)


def test_the_port_forwards_reach_the_admin_port() -> None:
    deployment = find(tuple(applied()), "Deployment", "extproc")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    config = server_config()
    assert ports[ADMIN_PORT_NAME] == config.server.metrics_port  # what the plugin forwards to
    # §4: the status page through `kubectl port-forward deploy/extproc 9090:9090`.
    forward = re.search(
        r"kubectl -n extproc port-forward deploy/extproc (\d+):(\d+)",
        between(GUIDE.read_text(), "### The status page", "\n## "),
    )
    assert forward is not None
    assert int(forward.group(2)) == config.server.metrics_port


def test_the_status_page_the_guide_opens_is_on() -> None:
    assert server_config().server.status_page is True


@pytest.mark.parametrize(
    "doc", [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_pages_are_opened_the_same_way_on_every_os(doc: Any) -> None:
    """`open URL` is macOS only (xdg-open elsewhere): the docs say `python3 -m webbrowser`."""
    macos_only = [ln for ln in doc.read_text().splitlines() if re.match(r"\s*open\s+https?://", ln)]
    assert macos_only == []
