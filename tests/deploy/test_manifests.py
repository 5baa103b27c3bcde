"""deploy/: every overlay renders with `kubectl kustomize` and every object matches its schema.

Gateway API, Envoy Gateway, InferencePool and prometheus-operator kinds are checked against the real CRD
schemas in tests/deploy/crds (upstream files, unmodified), with unknown fields rejected the way the
API server's strict field validation does (a typo would otherwise be pruned silently).
Core kinds are checked with `kubernetes-validate` (strict).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator, Mapping
from typing import Any

import jsonschema  # type: ignore[import-untyped]
import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

from extproc.config import load_config_text, parse_route_annotations
from extproc.director.steps import EXPLAIN_HEADER
from extproc.server.accesslog import CLOSE_AFTER_BATCH_WAIT_S
from extproc.stack.envoy_config import EXTPROC_RETRY_BACK_OFF_S, EXTPROC_RETRY_ON, EnvoyOptions
from extproc.stack.envoy_gateway import EG_DEFAULTS, quantity_bytes
from extproc.wire import (
    ACCESS_LOG_NAME,
    DESTINATION_HEADER,
    LB_NAMESPACE,
    REQUEST_NAMESPACE,
    TOKEN_NAMESPACE,
)
from tests.deploy._manifests import (
    DEPLOY,
    REPO,
    find,
    pod_labels,
    render,
    validate,
)

OVERLAYS = [
    "envoy-gateway",
    "envoy-gateway-one-message",
    "envoy-gateway-fleet",
    "envoy-gateway-token-limits",
    "envoy-gateway-tracing",
    "inferencepool",
    "keda",
    "nats",
    "observability",
    "sim",
]
# The accounting Lua filter: one script for the local stack and for Envoy Gateway.
USAGE_LUA = REPO / "extproc" / "stack" / "usage.lua"


def server_config_map(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    """The server's ConfigMap: generated from deploy/base/config.yaml, hash-suffixed name."""
    matches = [
        d
        for d in docs
        if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith("extproc-config-")
    ]
    assert len(matches) == 1, f"expected one extproc-config-<hash> ConfigMap, got {len(matches)}"
    return matches[0]


def all_objects() -> Iterator[Any]:
    for overlay in OVERLAYS:
        for doc in render(overlay):
            yield pytest.param(
                overlay, doc, id=f"{overlay}:{doc['kind']}/{doc['metadata']['name']}"
            )


def test_every_overlay_is_checked() -> None:
    present = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir())
    assert present == sorted(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_renders(overlay: str) -> None:
    kinds = {doc["kind"] for doc in render(overlay)}
    assert kinds, f"{overlay} rendered nothing"


@pytest.mark.parametrize(("overlay", "obj"), list(all_objects()))
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_every_object_validates_against_its_schema(overlay: str, obj: dict[str, Any]) -> None:
    validate(obj)


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_the_validator_rejects_what_the_api_server_would() -> None:
    policy = copy.deepcopy(find(render("envoy-gateway"), "EnvoyExtensionPolicy"))
    policy["spec"]["extProc"][0]["processingMode"]["request"]["body"] = "Bufferd"
    with pytest.raises(jsonschema.ValidationError):
        validate(policy)
    policy = copy.deepcopy(find(render("envoy-gateway"), "EnvoyExtensionPolicy"))
    policy["spec"]["extProc"][0]["processingMod"] = {}
    with pytest.raises(jsonschema.ValidationError):
        validate(policy)
    proxy = copy.deepcopy(find(render("envoy-gateway"), "EnvoyProxy"))
    proxy["spec"]["telemetry"]["accessLog"]["settings"][0]["sinks"][0]["type"] = "Als"
    with pytest.raises(jsonschema.ValidationError):
        validate(proxy)
    proxy = copy.deepcopy(find(render("envoy-gateway"), "EnvoyProxy"))
    proxy["spec"]["telemetry"]["accessLog"]["settings"][0]["sinks"][0]["als"]["logname"] = "x"
    with pytest.raises(jsonschema.ValidationError):
        validate(proxy)
    gateway = copy.deepcopy(find(render("envoy-gateway"), "Gateway"))
    del gateway["spec"]["infrastructure"]["parametersRef"]["group"]
    with pytest.raises(jsonschema.ValidationError):
        validate(gateway)
    client = copy.deepcopy(find(render("envoy-gateway"), "ClientTrafficPolicy"))
    client["spec"]["connection"]["bufferLimit"] = "8MB"
    with pytest.raises(jsonschema.ValidationError):
        validate(client)
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
    configmap = server_config_map(docs)
    mounted = {v["name"]: v for v in pod["volumes"]}["config"]["configMap"]["name"]
    assert mounted == configmap["metadata"]["name"]
    pdb = find(docs, "PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels(deployment).items()


@pytest.mark.parametrize("overlay", ["envoy-gateway", "inferencepool", "keda", "nats"])
def test_the_admin_token_is_mounted_where_the_config_reads_it(overlay: str) -> None:
    docs = render(overlay)
    config = load_config_text(server_config_map(docs)["data"]["config.yaml"])
    assert config.admin.token is None and config.admin.token_file is not None
    pod = find(docs, "Deployment", "extproc")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    directory, _, key = config.admin.token_file.rpartition("/")
    volume = {v["name"]: v for v in pod["volumes"]}[mounts[directory]]["secret"]
    assert volume["secretName"] == "extproc-admin"  # the name kubectl extproc reads
    assert volume["items"] == [{"key": "token", "path": key}]
    secret = find(docs, "Secret", "extproc-admin")  # generated, no hash suffix
    assert set(secret["data"]) == {"token"}


def test_the_network_policy_admits_the_gateway_to_grpc_and_scrapers_to_metrics() -> None:
    docs = render("envoy-gateway")
    policy = find(docs, "NetworkPolicy", "extproc")
    deployment = find(docs, "Deployment", "extproc")
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels(deployment).items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    declared = {p["name"] for p in container["ports"]}
    sources = {}
    for rule in policy["spec"]["ingress"]:
        (port,) = rule["ports"]
        assert port["port"] in declared  # by name: a renumbered port stays covered
        (peer,) = rule["from"]
        sources[port["port"]] = peer["namespaceSelector"]["matchLabels"]
    assert sources == {
        "grpc": {"kubernetes.io/metadata.name": "envoy-gateway-system"},
        "metrics": {"kubernetes.io/metadata.name": "monitoring"},
    }
    # The PodMonitor scrapes the port the policy opens, at the open path.
    monitor = find(render("observability"), "PodMonitor", "extproc")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint.get("path", "/metrics") == "/metrics"


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
    expected |= {
        ("llm-d.ai", r, v) for r in ("inferencemodelrewrites", "inferenceobjectives") for v in read
    }
    expected |= {("", "events", "create")}
    assert granted == expected
    # Namespaced: the one cluster-wide object is the operators' read-only ClusterRole for
    # `kubectl extproc config` (HTTPRoutes live anywhere), bound to no one.
    cluster_wide = [d for d in render("envoy-gateway") if d["kind"].startswith("Cluster")]
    assert [(d["kind"], d["metadata"]["name"]) for d in cluster_wide] == [
        ("ClusterRole", "extproc-operator-routes")
    ]
    assert {v for rule in cluster_wide[0]["rules"] for v in rule["verbs"]} <= {"get", "list"}


def grpc_service(docs: tuple[dict[str, Any], ...]) -> tuple[str, str, int]:
    """Namespace, name and gRPC port of the server's Service: ext_proc and access log alike."""
    service = find(docs, "Service", "extproc")
    (port,) = [p for p in service["spec"]["ports"] if p["name"] == "grpc"]
    return service["metadata"]["namespace"], service["metadata"]["name"], port["port"]


def lua_metadata_keys() -> set[tuple[str, str]]:
    """(namespace, key) of every dynamic metadata usage.lua writes."""
    return set(re.findall(r':set\(\s*"([^"]+)"\s*,\s*"([^"]+)"', USAGE_LUA.read_text()))


def test_extension_policy_routes_on_the_request_only() -> None:
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
    (routing,) = policy["spec"]["extProc"]
    namespace, name, port = grpc_service(docs)
    (ref,) = routing["backendRefs"]
    assert (ref["group"], ref["kind"], ref["name"], ref["port"]) == ("", "Service", name, port)
    assert namespace == policy["metadata"]["namespace"]
    assert routing["processingMode"] == {
        "request": {"body": "Buffered", "attributes": ["xds.route_name"]}
    }
    assert routing["failOpen"] is False
    # The pick (envoy.lb) and what the decision knew, for the access-log record
    # (extproc.request); token metadata is the Lua filter's.
    assert sorted(routing["metadata"]["writableNamespaces"]) == sorted(
        [LB_NAMESPACE, REQUEST_NAMESPACE]
    )


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o.startswith("envoy-gateway")])
def test_no_ext_proc_filter_observes_responses(overlay: str) -> None:
    # Accounting reads usage inside Envoy (Lua) and gets one access-log record per request; an
    # ext_proc filter on the response would cost a gRPC message per streamed chunk again.
    policies = [d for d in render(overlay) if d["kind"] == "EnvoyExtensionPolicy"]
    assert policies
    for policy in policies:
        for entry in policy["spec"].get("extProc", []):
            assert "response" not in entry.get("processingMode", {})
            assert not entry.get("shadowMode", False)


def test_overlay_ships_the_stack_usage_lua_byte_for_byte() -> None:
    shipped = DEPLOY / "overlays" / "envoy-gateway" / "usage.lua"
    assert shipped.read_bytes() == USAGE_LUA.read_bytes(), (
        f"copy {USAGE_LUA.relative_to(REPO)} to {shipped.relative_to(REPO)}"
    )


def test_extension_policy_runs_usage_lua_from_the_generated_config_map() -> None:
    docs = render("envoy-gateway")
    policy = find(docs, "EnvoyExtensionPolicy")
    (lua,) = policy["spec"]["lua"]
    # Envoy Gateway's CEL rules, which the JSON schema leaves out: a ValueRef has a valueRef
    # and no inline, and names a ConfigMap of the core group.
    assert lua["type"] == "ValueRef" and "inline" not in lua
    ref = lua["valueRef"]
    assert ref["kind"] == "ConfigMap" and ref["group"] in ("", "v1")
    # Resolvable as written (no hash suffix), in the policy's namespace.
    configmap = find(docs, "ConfigMap", ref["name"])
    assert configmap["metadata"]["namespace"] == policy["metadata"]["namespace"]
    # Envoy Gateway reads the key `lua` (else whichever key comes first).
    assert configmap["data"] == {"lua": USAGE_LUA.read_text()}


def test_gateway_takes_the_envoy_proxy() -> None:
    docs = render("envoy-gateway")
    gateway = find(docs, "Gateway")
    proxy = find(docs, "EnvoyProxy")
    assert gateway["spec"]["infrastructure"]["parametersRef"] == {
        "group": "gateway.envoyproxy.io",
        "kind": "EnvoyProxy",
        "name": proxy["metadata"]["name"],
    }
    # A Gateway's parametersRef is local: Envoy Gateway looks in the Gateway's namespace.
    assert proxy["metadata"]["namespace"] == gateway["metadata"]["namespace"]
    route = find(docs, "HTTPRoute")
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]


def test_access_log_sends_each_request_to_the_ext_proc_service() -> None:
    docs = render("envoy-gateway")
    proxy = find(docs, "EnvoyProxy")
    settings = proxy["spec"]["telemetry"]["accessLog"]["settings"]
    als = [(s, sink["als"]) for s in settings for sink in s["sinks"] if sink["type"] == "ALS"]
    assert len(als) == 1
    setting, sink = als[0]
    # One record per HTTP request (not per upstream attempt), for every request.
    assert setting["type"] == "Route"
    assert "matches" not in setting
    assert sink["type"] == "HTTP"
    assert sink["logName"] == ACCESS_LOG_NAME  # the server ignores other logs
    # Envoy Gateway's CEL rules: backendRefs (not backendRef), Service of the core group.
    assert "backendRef" not in sink
    (ref,) = sink["backendRefs"]
    assert (ref["group"], ref["kind"]) == ("", "Service")
    namespace, name, port = grpc_service(docs)
    assert (ref["name"], ref["port"]) == (name, port)
    # A backendRef without namespace is looked up in the EnvoyProxy's namespace.
    assert ref.get("namespace", proxy["metadata"]["namespace"]) == namespace
    config = load_config_text(server_config_map(docs)["data"]["config.yaml"])
    container = find(docs, "Deployment", "extproc")["spec"]["template"]["spec"]["containers"][0]
    grpc = {p["name"]: p["containerPort"] for p in container["ports"]}["grpc"]
    assert config.server.grpc_port == grpc


def test_access_log_keeps_the_default_stdout_log() -> None:
    # Settings replace Envoy Gateway's default (JSON to /dev/stdout, routes and unmatched
    # requests): one setting must bring it back as it was.
    settings = find(render("envoy-gateway"), "EnvoyProxy")["spec"]["telemetry"]["accessLog"]
    stdout = [s for s in settings["settings"] if any(k["type"] == "File" for k in s["sinks"])]
    assert stdout == [{"sinks": [{"type": "File", "file": {"path": "/dev/stdout"}}]}]
    assert "disable" not in settings


def test_default_overlay_needs_no_rate_limit_service() -> None:
    # A global rate limit without Envoy Gateway's rate limit service makes the route answer 500.
    assert "rateLimit" not in find(render("envoy-gateway"), "BackendTrafficPolicy")["spec"]


def test_token_limits_charge_what_the_lua_filter_writes() -> None:
    docs = render("envoy-gateway-token-limits")
    policy = find(docs, "BackendTrafficPolicy")
    assert (
        policy["spec"]["loadBalancer"]
        == find(render("envoy-gateway"), "BackendTrafficPolicy")["spec"]["loadBalancer"]
    )
    rate = policy["spec"]["rateLimit"]
    assert rate["type"] == "Global"  # response costs exist for global limits only
    (rule,) = rate["global"]["rules"]
    # Check the budget on the request; charge the answer's tokens when it is done.
    assert rule["cost"]["request"] == {"from": "Number", "number": 0}
    response = rule["cost"]["response"]
    assert response["from"] == "Metadata" and "number" not in response
    charged = (response["metadata"]["namespace"], response["metadata"]["key"])
    assert charged == (TOKEN_NAMESPACE, "llm_total_token")
    written = lua_metadata_keys()
    assert {(TOKEN_NAMESPACE, "llm_input_token"), (TOKEN_NAMESPACE, "llm_output_token")} <= written
    assert charged in written
    # Users are told apart the way the server tells them apart.
    config = load_config_text(server_config_map(docs)["data"]["config.yaml"])
    assert rule["clientSelectors"] == [
        {"headers": [{"name": config.routing.user_header, "type": "Distinct"}]}
    ]


def test_backend_traffic_policy_overrides_the_endpoint_from_our_header() -> None:
    docs = render("envoy-gateway")
    policy = find(docs, "BackendTrafficPolicy")
    assert policy["spec"]["targetRefs"][0]["name"] == find(docs, "HTTPRoute")["metadata"]["name"]
    assert policy["spec"]["loadBalancer"]["endpointOverride"] == {
        "extractFrom": [{"header": "x-gateway-destination-endpoint"}]
    }


def test_timeouts_match_the_local_stack() -> None:
    """No limit on a whole request (streams), the local stack's idle limit between bytes."""
    docs = render("envoy-gateway")
    route = find(docs, "HTTPRoute")
    assert [r["timeouts"]["request"] for r in route["spec"]["rules"]] == ["0s"]
    assert EnvoyOptions().route_timeout_s == 0
    idle = find(docs, "BackendTrafficPolicy")["spec"]["timeout"]["http"]["streamIdleTimeout"]
    assert idle == f"{EnvoyOptions().stream_idle_timeout_s:g}s"


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
    config = load_config_text(server_config_map(docs)["data"]["config.yaml"])
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


# -- what Envoy Gateway would otherwise get wrong (its defaults are not the local stack's) ----

# Envoy's per-cluster circuit-breaker default, which Envoy Gateway leaves in place.
ENVOY_DEFAULT_CIRCUIT_BREAKER = 1024
# Envoy Gateway's listener buffer when no ClientTrafficPolicy sets one.
EG_DEFAULT_BUFFER_LIMIT = EG_DEFAULTS["buffer_limit_bytes"]
# Envoy's access-log flush interval; Envoy Gateway sets none.
EG_ACCESS_LOG_FLUSH_S = 1.0


def client_traffic_policy(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    policy = find(docs, "ClientTrafficPolicy")
    gateway = find(docs, "Gateway")
    assert policy["spec"]["targetRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": gateway["metadata"]["name"],
        }
    ]
    assert policy["metadata"]["namespace"] == gateway["metadata"]["namespace"]
    return policy


@pytest.mark.parametrize("overlay", ["envoy-gateway", "envoy-gateway-token-limits"])
def test_listener_buffers_any_prompt_the_server_accepts(overlay: str) -> None:
    # The routing filter buffers the whole body in the listener's buffer: below the server's
    # limit, Envoy answers 413 itself for prompts the server would take (EG's default: 32 KiB).
    docs = render(overlay)
    limit = quantity_bytes(client_traffic_policy(docs)["spec"]["connection"]["bufferLimit"])
    config = load_config_text(server_config_map(docs)["data"]["config.yaml"])
    assert limit > config.server.max_body_bytes > EG_DEFAULT_BUFFER_LIMIT
    assert limit >= EnvoyOptions().buffer_limit_bytes  # as the local stack


def test_quantity_bytes_reads_kubernetes_suffixes() -> None:
    assert quantity_bytes("8Mi") == 8 * 1024 * 1024
    assert quantity_bytes("32Ki") == EG_DEFAULT_BUFFER_LIMIT
    assert quantity_bytes(32768) == quantity_bytes("32768") == EG_DEFAULT_BUFFER_LIMIT
    assert quantity_bytes("4M") == 4_000_000


def test_a_client_sent_destination_is_removed_before_routing() -> None:
    early = client_traffic_policy(render("envoy-gateway"))["spec"]["headers"]["earlyRequestHeaders"]
    assert DESTINATION_HEADER in early["remove"]


def assert_circuit_breaker_lifted(breaker: Mapping[str, int], at_least: int) -> None:
    for key in ("maxConnections", "maxPendingRequests", "maxParallelRequests"):
        assert breaker.get(key, ENVOY_DEFAULT_CIRCUIT_BREAKER) >= at_least, key
    assert at_least > ENVOY_DEFAULT_CIRCUIT_BREAKER


@pytest.mark.parametrize("overlay", ["envoy-gateway", "envoy-gateway-token-limits"])
def test_model_cluster_circuit_breaker_is_lifted(overlay: str) -> None:
    # Every streamed completion holds a request on the model cluster for its whole length.
    policy = find(render(overlay), "BackendTrafficPolicy")
    assert_circuit_breaker_lifted(
        policy["spec"].get("circuitBreaker", {}), EnvoyOptions().upstream_max_requests
    )


def test_ext_proc_cluster_circuit_breaker_is_lifted() -> None:
    # One ext_proc stream per request being decided (per completion where the stream is
    # held: no access log); over the limit, fail-closed answers 500.
    (routing,) = find(render("envoy-gateway"), "EnvoyExtensionPolicy")["spec"]["extProc"]
    breaker = routing.get("backendSettings", {}).get("circuitBreaker", {})
    assert_circuit_breaker_lifted(breaker, EnvoyOptions().extproc_max_requests)


def test_access_log_cluster_is_health_checked_and_lifted() -> None:
    proxy = find(render("envoy-gateway"), "EnvoyProxy")
    (sink,) = [
        sink["als"]
        for s in proxy["spec"]["telemetry"]["accessLog"]["settings"]
        for sink in s["sinks"]
        if sink["type"] == "ALS"
    ]
    settings = sink.get("backendSettings", {})
    check = settings.get("healthCheck", {}).get("active", {})
    assert check.get("type") == "GRPC" and check["grpc"] == {"service": "readiness"}
    assert_circuit_breaker_lifted(settings.get("circuitBreaker", {}), 10_000)
    # A draining server waits for Envoy's next batch longer than Envoy's flush interval.
    assert CLOSE_AFTER_BATCH_WAIT_S > EG_ACCESS_LOG_FLUSH_S


def test_retries_trigger_as_the_local_stack() -> None:
    retry = find(render("envoy-gateway"), "BackendTrafficPolicy")["spec"]["retry"]
    local = EnvoyOptions()
    assert set(retry["retryOn"]["triggers"]) == set(local.retry_on.split(","))
    assert retry["retryOn"]["httpStatusCodes"] == list(local.retriable_status_codes)
    assert retry["numRetries"] == local.num_retries


def test_routing_stream_retries_trigger_as_the_local_stack() -> None:
    # A routing stream reset by a replica that died with it open is retried too (the local
    # stack's e2e test: tests/reliability/test_extproc_retry_e2e.py).
    (routing,) = find(render("envoy-gateway"), "EnvoyExtensionPolicy")["spec"]["extProc"]
    retry = routing["backendSettings"]["retry"]
    triggers = retry["retryOn"]["triggers"]
    assert ",".join(triggers) == EXTPROC_RETRY_ON
    assert "reset" in triggers
    # As many retries, as far apart: the later ones land after Envoy took the refused out.
    assert retry["numRetries"] == EnvoyOptions().extproc_retries
    back_off = retry["perRetry"]["backOff"]
    as_seconds = tuple(int(v.removesuffix("ms")) / 1000 for v in back_off.values())
    assert as_seconds == EXTPROC_RETRY_BACK_OFF_S


def echoed_headers(route: Mapping[str, Any]) -> list[dict[str, str]]:
    """The response headers every rule of `route` sets (one ResponseHeaderModifier each)."""
    sets = []
    for rule in route["spec"]["rules"]:
        mods = [
            f["responseHeaderModifier"]
            for f in rule.get("filters", [])
            if f["type"] == "ResponseHeaderModifier"
        ]
        assert len(mods) == 1, "each rule needs the ResponseHeaderModifier that echoes"
        sets.append(mods[0].get("set", []))
    assert all(s == sets[0] for s in sets)
    return list(sets[0])


def test_route_echoes_what_the_server_set_on_the_request() -> None:
    # Envoy Gateway copies these values into the route's response_headers_to_add unchanged
    # (OVERWRITE_IF_EXISTS_OR_ADD, keep_empty_value false): the same Envoy config the local
    # stack renders from EnvoyOptions.echo_headers, which tests/e2e exercise on a real Envoy.
    docs = render("envoy-gateway")
    echoed = echoed_headers(find(docs, "HTTPRoute"))
    local = EnvoyOptions().echo_headers
    assert echoed == [{"name": name, "value": f"%REQ({name})%"} for name in local]
    config = load_config_text(server_config_map(docs)["data"]["config.yaml"])
    # session-affinity's refreshed id must round-trip; explain must be visible.
    assert {config.routing.session_header, EXPLAIN_HEADER} <= set(local)


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)", duration)
    assert match, duration
    return int(match[1]) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match[2]]


def test_ext_proc_message_timeout_outlasts_the_flow_control_queue() -> None:
    """A request waiting in flow control holds its ext_proc answer up to the TTL: Envoy must
    wait longer, or the client gets Envoy's 500 instead of our 429/503 with the reason. The
    local stack derives its timeout the same way (`message_timeout_s`)."""
    from extproc.stack.local import message_timeout_s

    docs = render("envoy-gateway")
    (routing,) = find(docs, "EnvoyExtensionPolicy")["spec"]["extProc"]
    timeout = _seconds(routing["messageTimeout"])
    config = load_config_text(server_config_map(docs)["data"]["config.yaml"])
    assert timeout > config.flow_control.ttl_s
    enabled = {"flow_control": {"enabled": True, "ttl_s": config.flow_control.ttl_s}}
    assert message_timeout_s(enabled) == timeout
    assert message_timeout_s({"flow_control": {"enabled": False}}) == 5.0
    assert message_timeout_s({}) == timeout  # on by default


def test_keda_scales_the_model_servers_from_zero_on_flow_control_metrics() -> None:
    """The ScaledObject targets the model server Deployment, may go to zero, and queries
    metrics the server exports, for the model the config serves; the overlay's config is the
    base config with flow control on (else nothing would wait and the queue reads 0)."""
    from prometheus_client import CollectorRegistry

    from extproc.flowcontrol import FlowMetrics

    docs = render("keda")
    scaled = find(docs, "ScaledObject")
    sim = find(render("sim"), "Deployment")
    assert scaled["spec"]["scaleTargetRef"]["name"] == sim["metadata"]["name"]
    assert scaled["spec"]["minReplicaCount"] == 0
    registry = CollectorRegistry()
    FlowMetrics(registry)
    exported = {m.name for m in registry.collect()}
    base = yaml.safe_load((DEPLOY / "base" / "config.yaml").read_text())
    model = base["models"][0]["name"]
    triggers = {t["name"]: t["metadata"] for t in scaled["spec"]["triggers"]}
    assert set(triggers) == {"queue-depth", "pool-saturation"}
    for meta in triggers.values():
        names = set(re.findall(r"(extproc_[a-z_]+)\{", meta["query"]))
        assert names and names <= exported, names
        assert f'model="{model}"' in meta["query"]
    assert triggers["queue-depth"]["activationThreshold"] == "0"  # a waiting request wakes it
    overlay = yaml.safe_load(server_config_map(docs)["data"]["config.yaml"])
    assert overlay["flow_control"].pop("enabled") is True
    base["flow_control"].pop("enabled")
    assert overlay == base, "copy deploy/base/config.yaml into the overlay's config.yaml"
