"""The pools this server serves at one moment (`FleetSnapshot`, immutable) and what changed
between two of them (`FleetChanges`).

A snapshot is built from the API server's view (pools, the pods of their namespaces, the
HTTPRoutes that send to them) by `snapshot_of`, a pure function: tests feed it objects, the
watcher feeds it its stores. Each pool's endpoints are its ready pods' `ip:targetPort`s,
named under the pool's `runtime_name` (namespace/name), so two pools serving one model name
never share an endpoint, an index or a decision.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from extproc.config import KubernetesDiscoveryConfig, ModelConfig
from extproc.discovery.kubernetes import PodSource, endpoints_from_pods, route_key_from_xds_name
from extproc.discovery.pools.spec import (
    PoolKey,
    PoolSelection,
    PoolSpec,
    matches,
    route_backend_pools,
)
from extproc.types import Endpoint

__all__ = ["FleetChanges", "FleetSnapshot", "PoolState", "model_config", "snapshot_of"]

RouteKey = tuple[str, str]  # (namespace, name) of an HTTPRoute


@dataclass(frozen=True, slots=True)
class PoolState:
    spec: PoolSpec
    endpoints: tuple[Endpoint, ...] = ()


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    pools: Mapping[PoolKey, PoolState] = field(default_factory=lambda: MappingProxyType({}))
    routes: Mapping[RouteKey, tuple[PoolKey, ...]] = field(
        default_factory=lambda: MappingProxyType({})
    )

    def pool_for_route(self, route_name: str | None) -> PoolKey | None:
        """The pool a request's route sends to: Envoy Gateway's xDS route name
        (`httproute/<ns>/<name>/rule/...`) or `<ns>/<name>`, through the HTTPRoute's
        InferencePool backendRef (the first one this server serves). None: no pool route."""
        if not route_name:
            return None
        key = route_key_from_xds_name(route_name)
        if key is None:
            ns, sep, name = route_name.partition("/")
            if not sep or "/" in name:
                return None
            key = (ns, name)
        for pool in self.routes.get(key, ()):
            if pool in self.pools:
                return pool
        return None

    def endpoints(self) -> dict[str, tuple[Endpoint, ...]]:
        """Endpoints by runtime name (what the endpoint store is given)."""
        return {s.spec.runtime_name: s.endpoints for s in self.pools.values()}


@dataclass(frozen=True, slots=True)
class FleetChanges:
    added: tuple[PoolKey, ...] = ()
    changed: tuple[PoolKey, ...] = ()  # the spec (settings, selector, ports) changed
    removed: tuple[PoolKey, ...] = ()
    endpoints: tuple[PoolKey, ...] = ()  # only the endpoints changed

    @classmethod
    def between(cls, old: FleetSnapshot, new: FleetSnapshot) -> FleetChanges:
        added = tuple(k for k in new.pools if k not in old.pools)
        removed = tuple(k for k in old.pools if k not in new.pools)
        changed: list[PoolKey] = []
        endpoints: list[PoolKey] = []
        for key, state in new.pools.items():
            before = old.pools.get(key)
            if before is None:
                continue
            if before.spec != state.spec:
                changed.append(key)
            elif before.endpoints != state.endpoints:
                endpoints.append(key)
        return cls(added, tuple(changed), removed, tuple(endpoints))

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed or self.endpoints)


def _pod_source(spec: PoolSpec) -> PodSource:
    s = spec.settings
    return PodSource(
        namespace=spec.namespace,
        selector=spec.selector,
        target_ports=spec.target_ports,
        metrics_port=s.metrics_port,
        kv_events_template=f"tcp://{{ip}}:{s.kv_events_port}" if s.kv_events_port else None,
        kv_replay_template=f"tcp://{{ip}}:{s.kv_replay_port}" if s.kv_replay_port else None,
        data_parallel_size=s.data_parallel_size,
    )


def snapshot_of(
    pools: Iterable[PoolSpec],
    pods: Mapping[str, Sequence[Mapping[str, Any]]],
    routes: Iterable[Mapping[str, Any]],
    selection: PoolSelection,
) -> FleetSnapshot:
    """The pools `selection` picks, with their ready pods' endpoints (`pods` by namespace),
    and every HTTPRoute's InferencePool backends."""
    states: dict[PoolKey, PoolState] = {}
    for spec in sorted(pools, key=lambda s: s.key):
        if not selection.selects(spec):
            continue
        mine = [
            p
            for p in pods.get(spec.namespace, ())
            if matches(spec.selector, (p.get("metadata") or {}).get("labels") or {})
        ]
        eps = endpoints_from_pods(spec.runtime_name, mine, _pod_source(spec), spec.target_ports)
        states[spec.key] = PoolState(spec, eps)
    by_route: dict[RouteKey, tuple[PoolKey, ...]] = {}
    for route in routes:
        meta = route.get("metadata") or {}
        backends = route_backend_pools(route)
        if backends:
            by_route[(str(meta.get("namespace") or ""), str(meta.get("name") or ""))] = backends
    return FleetSnapshot(MappingProxyType(states), MappingProxyType(by_route))


def model_config(spec: PoolSpec, default_tokenizer: str | None) -> ModelConfig:
    """The pool as one model of the server's config: named by its runtime name, answering to
    its model names, its pods described (the fleet supplies the endpoints themselves)."""
    s = spec.settings
    return ModelConfig(
        name=spec.runtime_name,
        tokenizer=s.tokenizer or default_tokenizer,
        block_size=s.block_size,
        aliases=[m for m in spec.models if m != spec.runtime_name],
        strategy=s.strategy,
        kv_events_mode=s.kv_events_mode,  # type: ignore[arg-type]
        kubernetes=KubernetesDiscoveryConfig(
            namespace=spec.namespace,
            selector=dict(spec.selector),
            target_port=spec.target_ports[0],
            metrics_port=s.metrics_port,
            kv_events_port=s.kv_events_port,
            kv_replay_port=s.kv_replay_port,
            data_parallel_size=s.data_parallel_size,
        ),
    )
