"""deploy/: every overlay renders with `kubectl kustomize` and every object matches its schema.

Gateway API, Envoy Gateway and InferencePool kinds are checked against the real CRD
schemas in tests/deploy/crds (upstream files, unmodified), with unknown fields rejected the way the
API server's strict field validation does (a typo would otherwise be pruned silently).
Core kinds are checked with `kubernetes-validate` (strict).
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from extproc.config import load_config_text, parse_route_annotations

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
CRDS = Path(__file__).resolve().parent / "crds"  # upstream CRDs, unmodified (see its README)
OVERLAYS = ["envoy-gateway", "envoy-gateway-shadow", "inferencepool", "sim"]
KUBERNETES_VERSION = "1.32"
KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"


@functools.cache
def render(overlay: str) -> tuple[dict[str, Any], ...]:
    out = subprocess.run(
        [KUBECTL, "kustomize", str(DEPLOY / "overlays" / overlay)],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return tuple(doc for doc in yaml.safe_load_all(out) if doc)


def find(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    matches = [d for d in docs if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    assert len(matches) == 1, f"expected one {kind} {name or ''}, got {len(matches)}"
    return matches[0]


def _strict(schema: Any) -> Any:
    """Closes every object schema: unknown fields become errors, as with strict validation."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_schemas() -> Mapping[tuple[str, str], Any]:
    if not CRDS.is_dir():
        pytest.fail(f"CRD schemas not found at {CRDS}")
    schemas: dict[tuple[str, str], Any] = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        group, kind = crd["spec"]["group"], crd["spec"]["names"]["kind"]
        for version in crd["spec"]["versions"]:
            schema = copy.deepcopy(version["schema"]["openAPIV3Schema"])
            # apiVersion/kind/metadata are checked by the API server itself, not the CRD schema.
            schema.setdefault("properties", {})["metadata"] = {"type": "object"}
            schemas[(f"{group}/{version['name']}", kind)] = _strict(schema)
    return schemas


def validate(obj: Mapping[str, Any]) -> None:
    key = (obj["apiVersion"], obj["kind"])
    schema = crd_schemas().get(key)
    if schema is not None:
        jsonschema.Draft7Validator(schema).validate(obj)
        return
    group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
    assert "." not in group or group.endswith(".k8s.io"), f"no schema for {key}"
    kubernetes_validate.validate(dict(obj), KUBERNETES_VERSION, strict=True)


def all_objects() -> Iterator[Any]:
    for overlay in OVERLAYS:
        for doc in render(overlay):
            yield pytest.param(
                overlay, doc, id=f"{overlay}:{doc['kind']}/{doc['metadata']['name']}"
            )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders(overlay: str) -> None:
    kinds = {doc["kind"] for doc in render(overlay)}
    assert kinds, f"{overlay} rendered nothing"


@pytest.mark.parametrize(("overlay", "obj"), list(all_objects()))
def test_every_object_validates_against_its_schema(overlay: str, obj: dict[str, Any]) -> None:
    validate(obj)


def test_the_validator_rejects_what_the_api_server_would() -> None:
    policy = copy.deepcopy(find(render("envoy-gateway"), "EnvoyExtensionPolicy"))
    policy["spec"]["extProc"][0]["processingMode"]["request"]["body"] = "Bufferd"
    with pytest.raises(jsonschema.ValidationError):
        validate(policy)
    policy = copy.deepcopy(find(render("envoy-gateway"), "EnvoyExtensionPolicy"))
    policy["spec"]["extProc"][0]["processingMod"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate(policy)
    deployment = copy.deepcopy(find(render("envoy-gateway"), "Deployment"))
    deployment["spec"]["replica"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)


# -- what the manifests must say ------------------------------------------------------------


def test_server_deployment_is_hardened_and_probed() -> None:
    docs = render("envoy-gateway")
    deployment = find(docs, "Deployment", "extproc")
    spec = deployment["spec"]
    assert spec["replicas"] == 2
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (container,) = pod["containers"]
    assert container["args"][:3] == ["serve", "--config", "/etc/extproc/config.yaml"]
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert container["livenessProbe"]["grpc"] == {"port": 9002, "service": "liveness"}
    assert container["readinessProbe"]["grpc"] == {"port": 9002, "service": "readiness"}
    assert {"cpu", "memory"} <= set(container["resources"]["requests"])
    assert {"cpu", "memory"} <= set(container["resources"]["limits"])
    # The generated ConfigMap (hash-suffixed name) is the one mounted.
    configmap = find(docs, "ConfigMap")
    mounted = {v["name"]: v for v in pod["volumes"]}["config"]["configMap"]["name"]
    assert mounted == configmap["metadata"]["name"]
    pdb = find(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(deployment).items()


def pod_labels(deployment: Mapping[str, Any]) -> dict[str, str]:
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    return labels


def test_service_exposes_grpc_as_h2c_and_metrics() -> None:
    docs = render("envoy-gateway")
    service = find(docs, "Service", "extproc")
    ports = {p["name"]: p for p in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == 9002 and ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert ports["metrics"]["port"] == 9090
    assert service["spec"]["selector"].items() <= pod_labels(find(docs, "Deployment")).items()


def test_rbac_is_read_only_except_creating_events() -> None:
    role = find(render("envoy-gateway"), "Role", "extproc")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    read = {"get", "list", "watch"}
    expected = {("", "pods", v) for v in read}
    expected |= {("inference.networking.k8s.io", "inferencepools", v) for v in read}
    expected |= {("gateway.networking.k8s.io", "httproutes", v) for v in read}
    expected |= {("", "events", "create")}
    assert granted == expected
    assert not any(d["kind"].startswith("Cluster") for d in render("envoy-gateway"))


def test_extension_policy_processing_modes() -> None:
    docs = render("envoy-gateway")
    policy = find(docs, "EnvoyExtensionPolicy")
    route = find(docs, "HTTPRoute")
    assert policy["spec"]["targetRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "HTTPRoute",
            "name": route["metadata"]["name"],
        }
    ]
    routing, accounting = policy["spec"]["extProc"]
    service = find(docs, "Service", "extproc")
    for entry in (routing, accounting):
        (ref,) = entry["backendRefs"]
        assert (ref["kind"], ref["name"], ref["port"]) == ("Service", "extproc", 9002)
        assert service["metadata"]["namespace"] == policy["metadata"]["namespace"]
    assert routing["processingMode"] == {
        "request": {"body": "Buffered", "attributes": ["xds.route_name"]}
    }
    assert routing["failOpen"] is False
    assert set(routing["metadata"]["writableNamespaces"]) == {"envoy.lb", "io.envoy.ai_gateway"}
    assert accounting["processingMode"]["response"]["body"] == "Streamed"
    assert "request" not in accounting["processingMode"]

    shadow = find(render("envoy-gateway-shadow"), "EnvoyExtensionPolicy")["spec"]["extProc"]
    assert "shadowMode" not in shadow[0]
    # EG's CEL rule: shadowMode needs Streamed (or no) body modes.
    assert shadow[1]["shadowMode"] is True
    assert shadow[1]["processingMode"]["response"]["body"] == "Streamed"


def test_backend_traffic_policy_overrides_the_endpoint_from_our_header() -> None:
    docs = render("envoy-gateway")
    policy = find(docs, "BackendTrafficPolicy")
    assert policy["spec"]["targetRefs"][0]["name"] == find(docs, "HTTPRoute")["metadata"]["name"]
    assert policy["spec"]["loadBalancer"]["endpointOverride"] == {
        "extractFrom": [{"header": "x-gateway-destination-endpoint"}]
    }


def test_example_route_annotations_are_valid() -> None:
    route = find(render("envoy-gateway"), "HTTPRoute")
    annotations = route["metadata"]["annotations"]
    assert any(key.startswith("lb.extproc.io/") for key in annotations)
    settings, errors = parse_route_annotations(annotations)
    assert errors == []
    assert settings.strategy == annotations["lb.extproc.io/strategy"]


@pytest.mark.parametrize("overlay", ["envoy-gateway", "inferencepool"])
def test_embedded_config_loads_and_finds_the_simulated_pods(overlay: str) -> None:
    docs = render(overlay)
    config = load_config_text(find(docs, "ConfigMap")["data"]["config.yaml"])
    assert config.server.grpc_port == 9002 and config.server.metrics_port == 9090
    assert config.server.host == "0.0.0.0"  # reachable from Envoy through the Service
    sim = find(render("sim"), "Deployment", "vllm-sim")
    (model,) = config.models
    assert model.kubernetes is not None
    sim_args = sim["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--model={model.name}" in sim_args
    if model.kubernetes.inference_pool is None:
        selector = model.kubernetes.selector
        ports = [model.kubernetes.target_port]
    else:
        pool = find(docs, "InferencePool", model.kubernetes.inference_pool)
        selector = pool["spec"]["selector"]["matchLabels"]
        ports = [p["number"] for p in pool["spec"]["targetPorts"]]
    assert selector.items() <= pod_labels(sim).items()
    container_ports = [
        p["containerPort"] for p in sim["spec"]["template"]["spec"]["containers"][0]["ports"]
    ]
    assert set(ports) <= set(container_ports)
    assert model.kubernetes.kv_events_port in container_ports


def test_inference_pool_points_at_our_service() -> None:
    docs = render("inferencepool")
    pool = find(docs, "InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = find(docs, "Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    assert ref["failureMode"] == "FailClose"


def test_sim_overlay_runs_four_engines_behind_a_service() -> None:
    docs = render("sim")
    deployment = find(docs, "Deployment", "vllm-sim")
    assert deployment["spec"]["replicas"] == 4
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[0] == "sim" and "--port=8000" in args
    service = find(docs, "Service", "vllm-sim")
    assert service["spec"]["selector"].items() <= pod_labels(deployment).items()
    route = find(render("envoy-gateway"), "HTTPRoute")
    backend = route["spec"]["rules"][0]["backendRefs"][0]
    assert (backend["name"], backend["port"]) == ("vllm-sim", 8000)
