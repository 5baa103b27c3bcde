"""The local Envoy bootstrap as Envoy Gateway renders deploy/overlays/envoy-gateway.

`extproc up --gateway-shape envoy-gateway` runs Envoy with this bootstrap instead of the local
one (envoy_config.py), so what Envoy Gateway would do on a cluster (its filter order and
names, its defaults, its route names) meets the real server and simulators here. The
values come from the overlay's manifests, read at render time (overlay.py); Envoy Gateway's
defaults fill what they leave unset. This is a translator for the subset of the Envoy Gateway
API our manifests use: a field it does not render is an OverlayError naming it, never
silently dropped.

Derived from Envoy Gateway's translator (internal/gatewayapi, internal/xds/translator) and its
golden files (internal/xds/translator/testdata/out/xds-ir, internal/cmd/egctl/testdata/
translate/out), v1.8.0 to v1.9.0 and main @ d32f2829; docs/operations.md, "The Envoy Gateway
shape", lists which file each piece follows so it can be re-checked on the next release.
Differences that stay (no xDS server here): the model clusters are STATIC with the local
addresses instead of EDS; the server processes' clusters are EDS read from files the local
stack writes (`EnvoyOptions.server_eds_dir`; STATIC without it), so a stopping process leaves
them as a terminating pod leaves Envoy Gateway's EDS; Envoy Gateway's own listeners
(readiness, stats) and bootstrap extras (overload manager, runtime) are left out.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from extproc.config import RouteSettings, parse_route_annotations
from extproc.stack.envoy_config import EnvoyOptions, HostPort, retry_elsewhere
from extproc.stack.overlay import Overlay, OverlayError, load_overlay

__all__ = [
    "DEFAULT_OVERLAY",
    "EG_DEFAULTS",
    "EnvoyGatewayTranslation",
    "GatewayShape",
    "OverlayError",
    "eds_path",
    "eds_response",
    "translate",
    "translate_overlay",
]

# The repository's deploy/ (the local stack runs from a checkout).
DEPLOY_DIR = Path(__file__).resolve().parents[2] / "deploy"
DEFAULT_OVERLAY = DEPLOY_DIR / "overlays" / "envoy-gateway"


class GatewayShape(enum.StrEnum):
    """Which gateway's Envoy configuration the local stack reproduces."""

    LOCAL = "local"  # envoy_config.render_bootstrap: the bootstrap `make run` always had
    ENVOY_GATEWAY = "envoy-gateway"  # this module: Envoy Gateway's translation of deploy/


# Envoy Gateway's values where our manifests set nothing. Each names where Envoy Gateway sets
# it; the CRD defaults (the API server fills them in) are checked against tests/deploy/crds.
EG_DEFAULTS: Mapping[str, Any] = {
    # xds/translator/listener.go (tcpListenerPerConnectionBufferLimitBytes), cluster.go
    "buffer_limit_bytes": 32768,
    "connect_timeout": "10s",  # cluster.go (tcpClusterPerConnectTimeout)
    "max_retries": 1024,  # cluster.go buildXdsClusterCircuitBreaker
    "ext_service_timeout": "10s",  # extproc.go defaultExtServiceRequestTimeout
    # route.go buildRetryPolicy (when a BackendTrafficPolicy has `retry`)
    "retry_on": "connect-failure,refused-stream,unavailable,cancelled,retriable-status-codes",
    "num_retries": 2,
    "retriable_status_codes": (503,),
    "host_selection_retry_max_attempts": 5,
    "idle_timeout_s": 3600.0,  # route.go idleTimeout: 1 h when only a request timeout is set
    # CRD defaults: api/v1alpha1/healthcheck_types.go
    "active": {"timeout": "1s", "interval": "3s", "unhealthyThreshold": 3, "healthyThreshold": 1},
    "passive": {
        "splitExternalLocalOriginErrors": False,
        "interval": "3s",
        "consecutiveLocalOriginFailures": 5,
        "consecutive5XxErrors": 5,
        "baseEjectionTime": "30s",
        "maxEjectionPercent": 10,
    },
}

# Envoy Gateway's default access log format (a File sink without `format`), as in
# internal/cmd/egctl/testdata/translate/out/from-gateway-api-to-xds.listener.yaml.
EG_DEFAULT_LOG_FORMAT: Mapping[str, str] = {
    "start_time": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "x-envoy-origin-path": "%REQ(X-ENVOY-ORIGINAL-PATH?:PATH)%",
    "protocol": "%PROTOCOL%",
    "response_code": "%RESPONSE_CODE%",
    "response_flags": "%RESPONSE_FLAGS%",
    "response_code_details": "%RESPONSE_CODE_DETAILS%",
    "connection_termination_details": "%CONNECTION_TERMINATION_DETAILS%",
    "upstream_transport_failure_reason": "%UPSTREAM_TRANSPORT_FAILURE_REASON%",
    "bytes_received": "%BYTES_RECEIVED%",
    "bytes_sent": "%BYTES_SENT%",
    "duration": "%DURATION%",
    "x-envoy-upstream-service-time": "%RESP(X-ENVOY-UPSTREAM-SERVICE-TIME)%",
    "x-forwarded-for": "%REQ(X-FORWARDED-FOR)%",
    "user-agent": "%REQ(USER-AGENT)%",
    "x-request-id": "%REQ(X-REQUEST-ID)%",
    ":authority": "%REQ(:AUTHORITY)%",
    "upstream_host": "%UPSTREAM_HOST%",
    "upstream_cluster": "%UPSTREAM_CLUSTER%",
    "upstream_local_address": "%UPSTREAM_LOCAL_ADDRESS%",
    "downstream_local_address": "%DOWNSTREAM_LOCAL_ADDRESS%",
    "downstream_remote_address": "%DOWNSTREAM_REMOTE_ADDRESS%",
    "requested_server_name": "%REQUESTED_SERVER_NAME%",
    "route_name": "%ROUTE_NAME%",
}

RATE_LIMIT_CLUSTER = "ratelimit_cluster"  # ratelimit.go getRateLimitServiceClusterName
ROUTER_FILTER = "envoy.filters.http.router"
RATE_LIMIT_FILTER = "envoy.filters.http.ratelimit"

_T = "type.googleapis.com/"
_HTTP2_WINDOWS = {"initial_connection_window_size": 1048576, "initial_stream_window_size": 65536}


@dataclass(frozen=True, slots=True)
class EnvoyGatewayTranslation:
    """The bootstrap plus what the server must know to play the cluster's part."""

    bootstrap: dict[str, Any]
    # The HTTPRoutes' lb.extproc.io annotations as the server's `routes:` entries, keyed
    # `<ns>/<name>` (what the HTTPRoute watcher would give it on a cluster).
    server_routes: dict[str, dict[str, Any]]
    route_names: tuple[str, ...]  # xds.route_name of each route, in order
    model_clusters: tuple[str, ...]
    extproc_cluster: str | None
    access_log_names: tuple[str, ...]  # log_name of each ALS sink
    rate_limited: bool
    # The clusters of the server processes (ext_proc and access-log sinks): EDS read from
    # `eds_path(server_eds_dir, name)` when the options name that directory.
    server_clusters: tuple[str, ...] = ()


def translate_overlay(directory: Path, opts: EnvoyOptions) -> EnvoyGatewayTranslation:
    return translate(load_overlay(directory), opts)


# -- small readers ---------------------------------------------------------------------------

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(h|ms|m|s)")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_QUANTITY = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}


def duration_s(text: str) -> float:
    """A Gateway API duration (`1h30m`, `500ms`, `0s`) in seconds."""
    parts = _DURATION_PART.findall(str(text))
    if not parts or "".join(n + u for n, u in parts) != str(text):
        raise OverlayError(f"not a duration: {text!r}")
    return sum(float(n) * _UNITS[u] for n, u in parts)


def quantity_bytes(value: int | str) -> int:
    """A Kubernetes quantity as Envoy Gateway's bufferLimit takes it."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"([1-9][0-9]*)(Ki|Mi|Gi|k|M|G)?", str(value))
    if m is None:
        raise OverlayError(f"unsupported quantity {value!r}")
    return int(m.group(1)) * _QUANTITY[m.group(2) or ""]


def _envoy_duration(text: str) -> str:
    return f"{duration_s(text):g}s"


def _only(obj: Mapping[str, Any] | None, allowed: set[str], where: str) -> Mapping[str, Any]:
    """`obj` (or {}), refusing fields this translator does not render."""
    if obj is None:
        return {}
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise OverlayError(
            f"{where}: {', '.join(unknown)}: not rendered by the Envoy Gateway shape "
            "(extproc/stack/envoy_gateway.py)"
        )
    return obj


def _typed(type_name: str, **fields: Any) -> dict[str, Any]:
    return {"@type": _T + type_name, **fields}


def _static_endpoints(name: str, addrs: Sequence[HostPort]) -> dict[str, Any]:
    return {
        "cluster_name": name,
        "endpoints": [
            {
                "lb_endpoints": [
                    {
                        "endpoint": {
                            "address": {"socket_address": {"address": a.host, "port_value": a.port}}
                        }
                    }
                    for a in addrs
                ]
            }
        ],
    }


def eds_path(eds_dir: str | Path, cluster: str) -> Path:
    """The file a server cluster's EDS reads (its name made a file name: EG's cluster names
    have slashes)."""
    return Path(eds_dir) / (re.sub(r"[^\w.-]", "_", cluster) + ".json")


def eds_response(cluster: str, addrs: Sequence[HostPort], version: int) -> dict[str, Any]:
    """The file a server cluster's EDS reads: a DiscoveryResponse of its one
    ClusterLoadAssignment, the endpoints Envoy Gateway would list (the ready pods)."""
    return {
        "version_info": str(version),
        "resources": [{"@type": _T + "envoy.config.endpoint.v3.ClusterLoadAssignment",
                       **_static_endpoints(cluster, addrs)}],
    }  # fmt: skip


def _resource_metadata(kind: str, obj: Mapping[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    resource = {"kind": kind, "name": meta["name"], "namespace": meta.get("namespace", "")}
    return {"filter_metadata": {"envoy-gateway": {"resources": [resource]}}}


# -- clusters ----------------------------------------------------------------------------------


def _circuit_breakers(spec: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """cluster.go buildXdsClusterCircuitBreaker: max_retries 1024 unless set."""
    cb = _only(
        spec,
        {"maxConnections", "maxPendingRequests", "maxParallelRequests", "maxParallelRetries"},
        where,
    )
    threshold: dict[str, Any] = {"max_retries": EG_DEFAULTS["max_retries"]}
    for src, dst in (
        ("maxConnections", "max_connections"),
        ("maxPendingRequests", "max_pending_requests"),
        ("maxParallelRequests", "max_requests"),
        ("maxParallelRetries", "max_retries"),
    ):
        if src in cb:
            threshold[dst] = int(cb[src])
    return {"thresholds": [threshold]}


def _health_check(active: Mapping[str, Any], where: str) -> dict[str, Any]:
    """cluster.go buildXdsHealthCheck, with the CRD's defaults; gRPC checks only."""
    spec = {
        **EG_DEFAULTS["active"],
        **_only(
            active,
            {"type", "grpc", "interval", "timeout", "unhealthyThreshold", "healthyThreshold"},
            where,
        ),
    }
    if spec.get("type") != "GRPC":
        raise OverlayError(f"{where}.type: only GRPC checks are rendered by the shape")
    # No no_traffic_interval: Envoy's 60 s applies to a cluster that carries no traffic.
    return {
        "timeout": _envoy_duration(spec["timeout"]),
        "interval": _envoy_duration(spec["interval"]),
        "unhealthy_threshold": int(spec["unhealthyThreshold"]),
        "healthy_threshold": int(spec["healthyThreshold"]),
        "grpc_health_check": {"service_name": (spec.get("grpc") or {}).get("service", "")},
    }


def _outlier_detection(passive: Mapping[str, Any], where: str) -> dict[str, Any]:
    """cluster.go buildXdsOutlierDetection, with the CRD's defaults (Envoy's own for the
    enforcing_* fields: Envoy Gateway sets none)."""
    spec = {
        **EG_DEFAULTS["passive"],
        **_only(
            passive,
            {
                "splitExternalLocalOriginErrors",
                "interval",
                "consecutiveLocalOriginFailures",
                "consecutive5XxErrors",
                "baseEjectionTime",
                "maxEjectionPercent",
            },
            where,
        ),
    }
    od: dict[str, Any] = {
        "base_ejection_time": _envoy_duration(spec["baseEjectionTime"]),
        "interval": _envoy_duration(spec["interval"]),
        "consecutive_local_origin_failure": int(spec["consecutiveLocalOriginFailures"]),
        "consecutive_5xx": int(spec["consecutive5XxErrors"]),
    }
    if spec["splitExternalLocalOriginErrors"]:
        od["split_external_local_origin_errors"] = True
    if int(spec["maxEjectionPercent"]) > 0:
        od["max_ejection_percent"] = int(spec["maxEjectionPercent"])
    return od


def _least_request(locality: bool) -> dict[str, Any]:
    fields: dict[str, Any] = {"locality_lb_config": {"locality_weighted_lb_config": {}}}
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.least_request",
                    "typed_config": _typed(
                        "envoy.extensions.load_balancing_policies.least_request.v3.LeastRequest",
                        **(fields if locality else {}),
                    ),
                }
            }
        ]
    }


def _cluster(
    name: str,
    addrs: Sequence[HostPort],
    *,
    traffic: Mapping[str, Any],
    where: str,
    grpc: bool,
    load_balancing_policy: dict[str, Any] | None = None,
    buffer_limit: int | None = None,
    connect_timeout: str | None = None,
    eds_dir: str | None = None,
) -> dict[str, Any]:
    """cluster.go buildXdsCluster for one backend (STATIC here, EDS on a cluster; EDS read
    from a file in `eds_dir` when given)."""
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC" if eds_dir is None else "EDS",
        "connect_timeout": connect_timeout or EG_DEFAULTS["connect_timeout"],
        "per_connection_buffer_limit_bytes": buffer_limit or EG_DEFAULTS["buffer_limit_bytes"],
        "circuit_breakers": _circuit_breakers(
            traffic.get("circuitBreaker"), f"{where}.circuitBreaker"
        ),
        "common_lb_config": {},
        "dns_lookup_family": "V4_PREFERRED",
        "ignore_health_on_host_removal": True,
        "load_balancing_policy": load_balancing_policy or _least_request(locality=True),
    }
    if eds_dir is None:
        cluster["load_assignment"] = _static_endpoints(name, addrs)
    else:
        source = {"path": str(eds_path(eds_dir, name)), "watched_directory": {"path": eds_dir}}
        cluster["eds_cluster_config"] = {
            "eds_config": {"resource_api_version": "V3", "path_config_source": source}
        }
    health = traffic.get("healthCheck") or {}
    _only(health, {"active", "passive"}, f"{where}.healthCheck")
    if "active" in health:
        cluster["health_checks"] = [_health_check(health["active"], f"{where}.healthCheck.active")]
    if "passive" in health:
        cluster["outlier_detection"] = _outlier_detection(
            health["passive"], f"{where}.healthCheck.passive"
        )
    if grpc:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                explicit_http_config={"http2_protocol_options": dict(_HTTP2_WINDOWS)},
            )
        }
    return cluster


def _endpoint_override_policy(lb: Mapping[str, Any], where: str) -> dict[str, Any] | None:
    """cluster.go buildEndpointOverrideLoadBalancingPolicy (header sources only)."""
    _only(lb, {"type", "endpointOverride"}, where)
    if lb.get("type", "LeastRequest") != "LeastRequest":
        raise OverlayError(f"{where}.type: only LeastRequest is rendered by the shape")
    override = lb.get("endpointOverride")
    if override is None:
        return None
    sources = []
    for source in _only(override, {"extractFrom"}, f"{where}.endpointOverride")["extractFrom"]:
        sources.append({"header": _only(source, {"header"}, f"{where}.extractFrom")["header"]})
    return {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": _typed(
                        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                        override_host_sources=sources,
                        fallback_policy=_least_request(locality=False),
                    ),
                }
            }
        ]
    }


# -- routes -----------------------------------------------------------------------------------


def _service_retry_policy(retry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """oidc.go buildNonRouteRetryPolicy (an ext_proc or ext_authz service's retries): the
    default triggers, the number, the back-off; no host predicate, no status codes."""
    spec = _only(retry, {"numRetries", "retryOn", "perRetry"}, where)
    policy: dict[str, Any] = {"retry_on": EG_DEFAULTS["retry_on"]}
    per_retry = _only(spec.get("perRetry"), {"backOff"}, f"{where}.perRetry")
    if "backOff" in per_retry:
        back_off = _only(
            per_retry["backOff"], {"baseInterval", "maxInterval"}, f"{where}.perRetry.backOff"
        )
        policy["retry_back_off"] = {
            "base_interval": _envoy_duration(back_off["baseInterval"]),
            "max_interval": _envoy_duration(back_off["maxInterval"]),
        }
    if "numRetries" in spec:
        policy["num_retries"] = int(spec["numRetries"])
    if "retryOn" in spec:
        _set_triggers(policy, _only(spec["retryOn"], {"triggers"}, f"{where}.retryOn"))
    return policy


def _set_triggers(policy: dict[str, Any], retry_on: Mapping[str, Any]) -> None:
    """route.go buildRetryOn: the triggers, when given, replace the default ones."""
    if retry_on.get("triggers"):
        policy["retry_on"] = ",".join(retry_on["triggers"])


def _retry_policy(retry: Mapping[str, Any], where: str) -> dict[str, Any]:
    """route.go buildRetryPolicy."""
    spec = _only(retry, {"numRetries", "retryOn"}, where)
    policy: dict[str, Any] = {
        "retry_on": EG_DEFAULTS["retry_on"],
        "retriable_status_codes": list(EG_DEFAULTS["retriable_status_codes"]),
        "num_retries": int(spec.get("numRetries", EG_DEFAULTS["num_retries"])),
        **retry_elsewhere(max_attempts=EG_DEFAULTS["host_selection_retry_max_attempts"]),
    }
    if "retryOn" in spec:
        on = _only(spec["retryOn"], {"triggers", "httpStatusCodes"}, f"{where}.retryOn")
        _set_triggers(policy, on)
        policy["retriable_status_codes"] = [int(c) for c in on.get("httpStatusCodes", [])]
    return policy


def _added_headers(headers: Sequence[Mapping[str, str]], append: bool) -> list[dict[str, Any]]:
    """route.go buildXdsAddedHeaders."""
    action = "APPEND_IF_EXISTS_OR_ADD" if append else "OVERWRITE_IF_EXISTS_OR_ADD"
    return [
        {
            "header": {"key": h["name"], "value": h["value"]},
            "append_action": action,
            "keep_empty_value": h["value"] == "",
        }
        for h in headers
    ]


def _path_match(match: Mapping[str, Any], where: str) -> dict[str, Any]:
    """route.go buildXdsRouteMatch: a prefix loses its trailing slash and matches whole
    segments; `/` stays a plain prefix."""
    _only(match, {"path"}, where)
    path = match.get("path") or {"type": "PathPrefix", "value": "/"}
    kind, value = path.get("type", "PathPrefix"), path.get("value", "/")
    if kind == "Exact":
        return {"path": value}
    if kind != "PathPrefix":
        raise OverlayError(f"{where}.path.type: {kind} is not rendered by the shape")
    if value == "/":
        return {"prefix": "/"}
    return {"path_separated_prefix": value.rstrip("/")}


def _route_server_settings(route: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The route's lb.extproc.io annotations as a `routes:` entry (non-default fields)."""
    annotations = route["metadata"].get("annotations") or {}
    settings, errors = parse_route_annotations(annotations)
    if errors:
        raise OverlayError(f"{where}: " + "; ".join(errors))
    default = RouteSettings()
    return {
        f.name: getattr(settings, f.name)
        for f in dataclasses.fields(RouteSettings)
        if getattr(settings, f.name) != getattr(default, f.name)
    }


# -- the translation ---------------------------------------------------------------------------


@dataclass
class _Parts:
    """What the translation steps add to, in the order Envoy Gateway emits them."""

    filters_lua: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    filters_extproc: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    clusters: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    seen_filters: set[str] = dataclasses.field(default_factory=set)
    vhosts: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    route_names: list[str] = dataclasses.field(default_factory=list)
    model_clusters: list[str] = dataclasses.field(default_factory=list)
    server_routes: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    extproc_cluster: str | None = None
    rate_limited: bool = False
    server_clusters: list[str] = dataclasses.field(default_factory=list)

    def server_cluster(
        self, name: str, opts: EnvoyOptions, traffic: Mapping[str, Any], where: str
    ) -> None:
        """Add a cluster of the server processes (ext_proc or an access-log sink): gRPC, EDS
        from `opts.server_eds_dir` when set."""
        cluster = _cluster(
            name, opts.extproc, traffic=traffic, where=where, grpc=True,
            eds_dir=opts.server_eds_dir,
        )  # fmt: skip
        self.clusters.append(cluster)
        self.server_clusters.append(name)


def _extension_filters(
    policy: Mapping[str, Any], overlay: Overlay, opts: EnvoyOptions, parts: _Parts
) -> tuple[list[str], str | None]:
    """An EnvoyExtensionPolicy's Lua and ext_proc filters (envoyextensionpolicy.go,
    extproc.go, lua.go): names of the filters the route enables, and the ext_proc cluster."""
    ns, name = policy["metadata"].get("namespace", ""), policy["metadata"]["name"]
    where = f"EnvoyExtensionPolicy {name}"
    spec = _only(policy["spec"], {"targetRefs", "extProc", "lua"}, f"{where}.spec")
    base = f"envoyextensionpolicy/{ns}/{name}"
    enabled: list[str] = []
    extproc_cluster = None
    for i, lua in enumerate(spec.get("lua", [])):
        filter_name = f"envoy.filters.http.lua/{base}/lua/{i}"
        enabled.append(filter_name)
        if filter_name in parts.seen_filters:
            continue
        parts.seen_filters.add(filter_name)
        parts.filters_lua.append(
            {
                "name": filter_name,
                "disabled": True,
                "typed_config": _typed(
                    "envoy.extensions.filters.http.lua.v3.Lua",
                    default_source_code={"inline_string": _lua_code(lua, ns, overlay, where)},
                ),
            }
        )
    for i, ep in enumerate(spec.get("extProc", [])):
        w = f"{where}.extProc[{i}]"
        _only(
            ep,
            {
                "backendRefs",
                "backendSettings",
                "messageTimeout",
                "failOpen",
                "processingMode",
                "metadata",
                "statusOnError",
            },
            w,
        )
        if not opts.extproc:
            raise OverlayError(f"{w}: the stack has no ext_proc server to send it to")
        filter_name = f"envoy.filters.http.ext_proc/{base}/extproc/{i}"
        cluster_name = f"{base}/extproc/{i}"  # ext_service.go irIndexedExtServiceDestinationName
        extproc_cluster = extproc_cluster or cluster_name
        enabled.append(filter_name)
        if filter_name in parts.seen_filters:
            continue
        parts.seen_filters.add(filter_name)
        (ref,) = ep["backendRefs"]
        authority = f"{ref['name']}.{ref.get('namespace', ns)}"
        if "port" in ref:
            authority += f":{ref['port']}"
        mode = _only(ep.get("processingMode"), {"request", "response"}, f"{w}.processingMode")
        if "response" in mode:
            raise OverlayError(f"{w}.processingMode.response: not rendered by the shape")
        request = _only(mode.get("request"), {"body", "attributes"}, f"{w}.processingMode.request")
        body = {
            "Buffered": "BUFFERED",
            "Streamed": "STREAMED",
            "BufferedPartial": "BUFFERED_PARTIAL",
            "FullDuplexStreamed": "FULL_DUPLEX_STREAMED",
        }
        processing: dict[str, Any] = {
            "request_header_mode": "SEND" if "request" in mode else "SKIP",
            "response_header_mode": "SKIP",
            "request_body_mode": body[request["body"]] if "body" in request else "NONE",
            "response_body_mode": "NONE",
            "request_trailer_mode": "SKIP",
            "response_trailer_mode": "SKIP",
        }
        if processing["request_body_mode"] == "FULL_DUPLEX_STREAMED":
            processing["request_trailer_mode"] = "SEND"
        config: dict[str, Any] = {
            "grpc_service": {
                "envoy_grpc": {"cluster_name": cluster_name, "authority": authority},
                "timeout": EG_DEFAULTS["ext_service_timeout"],
            },
            "processing_mode": processing,
        }
        if "failOpen" in ep:
            config["failure_mode_allow"] = bool(ep["failOpen"])
        if "statusOnError" in ep:  # extproc.go: StatusOnError
            config["status_on_error"] = {"code": int(ep["statusOnError"])}
        if "messageTimeout" in ep:
            config["message_timeout"] = _envoy_duration(ep["messageTimeout"])
        if request.get("attributes"):
            config["request_attributes"] = list(request["attributes"])
        metadata = _only(
            ep.get("metadata"), {"writableNamespaces", "accessibleNamespaces"}, f"{w}.metadata"
        )
        if metadata:
            options: dict[str, Any] = {}
            if "accessibleNamespaces" in metadata:
                options["forwarding_namespaces"] = {
                    "untyped": list(metadata["accessibleNamespaces"])
                }
            if "writableNamespaces" in metadata:
                options["receiving_namespaces"] = {"untyped": list(metadata["writableNamespaces"])}
            config["metadata_options"] = options
        config["allow_mode_override"] = False
        parts.filters_extproc.append(
            {
                "name": filter_name,
                "disabled": True,
                "typed_config": _typed(
                    "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor", **config
                ),
            }
        )
        traffic = _only(
            ep.get("backendSettings"),
            {"healthCheck", "circuitBreaker", "retry"},
            f"{w}.backendSettings",
        )
        if "retry" in traffic:
            config["grpc_service"]["retry_policy"] = _service_retry_policy(
                traffic["retry"], f"{w}.backendSettings.retry"
            )
        parts.server_cluster(cluster_name, opts, traffic, w)
    return enabled, extproc_cluster


def _lua_code(lua: Mapping[str, Any], ns: str, overlay: Overlay, where: str) -> str:
    """envoyextensionpolicy.go getLuaBodyFromLocalObjectReference: key `lua`, else the first."""
    _only(lua, {"type", "valueRef", "inline"}, f"{where}.lua")
    if lua.get("type") == "Inline":
        return str(lua["inline"])
    ref = lua["valueRef"]
    config_map = overlay.one("ConfigMap", ref["name"])
    if config_map["metadata"].get("namespace", "") != ns:
        raise OverlayError(f"{where}: ConfigMap {ref['name']} is not in namespace {ns}")
    data = config_map.get("data") or {}
    if not data:
        raise OverlayError(f"{where}: ConfigMap {ref['name']} has no data")
    return str(data.get("lua", next(iter(data.values()))))


def _access_logs(
    proxy: Mapping[str, Any] | None, opts: EnvoyOptions, parts: _Parts
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
    """EnvoyProxy telemetry.accessLog (gatewayapi/listener.go, xds/translator/accesslog.go):
    (HCM access logs, listener access logs, ALS log names). Without an EnvoyProxy, Envoy
    Gateway's default: JSON to /dev/stdout."""
    settings: list[Mapping[str, Any]] = [
        {"sinks": [{"type": "File", "file": {"path": "/dev/stdout"}}]}
    ]
    if proxy is not None:
        spec = _only(proxy["spec"], {"mergeType", "telemetry"}, "EnvoyProxy.spec")
        telemetry = _only(spec.get("telemetry"), {"accessLog"}, "EnvoyProxy.spec.telemetry")
        log = _only(telemetry.get("accessLog"), {"settings"}, "EnvoyProxy.spec.telemetry.accessLog")
        settings = log.get("settings", settings)
    hcm: list[dict[str, Any]] = []
    listener: list[dict[str, Any]] = []
    names: list[str] = []
    meta = proxy["metadata"] if proxy is not None else {}
    for i, setting in enumerate(settings):
        where = f"EnvoyProxy accessLog.settings[{i}]"
        _only(setting, {"type", "sinks"}, where)
        kind = setting.get("type")  # None: both request (Route) and listener logs
        for j, sink in enumerate(setting["sinks"]):
            w = f"{where}.sinks[{j}]"
            if sink["type"] == "File":
                path = _only(sink["file"], {"path"}, f"{w}.file")["path"]
                entry = {
                    "name": "envoy.access_loggers.file",
                    "typed_config": _typed(
                        "envoy.extensions.access_loggers.file.v3.FileAccessLog",
                        path=path,
                        log_format={"json_format": dict(EG_DEFAULT_LOG_FORMAT)},
                    ),
                }
            elif sink["type"] == "ALS":
                als = _only(sink["als"], {"type", "logName", "backendRefs", "backendSettings"}, w)
                if als.get("type") != "HTTP":
                    raise OverlayError(f"{w}.als.type: only HTTP is rendered by the shape")
                log_name = als.get("logName") or f"{meta.get('namespace', '')}/{meta.get('name')}"
                cluster_name = f"accesslog_als_{i}_{j}"
                names.append(log_name)
                traffic = _only(
                    als.get("backendSettings"), {"healthCheck", "circuitBreaker"}, f"{w}.als"
                )
                if not opts.extproc:
                    raise OverlayError(f"{w}: the stack has no server to send access logs to")
                parts.server_cluster(cluster_name, opts, traffic, w)
                # No buffer_flush_interval: Envoy's 1 s default applies.
                entry = {
                    "name": "envoy.access_loggers.http_grpc",
                    "typed_config": _typed(
                        "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
                        common_config={
                            "log_name": log_name,
                            "grpc_service": {"envoy_grpc": {"cluster_name": cluster_name}},
                            "transport_api_version": "V3",
                        },
                    ),
                }
            else:
                raise OverlayError(f"{w}.type: {sink['type']} is not rendered by the shape")
            if kind in (None, "Route"):
                hcm.append(entry)
            if kind in (None, "Listener"):
                # Only requests that match no route (NR) at the listener, for a global setting.
                listener.append({**entry, "filter": {"response_flag_filter": {"flags": ["NR"]}}})
    return hcm, listener, names


def _rate_limits(btp: Mapping[str, Any], route_name: str, where: str) -> list[dict[str, Any]]:
    """ratelimit.go buildRouteRateLimits for a global rule set (header selectors only)."""
    rate = _only(btp["spec"]["rateLimit"], {"type", "global"}, f"{where}.rateLimit")
    if rate.get("type") != "Global":
        raise OverlayError(f"{where}.rateLimit.type: only Global is rendered by the shape")
    limits: list[dict[str, Any]] = []
    for r, rule in enumerate(_only(rate["global"], {"rules"}, where)["rules"]):
        w = f"{where}.rateLimit.global.rules[{r}]"
        _only(rule, {"clientSelectors", "limit", "cost"}, w)
        actions: list[dict[str, Any]] = [
            {"generic_key": {"descriptor_key": route_name, "descriptor_value": route_name}}
        ]
        matches = [
            h
            for selector in rule.get("clientSelectors", [])
            for h in _only(selector, {"headers"}, f"{w}.clientSelectors")["headers"]
        ]
        for m, header in enumerate(matches):
            key = f"rule-{r}-match-{m}"
            if header.get("type") == "Distinct":
                actions.append(
                    {"request_headers": {"header_name": header["name"], "descriptor_key": key}}
                )
            else:
                raise OverlayError(f"{w}: only Distinct header selectors are rendered")
        if not matches:
            key = f"rule-{r}-match--1"
            actions.append({"generic_key": {"descriptor_key": key, "descriptor_value": key}})
        cost = _only(rule.get("cost"), {"request", "response"}, f"{w}.cost")
        request: dict[str, Any] = {"actions": actions}
        if "request" in cost:
            request["hits_addend"] = _hits_addend(cost["request"])
        limits.append(request)
        if "response" in cost:
            limits.append(
                {
                    "actions": actions,
                    "apply_on_stream_done": True,
                    "hits_addend": _hits_addend(cost["response"]),
                }
            )
    return limits


def _hits_addend(cost: Mapping[str, Any]) -> dict[str, Any]:
    """backendtrafficpolicy.go: a number, or %DYNAMIC_METADATA(ns:key)%."""
    if cost["from"] == "Number":
        return {"number": int(cost["number"])}
    meta = cost["metadata"]
    return {"format": f"%DYNAMIC_METADATA({meta['namespace']}:{meta['key']})%"}


def _http_route(
    route: Mapping[str, Any],
    gateway: Mapping[str, Any],
    listener_name: str,
    overlay: Overlay,
    opts: EnvoyOptions,
    parts: _Parts,
) -> None:
    """One HTTPRoute: a cluster per rule, an xDS route per match and hostname (route.go),
    with its BackendTrafficPolicy and EnvoyExtensionPolicy applied."""
    ns, name = route["metadata"].get("namespace", ""), route["metadata"]["name"]
    where = f"HTTPRoute {name}"
    spec = _only(route["spec"], {"parentRefs", "hostnames", "rules"}, f"{where}.spec")
    parts.server_routes[f"{ns}/{name}"] = _route_server_settings(route, where)
    btp = overlay.targeting("BackendTrafficPolicy", "HTTPRoute", name)
    btp_spec = _only(
        btp["spec"] if btp else None,
        {"targetRefs", "loadBalancer", "circuitBreaker", "retry", "timeout", "rateLimit"},
        f"BackendTrafficPolicy for {name}",
    )
    eep = overlay.targeting("EnvoyExtensionPolicy", "HTTPRoute", name)
    enabled, cluster = _extension_filters(eep, overlay, opts, parts) if eep else ([], None)
    parts.extproc_cluster = parts.extproc_cluster or cluster
    timeout = _only(btp_spec.get("timeout"), {"http", "tcp"}, "BTP timeout")
    http_timeout = _only(
        timeout.get("http"), {"streamIdleTimeout", "requestTimeout"}, "BTP timeout.http"
    )
    tcp_timeout = _only(timeout.get("tcp"), {"connectTimeout"}, "BTP timeout.tcp")
    lb_policy = _endpoint_override_policy(btp_spec.get("loadBalancer") or {}, "BTP loadBalancer")
    hosts = spec.get("hostnames") or ["*"]
    for i, rule in enumerate(spec["rules"]):
        w = f"{where}.rules[{i}]"
        _only(rule, {"matches", "backendRefs", "timeouts", "filters"}, w)
        cluster_name = f"httproute/{ns}/{name}/rule/{i}"
        parts.model_clusters.append(cluster_name)
        parts.clusters.append(
            {
                **_cluster(
                    cluster_name,
                    opts.endpoints,
                    traffic={"circuitBreaker": btp_spec.get("circuitBreaker")},
                    where="BackendTrafficPolicy",
                    grpc=False,
                    load_balancing_policy=lb_policy,
                    connect_timeout=(
                        _envoy_duration(tcp_timeout["connectTimeout"])
                        if "connectTimeout" in tcp_timeout
                        else None
                    ),
                ),
                "metadata": _resource_metadata("HTTPRoute", route),
            }
        )
        action = _route_action(cluster_name, rule, btp_spec, http_timeout)
        response_add: list[dict[str, Any]] = []
        response_remove: list[str] = []
        for f in rule.get("filters", []):
            if f.get("type") != "ResponseHeaderModifier":
                raise OverlayError(f"{w}.filters: {f.get('type')} is not rendered")
            mod = _only(f["responseHeaderModifier"], {"set", "add", "remove"}, w)
            response_add += _added_headers(mod.get("set", []), append=False)
            response_add += _added_headers(mod.get("add", []), append=True)
            response_remove += list(mod.get("remove", []))
        for j, match in enumerate(rule.get("matches") or [{}]):
            for host in hosts:
                underscored = host.replace(".", "_")
                route_name = f"httproute/{ns}/{name}/rule/{i}/match/{j}/{underscored}"
                parts.route_names.append(route_name)
                xds_route: dict[str, Any] = {
                    "name": route_name,
                    "match": _path_match(match, f"{w}.matches[{j}]"),
                    "metadata": _resource_metadata("HTTPRoute", route),
                    "route": action,
                }
                if response_add:
                    xds_route["response_headers_to_add"] = response_add
                if response_remove:
                    xds_route["response_headers_to_remove"] = response_remove
                # The policy's filters, off on the listener, are turned on for this route.
                per_filter: dict[str, Any] = {
                    fname: _typed("envoy.config.route.v3.FilterConfig", config={})
                    for fname in enabled
                }
                if btp is not None and "rateLimit" in btp_spec:
                    parts.rate_limited = True
                    per_filter[RATE_LIMIT_FILTER] = _typed(
                        "envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
                        domain=listener_name,
                        rate_limits=_rate_limits(btp, route_name, "BackendTrafficPolicy"),
                    )
                if per_filter:
                    xds_route["typed_per_filter_config"] = per_filter
                vhost = parts.vhosts.setdefault(
                    host,
                    {
                        "name": f"{listener_name}/{underscored}",
                        "domains": [host],
                        "metadata": _resource_metadata("Gateway", gateway),
                        "routes": [],
                    },
                )
                vhost["routes"].append(xds_route)


def _route_action(
    cluster_name: str,
    rule: Mapping[str, Any],
    btp_spec: Mapping[str, Any],
    http_timeout: Mapping[str, Any],
) -> dict[str, Any]:
    """route.go buildXdsRoute's action: timeouts, retries, websocket upgrades."""
    request_timeout = (rule.get("timeouts") or {}).get(
        "request", http_timeout.get("requestTimeout")
    )
    action: dict[str, Any] = {"cluster": cluster_name}
    if request_timeout is not None:
        action["timeout"] = _envoy_duration(request_timeout)
    if "streamIdleTimeout" in http_timeout:
        action["idle_timeout"] = _envoy_duration(http_timeout["streamIdleTimeout"])
    elif request_timeout is not None:
        rt = duration_s(request_timeout)
        idle = 0.0 if rt == 0 else max(EG_DEFAULTS["idle_timeout_s"], rt)
        action["idle_timeout"] = f"{idle:g}s"
    if "retry" in btp_spec:
        action["retry_policy"] = _retry_policy(btp_spec["retry"], "BTP retry")
    action["upgrade_configs"] = [{"upgrade_type": "websocket"}]
    return action


def _rate_limit_filter(listener_name: str, opts: EnvoyOptions, parts: _Parts) -> dict[str, Any]:
    """ratelimit.go createRateLimitFilter, and the rate limit service's cluster."""
    if opts.rate_limit_service is None:
        raise OverlayError(
            "the overlay sets a global rate limit: the stack needs a rate limit service "
            "(--rate-limit-service HOST:PORT; Envoy Gateway's is configured in the "
            "EnvoyGateway config's rateLimit backend)"
        )
    rls: dict[str, Any] = {
        "domain": listener_name,
        "rate_limit_service": {
            "grpc_service": {"envoy_grpc": {"cluster_name": RATE_LIMIT_CLUSTER}},
            "transport_api_version": "V3",
        },
        "disable_x_envoy_ratelimited_header": True,
        "enable_x_ratelimit_headers": "DRAFT_VERSION_03",
    }
    if opts.rate_limit_timeout_s is not None:  # EnvoyGateway config rateLimit.timeout
        rls["timeout"] = f"{opts.rate_limit_timeout_s:g}s"
    parts.clusters.append(
        _cluster(
            RATE_LIMIT_CLUSTER,
            (opts.rate_limit_service,),
            traffic={},
            where="rate limit service",
            grpc=True,
        )
    )
    return {
        "name": RATE_LIMIT_FILTER,
        "typed_config": _typed("envoy.extensions.filters.http.ratelimit.v3.RateLimit", **rls),
    }


def _listener(
    listener_name: str,
    overlay: Overlay,
    gateway_name: str,
    filters: list[dict[str, Any]],
    logs: tuple[list[dict[str, Any]], list[dict[str, Any]]],
    opts: EnvoyOptions,
    parts: _Parts,
) -> dict[str, Any]:
    """xds/translator/listener.go: the listener and its HCM, with the Gateway's
    ClientTrafficPolicy (buffer limit, early header removal) and Envoy Gateway's defaults."""
    ctp = overlay.targeting("ClientTrafficPolicy", "Gateway", gateway_name)
    ctp_spec = _only(
        ctp["spec"] if ctp else None, {"targetRefs", "connection", "headers"}, "CTP.spec"
    )
    connection = _only(ctp_spec.get("connection"), {"bufferLimit"}, "CTP.spec.connection")
    buffer_limit = quantity_bytes(connection.get("bufferLimit", EG_DEFAULTS["buffer_limit_bytes"]))
    headers = _only(ctp_spec.get("headers"), {"earlyRequestHeaders"}, "CTP.spec.headers")
    early = _only(headers.get("earlyRequestHeaders"), {"remove"}, "CTP earlyRequestHeaders")
    hcm_logs, listener_logs = logs
    hcm: dict[str, Any] = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix=f"http-{opts.listener.port}",
        common_http_protocol_options={"headers_with_underscores_action": "REJECT_REQUEST"},
        http2_protocol_options={**_HTTP2_WINDOWS, "max_concurrent_streams": 100},
        http_filters=filters,
        merge_slashes=True,
        normalize_path=True,
        path_with_escaped_slashes_action="UNESCAPE_AND_REDIRECT",
        server_header_transformation="PASS_THROUGH",
        use_remote_address=True,
        route_config={
            "name": listener_name,
            "ignore_port_in_host_matching": True,
            "virtual_hosts": list(parts.vhosts.values()),
        },
    )
    if early.get("remove"):
        hcm["early_header_mutation_extensions"] = [
            {
                "name": "envoy.http.early_header_mutation.header_mutation",
                "typed_config": _typed(
                    "envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                    mutations=[{"remove": h} for h in early["remove"]],
                ),
            }
        ]
    if hcm_logs:
        hcm["access_log"] = hcm_logs
    listener: dict[str, Any] = {
        "name": listener_name,
        "address": {
            "socket_address": {"address": opts.listener.host, "port_value": opts.listener.port}
        },
        "default_filter_chain": {
            "name": listener_name,
            "filters": [
                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
            ],
        },
        "max_connections_to_accept_per_socket_event": 1,
        "per_connection_buffer_limit_bytes": buffer_limit,
    }
    if listener_logs:
        listener["access_log"] = listener_logs
    return listener


def translate(overlay: Overlay, opts: EnvoyOptions) -> EnvoyGatewayTranslation:
    """The Envoy bootstrap Envoy Gateway would program from `overlay`'s Gateway, with the
    local stack's addresses (`opts`: listener, admin, ext_proc processes, model endpoints,
    rate limit service). Every other EnvoyOptions field is the local shape's and unused."""
    if opts.baseline:
        raise OverlayError("the Envoy Gateway shape has no baseline variant")
    gateway = overlay.one("Gateway")
    gw_ns, gw_name = gateway["metadata"].get("namespace", ""), gateway["metadata"]["name"]
    gw_spec = _only(
        gateway["spec"], {"gatewayClassName", "infrastructure", "listeners"}, "Gateway.spec"
    )
    (gw_listener,) = gw_spec["listeners"]
    if gw_listener.get("protocol") != "HTTP":
        raise OverlayError("Gateway listener: only HTTP is rendered by the shape")
    listener_name = f"{gw_ns}/{gw_name}/{gw_listener['name']}"
    parts = _Parts()
    proxy = None
    ref = (gw_spec.get("infrastructure") or {}).get("parametersRef")
    if ref is not None:
        proxy = overlay.one("EnvoyProxy", ref["name"])
    hcm_logs, listener_logs, log_names = _access_logs(proxy, opts, parts)
    for route in overlay.all("HTTPRoute"):
        if any(p.get("name") == gw_name for p in route["spec"].get("parentRefs", [])):
            _http_route(route, gateway, listener_name, overlay, opts, parts)
    # httpfilters.go: lua (13+i), ext_proc (100+i), ratelimit (303), router (310).
    filters = [*parts.filters_lua, *parts.filters_extproc]
    if parts.rate_limited:
        filters.append(_rate_limit_filter(listener_name, opts, parts))
    filters.append(
        {
            "name": ROUTER_FILTER,
            "typed_config": _typed(
                "envoy.extensions.filters.http.router.v3.Router", suppress_envoy_headers=True
            ),
        }
    )
    listener = _listener(
        listener_name, overlay, gw_name, filters, (hcm_logs, listener_logs), opts, parts
    )
    _patch_listener(overlay, gw_name, listener, listener_name)
    admin = {"socket_address": {"address": opts.admin.host, "port_value": opts.admin.port}}
    return EnvoyGatewayTranslation(
        bootstrap={
            # EG's bootstrap names the node (its xDS needs it; here the files of the EDS do).
            "node": {"id": "envoy-local", "cluster": f"{gw_ns}/{gw_name}"},
            "admin": {"address": admin},
            "static_resources": {"listeners": [listener], "clusters": parts.clusters},
        },
        server_routes=parts.server_routes,
        route_names=tuple(parts.route_names),
        model_clusters=tuple(parts.model_clusters),
        extproc_cluster=parts.extproc_cluster,
        access_log_names=tuple(log_names),
        rate_limited=parts.rate_limited,
        server_clusters=tuple(dict.fromkeys(parts.server_clusters)),
    )


# EnvoyPatchPolicy (JSONPatch): what our overlays use, `add`/`replace`/`remove` on the
# Gateway's listener, at a JSON pointer or at the nodes a JSONPath of this one form selects.
_LISTENER_TYPE = _T + "envoy.config.listener.v3.Listener"
_BY_NAME = re.compile(r"^\$\.\.(\w+)\[\?\(@\.name\s*==\s*'([^']+)'\)\]$")


def _pointers(node: Any, key: str, name: str, at: str = "") -> list[str]:
    """JSON pointers of every `key` array element whose `name` is `name` (`$..key[?(...)]`)."""
    out: list[str] = []
    if isinstance(node, dict):
        for k, v in node.items():
            here = f"{at}/{k}"
            if k == key and isinstance(v, list):
                out += [
                    f"{here}/{i}"
                    for i, e in enumerate(v)
                    if isinstance(e, dict) and e.get("name") == name
                ]
            out += _pointers(v, key, name, here)
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _pointers(v, key, name, f"{at}/{i}")
    return out


def _json_patch(doc: Any, op: str, pointer: str, value: Any, where: str) -> None:
    *parents, last = pointer.split("/")[1:]
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.get(part)
        if node is None:
            raise OverlayError(f"{where}: {pointer} does not exist")
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op == "add":
            node.insert(index, value)
        elif op == "replace":
            node[index] = value
        else:
            del node[index]
    elif isinstance(node, dict):
        if op == "replace" and last not in node:
            raise OverlayError(f"{where}: {pointer} does not exist (replace)")
        if op == "remove":
            node.pop(last)
        else:
            node[last] = value
    else:
        raise OverlayError(f"{where}: {pointer} is inside a value")


def _patch_listener(overlay: Overlay, gateway: str, listener: dict[str, Any], name: str) -> None:
    """Envoy Gateway's EnvoyPatchPolicies on the Gateway, applied to its listener (in the
    order of the policies' priority, then of their patches)."""
    policies = [
        p
        for p in overlay.all("EnvoyPatchPolicy")
        if (p["spec"].get("targetRef") or {}).get("name") == gateway
    ]
    for policy in sorted(policies, key=lambda p: p["spec"].get("priority", 0)):
        where = f"EnvoyPatchPolicy {policy['metadata']['name']}"
        spec = _only(policy["spec"], {"targetRef", "type", "jsonPatches", "priority"}, where)
        if spec["type"] != "JSONPatch":
            raise OverlayError(f"{where}.type: only JSONPatch is rendered by the shape")
        for i, patch in enumerate(spec["jsonPatches"]):
            w = f"{where}.jsonPatches[{i}]"
            if patch["type"] != _LISTENER_TYPE or patch["name"] != name:
                raise OverlayError(f"{w}: only the Gateway's listener {name} is patched here")
            op = _only(patch["operation"], {"op", "path", "jsonPath", "value"}, f"{w}.operation")
            if op["op"] not in ("add", "replace", "remove"):
                raise OverlayError(f"{w}.operation.op: {op['op']} is not rendered by the shape")
            pointers = [""]
            if "jsonPath" in op:
                m = _BY_NAME.match(op["jsonPath"])
                if m is None:
                    raise OverlayError(f"{w}.operation.jsonPath: only $..key[?(@.name=='x')]")
                pointers = _pointers(listener, m.group(1), m.group(2))
                if not pointers:  # as Envoy Gateway: a JSONPath that finds nothing is an error
                    raise OverlayError(f"{w}.operation.jsonPath matches nothing")
            for pointer in pointers:
                _json_patch(listener, op["op"], pointer + op.get("path", ""), op.get("value"), w)


def render_yaml(translation: EnvoyGatewayTranslation, overlay: Path) -> str:
    header = (
        f"# Envoy Gateway's translation of {overlay} (extproc/stack/envoy_gateway.py),\n"
        "# with the local stack's addresses. Do not edit: it is rendered at every start.\n"
    )
    return header + yaml.safe_dump(translation.bootstrap, sort_keys=False, width=100)
