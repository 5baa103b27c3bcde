"""Watches the cluster for the pools this server serves: their InferencePools, the pods of the
namespaces they live in, and the HTTPRoutes that send to them; reports a `FleetSnapshot`
after every change that changes it.

One list+watch of InferencePools and one of HTTPRoutes (per configured namespace, or cluster
wide), and one of pods per namespace holding a selected pool (started when the first pool
appears there, stopped when the last one goes): a hundred pools in three namespaces are five
watches, not a hundred. Pods are matched to pools here by `matchLabels`. While the API
server is unreachable nothing is reported: the last snapshot keeps routing.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from extproc.discovery._listwatch import Backoff, ListWatcher, Store
from extproc.discovery.kubernetes import (
    POOL_GROUP,
    POOL_PLURAL,
    POOL_VERSION,
    ROUTE_GROUP,
    ROUTE_PLURAL,
    ROUTE_VERSION,
)
from extproc.discovery.pools.fleet import FleetSnapshot, snapshot_of
from extproc.discovery.pools.spec import PoolSelection, PoolSpec, parse_pool

if TYPE_CHECKING:
    from kubernetes import client as k8s

__all__ = ["PoolWatcher"]

_LOG = logging.getLogger(__name__)
OnSnapshot = Callable[[FleetSnapshot], None]


class PoolWatcher:
    def __init__(
        self,
        api_client: k8s.ApiClient,
        selection: PoolSelection,
        on_snapshot: OnSnapshot,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        backoff_base_s: float = 0.5,
        backoff_cap_s: float = 30.0,
        watch_timeout_s: int = 300,
    ) -> None:
        from kubernetes import client as k8s  # imported at first use: see discovery.kubernetes

        self._core = k8s.CoreV1Api(api_client)
        self._custom = k8s.CustomObjectsApi(api_client)
        self._selection = selection
        self._on_snapshot = on_snapshot
        self._loop = loop
        self._backoff = (backoff_base_s, backoff_cap_s)
        self._watch_timeout_s = watch_timeout_s
        self._lock = threading.Lock()
        # One snapshot computed and handed over at a time, in order (callbacks come from
        # several watcher threads).
        self._publishing = threading.Lock()
        self._pool_stores: dict[str, Store] = {}
        self._route_stores: dict[str, Store] = {}
        self._pod_stores: dict[str, Store] = {}
        self._pod_watchers: dict[str, ListWatcher] = {}
        self._reported_problems: set[tuple[str, str, str]] = set()
        self._last: FleetSnapshot | None = None
        self._stopped = False
        scopes: Sequence[str | None] = list(selection.namespaces) or [None]
        self._watchers = [
            self._custom_watcher((POOL_GROUP, POOL_VERSION, POOL_PLURAL), ns, self._on_pools)
            for ns in scopes
        ] + [
            self._custom_watcher((ROUTE_GROUP, ROUTE_VERSION, ROUTE_PLURAL), ns, self._on_routes)
            for ns in scopes
        ]

    @property
    def snapshot(self) -> FleetSnapshot:
        return self._last or FleetSnapshot()

    def pod_watch_namespaces(self) -> list[str]:
        """Namespaces whose pods are watched now (a watch per namespace holding a pool)."""
        with self._lock:
            return sorted(self._pod_watchers)

    def _new_backoff(self) -> Backoff:
        return Backoff(base_s=self._backoff[0], cap_s=self._backoff[1])

    def _custom_watcher(
        self,
        resource: tuple[str, str, str],
        namespace: str | None,
        on_sync: Callable[[str, Store], None],
    ) -> ListWatcher:
        group, version, plural = resource
        if namespace is None:
            list_fn = functools.partial(
                self._custom.list_cluster_custom_object, group, version, plural
            )
        else:
            list_fn = functools.partial(
                self._custom.list_namespaced_custom_object, group, version, namespace, plural
            )
        scope = namespace or "*"
        return ListWatcher(
            name=f"{plural}/{scope}",
            list_fn=list_fn,
            on_sync=functools.partial(on_sync, scope),
            backoff=self._new_backoff(),
            watch_timeout_s=self._watch_timeout_s,
        )

    def start(self) -> None:
        for watcher in self._watchers:
            watcher.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            pods = list(self._pod_watchers.values())
            self._pod_watchers.clear()
        for watcher in [*self._watchers, *pods]:
            watcher.stop()

    # -- watch callbacks (watcher threads) ---------------------------------------------------

    def _on_pools(self, scope: str, store: Store) -> None:
        with self._lock:
            self._pool_stores[scope] = store
        self._follow_namespaces()
        self._publish()

    def _on_routes(self, scope: str, store: Store) -> None:
        with self._lock:
            self._route_stores[scope] = store
        self._publish()

    def _on_pods(self, namespace: str, store: Store) -> None:
        with self._lock:
            if namespace not in self._pod_watchers:
                return  # its last pool went while this sync was on its way
            self._pod_stores[namespace] = store
        self._publish()

    # -- state ---------------------------------------------------------------------------------

    def _specs(self) -> list[PoolSpec]:
        with self._lock:
            objects = [p for s in self._pool_stores.values() for p in s.values()]
        specs: list[PoolSpec] = []
        for obj in objects:
            meta = obj.get("metadata") or {}
            where = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
            try:
                spec = parse_pool(obj)
            except ValueError as exc:
                self._report_once(where, str(exc))
                continue
            for problem in spec.problems:
                if self._selection.selects(spec):
                    self._report_once(where, problem)
            specs.append(spec)
        return specs

    def _report_once(self, where: tuple[str, str], problem: str) -> None:
        key = (*where, problem)
        if key in self._reported_problems:
            return
        self._reported_problems.add(key)
        _LOG.warning("inferencepool %s/%s: %s", where[0], where[1], problem)

    def _follow_namespaces(self) -> None:
        """A pod watch for every namespace holding a selected pool, and no other."""
        wanted = {s.namespace for s in self._specs() if self._selection.selects(s)}
        start: list[ListWatcher] = []
        stop: list[ListWatcher] = []
        with self._lock:
            if self._stopped:
                return
            for ns in [n for n in self._pod_watchers if n not in wanted]:
                stop.append(self._pod_watchers.pop(ns))
                self._pod_stores.pop(ns, None)
            for ns in sorted(wanted - set(self._pod_watchers)):
                watcher = ListWatcher(
                    name=f"pods/{ns}",
                    list_fn=functools.partial(self._core.list_namespaced_pod, ns),
                    on_sync=functools.partial(self._on_pods, ns),
                    backoff=self._new_backoff(),
                    watch_timeout_s=self._watch_timeout_s,
                )
                self._pod_watchers[ns] = watcher
                start.append(watcher)
        for watcher in stop:
            watcher.stop()
        for watcher in start:
            watcher.start()

    def _publish(self) -> None:
        with self._publishing:
            self._publish_locked()

    def _publish_locked(self) -> None:
        specs = self._specs()
        with self._lock:
            pods: Mapping[str, list[Mapping[str, Any]]] = {
                ns: list(store.values()) for ns, store in self._pod_stores.items()
            }
            routes = [r for s in self._route_stores.values() for r in s.values()]
        snapshot = snapshot_of(specs, pods, routes, self._selection)
        with self._lock:
            if self._stopped or snapshot == self._last:
                return
            self._last = snapshot
        if self._loop is None:
            self._on_snapshot(snapshot)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_snapshot, snapshot)
