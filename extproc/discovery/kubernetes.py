"""Kubernetes discovery: model-server pods per model, per-route settings from HTTPRoutes, and
llm-d's InferenceModelRewrite resources.

Each watched collection runs in its own thread (see `_listwatch`). Callbacks run in that
thread, or on an asyncio loop when one is given, so consumers that live on the loop never
see concurrent calls.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import hashlib
import ipaddress
import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from extproc.config import (
    ConfigError,
    KubernetesDiscoveryConfig,
    ModelRewriteConfig,
    parse_model_rewrite,
)
from extproc.discovery._listwatch import Backoff, ListWatcher, ObjectKey, Store
from extproc.types import EMPTY_LABELS, Endpoint, EndpointRole

if TYPE_CHECKING:
    from kubernetes import client as k8s

# The kubernetes library is imported where it is first used (0.4 s): a server without
# Kubernetes discovery, a local stack's, never loads it.

__all__ = [
    "DATA_PARALLEL_ANNOTATION",
    "DEFAULT_ROLE_LABEL",
    "Backoff",
    "CustomResourceWatcher",
    "HTTPRouteWatcher",
    "InferenceObjective",
    "InferenceObjectiveWatcher",
    "ModelRewriteWatcher",
    "PodDiscovery",
    "PodSource",
    "endpoints_from_pods",
    "format_selector",
    "make_api_client",
    "parse_inference_objective",
    "pod_is_routable",
    "route_key_from_xds_name",
]

_LOG = logging.getLogger(__name__)

DEFAULT_ROLE_LABEL = "llm-d.ai/role"
DATA_PARALLEL_ANNOTATION = "lb.extproc.io/data-parallel-size"  # the pod's vLLM DP size
POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
ROUTE_GROUP, ROUTE_VERSION, ROUTE_PLURAL = "gateway.networking.k8s.io", "v1", "httproutes"
REWRITE_GROUP, REWRITE_VERSION, REWRITE_PLURAL = "llm-d.ai", "v1alpha2", "inferencemodelrewrites"
OBJECTIVE_GROUP, OBJECTIVE_VERSION, OBJECTIVE_PLURAL = "llm-d.ai", "v1alpha2", "inferenceobjectives"

S = TypeVar("S")
T = TypeVar("T")
OnChange = Callable[[str, tuple[Endpoint, ...]], None]


def make_api_client(
    *, in_cluster: bool | None = None, kubeconfig: str | None = None, context: str | None = None
) -> k8s.ApiClient:
    """A client with the pod's service account (in cluster) or a kubeconfig (KUBECONFIG/~/.kube).

    `in_cluster=None` decides from the environment: inside a pod KUBERNETES_SERVICE_HOST is set.
    """
    from kubernetes import client as k8s
    from kubernetes import config as k8s_config

    configuration = k8s.Configuration()
    if in_cluster is None:
        in_cluster = kubeconfig is None and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    if in_cluster:
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, context=context, client_configuration=configuration
        )
    return k8s.ApiClient(configuration)


@dataclass(frozen=True, slots=True)
class PodSource:
    """Where one model's pods are: a label selector + ports, or an InferencePool by name."""

    namespace: str
    selector: Mapping[str, str] = field(default_factory=dict)
    target_ports: tuple[int, ...] = ()
    inference_pool: str | None = None
    metrics_port: int | None = None  # None: scrape the target port
    metrics_path: str = "/metrics"
    kv_events_template: str | None = None  # e.g. "tcp://{ip}:5557"
    kv_replay_template: str | None = None  # e.g. "tcp://{ip}:5657"
    role_label: str | None = DEFAULT_ROLE_LABEL
    data_parallel_size: int = 1  # a pod's DATA_PARALLEL_ANNOTATION overrides it

    @classmethod
    def from_config(cls, config: KubernetesDiscoveryConfig) -> PodSource:
        """The discovery settings of one `models[].kubernetes` config section."""
        pool = config.inference_pool
        return cls(
            namespace=config.namespace,
            selector=MappingProxyType(dict(config.selector)) if pool is None else EMPTY_LABELS,
            target_ports=(config.target_port,) if pool is None else (),
            inference_pool=pool,
            metrics_port=config.metrics_port,
            kv_events_template=(
                f"tcp://{{ip}}:{config.kv_events_port}" if config.kv_events_port else None
            ),
            kv_replay_template=(
                f"tcp://{{ip}}:{config.kv_replay_port}" if config.kv_replay_port else None
            ),
            role_label=config.role_label,
            data_parallel_size=config.data_parallel_size,
        )

    def __post_init__(self) -> None:
        if self.inference_pool is None:
            if not self.selector:
                raise ValueError("kubernetes discovery needs a selector or an inference_pool")
            if not self.target_ports:
                raise ValueError("kubernetes discovery with a selector needs target_ports")
        elif self.selector or self.target_ports:
            raise ValueError("give either inference_pool or selector/target_ports, not both")


def format_selector(labels: Mapping[str, str]) -> str:
    return ",".join(f"{key}={value}" for key, value in sorted(labels.items()))


def pod_is_routable(pod: Mapping[str, Any]) -> bool:
    """Ready, not terminating, and with an IP: the only pods Envoy may be sent to."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    return any(
        cond.get("type") == "Ready" and cond.get("status") == "True"
        for cond in status.get("conditions") or ()
    )


def _host(ip: str) -> str:
    try:
        return f"[{ip}]" if ipaddress.ip_address(ip).version == 6 else ip
    except ValueError:
        return ip


def _role(labels: Mapping[str, str], role_label: str | None) -> EndpointRole:
    if role_label is None:
        return EndpointRole.BOTH
    try:
        return EndpointRole(labels.get(role_label, EndpointRole.BOTH.value))
    except ValueError:  # an unknown role serves both phases rather than disappearing
        return EndpointRole.BOTH


def _data_parallel_size(meta: Mapping[str, Any], default: int) -> int:
    raw = (meta.get("annotations") or {}).get(DATA_PARALLEL_ANNOTATION)
    if raw is None:
        return default
    try:
        size = int(str(raw))
    except ValueError:
        size = 0
    if not 1 <= size <= 1024:
        _LOG.warning(
            "pod %s: %s=%r is not an integer in 1..1024; using %d",
            meta.get("name"), DATA_PARALLEL_ANNOTATION, raw, default,
        )  # fmt: skip
        return default
    return size


def endpoints_from_pods(
    model: str,
    pods: Iterable[Mapping[str, Any]],
    source: PodSource,
    target_ports: Sequence[int],
) -> tuple[Endpoint, ...]:
    """The routable endpoints, one per (pod, target port), in a stable order."""
    endpoints: list[Endpoint] = []
    for pod in pods:
        if not pod_is_routable(pod):
            continue
        meta = pod.get("metadata") or {}
        labels: Mapping[str, str] = dict(meta.get("labels") or {})
        host = _host(str(pod["status"]["podIP"]))
        role = _role(labels, source.role_label)
        dp_size = _data_parallel_size(meta, source.data_parallel_size)
        for port in target_ports:
            metrics_port = source.metrics_port if source.metrics_port is not None else port
            endpoints.append(
                Endpoint(
                    address=f"{host}:{port}",
                    model=model,
                    metrics_url=f"http://{host}:{metrics_port}{source.metrics_path}",
                    role=role,
                    kv_events_endpoint=(
                        source.kv_events_template.format(ip=host)
                        if source.kv_events_template
                        else None
                    ),
                    kv_replay_endpoint=(
                        source.kv_replay_template.format(ip=host)
                        if source.kv_replay_template
                        else None
                    ),
                    labels=labels,
                    name=str(meta.get("name") or ""),
                    data_parallel_size=dp_size,
                )
            )
    endpoints.sort(key=lambda ep: (ep.name, ep.address))
    return tuple(endpoints)


def _dispatch(loop: asyncio.AbstractEventLoop | None, fn: Callable[..., None], *args: Any) -> None:
    if loop is None:
        fn(*args)
    elif not loop.is_closed():
        loop.call_soon_threadsafe(fn, *args)


class PodDiscovery:
    """Tracks one model's routable pods and reports every change of the endpoint set.

    With `source.inference_pool`, the pool is watched too: a new selector or port list
    restarts the pod watch. While the API server is unreachable nothing is reported, so
    consumers keep routing to the last known set.
    """

    def __init__(
        self,
        model: str,
        source: PodSource,
        api_client: k8s.ApiClient,
        on_change: OnChange,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        watch_timeout_s: int = 300,
    ) -> None:
        from kubernetes import client as k8s

        self._model = model
        self._source = source
        self._core = k8s.CoreV1Api(api_client)
        self._custom = k8s.CustomObjectsApi(api_client)
        self._on_change = on_change
        self._loop = loop
        self._backoff_base_s = backoff_base_s
        self._backoff_cap_s = backoff_cap_s
        self._watch_timeout_s = watch_timeout_s
        self._lock = threading.Lock()
        self._pods: ListWatcher | None = None
        self._pool: ListWatcher | None = None
        self._selection: tuple[str, tuple[int, ...]] | None = None
        self._last: tuple[Endpoint, ...] | None = None
        self._stopped = False

    @property
    def model(self) -> str:
        return self._model

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return self._last or ()

    def start(self) -> None:
        if self._source.inference_pool is None:
            self._select(format_selector(self._source.selector), self._source.target_ports)
            return
        self._pool = ListWatcher(
            name=f"inferencepool/{self._source.namespace}/{self._source.inference_pool}",
            list_fn=functools.partial(
                self._custom.list_namespaced_custom_object,
                POOL_GROUP,
                POOL_VERSION,
                self._source.namespace,
                POOL_PLURAL,
                field_selector=f"metadata.name={self._source.inference_pool}",
            ),
            on_sync=self._on_pool,
            backoff=self._new_backoff(),
            watch_timeout_s=self._watch_timeout_s,
        )
        self._pool.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            watchers = [w for w in (self._pool, self._pods) if w is not None]
        for watcher in watchers:
            watcher.stop()

    def _new_backoff(self) -> Backoff:
        return Backoff(base_s=self._backoff_base_s, cap_s=self._backoff_cap_s)

    def _on_pool(self, store: Store) -> None:
        pool = store.get((self._source.namespace, self._source.inference_pool or ""))
        if pool is None:
            # A deleted pool routes nowhere; the pod watch stops with it.
            self._select(None, ())
            return
        spec = pool.get("spec") or {}
        labels = (spec.get("selector") or {}).get("matchLabels") or {}
        ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or () if "number" in p)
        self._select(format_selector(labels) if labels and ports else None, ports)

    def _select(self, selector: str | None, ports: tuple[int, ...]) -> None:
        """(Re)start the pod watch for a selector; None stops it and empties the set."""
        selection = (selector, ports) if selector is not None else None
        with self._lock:
            if self._stopped or selection == self._selection:
                return
            self._selection = selection
            old, self._pods = self._pods, None
        if old is not None:
            old.stop()
        if selector is None:
            self._report(())
            return
        watcher = ListWatcher(
            name=f"pods/{self._source.namespace}/{self._model}",
            list_fn=functools.partial(
                self._core.list_namespaced_pod, self._source.namespace, label_selector=selector
            ),
            on_sync=functools.partial(self._on_pods, ports),
            backoff=self._new_backoff(),
            watch_timeout_s=self._watch_timeout_s,
        )
        with self._lock:
            if self._stopped:
                return
            self._pods = watcher
        watcher.start()

    def _on_pods(self, ports: tuple[int, ...], store: Store) -> None:
        self._report(endpoints_from_pods(self._model, store.values(), self._source, ports))

    def _report(self, endpoints: tuple[Endpoint, ...]) -> None:
        with self._lock:
            if endpoints == self._last:
                return
            self._last = endpoints
        _dispatch(self._loop, self._on_change, self._model, endpoints)


def route_key_from_xds_name(name: str) -> ObjectKey | None:
    """`httproute/<ns>/<name>/rule/<i>/match/<j>/<host>` (Envoy Gateway's xDS route name) -> (ns, name)."""
    parts = name.split("/")
    if (
        len(parts) < 4
        or parts[0] != "httproute"
        or parts[3] != "rule"
        or not parts[1]
        or not parts[2]
    ):
        return None
    return (parts[1], parts[2])


def _custom_object_watchers(
    custom: k8s.CustomObjectsApi,
    resource: tuple[str, str, str],
    namespaces: Sequence[str],
    on_sync: Callable[[str, Store], None],
    *,
    backoff: Callable[[], Backoff],
    watch_timeout_s: int,
) -> list[ListWatcher]:
    """One list+watch of a custom resource (group, version, plural) per namespace, or one
    cluster-wide when `namespaces` is empty; `on_sync(scope, store)` gets each one's store."""
    group, version, plural = resource
    watchers: list[ListWatcher] = []
    scopes: Sequence[str | None] = list(namespaces) or [None]
    for namespace in scopes:
        if namespace is None:
            list_fn = functools.partial(custom.list_cluster_custom_object, group, version, plural)
        else:
            list_fn = functools.partial(
                custom.list_namespaced_custom_object, group, version, namespace, plural
            )
        scope = namespace or "*"
        watchers.append(
            ListWatcher(
                name=f"{plural}/{scope}",
                list_fn=list_fn,
                on_sync=functools.partial(on_sync, scope),
                backoff=backoff(),  # each its own: a Backoff counts failures
                watch_timeout_s=watch_timeout_s,
            )
        )
    return watchers


class HTTPRouteWatcher(Generic[S]):
    """Watches HTTPRoutes and reports each route's parsed settings.

    `parse(annotations) -> (settings, errors)` (the config layer's
    `parse_route_annotations`) returns defaults for the bad keys; every distinct error
    becomes one Warning Event on the route, visible in `kubectl describe httproute`.
    Event names are derived from (route uid, message), so replicas do not duplicate them.
    """

    def __init__(
        self,
        api_client: k8s.ApiClient,
        parse: Callable[[Mapping[str, str]], tuple[S, list[str]]],
        on_routes: Callable[[dict[ObjectKey, S]], None],
        *,
        namespaces: Sequence[str] = (),
        component: str = "extproc",
        instance: str = "",
        loop: asyncio.AbstractEventLoop | None = None,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        watch_timeout_s: int = 300,
    ) -> None:
        from kubernetes import client as k8s

        self._core = k8s.CoreV1Api(api_client)
        custom = k8s.CustomObjectsApi(api_client)
        self._parse = parse
        self._on_routes = on_routes
        self._component = component
        self._instance = instance or os.environ.get("POD_NAME", "")
        self._loop = loop
        self._lock = threading.Lock()
        self._stores: dict[str, Store] = {}
        self._last: dict[ObjectKey, S] | None = None
        self._posted: set[tuple[str, str]] = set()  # (route uid, message)
        self.events_posted = 0
        self._watchers = _custom_object_watchers(
            custom, (ROUTE_GROUP, ROUTE_VERSION, ROUTE_PLURAL), namespaces, self._on_sync,
            backoff=lambda: Backoff(base_s=backoff_base_s, cap_s=backoff_cap_s),
            watch_timeout_s=watch_timeout_s,
        )  # fmt: skip

    def start(self) -> None:
        for watcher in self._watchers:
            watcher.start()

    def stop(self) -> None:
        for watcher in self._watchers:
            watcher.stop()

    def _on_sync(self, scope: str, store: Store) -> None:
        with self._lock:
            self._stores[scope] = store
            routes = [route for s in self._stores.values() for route in s.values()]
        settings: dict[ObjectKey, S] = {}
        for route in routes:
            meta = route.get("metadata") or {}
            key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
            annotations = {str(k): str(v) for k, v in (meta.get("annotations") or {}).items()}
            parsed, errors = self._parse(annotations)
            settings[key] = parsed
            for message in errors:
                self._warn_once(route, message)
        with self._lock:
            if settings == self._last:
                return
            self._last = settings
        _dispatch(self._loop, self._on_routes, dict(settings))

    def _warn_once(self, route: Mapping[str, Any], message: str) -> None:
        meta = route.get("metadata") or {}
        uid = str(meta.get("uid") or f"{meta.get('namespace')}/{meta.get('name')}")
        if (uid, message) in self._posted:
            return
        from kubernetes import client as k8s
        from kubernetes.client.exceptions import ApiException

        namespace, name = str(meta.get("namespace") or "default"), str(meta.get("name") or "")
        digest = hashlib.sha256(f"{uid}\n{message}".encode()).hexdigest()[:16]
        now = dt.datetime.now(dt.UTC)
        event = k8s.CoreV1Event.from_dict(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{name}.{digest}", "namespace": namespace},
                "involvedObject": {
                    "apiVersion": f"{ROUTE_GROUP}/{ROUTE_VERSION}",
                    "kind": "HTTPRoute",
                    "name": name,
                    "namespace": namespace,
                    "uid": meta.get("uid"),
                    "resourceVersion": meta.get("resourceVersion"),
                },
                "reason": "InvalidAnnotation",
                "type": "Warning",
                "message": f"{message} (the route keeps its default for this setting)",
                "source": {"component": self._component},
                "reportingComponent": self._component,
                **({"reportingInstance": self._instance} if self._instance else {}),
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
        )
        if event is None:  # from_dict only returns None for a None input
            return
        try:
            self._core.create_namespaced_event(namespace, event)
        except ApiException as exc:
            if exc.status != 409:  # 409: another replica already reported this problem
                _LOG.warning("cannot post Event on httproute %s/%s: %s", namespace, name, exc)
                return  # not remembered, so the next sync retries
        except Exception as exc:
            _LOG.warning("cannot post Event on httproute %s/%s: %s", namespace, name, exc)
            return
        else:
            self.events_posted += 1
        self._posted.add((uid, message))


class CustomResourceWatcher(Generic[T]):
    """Watches one kind of custom resource and reports every valid one, parsed, sorted.

    A resource that does not parse is left out and logged once per (uid, problem); the others
    keep applying. Reports only when the parsed set changes. `ModelRewriteWatcher` and
    `InferenceObjectiveWatcher` are this with their resource, parser and order.
    """

    kind = "resource"

    def __init__(
        self,
        api_client: k8s.ApiClient,
        resource: tuple[str, str, str],  # group, version, plural
        parse: Callable[[Mapping[str, Any]], T],
        on_change: Callable[[list[T]], None],
        *,
        sort_key: Callable[[T], Any],
        namespaces: Sequence[str] = (),
        loop: asyncio.AbstractEventLoop | None = None,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        watch_timeout_s: int = 300,
    ) -> None:
        from kubernetes import client as k8s

        custom = k8s.CustomObjectsApi(api_client)
        self._parse = parse
        self._on_change = on_change
        self._sort_key = sort_key
        self._loop = loop
        self._lock = threading.Lock()
        self._stores: dict[str, Store] = {}
        self._last: list[T] | None = None
        self._logged: set[tuple[str, str]] = set()
        self._watchers = _custom_object_watchers(
            custom, resource, namespaces, self._on_sync,
            backoff=lambda: Backoff(base_s=backoff_base_s, cap_s=backoff_cap_s),
            watch_timeout_s=watch_timeout_s,
        )  # fmt: skip

    def start(self) -> None:
        for watcher in self._watchers:
            watcher.start()

    def stop(self) -> None:
        for watcher in self._watchers:
            watcher.stop()

    def _on_sync(self, scope: str, store: Store) -> None:
        with self._lock:
            self._stores[scope] = store
            resources = [r for s in self._stores.values() for r in s.values()]
        parsed: list[T] = []
        for resource in resources:
            try:
                parsed.append(self._parse(resource))
            except ConfigError as exc:
                meta = resource.get("metadata") or {}
                key = (str(meta.get("uid") or meta.get("name")), str(exc))
                if key not in self._logged:
                    self._logged.add(key)
                    _LOG.warning(
                        "%s %s/%s ignored: %s",
                        self.kind, meta.get("namespace"), meta.get("name"), exc,
                    )  # fmt: skip
        parsed.sort(key=self._sort_key)
        with self._lock:
            if parsed == self._last:
                return
            self._last = parsed
        _dispatch(self._loop, self._on_change, list(parsed))


class ModelRewriteWatcher(CustomResourceWatcher[ModelRewriteConfig]):
    """InferenceModelRewrites (llm-d.ai/v1alpha2), oldest first (llm-d's precedence)."""

    kind = "InferenceModelRewrite"

    def __init__(
        self,
        api_client: k8s.ApiClient,
        on_rewrites: Callable[[list[ModelRewriteConfig]], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(
            api_client, (REWRITE_GROUP, REWRITE_VERSION, REWRITE_PLURAL), parse_model_rewrite,
            on_rewrites, sort_key=lambda r: (r.created, r.namespace, r.name), **kwargs,
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class InferenceObjective:
    """An InferenceObjective (llm-d.ai/v1alpha2): a name requests choose by header, and the
    flow-control priority it gives them (unset: 0, as the resource's documentation says)."""

    namespace: str
    name: str
    priority: int
    pool: str


def parse_inference_objective(resource: Mapping[str, Any]) -> InferenceObjective:
    meta = resource.get("metadata") or {}
    spec = resource.get("spec") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError("metadata.name: missing")
    priority = spec.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise ConfigError(f"spec.priority: expected an integer, got {priority!r}")
    if not -(2**31) <= priority < 2**31:
        raise ConfigError(f"spec.priority: {priority} is outside int32")
    pool = (spec.get("poolRef") or {}).get("name")
    if not isinstance(pool, str) or not pool:
        raise ConfigError("spec.poolRef.name: missing")
    return InferenceObjective(str(meta.get("namespace") or ""), name, priority, pool)


class InferenceObjectiveWatcher(CustomResourceWatcher[InferenceObjective]):
    """InferenceObjectives (llm-d.ai/v1alpha2): the priorities flow control gives requests
    that name them (`x-llm-d-inference-objective`)."""

    kind = "InferenceObjective"

    def __init__(
        self,
        api_client: k8s.ApiClient,
        on_objectives: Callable[[list[InferenceObjective]], None],
        **kwargs: Any,
    ) -> None:
        super().__init__(
            api_client, (OBJECTIVE_GROUP, OBJECTIVE_VERSION, OBJECTIVE_PLURAL),
            parse_inference_objective, on_objectives,
            sort_key=lambda o: (o.namespace, o.name), **kwargs,
        )  # fmt: skip
