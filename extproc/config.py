"""The server's configuration: one YAML file, loaded strictly.

Every section is a frozen dataclass whose defaults are the one visible place defaults live.
The loader walks the dataclass type hints: an unknown key or a wrongly typed value is a
`ConfigError` naming the key path (``models[0].endpoints[1].adress: unknown key``). It goes on
past a bad key, so one `ConfigError` carries every problem in the file (`errors`), and
`check_config_text` gives each its line (``extproc config check FILE``).
HTTPRoute annotations (``lb.extproc.io/...``) decode into `RouteSettings` here too, so the
local YAML ``routes:`` section and Kubernetes annotations share one schema.
"""

from __future__ import annotations

import dataclasses
import datetime
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from extproc.wire import SYNC_SUBJECT_PREFIX

__all__ = [
    "ANNOTATION_PREFIX",
    "AccountingConfig",
    "AdminConfig",
    "CaptureConfig",
    "Config",
    "ConfigError",
    "ConfigProblem",
    "EndpointConfig",
    "FlowControlConfig",
    "KVEventsConfig",
    "KubernetesConfig",
    "KubernetesDiscoveryConfig",
    "MetricsConfig",
    "ModelConfig",
    "ModelRewriteConfig",
    "PoolsConfig",
    "RewriteRule",
    "RewriteTarget",
    "RouteSettings",
    "RouteTable",
    "RoutingConfig",
    "SaturationConfig",
    "ServerConfig",
    "SyncConfig",
    "SyncTLSConfig",
    "TLSConfig",
    "TracingConfig",
    "check_config_text",
    "load_config",
    "load_config_text",
    "parse_model_rewrite",
    "parse_route_annotations",
    "read_admin_token",
    "read_capture_key",
    "read_session_secret",
]

ANNOTATION_PREFIX = "lb.extproc.io/"


class ConfigError(ValueError):
    """A configuration problem; the message names the offending key path (the first problem's,
    when the loader found several: `errors` holds them all, in file order)."""

    def __init__(self, message: str, errors: Sequence[ConfigError] = ()) -> None:
        super().__init__(message)
        self.errors: tuple[ConfigError, ...] = tuple(errors) or (self,)
        self.line: int | None = None  # 1-based, where the loader knew it (YAML syntax errors)


def _gathered(errors: list[ConfigError]) -> ConfigError:
    """One error that carries every problem found (its message is the first one's)."""
    return errors[0] if len(errors) == 1 else ConfigError(str(errors[0]), errors)


def _collect(errors: list[ConfigError], exc: ConfigError) -> None:
    errors.extend(exc.errors)


_PORT = (1, 65535)
_AT_LEAST_0 = (0, None)
_AT_LEAST_1 = (1, None)


def _check_ranges(obj: object, **bounds: tuple[float, float | None]) -> list[ConfigError]:
    """A problem for each named field of `obj` outside its inclusive (low, high) bounds (high
    None: no upper bound; a field that is None is not checked), named by the field."""
    errors = []
    for name, (low, high) in bounds.items():
        value = getattr(obj, name)
        if value is None or (low <= value and (high is None or value <= high)):
            continue
        wanted = f"in {low}..{high}" if high is not None else f">= {low}"
        errors.append(ConfigError(f"{name}: {value!r} must be {wanted}"))
    return errors


def _check_positive(obj: object, *names: str) -> list[ConfigError]:
    """A problem for each named field of `obj` that is not above 0 (None is not checked)."""
    values = {name: getattr(obj, name) for name in names}
    return [
        ConfigError(f"{name}: {value!r} must be > 0")
        for name, value in values.items()
        if value is not None and value <= 0
    ]


def _raise_all(errors: list[ConfigError]) -> None:
    if errors:
        raise _gathered(errors)


@dataclass(frozen=True, slots=True)
class TLSConfig:
    cert_file: str
    key_file: str
    client_ca_file: str | None = None  # set to require client certificates (mTLS)
    reload_interval_s: float = 30.0  # certificate files are re-read when they change


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    grpc_port: int = 9002
    metrics_port: int = 9090  # Prometheus /metrics and /debug endpoints (HTTP)
    max_body_bytes: int = 4 * 1024 * 1024
    max_concurrent_streams: int = 4096  # gRPC streams per connection (Envoy opens few connections)
    max_pending_requests: int = (
        2048  # requests between headers and decision; more are shed with 429
    )
    shutdown_grace_s: float = 10.0
    # SIGTERM: report NOT_SERVING, and refuse new streams once none has come for this long
    # (shutdown_grace_s at most), so Envoy's health check (every 0.5 s in our bootstraps) has
    # moved new streams and the access log elsewhere; Envoy's panic mode sends here while it
    # sees no other healthy process.
    shutdown_announce_s: float = 1.0
    # Once drained, a process that was scraped waits for one more scrape of /metrics (this
    # long at most) before it exits, so its counters' last increments (the access log's last
    # batch) are read. 0: exit at once; deploy/ sets 16 (its PodMonitor scrapes every 15 s).
    final_scrape_s: float = 0.0
    allow_explain: bool = False  # honour `x-routing-explain: true` on requests
    # The admin port's status page (`/`, `/status.json`): endpoints, recent decisions, config.
    status_page: bool = False
    tls: TLSConfig | None = None
    # Text the tokenizer caches have not seen, up to this many characters (~3.5k tokens,
    # ~3 ms), is encoded on the event loop: a hop to a thread and back cost more than that
    # under load (the higress scenario: 4.7 against 8.5 ms mean tokenization at 4096).
    tokenize_inline_bytes: int = 16384
    tokenizer_threads: int = 1  # shared by every tokenizer
    # Distinct tokenizers (by file content: models naming equal files share one) kept loaded;
    # past it the least recently used is dropped and loaded again by its next request.
    max_tokenizers: int = 8
    # When set, every tokenizer directory must resolve (symlinks followed) inside this root:
    # the config cannot make the server read files elsewhere.
    tokenizer_root: str | None = None
    log_level: str = "info"

    def __post_init__(self) -> None:
        _raise_all(
            _check_ranges(
                self,
                grpc_port=_PORT,
                metrics_port=_PORT,
                max_body_bytes=_AT_LEAST_1,
                max_concurrent_streams=_AT_LEAST_1,
                max_pending_requests=_AT_LEAST_1,
                shutdown_grace_s=_AT_LEAST_0,
                shutdown_announce_s=_AT_LEAST_0,
                final_scrape_s=_AT_LEAST_0,
                tokenize_inline_bytes=_AT_LEAST_0,
                tokenizer_threads=_AT_LEAST_1,
                max_tokenizers=_AT_LEAST_1,
            )
        )


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """The admin port (`server.metrics_port`): `/metrics` and the probes are open; `/debug/*`,
    the status page and `/status.json` need the token (docs/operations.md, "The admin port")."""

    token: str | None = field(default=None, repr=False)
    token_file: str | None = None  # read by load_config (a mounted Secret), at every reload
    # POST /debug/explain runs a whole decision (tokenization included) on the router's event
    # loop: this many at once, this many more waiting, this many a second on average, 429
    # beyond; bodies up to this size.
    explain_concurrency: int = 1
    explain_queue: int = 2
    explain_rate_per_s: float = 2.0  # a person asks a few a minute; bench/explain_flood.py
    explain_max_body_bytes: int = 256 * 1024

    def __post_init__(self) -> None:
        if self.token is not None and len(self.token.strip()) < 16:
            raise ConfigError("token: must be at least 16 characters (`openssl rand -hex 32`)")
        if self.explain_concurrency < 1 or self.explain_queue < 0 or self.explain_rate_per_s <= 0:
            raise ConfigError(
                "needs explain_concurrency >= 1, explain_queue >= 0, explain_rate_per_s > 0"
            )
        if self.explain_max_body_bytes < 1:
            raise ConfigError("explain_max_body_bytes: must be positive")


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    poll_interval_s: float = 0.5  # busy or changing pods
    # Idle pods (nothing running or waiting, figures unchanged, nothing routed there): the
    # pause grows 4x per scrape up to this; their figures are used until the next scrape is
    # due plus stale_after_s (extproc/metrics/poller.py). Equal to poll_interval_s: a fixed pace.
    idle_poll_interval_s: float = 10.0
    timeout_s: float = 1.0
    stale_after_s: float = 3.0  # a pod whose last good scrape is older leaves the candidate set
    preset: Literal["vllm", "sglang"] = "vllm"
    names: dict[str, str] = field(default_factory=dict)  # override single metric names
    max_response_bytes: int = 4 * 1024 * 1024

    def __post_init__(self) -> None:
        errors = _check_positive(self, "poll_interval_s", "timeout_s", "stale_after_s")
        errors += _check_ranges(self, max_response_bytes=_AT_LEAST_1)
        if self.idle_poll_interval_s < self.poll_interval_s:
            errors.append(ConfigError("idle_poll_interval_s: must be at least poll_interval_s"))
        _raise_all(errors)


@dataclass(frozen=True, slots=True)
class AccountingConfig:
    inject_include_usage: bool = (
        True  # add stream_options.include_usage when a streaming client did not
    )
    # Envoy sends this gateway's access-log records (the usage filter and the gRPC access log
    # to the ext_proc cluster): a request's record ends its in-flight lease, so the routing
    # stream ends once its answer is delivered and a restart of the server cuts no response.
    # Off: the stream is held for the whole request and its end releases the lease.
    access_log: bool = True
    # A lease whose record never comes (sink down, Envoy restarted) ends after 3x the longest
    # response its pod has given, within these bounds (the maximum until one is observed).
    lease_min_s: float = 300.0
    lease_max_s: float = 900.0

    def __post_init__(self) -> None:
        if not 0 < self.lease_min_s <= self.lease_max_s:
            raise ConfigError("needs 0 < lease_min_s <= lease_max_s")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    default_strategy: str = "kv-aware"  # why: docs/strategies.md, "Choosing a strategy"
    strategy_header: str = "routing-strategy"
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    strategy_params: dict[str, dict[str, Any]] = field(
        default_factory=dict
    )  # e.g. {prefix-cache: {...}}
    max_fallbacks: int = 2  # endpoints after the pick in the destination header, for Envoy retries
    # A pod holding a request unanswered this long, that has answered nothing for as long, is
    # hung: it leaves the candidates until it answers (needs response accounting; 0 = off).
    stall_after_s: float = 10.0
    # The same, sooner, from the engine's own figures: a pod holding a request this long whose
    # scrapes (token counters, running/waiting, KV usage) and answers have not moved for as
    # long is hung (0 = off; engines that export none of them fall back to stall_after_s).
    hang_after_s: float = 2.0
    priority_header: str = "x-request-priority"  # < 0 marks a request sheddable
    session_header: str = "x-session-id"
    # Key of the opaque session ids (docs/strategies.md, session-affinity). Every process and
    # replica of a gateway must share it; unset, each process makes its own (one process only).
    session_secret: str | None = field(default=None, repr=False)
    session_secret_file: str | None = None  # read by load_config (a mounted Secret)
    user_header: str = "x-user-id"
    seed: int | None = None  # fixed seed for reproducible tie-breaks (tests, benchmarks)

    def __post_init__(self) -> None:
        _raise_all(
            _check_ranges(
                self, max_fallbacks=_AT_LEAST_0, stall_after_s=_AT_LEAST_0, hang_after_s=_AT_LEAST_0
            )
        )


@dataclass(frozen=True, slots=True)
class SaturationConfig:
    """When a pod is full, one idea for every part that asks (llm-d's utilization detector): the
    shedding of sheddable requests, flow control's dispatch and pool saturation, and the
    `saturation` filter's defaults. A pod is saturated at `queue_threshold` waiting requests or
    `kv_threshold` KV usage (`headroom` stretches both for the filter and the shedding)."""

    queue_threshold: float = 5.0  # llm-d's queueDepthThreshold (0: every pod counts as full)
    kv_threshold: float = 0.8  # llm-d's kvCacheUtilThreshold (0: every pod counts as full)
    headroom: float = 0.0

    def __post_init__(self) -> None:
        if self.queue_threshold < 0 or not 0 <= self.kv_threshold <= 1 or self.headroom < 0:
            raise ConfigError("needs queue_threshold >= 0, 0 <= kv_threshold <= 1, headroom >= 0")


@dataclass(frozen=True, slots=True)
class FlowControlConfig:
    """The queue in the gateway for demand above the pool (docs/operations.md, flow control).

    On by default (docs/benchmarks.md §4: below saturation it costs nothing measurable, above it
    every flow is served far sooner than with the engines queueing first come, first served).
    It needs Envoy to wait for a decision longer than `ttl_s` (the Envoy Gateway overlay's
    `messageTimeout: 65s`)."""

    enabled: bool = True
    # Policies, plugins by type name (extproc/flowcontrol/policies.py). Inside a band:
    # "round-robin" between flows, "token" (fewest VTC tokens used goes next), or
    # "global-strict" (no fairness: one order over the band). Inside a flow: "fcfs", or "edf"
    # (the TTFT SLO or the TTL). Their params by type name: `policy_params: {edf: {...}}`.
    fairness: str = "round-robin"
    ordering: str = "fcfs"
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    ttl_s: float = 60.0  # then 429 (rejected-ttl-expired), or 503 while no pod was ready
    max_requests_per_band: int = 5000
    max_bytes_per_band: int = 1 << 30
    retry_after_s: int = 1
    # When a pod takes another request (docs/operations.md, flow control): "slots": into a free
    # running slot, each pod's learned from its scrapes (the engines' queues stay near empty,
    # what waits waits here); "queue": llm-d's, while the estimated engine queue is under
    # `saturation.queue_threshold`. Either way a pod at `saturation.kv_threshold` takes none,
    # nor one the gateway holds `max_concurrency` requests on (0: no such limit).
    dispatch: Literal["slots", "queue"] = "slots"
    # Under "slots", requests each engine may hold waiting beyond its running slots: 1 has the
    # next request in the engine when a slot frees (no round trip through the gateway then).
    engine_queue: int = 1
    # Free running slots each model's pool keeps for the bands above the default priority
    # (they start at the next engine step instead of when a running request ends): the
    # default band and below dispatch only into the room beyond them (docs/operations.md).
    reserved_slots: int = 0
    max_concurrency: int = 0
    # InferenceObjective names -> priority (higher first, < 0 sheddable), chosen per request by
    # `x-llm-d-inference-objective` (or `x-gateway-inference-objective`); resources watched
    # through discovery add to these.
    objectives: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        errors = _check_positive(self, "ttl_s", "max_requests_per_band", "max_bytes_per_band")
        errors += _check_ranges(
            self,
            retry_after_s=_AT_LEAST_0,
            engine_queue=_AT_LEAST_0,
            reserved_slots=_AT_LEAST_0,
            max_concurrency=_AT_LEAST_0,
        )
        _raise_all(errors)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    mode: Literal["auto", "exact", "approximate"] = "auto"
    approx_ttl_s: float = 600.0
    approx_capacity_blocks: int = 1_000_000
    exact_capacity_blocks: int = 1_000_000  # ~150 MB at ~150 B per block (bench/kvevents_bench.py)
    replay_timeout_s: float = 1.0
    stall_after_s: float = 10.0
    # AUTO mode: blocks routed to a pod count as cached there this long before its events
    # confirm them (the blind spot between a decision and the BlockStored event); 0 = off.
    # 2 s as llm-d's speculative entries: kv-aware's hit rate rose 0.88 -> 0.92 on tenants and
    # 0.80 -> 0.83 on docqa (docs/benchmarks.md §3.7). prefix-cache with a first block every
    # request shares can starve pods that got no traffic yet (AIBrix's own immediate insert
    # does the same): set 0 there (docs/strategies.md, prefix-cache).
    pending_s: float = 2.0

    def __post_init__(self) -> None:
        errors = _check_positive(self, "approx_ttl_s", "replay_timeout_s")
        errors += _check_ranges(
            self,
            approx_capacity_blocks=_AT_LEAST_1,
            exact_capacity_blocks=_AT_LEAST_1,
            stall_after_s=_AT_LEAST_0,
            pending_s=_AT_LEAST_0,
        )
        _raise_all(errors)


@dataclass(frozen=True, slots=True)
class SyncTLSConfig:
    ca_file: str | None = None  # verify the bus server with this CA
    cert_file: str | None = None  # client certificate (mutual TLS)
    key_file: str | None = None


@dataclass(frozen=True, slots=True)
class SyncConfig:
    """Routing state shared between replicas over NATS (off when `url` is null)."""

    url: str | None = None  # nats://host:4222 (tls:// with TLS)
    subject: str = f"{SYNC_SUBJECT_PREFIX}.default"  # one subject per gateway (its replicas)
    user: str | None = None
    password_file: str | None = None  # read at start; never logged
    tls: SyncTLSConfig | None = None
    tick_s: float = 0.01  # one combined message per tick at most
    heartbeat_s: float = 0.1  # a message at least this often (liveness)
    expire_s: float = 0.5  # a peer silent this long: its share no longer counts

    def __post_init__(self) -> None:
        if not 0 < self.tick_s <= self.heartbeat_s < self.expire_s:
            raise ConfigError("needs 0 < tick_s <= heartbeat_s < expire_s")
        if self.url is not None and not self.url.startswith(("nats://", "tls://")):
            raise ConfigError(f"url: expected nats://host:port or tls://..., got {self.url!r}")


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """OpenTelemetry traces of routing decisions (docs/operations.md, "Traces"). Off by default;
    read at start-up (a reload does not change them). A request's spans continue the trace
    Envoy started (W3C `traceparent`) and go in batches, off the request path, over OTLP/gRPC."""

    enabled: bool = False
    endpoint: str = "http://127.0.0.1:4317"  # the OTLP/gRPC collector: http:// plain, https:// TLS
    # Head sampling: a request whose parent was not sampled never is; the others are, at this
    # ratio of trace ids (deterministic per trace id, so every process agrees).
    sample_ratio: float = 1.0
    service_name: str = "extproc"
    flush_interval_s: float = 1.0  # spans are exported at least this often
    max_queue_spans: int = 8192  # beyond it new spans are dropped, never the request delayed

    def __post_init__(self) -> None:
        errors = _check_ranges(self, sample_ratio=(0, 1), max_queue_spans=_AT_LEAST_1)
        errors += _check_positive(self, "flush_interval_s")
        if not self.endpoint.startswith(("http://", "https://")):
            errors.append(
                ConfigError(f"endpoint: expected http(s)://host:port, got {self.endpoint!r}")
            )
        _raise_all(errors)


@dataclass(frozen=True, slots=True)
class CaptureConfig:
    """A capture of the traffic for a replay (docs/operations.md, "Capture your traffic"): per
    process, the facts of each routed request (no text, ids as keyed hashes), in two bounded
    rings, fetched with `extproc capture`. Off by default; read at start-up."""

    enabled: bool = False
    max_records: int = 20000  # per ring (decisions, outcomes) and process; the oldest go first
    max_age_s: float = 3600.0  # older records are dropped
    # Key of the ids' keyed hashes (HMAC-SHA256): every process and replica must share it, or
    # one user's requests no longer look alike. Required when enabled.
    key: str | None = field(default=None, repr=False)
    key_file: str | None = None  # read by load_config (a mounted Secret)

    def __post_init__(self) -> None:
        errors = _check_ranges(self, max_records=_AT_LEAST_1)
        errors += _check_positive(self, "max_age_s")
        if self.key is not None and self.key_file is not None:
            errors.append(ConfigError("key_file: set it or key, not both"))
        elif self.enabled and self.key is None and self.key_file is None:
            errors.append(ConfigError("key_file: required when enabled (the ids' hash key)"))
        elif self.key is not None and len(self.key.strip()) < 16:
            errors.append(ConfigError("key: at least 16 characters"))
        _raise_all(errors)


@dataclass(frozen=True, slots=True)
class EndpointConfig:
    address: str
    metrics_url: str | None = None
    role: Literal["both", "prefill", "decode"] = "both"
    kv_events: str | None = None  # tcp://host:port of the engine's ZMQ PUB
    kv_replay: str | None = None  # tcp://host:port of the engine's ZMQ ROUTER
    data_parallel_size: int = 1  # vLLM --data-parallel-size: rank r on kv_events/kv_replay port + r

    def __post_init__(self) -> None:
        errors = _check_ranges(self, data_parallel_size=(1, 1024))
        if not _ADDRESS_RE.match(self.address):
            errors.insert(
                0, ConfigError(f"address: {self.address!r} must be ip:port (IPv6 in brackets)")
            )
        elif not 1 <= int(self.address.rpartition(":")[2]) <= 65535:
            errors.insert(0, ConfigError(f"address: {self.address!r}: port must be in 1..65535"))
        _raise_all(errors)


@dataclass(frozen=True, slots=True)
class KubernetesDiscoveryConfig:
    namespace: str = "default"
    selector: dict[str, str] = field(default_factory=dict)
    inference_pool: str | None = None  # read selector and targetPorts from this InferencePool
    target_port: int = 8000
    metrics_port: int | None = None  # defaults to target_port
    role_label: str | None = "llm-d.ai/role"
    kv_events_port: int | None = None
    kv_replay_port: int | None = None
    # vLLM --data-parallel-size of every pod; a pod's `lb.extproc.io/data-parallel-size`
    # annotation overrides it.
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        _raise_all(
            _check_ranges(
                self,
                target_port=_PORT,
                metrics_port=_PORT,
                kv_events_port=_PORT,
                kv_replay_port=_PORT,
                data_parallel_size=(1, 1024),
            )
        )


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    tokenizer: str | None = (
        None  # directory with tokenizer.json (+ tokenizer_config.json); "bundled:qwen3"
    )
    block_size: int = 16
    aliases: list[str] = field(default_factory=list)
    lora_adapters: list[str] = field(default_factory=list)
    strategy: str | None = None  # default strategy for this model (else routing.default_strategy)
    kv_events_mode: Literal["auto", "exact", "approximate"] | None = None
    # The engines' vLLM --scheduling-policy: with "priority" each request's band goes into the
    # body's `priority` (negated: vLLM serves lower first). vLLM refuses a non-zero priority
    # under "fcfs", and no metric says which policy runs, so it is declared here.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    endpoints: list[EndpointConfig] = field(default_factory=list)
    kubernetes: KubernetesDiscoveryConfig | None = None

    def __post_init__(self) -> None:
        _raise_all(_check_ranges(self, block_size=_AT_LEAST_1))


# -- model rewrites (llm-d's InferenceModelRewrite, llm-d.ai/v1alpha2) -------------------------

MAX_REWRITE_WEIGHT = 1_000_000


@dataclass(frozen=True, slots=True)
class RewriteTarget:
    """A weighted destination: the model (or LoRA adapter) name the request is rewritten to."""

    model: str
    weight: int | None = None  # 1..1,000,000; set on every target of a rule or on none

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("model: must not be empty")
        if self.weight is not None and not 1 <= self.weight <= MAX_REWRITE_WEIGHT:
            raise ConfigError(f"weight: {self.weight} is not in 1..{MAX_REWRITE_WEIGHT:,}")


@dataclass(frozen=True, slots=True)
class RewriteRule:
    """`models` are Exact matches on the request's `model` (OR'd); none: every model."""

    targets: list[RewriteTarget]
    models: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.targets:
            raise ConfigError("targets: needs at least one target")
        weighted = [t.weight is not None for t in self.targets]
        if any(weighted) and not all(weighted):
            raise ConfigError("targets: set a weight on every target or on none")


@dataclass(frozen=True, slots=True)
class ModelRewriteConfig:
    """One rewrite resource: config-file entries in file order, or discovered ones."""

    name: str
    rules: list[RewriteRule]
    pool: str | None = None  # poolRef.name: applies to the models of that InferencePool only
    namespace: str = ""
    created: float = 0.0  # creationTimestamp (epoch s): the oldest resource wins a tie


def _rfc3339(value: object) -> float:
    if not isinstance(value, str) or not value:
        return float("inf")  # no timestamp: after every dated resource
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return float("inf")


def parse_model_rewrite(resource: Mapping[str, Any]) -> ModelRewriteConfig:
    """An InferenceModelRewrite object (as the API server returns it) -> ModelRewriteConfig.
    Raises ConfigError naming the field of the first problem."""
    meta = resource.get("metadata") or {}
    spec = resource.get("spec")
    name = str(meta.get("name") or "")
    if not isinstance(spec, Mapping):
        raise ConfigError("spec: required")
    pool_ref = spec.get("poolRef")
    if not isinstance(pool_ref, Mapping) or not isinstance(pool_ref.get("name"), str):
        raise ConfigError("spec.poolRef.name: required")
    raw_rules = spec.get("rules")
    if not isinstance(raw_rules, list):
        raise ConfigError("spec.rules: must be a list")
    rules: list[RewriteRule] = []
    for i, rule in enumerate(raw_rules):
        where = f"spec.rules[{i}]"
        if not isinstance(rule, Mapping):
            raise ConfigError(f"{where}: must be an object")
        models: list[str] = []
        for j, match in enumerate(rule.get("matches") or []):
            model = match.get("model") if isinstance(match, Mapping) else None
            if not isinstance(model, Mapping) or not isinstance(model.get("value"), str):
                raise ConfigError(f"{where}.matches[{j}].model.value: required")
            if model.get("type", "Exact") != "Exact":
                raise ConfigError(f"{where}.matches[{j}].model.type: only Exact is supported")
            models.append(model["value"])
        targets: list[RewriteTarget] = []
        for j, target in enumerate(rule.get("targets") or []):
            if not isinstance(target, Mapping) or not isinstance(target.get("modelRewrite"), str):
                raise ConfigError(f"{where}.targets[{j}].modelRewrite: required")
            weight = target.get("weight")
            if weight is not None and (isinstance(weight, bool) or not isinstance(weight, int)):
                raise ConfigError(f"{where}.targets[{j}].weight: must be an integer")
            try:
                targets.append(RewriteTarget(model=target["modelRewrite"], weight=weight))
            except ConfigError as exc:
                raise ConfigError(f"{where}.targets[{j}].{exc}") from None
        try:
            rules.append(RewriteRule(targets=targets, models=models))
        except ConfigError as exc:
            raise ConfigError(f"{where}.{exc}") from None
    return ModelRewriteConfig(
        name=name,
        rules=rules,
        pool=pool_ref["name"],
        namespace=str(meta.get("namespace") or ""),
        created=_rfc3339(meta.get("creationTimestamp")),
    )


@dataclass(frozen=True, slots=True)
class KubernetesConfig:
    watch_httproutes: bool = False
    watch_model_rewrites: bool = False  # InferenceModelRewrite resources (llm-d.ai/v1alpha2)
    # InferenceObjective resources (llm-d.ai/v1alpha2): flow-control priorities by name.
    watch_inference_objectives: bool = False
    namespaces: list[str] = field(default_factory=list)  # empty: all namespaces
    in_cluster: bool = True
    kubeconfig: str | None = None  # used when in_cluster is false (local development)


@dataclass(frozen=True, slots=True)
class PoolsConfig:
    """InferencePools served without listing them (extproc/discovery/pools/): the ones whose
    `endpointPickerRef` is a Service named in `picker_names`, or carrying `labels`."""

    picker_names: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)
    namespaces: list[str] = field(default_factory=list)  # empty: every namespace
    tokenizer: str | None = None  # for pools whose `lb.extproc.io/tokenizer` names none

    @property
    def enabled(self) -> bool:
        return bool(self.picker_names or self.labels)


@dataclass(frozen=True, slots=True)
class RouteSettings:
    """Per-route routing settings, from HTTPRoute annotations or the YAML ``routes:`` section."""

    strategy: str | None = None
    profile: str | None = None
    scorers: str | None = None  # ad hoc weighted profile: "prefix-cache:3,least-request:1"
    model_map: dict[str, str] = field(default_factory=dict)  # requested model -> served model
    shed_sheddable: bool = True  # 429 for sheddable requests when every pod is saturated
    accounting: bool = True  # response token accounting on this route
    inject_include_usage: bool | None = None  # None: the accounting section decides
    # Flow control on this route: the priority of requests that name none, or an objective.
    priority: int | None = None
    objective: str | None = None


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    accounting: AccountingConfig = field(default_factory=AccountingConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    saturation: SaturationConfig = field(default_factory=SaturationConfig)
    flow_control: FlowControlConfig = field(default_factory=FlowControlConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    pools: PoolsConfig = field(default_factory=PoolsConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    models: list[ModelConfig] = field(default_factory=list)
    model_rewrites: list[ModelRewriteConfig] = field(default_factory=list)  # aliases, canaries
    routes: dict[str, RouteSettings] = field(
        default_factory=dict
    )  # key: "<ns>/<name>" or an xDS route name

    def __post_init__(self) -> None:
        seen: set[str] = set()
        errors = []
        for i, model in enumerate(self.models):
            for name in (model.name, *model.aliases):
                if name in seen:
                    errors.append(
                        ConfigError(f"models[{i}]: model name {name!r} is declared twice")
                    )
                seen.add(name)
            if not model.endpoints and model.kubernetes is None:
                errors.append(
                    ConfigError(
                        f"models[{i}] ({model.name}): needs `endpoints` or `kubernetes` discovery"
                    )
                )
        if errors:
            raise _gathered(errors)


_ADDRESS_RE = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):\d{1,5}$")


# ---------------------------------------------------------------------------------------------
# Strict decoding from plain YAML data into the dataclasses above.


def _decode(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        tried: list[ConfigError] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _decode(arg, value, path)
            except ConfigError as exc:
                tried.append(exc)
        if len(tried) == 1:
            raise tried[0]
        raise ConfigError(f"{path}: invalid value {value!r}")
    if origin is Literal:
        if value not in args:
            choices = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{path}: {value!r} is not one of {choices}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        items: list[Any] = []
        errors: list[ConfigError] = []
        for i, item in enumerate(value):
            try:
                items.append(_decode(args[0], item, f"{path}[{i}]"))
            except ConfigError as exc:
                _collect(errors, exc)
        if errors:
            raise _gathered(errors)
        return items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        out: dict[Any, Any] = {}
        errors = []
        for k, v in value.items():
            try:
                out[_decode(args[0], k, f"{path}.<key>")] = _decode(args[1], v, f"{path}.{k}")
            except ConfigError as exc:
                _collect(errors, exc)
        if errors:
            raise _gathered(errors)
        return out
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _decode_dataclass(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {tp!r}")  # a schema bug, not a user error


def _decode_dataclass(cls: type[Any], value: Any, path: str) -> Any:
    prefix = f"{path}." if path else ""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(value).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    errors: list[ConfigError] = []
    known = ", ".join(sorted(fields))
    for key in value:  # in file order, so `config check` lists problems top to bottom
        if key not in fields:
            errors.append(ConfigError(f"{prefix}{key}: unknown key (known: {known})"))
    kwargs = {}
    for name, f in fields.items():
        if name in value:
            try:
                kwargs[name] = _decode(hints[name], value[name], f"{prefix}{name}")
            except ConfigError as exc:
                _collect(errors, exc)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            errors.append(ConfigError(f"{prefix}{name}: required key is missing"))
    required = (
        n
        for n, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
    if any(n not in kwargs for n in required):  # nothing to stand in for it
        raise _gathered(errors)
    # The section's own checks run past schema errors too, so one run reports them all; with
    # a field that did not decode (its default stands in), only checks naming a decoded field.
    failed = any(name in value and name not in kwargs for name in fields)
    try:
        result = cls(**kwargs)
    except ConfigError as exc:
        for e in exc.errors:
            named = re.split(r"[:.\[ ]", str(e), maxsplit=1)[0]  # `models[0] (m): ...`: models
            if failed and named not in kwargs:
                continue
            # `field: ...` becomes `path.field: ...`, so the problem has that key's line.
            where = f"{path}.{e}" if named in fields else f"{path}: {e}"
            errors.append(e if not path else ConfigError(where))
    if errors:
        raise _gathered(errors)
    return result


def load_config_text(text: str) -> Config:
    """The config in `text`; a `ConfigError` (with every problem in `errors`) if it is invalid."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        error = ConfigError(f"config is not valid YAML: {exc}")
        mark = getattr(exc, "problem_mark", None)
        error.line = None if mark is None else mark.line + 1
        raise error from None
    result: Config = _decode_dataclass(Config, data, "")
    routing = result.routing
    if routing.session_secret is not None and not routing.session_secret.strip():
        raise ConfigError("routing.session_secret: must not be empty")
    if routing.session_secret is not None and routing.session_secret_file is not None:
        raise ConfigError("routing.session_secret_file: set it or routing.session_secret, not both")
    if result.admin.token is not None and result.admin.token_file is not None:
        raise ConfigError("admin.token_file: set it or admin.token, not both")
    return result


def read_session_secret(cfg: Config) -> Config:
    """`routing.session_secret_file` read into `routing.session_secret` (`load_config` does it
    at every load, so a reload picks up a rotated Secret; `load_config_text` reads no file)."""
    routing = cfg.routing
    path = routing.session_secret_file
    if path is None:
        return cfg
    secret = _secret_file(path, "routing.session_secret_file")
    return dataclasses.replace(cfg, routing=dataclasses.replace(routing, session_secret=secret))


def _secret_file(path: str, key: str, *, min_chars: int = 1) -> str:
    """The secret in the file at `path` (a mounted Secret, named by the config's `key`),
    stripped; a ConfigError naming `key` when it cannot be read or is too short."""
    try:
        secret = Path(path).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"{key}: cannot read {path}: {reason}") from None
    if len(secret) < min_chars:
        short = "is empty" if min_chars == 1 else f"holds fewer than {min_chars} characters"
        raise ConfigError(f"{key}: {path} {short}")
    return secret


def read_capture_key(cfg: Config) -> Config:
    """`capture.key_file` read into `capture.key` (`load_config` does it; `load_config_text`
    reads no file)."""
    path = cfg.capture.key_file
    if path is None:
        return cfg
    key = _secret_file(path, "capture.key_file", min_chars=16)
    capture = dataclasses.replace(cfg.capture, key=key, key_file=None)
    return dataclasses.replace(cfg, capture=capture)


def read_admin_token(cfg: Config) -> Config:
    """`admin.token_file` read into `admin.token` (`load_config` does it at every load, so a
    reload picks up a rotated Secret; `load_config_text` reads no file)."""
    path = cfg.admin.token_file
    if path is None:
        return cfg
    token = _secret_file(path, "admin.token_file", min_chars=16)
    return dataclasses.replace(cfg, admin=dataclasses.replace(cfg.admin, token=token))


@dataclass(frozen=True, slots=True)
class ConfigProblem:
    line: int | None  # 1-based line of the key the problem names, None if unknown
    message: str


def check_config_text(text: str, extra: Sequence[str] = ()) -> list[ConfigProblem]:
    """Every problem `load_config_text` finds in `text`, each with the line of the key it
    names (the nearest enclosing key for a cross-field problem), plus `extra` messages (checks
    a higher layer ran, e.g. strategy names), placed the same way. Empty: the config is valid."""
    try:
        load_config_text(text)
        errors: Sequence[ConfigError] = ()
    except ConfigError as exc:
        errors = exc.errors
    if any(e.line is not None for e in errors):  # not YAML: no key has a line
        return [ConfigProblem(e.line, str(e)) for e in errors]
    lines = _key_lines(text)
    problems = [ConfigProblem(_line_of(str(e), lines), str(e)) for e in errors]
    problems += [ConfigProblem(_line_of(m, lines), m) for m in extra]
    return sorted(problems, key=lambda p: (p.line is None, p.line or 0))


def _key_lines(text: str) -> dict[str, int]:
    """Key path (the decoder's spelling: ``models[0].endpoints[1].address``) -> 1-based line."""
    out: dict[str, int] = {}

    def walk(node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, child in node.value:
                sub = f"{path}.{key.value}" if path else str(key.value)
                out.setdefault(sub, key.start_mark.line + 1)
                walk(child, sub)
        elif isinstance(node, yaml.SequenceNode):
            for i, child in enumerate(node.value):
                sub = f"{path}[{i}]"
                out.setdefault(sub, child.start_mark.line + 1)
                walk(child, sub)

    root = yaml.compose(text, Loader=yaml.SafeLoader)
    if root is not None:
        walk(root, "")
    return out


_PATH_STEP_RE = re.compile(r"(\.[^.\[]+|\[\d+\])$")


def _line_of(message: str, lines: Mapping[str, int]) -> int | None:
    path = message.split(": ", 1)[0].split(" ", 1)[0].replace(".<key>", "")
    while path:
        if path in lines:
            return lines[path]
        shorter = _PATH_STEP_RE.sub("", path)
        if shorter == path:
            return lines.get(path)
        path = shorter
    return None


def load_config(path: str | Path) -> Config:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"config file {path} is not UTF-8 text: {exc.reason} at byte {exc.start}"
        ) from None
    return read_capture_key(read_admin_token(read_session_secret(load_config_text(text))))


# ---------------------------------------------------------------------------------------------
# HTTPRoute annotations.

_BOOL_WORDS = {"true": True, "on": True, "yes": True, "false": False, "off": False, "no": False}
_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9\-]*$")
_SCORER_SPEC_RE = re.compile(
    r"^\s*[a-z0-9\-]+\s*(:\s*[0-9]*\.?[0-9]+\s*)?(,\s*[a-z0-9\-]+\s*(:\s*[0-9]*\.?[0-9]+\s*)?)*$"
)


def parse_route_annotations(annotations: Mapping[str, str]) -> tuple[RouteSettings, list[str]]:
    """Decode ``lb.extproc.io/*`` annotations. Invalid values are reported and left at defaults.

    Keys (all optional): strategy, profile, scorers, model-map ("alias=served,..."),
    shed-sheddable, accounting, inject-include-usage, priority (flow control's band for
    requests that name none), objective (an InferenceObjective name, likewise). Unknown keys under the prefix are errors
    too, since a typo would otherwise be silently ignored.
    """
    kwargs: dict[str, Any] = {}
    errors: list[str] = []
    for key, raw in annotations.items():
        if not key.startswith(ANNOTATION_PREFIX):
            continue
        name = key[len(ANNOTATION_PREFIX) :]
        value = raw.strip()
        if name in ("strategy", "profile"):
            if _NAME_RE.match(value):
                kwargs[name] = value
            else:
                errors.append(f"{key}: {raw!r} is not a valid {name} name")
        elif name == "scorers":
            if _SCORER_SPEC_RE.match(value):
                kwargs["scorers"] = value.replace(" ", "")
            else:
                errors.append(f"{key}: {raw!r} must look like 'prefix-cache:3,least-request:1'")
        elif name == "model-map":
            mapping: dict[str, str] = {}
            for part in filter(None, (p.strip() for p in value.split(","))):
                src, sep, dst = part.partition("=")
                if not sep or not src.strip() or not dst.strip():
                    errors.append(f"{key}: {part!r} must be 'requested=served'")
                    mapping = {}
                    break
                mapping[src.strip()] = dst.strip()
            if mapping:
                kwargs["model_map"] = mapping
        elif name == "priority":
            try:
                kwargs["priority"] = int(value)
            except ValueError:
                errors.append(f"{key}: {raw!r} must be an integer (higher first, < 0 sheddable)")
        elif name == "objective":
            if _NAME_RE.match(value):
                kwargs["objective"] = value
            else:
                errors.append(f"{key}: {raw!r} is not a valid InferenceObjective name")
        elif name in ("shed-sheddable", "accounting", "inject-include-usage"):
            flag = _BOOL_WORDS.get(value.lower())
            if flag is None:
                errors.append(f"{key}: {raw!r} must be true or false")
            else:
                kwargs[name.replace("-", "_")] = flag
        else:
            errors.append(
                f"{key}: unknown annotation (known: strategy, profile, scorers, "
                "model-map, shed-sheddable, accounting, inject-include-usage, priority, objective)"
            )
    return RouteSettings(**kwargs), errors


class RouteTable:
    """Per-route settings by the route name Envoy sends (the `xds.route_name` attribute): the
    config file's `routes:` and HTTPRoute annotations (keyed `<namespace>/<name>`; they win on
    a clash). Immutable: a reload or an HTTPRoute change builds a new table that replaces the
    old one in one assignment."""

    __slots__ = ("_by_name", "kubernetes", "local")

    def __init__(
        self,
        local: Mapping[str, RouteSettings] | None = None,
        kubernetes: Mapping[str, RouteSettings] | None = None,
    ) -> None:
        self.local: Mapping[str, RouteSettings] = dict(local or {})
        self.kubernetes: Mapping[str, RouteSettings] = dict(kubernetes or {})
        self._by_name = {**self.local, **self.kubernetes}

    def with_local(self, routes: Mapping[str, RouteSettings]) -> RouteTable:
        return RouteTable(routes, self.kubernetes)

    def with_kubernetes(self, routes: Mapping[str, RouteSettings]) -> RouteTable:
        return RouteTable(self.local, routes)

    def lookup(self, route_name: str | None) -> RouteSettings | None:
        """The exact route name first; for an Envoy Gateway HTTPRoute route name
        (`httproute/<ns>/<name>/rule/...`) then its `<ns>/<name>`; for any other name, or
        none, the `default` route's settings."""
        if not route_name:
            return self._by_name.get("default")
        found = self._by_name.get(route_name)
        if found is not None:
            return found
        parts = route_name.split("/")
        if len(parts) >= 3 and parts[0] == "httproute":
            return self._by_name.get(f"{parts[1]}/{parts[2]}")
        return self._by_name.get("default")
