"""The composition root: builds every component from the config and runs them.

No singletons and no module-level state: everything is created here and handed down.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import random
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.accounting.inflight import InflightTracker
from extproc.accounting.latency_model import LatencyMetrics, LatencyModels
from extproc.accounting.podstats import PodStatsTracker
from extproc.admin import AdminServer, DecisionLog, ReloadStatus
from extproc.capture import CaptureStore
from extproc.config import (
    Config,
    ConfigError,
    ModelConfig,
    ModelRewriteConfig,
    RouteSettings,
    RouteTable,
    load_config,
    parse_route_annotations,
)
from extproc.director.api import AccessRecord, RequestHead
from extproc.director.attributes import AttributeReader
from extproc.director.bodyless import Bodyless
from extproc.director.capture import CaptureDecision, CaptureOutcome
from extproc.director.director import Deciding, Director, Limits
from extproc.director.engine_priority import EnginePriority, priority_models
from extproc.director.flow import FlowControl
from extproc.director.latency import LatencyShare, LearnLatency, MarkRouted, TagLatency
from extproc.director.leases import LEASE_LATENCY_MULTIPLE, LeaseBook
from extproc.director.lifecycle import ModelRuntime, RoutingState, Steps
from extproc.director.placement import Candidates, PlaceCandidates
from extproc.director.prefill import PrefillClient
from extproc.director.prepare import Models, ParseRequest, ResolveModel, Tokenize
from extproc.director.response import ChargeUser, CountResponse, PodSamples
from extproc.director.responses import StampResponseId
from extproc.director.steps import (
    ClaimEndpoint,
    DecideStrategy,
    ExplainHeader,
    RecordPick,
    RemotePrefill,
    RewriteBody,
    SessionAffinity,
    ShedSheddable,
    TagForAccounting,
)
from extproc.discovery.kubernetes import (
    HTTPRouteWatcher,
    InferenceObjective,
    InferenceObjectiveWatcher,
    ModelRewriteWatcher,
    PodDiscovery,
    PodSource,
    make_api_client,
)
from extproc.discovery.pools import (
    FleetChanges,
    FleetSnapshot,
    PoolDispatcher,
    PoolHandlers,
    PoolKey,
    PoolSelection,
    PoolWatcher,
    model_config,
)
from extproc.flowcontrol import FlowController, FlowMetrics, PoolCapacity
from extproc.flowcontrol.controller import ROOM_CACHE_S
from extproc.flowcontrol.policies import builtin_policies
from extproc.flowcontrol.ttft import EngineTtft
from extproc.gctune import tune_gc
from extproc.kvcache.approx import ApproximateIndex
from extproc.kvcache.exact import ExactIndex
from extproc.kvcache.prefix import IndexMode, PrefixIndex
from extproc.kvevents.metrics import KVEventMetrics
from extproc.kvevents.subscriber import KVEventManager, SubscriberSettings
from extproc.metrics.names import preset as metric_preset
from extproc.metrics.poller import MetricsPoller
from extproc.metrics.scrape import PageFetcher
from extproc.metrics.store import EndpointStore
from extproc.metrics.transport import PerHostTransport
from extproc.routing.builtin import default_plugins
from extproc.routing.registry import StrategyRegistry
from extproc.routing.rewrites import ModelRewrites
from extproc.routing.session import SessionTokens
from extproc.routing.settings import build_strategies, route_annotations
from extproc.server.service import ExtProcServer, ServerOptions
from extproc.sync import StateSync, SyncMetrics
from extproc.tokenization import (
    CharEstimateTokenizer,
    SharedTokenizers,
    TokenizerLoadError,
    TokenizerPool,
    bundled_qwen_dir,
    load_tokenizer,
)
from extproc.tokenization.base import Tokenizer
from extproc.tracing import NO_TRACER, Tracer, open_tracer
from extproc.types import Endpoint, EndpointRole, EngineMetrics, GatewayError

__all__ = [
    "App",
    "Core",
    "Runtime",
    "build_director",
    "build_endpoints",
    "build_runtime",
    "build_steps",
    "load_model_tokenizer",
]

log = logging.getLogger("extproc.app")

BUNDLED_PREFIX = "bundled:"
UNKNOWN_POD_BLOCKS = 32768  # a pod's KV blocks until it reports them: 512k tokens at 16


def check_tokenizer_path(path: Path, root: str | None, model: str) -> Path:
    """With `server.tokenizer_root`, a tokenizer directory must resolve inside that root."""
    if root is None:
        return path
    try:
        resolved = path.resolve(strict=True)
        allowed = Path(root).resolve(strict=True)
    except OSError as exc:
        raise ConfigError(f"models[{model}].tokenizer: {path}: {exc.strerror}") from None
    if not resolved.is_relative_to(allowed):
        raise ConfigError(
            f"models[{model}].tokenizer: {path} is outside server.tokenizer_root ({root})"
        )
    return resolved


def model_tokenizer_dir(model: ModelConfig, root: str | None = None) -> Path | None:
    """The directory of the model's tokenizer; None (logged) gives a labelled estimate."""
    spec = model.tokenizer
    if spec is None:
        log.warning(
            "model %s: no tokenizer configured; token counts are ESTIMATED (chars/4)", model.name
        )
        return None
    if spec.startswith(BUNDLED_PREFIX):
        if spec != "bundled:qwen3":
            raise ConfigError(f"models[{model.name}].tokenizer: unknown bundled tokenizer {spec!r}")
        path = bundled_qwen_dir()
        if path is None:
            log.error(
                "model %s: bundled Qwen3 tokenizer not installed; token counts are ESTIMATED",
                model.name,
            )
        return path
    return check_tokenizer_path(Path(spec), root, model.name)


def load_model_tokenizer(model: ModelConfig, root: str | None = None) -> Tokenizer:
    """The model's exact tokenizer, or a labelled estimate when none is configured or loadable."""
    path = model_tokenizer_dir(model, root)
    if path is None:
        return CharEstimateTokenizer()
    try:
        return load_tokenizer(path)
    except TokenizerLoadError as exc:
        log.error(
            "model %s: %s; token counts are ESTIMATED until the file is fixed", model.name, exc
        )
        return CharEstimateTokenizer()


def build_endpoints(model: ModelConfig) -> tuple[Endpoint, ...]:
    return tuple(
        Endpoint(
            address=e.address,
            model=model.name,
            metrics_url=e.metrics_url,
            role=EndpointRole(e.role),
            kv_events_endpoint=e.kv_events,
            kv_replay_endpoint=e.kv_replay,
            data_parallel_size=e.data_parallel_size,
        )
        for e in model.endpoints
    )


@dataclass
class Runtime:
    """Everything built from one config. A reload builds a new one beside the live one and
    swaps it in with one assignment (`App._install`): nothing live changes before the new
    runtime is complete, so a rejected reload leaves no trace."""

    config: Config
    director: Director
    tokenizers: dict[str, TokenizerPool]
    exact: dict[str, ExactIndex]
    approx: dict[str, ApproximateIndex]
    static: dict[str, tuple[Endpoint, ...]]  # endpoints from the config file, per model
    strategies: StrategyRegistry
    models: Models  # what the director routes to, by every name a request may use
    # The session key: kept by a reload that configures no other secret, so every session id
    # and stored-response id a client holds still names its pod.
    sessions: SessionTokens


class Core:
    """What a process builds once and every config's director shares. A config reload builds
    a new `Runtime` on it and replaces none of it: the metric families, the endpoint store and
    the gateway's trackers, the lease book, the latency models, the routing state (random
    source, routing memory), the deciding count, flow control and the decision log; and the
    live inputs the steps read per request (the route table, the model rewrites, the watched
    InferenceObjectives). `App` runs one; tests build theirs the same way (tests/_director.py).

    The hooks into the app's other parts (KV events, replica sync, the P/D prefill client)
    are set by `App`; without them a director routes alone (no events, no peers, no remote
    prefill)."""

    def __init__(
        self,
        config: Config,
        *,
        replica: str,
        registry: CollectorRegistry,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config  # the config in force (`install` replaces it)
        self.replica = replica  # host:pid: who routed a request, in its access-log record
        self.registry = registry
        self.clock = clock
        self.wall_clock = wall_clock
        self.metrics = GatewayMetrics(registry)
        self.store = EndpointStore(stale_after=config.metrics.stale_after_s, clock=clock)
        self.podstats = PodStatsTracker()
        # A pod whose engine shows no progress for two polls counts what it holds as waiting.
        self.inflight = InflightTracker(
            stats=self.podstats, metrics=self.metrics, clock=clock,
            progress=self.store.progressed_at, hang_after_s=config.routing.hang_after_s,
            quiet_after_s=2 * config.metrics.poll_interval_s,
        )  # fmt: skip
        self.fairness = FairnessCounters()
        # Routed requests' leases, until their access-log records end them (any process's).
        acct = config.accounting
        self.leases = LeaseBook(
            replica=replica, inflight=self.inflight, fairness=self.fairness, metrics=self.metrics,
            bound=self._lease_bound, min_s=acct.lease_min_s, records=acct.access_log, clock=clock,
        )  # fmt: skip
        # predicted-latency's per-pod models: learned from the records this process accounts.
        self.latency = LatencyModels(clock=clock)
        self.latency_metrics = LatencyMetrics(registry)
        self.state = RoutingState(random.Random(config.routing.seed))
        self.deciding = Deciding()
        # The status page: this process's last decisions.
        self.decisions = DecisionLog(wall_clock=wall_clock)
        self.flow = self._build_flow(config)
        if self.flow is not None:
            self.leases.on_end = self.flow.wake  # a lease's room may let a waiting request go
            self.fairness.on_forget = self.flow.fairness_changed  # a forgotten count reads 0
        # Live inputs: config-file routes + HTTPRoute annotations; the config's model rewrites
        # + discovered InferenceModelRewrites (one object, rebuilt whole on either change);
        # watched InferenceObjectives' priorities; discovered endpoints.
        self.routes = RouteTable()
        self.found_rewrites: list[ModelRewriteConfig] = []
        self.rewrites = ModelRewrites()
        self.objectives: dict[str, int] = {}
        self.discovered: dict[str, tuple[Endpoint, ...]] = {}
        self.static: dict[str, tuple[Endpoint, ...]] = {}
        self.pool_endpoints: dict[str, tuple[Endpoint, ...]] = {}  # pools found in the cluster
        # Tokenizers by content, loaded lazily within a bound, shared by every model, pool and
        # runtime (settings apply at start-up).
        self.tokenizers = SharedTokenizers(
            max_loaded=config.server.max_tokenizers,
            threads=config.server.tokenizer_threads,
            inline_threshold_chars=config.server.tokenize_inline_bytes,
        )
        # Hooks into the app's other parts.
        self.kv_healthy: Callable[[str], bool] = lambda _address: False
        self.on_routed: Callable[[str], None] | None = None  # the KV-event manager's
        self.share_blocks: Callable[[str, str, Sequence[int]], None] | None = None
        self.share_latency: LatencyShare | None = None
        self.prefill: PrefillClient | None = None
        # Spans of routing decisions (tracing.enabled; settings apply at start-up).
        self.tracer: Tracer = NO_TRACER
        # The traffic capture's rings (capture.enabled; settings apply at start-up).
        self.capture: CaptureStore | None = None
        if config.capture.enabled:
            self.capture = CaptureStore(
                config.capture, replica=replica, clock=clock, wall_clock=wall_clock
            )

    def _build_flow(self, config: Config) -> FlowController | None:
        """The queue for demand above the pool, when `flow_control.enabled` (settings apply at
        start-up only: waiting requests live in it)."""
        cfg = config.flow_control
        if not cfg.enabled:
            return None
        capacity = PoolCapacity(
            ready=lambda model: self.store.ready(model),
            in_flight=lambda address: self.inflight.load(address).requests,
            saturation=config.saturation,
            dispatch=cfg.dispatch,
            engine_queue=cfg.engine_queue,
            max_concurrency=cfg.max_concurrency,
            clock=self.clock,
        )
        load = self.inflight.load
        return FlowController(
            settings=cfg, capacity=capacity, tokens=self.fairness.tokens,
            policies=builtin_policies(tokens=self.fairness.tokens),
            ttft=EngineTtft(
                ready=lambda model: self.store.ready(model),
                load=lambda address: (load(address).requests, load(address).tokens),
                models=self.latency,
            ),
            metrics=FlowMetrics(self.registry), room_cache_s=ROOM_CACHE_S, clock=self.clock,
        )  # fmt: skip

    def _lease_bound(self, address: str) -> float:
        """How long a request on `address` may take before its lease is presumed lost: 3x
        the longest response seen there (else in the pool), within the configured bounds."""
        acct = self.config.accounting
        longest = self.podstats.longest_of(address)
        if longest is None:
            return acct.lease_max_s
        return min(acct.lease_max_s, max(acct.lease_min_s, LEASE_LATENCY_MULTIPLE * longest))

    def objective_priority(self, name: str) -> int | None:
        """An InferenceObjective's priority: the config's, else the watched resource's."""
        found = self.config.flow_control.objectives.get(name)
        if found is not None:
            return found
        return self.objectives.get(name)

    def install(self, rt: Runtime) -> None:
        """`rt`'s config in force: its routes, rewrites and static endpoints beside the
        discovered ones."""
        self.config = rt.config
        self.tokenizers.set_inline_threshold(rt.config.server.tokenize_inline_bytes)
        self.inflight.hang_after_s = rt.config.routing.hang_after_s
        self.routes = self.routes.with_local(rt.config.routes)
        self.static = rt.static
        self.set_rewrites(self.found_rewrites)
        self.publish_endpoints()

    def set_rewrites(self, found: list[ModelRewriteConfig]) -> None:
        """The rewrites in force: the config's, then discovered ones for our pools."""
        self.found_rewrites = found
        cfg = self.config
        pools = [m.kubernetes.inference_pool for m in cfg.models if m.kubernetes is not None]
        self.rewrites = ModelRewrites(
            [*cfg.model_rewrites, *found], pools=[p for p in pools if p is not None]
        )

    def publish_endpoints(self) -> None:
        by_model = dict(self.static)
        for model, eps in self.discovered.items():
            by_model[model] = (*by_model.get(model, ()), *eps)
        by_model.update(self.pool_endpoints)
        self.store.set_endpoints(by_model)

    def share_blocks_of(self, model: str) -> Callable[[str, Sequence[int]], None]:
        def share(pod: str, hashes: Sequence[int]) -> None:
            if self.share_blocks is not None:
                self.share_blocks(model, pod, hashes)

        return share

    def shared_latency(
        self, model: str, pod: str, tag: str, ttft_s: float | None, tpot_s: float | None
    ) -> None:
        if self.share_latency is not None:
            self.share_latency(model, pod, tag, ttft_s, tpot_s)


TokenizerFor = Callable[[ModelConfig], Tokenizer]


def build_runtime(
    config: Config,
    core: Core,
    previous: Runtime | None = None,
    created: list[TokenizerPool] | None = None,
    *,
    tokenizer_for: TokenizerFor | None = None,
) -> Runtime:
    """A complete runtime for `config` on `core`, reusing what is compatible from `previous`
    (warm tokenizers and indexes, the session key) and changing nothing live. Raises on a
    bad config. New tokenizer pools are appended to `created` (closed by the caller when the
    config is rejected). `tokenizer_for` loads a model's tokenizer (tests hand theirs)."""
    created = created if created is not None else []
    # Every routing setting checked (key path in errors).
    strategies = build_strategies(config, default_plugins(latency=core.latency))
    runtimes: dict[str, ModelRuntime] = {}
    tokenizers: dict[str, TokenizerPool] = {}
    exact_map: dict[str, ExactIndex] = {}
    approx_map: dict[str, ApproximateIndex] = {}
    for model in config.models:
        if tokenizer_for is None:
            # One pool per distinct tokenizer content, shared by every model and runtime.
            root = config.server.tokenizer_root
            pool = core.tokenizers.pool(model_tokenizer_dir(model, root), model=model.name)
        else:
            pool = TokenizerPool(
                tokenizer_for(model),
                max_workers=config.server.tokenizer_threads,
                inline_threshold_chars=config.server.tokenize_inline_bytes,
            )
            created.append(pool)
        tokenizers[model.name] = pool
        exact = previous.exact.get(model.name) if previous else None
        if exact is None or exact.block_size != model.block_size:
            # Another block size hashes other blocks: a new index, fed by new subscribers.
            exact = ExactIndex(
                block_size=model.block_size, max_blocks=config.kv_events.exact_capacity_blocks
            )
        exact_map[model.name] = exact
        approx = previous.approx.get(model.name) if previous else None
        if approx is None:
            approx = ApproximateIndex(
                ttl_s=config.kv_events.approx_ttl_s,
                max_blocks=config.kv_events.approx_capacity_blocks,
            )
        approx_map[model.name] = approx
        runtimes[model.name] = _model_runtime(config, core, model, pool, exact, approx)
    static = {m.name: build_endpoints(m) for m in config.models if m.endpoints}
    sessions = _session_tokens(config, previous)
    models = Models(runtimes)
    director = build_director(config, core, models, strategies, sessions)
    return Runtime(
        config, director, tokenizers, exact_map, approx_map, static, strategies, models, sessions
    )


def _model_runtime(
    config: Config,
    core: Core,
    model: ModelConfig,
    pool: TokenizerPool,
    exact: ExactIndex,
    approx: ApproximateIndex,
) -> ModelRuntime:
    return ModelRuntime(
        name=model.name,
        tokenizer=pool,
        prefix=PrefixIndex(
            mode=IndexMode(model.kv_events_mode or config.kv_events.mode),
            block_size=model.block_size,
            exact=exact,
            approximate=approx,
            events_healthy=lambda address: core.kv_healthy(address),
            on_record=core.share_blocks_of(model.name),
            pending_s=config.kv_events.pending_s,
        ),
        block_size=model.block_size,
        default_strategy=model.strategy,
        lora_adapters=frozenset(model.lora_adapters),
        aliases=tuple(model.aliases),
    )


def _session_tokens(config: Config, previous: Runtime | None) -> SessionTokens:
    """The previous runtime's session key unless this config sets another secret: a reload
    without `routing.session_secret` keeps every session and stored-response id valid."""
    secret = config.routing.session_secret
    if previous is not None and secret in (None, previous.config.routing.session_secret):
        return previous.sessions
    return SessionTokens.from_secret(secret)


def build_director(
    config: Config,
    core: Core,
    models: Models,
    strategies: StrategyRegistry,
    sessions: SessionTokens,
) -> Director:
    """The director for `config`: its steps, and the core's state it shares with the next."""
    cfg = config.routing
    return Director(
        build_steps(config, core, models, strategies, sessions),
        bodyless=Bodyless(
            models=models, store=core.store, inflight=core.inflight, sessions=sessions,
            state=core.state, max_fallbacks=cfg.max_fallbacks,
        ),
        leases=core.leases,
        state=core.state,
        deciding=core.deciding,
        metrics=core.metrics,
        limits=Limits(
            max_body_bytes=config.server.max_body_bytes,
            max_pending=config.server.max_pending_requests,
            max_fallbacks=cfg.max_fallbacks,
        ),
        tracer=core.tracer,
    )  # fmt: skip


def build_steps(
    config: Config,
    core: Core,
    models: Models,
    strategies: StrategyRegistry,
    sessions: SessionTokens,
) -> Steps:
    """Every step of the request lifecycle, in the order the director runs them (kinds:
    `extproc.director.lifecycle`). The one place they are listed."""
    cfg, metrics, clock = config.routing, core.metrics, core.clock
    candidates = Candidates(
        store=core.store, inflight=core.inflight, stall_after_s=cfg.stall_after_s
    )
    return Steps(
        prepare=(
            ParseRequest(
                max_body_bytes=config.server.max_body_bytes,
                routes=lambda name: core.routes.lookup(name),
                attributes=AttributeReader(cfg, core.objective_priority),
            ),
            ResolveModel(
                models=models,
                strategies=strategies,
                rewrites=lambda: core.rewrites,
                sessions=sessions,
                metrics=metrics,
                strategy_header=cfg.strategy_header,
                default_strategy=cfg.default_strategy,
            ),
            Tokenize(metrics=metrics),
        ),
        # With flow control, the queue decides what waits and what is shed (sheddable
        # requests first); without it, sheddable requests are shed when every pod is saturated.
        admit=(
            (FlowControl(core.flow),)
            if core.flow is not None
            else (
                ShedSheddable(
                    candidates=candidates,
                    metrics=metrics,
                    saturation=config.saturation,
                ),
            )
        ),
        place=PlaceCandidates(
            candidates=candidates,
            store=core.store,
            inflight=core.inflight,
            podstats=core.podstats,
            sessions=sessions,
            clock=clock,
        ),
        decide=DecideStrategy(fairness=core.fairness, metrics=metrics, clock=clock),
        pre_request=(
            RecordPick(metrics=metrics, clock=clock, on_routed=core.on_routed),
            RewriteBody(inject_include_usage=config.accounting.inject_include_usage),
            RemotePrefill(client=core.prefill, metrics=metrics),
            SessionAffinity(header=cfg.session_header, tokens=sessions),
            StampResponseId(tokens=sessions, session_header=cfg.session_header),
            ExplainHeader(allowed=config.server.allow_explain),
            TagForAccounting(replica=core.replica),
            EnginePriority(models=priority_models(config)),
            MarkRouted(models=core.latency),
            TagLatency(models=core.latency),
            *((core.decisions,) if config.server.status_page else ()),
            *(
                (
                    CaptureDecision(
                        core.capture,
                        replica=core.replica,
                        session_header=cfg.session_header,
                        wall_clock=core.wall_clock,
                    ),
                )
                if core.capture is not None
                else ()
            ),
        ),
        claim=ClaimEndpoint(leases=core.leases),
        complete=(
            CountResponse(metrics),
            ChargeUser(core.fairness),
            PodSamples(
                metrics=metrics,
                podstats=core.podstats,
                inflight=core.inflight,
                clock=clock,
                wall_clock=core.wall_clock,
            ),
            LearnLatency(
                models=core.latency, metrics=core.latency_metrics, share=core.shared_latency
            ),
            *((CaptureOutcome(core.capture),) if core.capture is not None else ()),
        ),
    )


class App:
    """Runs the ext_proc server with its metrics poller, admin HTTP server and config reload."""

    def __init__(self, config: Config, *, config_path: Path | None = None) -> None:
        self._config_path = config_path
        self._config_mtime = _mtime(config_path)
        self.registry = CollectorRegistry()
        # What outlives config reloads (the runtime built from each config runs on it).
        self.core = core = Core(
            config, replica=f"{socket.gethostname()}:{os.getpid()}", registry=self.registry
        )
        self.replica = core.replica
        self.metrics = core.metrics
        self.store = core.store
        self.podstats = core.podstats
        self.inflight = core.inflight
        self.fairness = core.fairness
        self.leases = core.leases
        self.latency = core.latency  # kept across reloads (the strategies are rebuilt)
        self.latency_metrics = core.latency_metrics
        self.decisions = core.decisions
        self.flow = core.flow
        self.capture = core.capture
        # How the config got in force (the status page).
        self.reload_status = ReloadStatus(
            path=str(config_path) if config_path else None, loaded_at=time.time()
        )
        self.state_gauge = Gauge(
            "server_state", "Per-request state and task counts (flat under steady load)", ["kind"],
            namespace="extproc", registry=self.registry,
        )  # fmt: skip
        self.config_reloads = Counter(
            "config_reloads", "Config file reloads by result", ["result"],
            namespace="extproc", registry=self.registry,
        )  # fmt: skip
        self._http = httpx.AsyncClient(limits=httpx.Limits(max_connections=256))
        # Scrapes get one small pool per pod: httpcore's single pool walks every connection
        # per request, which at hundreds of pods cost more CPU than the scrapes themselves.
        self._scrape_http = httpx.AsyncClient(transport=PerHostTransport())
        core.prefill = PrefillClient(self._http)
        core.on_routed = self._note_traffic
        # Not started here: `start()` starts its exporter (OpenTelemetry only when enabled).
        core.tracer = open_tracer(config.tracing, instance=core.replica)
        self._discoveries: list[PodDiscovery] = []
        self._route_watcher: HTTPRouteWatcher[RouteSettings] | None = None
        self._rewrite_watcher: ModelRewriteWatcher | None = None
        self._objective_watcher: InferenceObjectiveWatcher | None = None
        self._api_client: Any = None
        self.tokenizers = core.tokenizers
        # Pools found in the cluster (extproc/discovery/pools/): a runtime per pool, and the
        # dispatcher giving each request to its route's pool (the config's models otherwise).
        self._pool_runtimes: dict[PoolKey, Runtime] = {}
        self._pools: PoolDispatcher[Director] = PoolDispatcher(lambda: self._rt.director)
        self._pool_watcher: PoolWatcher | None = None
        self._install(self._build(config))
        self._kv_metrics = KVEventMetrics(self.registry)
        self.kv = self._kv_manager(config)
        # One kept-alive connection per pod, httpx for https and the rest (metrics/scrape.py).
        self._pages = PageFetcher(self._scrape_http, max_bytes=config.metrics.max_response_bytes)
        self.poller = MetricsPoller(
            self.store,
            self._scrape_http,
            fetch=self._pages.fetch,
            interval=config.metrics.poll_interval_s,
            idle_interval=config.metrics.idle_poll_interval_s,
            timeout=config.metrics.timeout_s,
            max_bytes=config.metrics.max_response_bytes,
            names=metric_preset(config.metrics.preset, config.metrics.names),
            observer=self.metrics,
        )
        self.sync = self._build_sync(config)
        self.server = ExtProcServer(
            _HandlerRef(self),
            ServerOptions(
                host=config.server.host,
                port=config.server.grpc_port,
                max_concurrent_streams=config.server.max_concurrent_streams,
                # Above Envoy's buffer limit (8 MiB locally and in the Envoy Gateway overlay),
                # so any body Envoy forwards reaches the director and gets its 413, not a
                # gRPC error (fail-closed 500).
                max_message_bytes=max(config.server.max_body_bytes + 1024 * 1024, 16 << 20),
                tls_cert_file=config.server.tls.cert_file if config.server.tls else None,
                tls_key_file=config.server.tls.key_file if config.server.tls else None,
                tls_client_ca_file=config.server.tls.client_ca_file if config.server.tls else None,
                tls_reload_interval_s=config.server.tls.reload_interval_s
                if config.server.tls
                else 30.0,
                trace_context=config.tracing.enabled,
            ),
        )
        self.registry.register(
            _Tally(
                "extproc_grpc_stream_ends", "ext_proc streams by how they ended "
                "(done|eof|cancelled|error)", "end", self.server.stream_ends,
            )
        )  # fmt: skip
        self.registry.register(
            _Tally(
                "extproc_access_log_entries", "Access-log entries received by result "
                "(accounted|skipped|error)", "result", self.server.access_log.entries,
            )
        )  # fmt: skip
        self._admin = AdminServer(self)
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    @property
    def config(self) -> Config:
        return self._rt.config

    @property
    def director(self) -> Director:
        return self._rt.director

    @property
    def exact_indexes(self) -> Mapping[str, ExactIndex]:
        return {k: v for rt in self._runtimes() for k, v in rt.exact.items()}

    @property
    def approx_indexes(self) -> Mapping[str, ApproximateIndex]:
        return {k: v for rt in self._runtimes() for k, v in rt.approx.items()}

    # -- building ------------------------------------------------------------------------------

    def _build(self, config: Config, previous: Runtime | None = None) -> Runtime:
        """A complete runtime for `config` (`build_runtime`); changes nothing live."""
        created: list[TokenizerPool] = []
        try:
            return build_runtime(config, self.core, previous, created)
        except BaseException:
            for pool in created:  # new pools of a rejected config: nothing else holds them
                pool.close()
            raise

    def _install(self, rt: Runtime) -> None:
        """Make `rt` the live runtime (start-up and reload). KV-event subscribers follow
        with `kv.set_indexes` (async). Tokenizer pools are shared by content and outlive
        runtimes (`SharedTokenizers`); the old director's requests keep theirs."""
        self._rt = rt
        self.core.install(rt)

    @property
    def _rewrites(self) -> ModelRewrites:
        return self.core.rewrites

    # -- flow control ---------------------------------------------------------------------------

    def _flow_gauges(self) -> None:
        flow = self.flow
        if flow is None or flow.metrics is None:
            return
        for model in self.store.models():
            tokens = sum(
                self.inflight.load(ep.address).tokens for ep in self.store.endpoints(model)
            )
            flow.metrics.demand.labels(model).set(tokens + flow.queued_bytes(model) // 4)
            flow.metrics.saturation.labels(model).set(flow.capacity(model).saturation)

    # -- replica sync ---------------------------------------------------------------------------

    def _build_sync(self, config: Config) -> StateSync | None:
        """Shared state over NATS when `sync.url` is set (settings apply at start-up only)."""
        cfg = config.sync
        if cfg.url is None:
            return None
        from extproc.sync.nats import NatsBus  # nats-py only where sync is on

        password = None
        if cfg.password_file is not None:
            try:
                password = Path(cfg.password_file).read_text(encoding="utf-8").strip()
            except OSError as exc:
                raise ConfigError(f"sync.password_file: {exc.strerror}") from None
        tls = cfg.tls
        bus = NatsBus(
            cfg.url,
            cfg.subject,
            user=cfg.user,
            password=password,
            ca_file=tls.ca_file if tls else None,
            cert_file=tls.cert_file if tls else None,
            key_file=tls.key_file if tls else None,
            name=f"extproc {self.replica}",
        )
        sync = StateSync(
            replica=self.replica,
            bus=bus,
            inflight=self.inflight,
            fairness=self.fairness,
            approx=lambda model: self._rt.approx.get(model),  # the live runtime's
            models=lambda: list(self._rt.approx),
            on_metrics=self._peer_scrape,
            on_latency=self.latency.observe_tagged,
            latency_rows=self.latency.rows,
            on_latency_rows=self._adopt_models,
            on_release=self.leases.release,
            on_adopt=self._adopt,
            queues=self.flow.depths if self.flow is not None else None,
            on_queues=self.flow.set_remote if self.flow is not None else None,
            settings=cfg,
            metrics=SyncMetrics(self.registry),
        )
        self.fairness.on_charge = sync.note_charge
        self.leases.forward = lambda key: sync.note_release(key.replica, key.seq)
        self.core.share_blocks = sync.note_blocks
        self.core.share_latency = sync.note_latency
        self.poller.owns = sync.owns
        self.poller.on_scraped = lambda ep, metrics: sync.note_metrics(
            ep.model, ep.address, metrics
        )
        return sync

    def _adopt_models(self, rows: list[Any]) -> None:
        n = self.latency.adopt(rows)
        if n:
            log.info("started %d latency models from a peer's (predicted-latency)", n)

    def _adopt(self, rows: list[Any]) -> None:
        n = self.leases.adopt(rows)
        log.info("adopted %d open leases from a replica that shut down", n)

    def _peer_scrape(self, model: str, address: str, metrics: EngineMetrics) -> None:
        ep = self.store.find(model, address)
        if ep is None:
            return
        state = self.store.state(ep)
        if state is None or state.metrics is None or state.metrics.updated_at < metrics.updated_at:
            self.poller.record_peer(ep, metrics)

    def _note_traffic(self, address: str) -> None:
        """A request was routed to `address`: its KV events and its metrics are watched
        closely from now on (an idle pod was scraped at the idle pace)."""
        self.kv.note_traffic(address)
        self.poller.note_traffic(address)

    def _kv_manager(self, config: Config) -> KVEventManager:
        manager = KVEventManager(
            indexes=self._rt.exact,
            settings=SubscriberSettings.from_config(config.kv_events),
            metrics=self._kv_metrics,  # registered once; a manager rebuilt on reload reuses them
        )
        self.core.kv_healthy = manager.is_healthy
        return manager

    def route_settings_for(self, route_name: str | None) -> RouteSettings | None:
        """Settings of the route Envoy matched (`RouteTable.lookup` on the live table)."""
        return self.core.routes.lookup(route_name)

    def set_route_settings(self, settings: Mapping[str, RouteSettings]) -> None:
        """Replace per-route settings (from the HTTPRoute watcher), keeping config-file routes."""
        self.core.routes = self.core.routes.with_kubernetes(settings)

    def _on_discovered(self, model: str, endpoints: tuple[Endpoint, ...]) -> None:
        """Kubernetes changed a model's endpoint set: metrics polling and KV events follow."""
        self.core.discovered[model] = endpoints
        self.core.publish_endpoints()
        log.info("model %s: %d endpoints discovered", model, len(endpoints))
        task = asyncio.get_running_loop().create_task(self.kv.set_endpoints(self.store.endpoints()))
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    def _on_routes(self, routes: Mapping[tuple[str, str], RouteSettings]) -> None:
        self.set_route_settings(
            {f"{ns}/{name}": settings for (ns, name), settings in routes.items()}
        )

    def _start_kubernetes(self) -> None:
        cfg = self.config
        wanted = [m for m in cfg.models if m.kubernetes is not None]
        k = cfg.kubernetes
        if (
            not wanted
            and not cfg.pools.enabled
            and not (k.watch_httproutes or k.watch_model_rewrites or k.watch_inference_objectives)
        ):
            return
        self._api_client = make_api_client(
            in_cluster=cfg.kubernetes.in_cluster, kubeconfig=cfg.kubernetes.kubeconfig
        )
        loop = asyncio.get_running_loop()
        self._start_pools(loop)
        for model in wanted:
            assert model.kubernetes is not None
            discovery = PodDiscovery(
                model.name, PodSource.from_config(model.kubernetes), self._api_client,
                self._on_discovered, loop=loop,
            )  # fmt: skip
            discovery.start()
            self._discoveries.append(discovery)
        if cfg.kubernetes.watch_httproutes:
            # Annotations naming a strategy the live config lacks are reported on the route.
            parse = route_annotations(parse_route_annotations, lambda: self._rt.strategies)
            self._route_watcher = HTTPRouteWatcher(
                self._api_client, parse, self._on_routes,
                namespaces=cfg.kubernetes.namespaces, loop=loop,
            )  # fmt: skip
            self._route_watcher.start()
        if cfg.kubernetes.watch_model_rewrites:
            self._rewrite_watcher = ModelRewriteWatcher(
                self._api_client,
                self.core.set_rewrites,
                namespaces=cfg.kubernetes.namespaces,
                loop=loop,
            )
            self._rewrite_watcher.start()
        if cfg.kubernetes.watch_inference_objectives:
            self._objective_watcher = InferenceObjectiveWatcher(
                self._api_client, self._set_objectives,
                namespaces=cfg.kubernetes.namespaces, loop=loop,
            )  # fmt: skip
            self._objective_watcher.start()

    def _set_objectives(self, objectives: list[InferenceObjective]) -> None:
        """The watched InferenceObjectives' priorities, by name (one namespace per gateway is
        the usual case; with several, the same name's first in namespace order wins)."""
        by_name: dict[str, int] = {}
        for objective in objectives:
            by_name.setdefault(objective.name, objective.priority)
        self.core.objectives = by_name
        log.info("%d InferenceObjectives in force", len(by_name))

    async def _stop_kubernetes(self) -> None:
        if self._pool_watcher is not None:
            await asyncio.to_thread(self._pool_watcher.stop)
            self._pool_watcher = None
        for discovery in self._discoveries:
            await asyncio.to_thread(discovery.stop)
        self._discoveries.clear()
        if self._route_watcher is not None:
            await asyncio.to_thread(self._route_watcher.stop)
            self._route_watcher = None
        if self._rewrite_watcher is not None:
            await asyncio.to_thread(self._rewrite_watcher.stop)
            self._rewrite_watcher = None
        if self._objective_watcher is not None:
            await asyncio.to_thread(self._objective_watcher.stop)
            self._objective_watcher = None
        if self._api_client is not None:
            self._api_client.close()
            self._api_client = None

    # -- pools found in the cluster (extproc/discovery/pools/) ----------------------------------

    def handler_for(self, head: RequestHead | None) -> Director:
        """The director of the pool the request's route names, else the config's."""
        return self._pools.handler_for(head)

    def _runtimes(self) -> list[Runtime]:
        return [self._rt, *self._pool_runtimes.values()]

    def _start_pools(self, loop: asyncio.AbstractEventLoop) -> None:
        pools = self.config.pools
        if not pools.enabled:
            return
        selection = PoolSelection(
            picker_names=frozenset(pools.picker_names),
            labels=dict(pools.labels),
            namespaces=tuple(pools.namespaces),
        )
        self._pool_watcher = PoolWatcher(self._api_client, selection, self._on_pools, loop=loop)
        self._pool_watcher.start()

    def _build_pool(self, snapshot: FleetSnapshot, key: PoolKey) -> Runtime:
        """A runtime for one pool: the live config with the pool as its only model."""
        spec = snapshot.pools[key].spec
        cfg = dataclasses.replace(
            self.config, models=[model_config(spec, self.config.pools.tokenizer)]
        )
        return self._build(cfg, previous=self._pool_runtimes.get(key))

    def _on_pools(self, snapshot: FleetSnapshot, *, rebuild: bool = False) -> None:
        """Pools appeared, changed or went: build the new ones beside the live ones, then
        swap; a pool whose settings do not build is left out (logged), the others go on."""
        changes = FleetChanges.between(self._pools.current.snapshot, snapshot)
        runtimes = {k: rt for k, rt in self._pool_runtimes.items() if k in snapshot.pools}
        build = list(snapshot.pools) if rebuild else [*changes.added, *changes.changed]
        for key in build:
            try:
                runtimes[key] = self._build_pool(snapshot, key)
            except (ConfigError, GatewayError, ValueError) as exc:
                log.error("inferencepool %s/%s is not served: %s", *key, exc)
                runtimes.pop(key, None)
        self._pool_runtimes = runtimes
        self.core.pool_endpoints = {
            name: eps for name, eps in snapshot.endpoints().items()
            if any(rt.config.models[0].name == name for rt in runtimes.values())
        }  # fmt: skip
        self._pools.install(PoolHandlers(snapshot, {k: rt.director for k, rt in runtimes.items()}))
        self.core.publish_endpoints()
        if changes or rebuild:
            log.info(
                "pools: %d served (%d added, %d changed, %d removed, %d with new endpoints)",
                len(runtimes), len(changes.added), len(changes.changed), len(changes.removed),
                len(changes.endpoints),
            )  # fmt: skip
        task = asyncio.get_running_loop().create_task(self._follow_kv())
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    async def _follow_kv(self) -> None:
        await self.kv.set_indexes(self.exact_indexes)
        await self.kv.set_endpoints(self.store.endpoints())

    def _rebuild_pools(self) -> None:
        if self._pool_runtimes or self._pool_watcher is not None:
            self._on_pools(self._pools.current.snapshot, rebuild=True)

    # -- running -------------------------------------------------------------------------------

    async def start(self) -> None:
        # Scrape once before listening: a restarted server must not answer 503 "no ready
        # endpoint" for the half second before its first poll (Envoy's fail-open only covers
        # a server it cannot reach, not one that answers).
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.poller.poll_once(), self.config.metrics.timeout_s + 0.5)
        # Tokenizers (up to the bound) load before listening. A load holds the GIL from its
        # thread (0.3 s for Qwen3's, over a second on a starved CPU): after SERVING it stalled
        # the health check past Envoy's 1 s timeout, Envoy took this process out, and a peer
        # stopping just then was the only healthy host left, its refused port every retry's
        # (CI, 2026-12-06: 6 of 548 requests a 503).
        await self.tokenizers.warm()
        self.core.tracer.start()
        await self.server.start()
        if self.sync is not None:
            await self.sync.start()
        self.poller.start()
        await self.kv.set_endpoints(self.store.endpoints())
        self._start_kubernetes()
        await self._admin.start(self.config.server.host, self.config.server.metrics_port)
        self._tasks.append(asyncio.create_task(self._readiness_loop(), name="readiness"))
        self._tasks.append(asyncio.create_task(self._lease_loop(), name="lease-expiry"))
        if self.flow is not None:
            await self.flow.start()
        if self._config_path is not None:
            self._tasks.append(asyncio.create_task(self._reload_loop(), name="config-reload"))

    async def stop(self) -> None:
        grace = self.config.server.shutdown_grace_s
        if self.flow is not None:
            # What waits is routed now (the engines queue it): a stopping process cuts none.
            await self.flow.stop()
        await self.server.stop(grace, announce_s=self.config.server.shutdown_announce_s)
        if self.sync is not None:
            # Decisions are drained and no more records come here: the releases still in
            # the outbox go out, then the open leases move to a live peer.
            with contextlib.suppress(Exception):
                await self.sync.tick()
                sent = await self.sync.handoff(self.leases.handoff_rows())
                if sent:
                    self.leases.end_all("handed_off")
                    log.info("handed %d open leases to the peers", sent)
        await self._stop_kubernetes()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        await self.poller.stop()
        if self.sync is not None:
            await self.sync.stop()
        await self.kv.close()
        await self._admin.final_scrape(self.config.server.final_scrape_s)
        await self._admin.stop()
        await self._http.aclose()
        await self._pages.aclose()
        await self._scrape_http.aclose()
        await asyncio.to_thread(self.tokenizers.close)
        await asyncio.to_thread(self.core.tracer.shutdown)  # the last spans go out

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        await self.start()
        tune_gc()  # start-up's objects frozen, young collections rarer (extproc/gctune.py)
        await self._stopping.wait()
        log.info("shutting down: health NOT_SERVING, draining streams")
        await self.stop()

    def request_stop(self) -> None:
        self._stopping.set()

    def is_ready(self) -> bool:
        """Serving: some pod is ready, or flow control is on (it holds requests while no pod
        is: the waiting room of a pool scaling up from zero)."""
        serves = bool(self.config.models or self._pool_runtimes)
        return serves and (self.flow is not None or self.store.any_ready())

    def _size_indexes(self) -> None:
        """Each pool's prefix indexes bounded by what its pods can cache (1.25x their reported
        blocks; 32k blocks for a pod not saying), within the configured per-pool ceilings: a
        fleet of small pools holds what it caches, not a ceiling per pool."""
        kv = self.config.kv_events
        approx_all = self.approx_indexes
        for model, exact in self.exact_indexes.items():
            need = int(1.25 * self.store.cache_blocks(model, unknown=UNKNOWN_POD_BLOCKS))
            exact.resize(max(1, min(kv.exact_capacity_blocks, need)))
            approx = approx_all.get(model)
            if approx is not None:
                approx.resize(max(1, min(kv.approx_capacity_blocks, need)))

    async def _readiness_loop(self) -> None:
        ready: bool | None = None
        sized = -math.inf
        while True:
            if time.monotonic() - sized > 5.0:
                self._size_indexes()
                sized = time.monotonic()
            self.metrics.refresh_ready(self.store, time.monotonic())
            stall_after = self.config.routing.stall_after_s
            self.metrics.refresh_stalled(self.inflight.stalled_addresses(stall_after))
            self.state_gauge.labels("access_log_streams").set(self.server.access_log.streams)
            self.state_gauge.labels("deciding").set(self.director.deciding)
            self.state_gauge.labels("flow_control_waiting").set(
                self.flow.queued if self.flow is not None else 0
            )
            self._flow_gauges()
            self.state_gauge.labels("asyncio_tasks").set(len(asyncio.all_tasks()))
            self.state_gauge.labels("grpc_streams").set(self.server.active_streams)
            # pymalloc blocks in use: a leak of small objects shows here before RSS moves
            self.state_gauge.labels("python_allocated_blocks").set(sys.getallocatedblocks())
            now_ready = self.is_ready()
            if now_ready != ready:
                ready = now_ready
                await self.server.set_ready(ready)
                log.info(
                    "readiness: %s",
                    "SERVING" if ready else "NOT_SERVING (no endpoint with fresh metrics)",
                )
            await asyncio.sleep(0.2)

    async def _lease_loop(self) -> None:
        """Leases whose record never came end after their bound (counted as expired)."""
        while True:
            await asyncio.sleep(1.0)
            expired = self.leases.expire()
            if expired:
                log.warning("%d in-flight leases expired without an access-log record", expired)

    async def _reload_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            mtime = _mtime(self._config_path)
            if mtime == self._config_mtime:
                continue
            self._config_mtime = mtime
            assert self._config_path is not None
            try:
                new = load_config(self._config_path)
                if new.flow_control != self._rt.config.flow_control:
                    log.warning(
                        "config reload: `flow_control` settings changed; they apply at the "
                        "next restart"
                    )
                    new = dataclasses.replace(new, flow_control=self._rt.config.flow_control)
                if new.sync != self._rt.config.sync:
                    # The bus and its membership live as long as the process (replicas must
                    # agree on subjects and timings): the running settings stay in force.
                    log.warning(
                        "config reload: `sync` settings changed; they apply at the next restart"
                    )
                    new = dataclasses.replace(new, sync=self._rt.config.sync)
                rt = self._build(new, previous=self._rt)
            except (ConfigError, GatewayError, ValueError) as exc:
                log.error("config reload failed, keeping the running config: %s", exc)
                self.config_reloads.labels("error").inc()
                self.reload_status.failed(time.time(), str(exc))
                continue
            self._install(rt)
            self._rebuild_pools()  # the pools' runtimes on the new settings
            # Subscribers of a model whose index was replaced (block size) restart on the new one.
            await self.kv.set_indexes(self.exact_indexes)
            await self.kv.set_endpoints(self.store.endpoints())
            self.config_reloads.labels("ok").inc()
            self.reload_status.succeeded(time.time())
            log.info("config reloaded from %s", self._config_path)


class _Tally(Collector):
    """A counter family read from one of the server's own tallies at scrape time."""

    def __init__(self, name: str, documentation: str, label: str, tally: Mapping[str, int]):
        self._name, self._doc, self._label, self._tally = name, documentation, label, tally

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(self._name, self._doc, labels=[self._label])
        for value, n in sorted(self._tally.items()):
            family.add_metric([value], n)
        yield family


class _HandlerRef:
    """The server's handler: always the current director (swapped on config reload)."""

    def __init__(self, app: App) -> None:
        self._app = app

    @property
    def max_body_bytes(self) -> int:
        return self._app.director.max_body_bytes

    async def route(self, head: RequestHead, body: bytes | None) -> Any:
        return await self._app.handler_for(head).route(head, body)

    def reject(self, head: RequestHead | None, status: int, message: str) -> Any:
        return self._app.handler_for(head).reject(head, status, message)

    def account(self, record: AccessRecord) -> None:
        self._app.director.account(record)


def _mtime(path: Path | None) -> float | None:
    if path is None:
        return None
    try:
        return os.stat(path).st_mtime
    except OSError:
        return None
