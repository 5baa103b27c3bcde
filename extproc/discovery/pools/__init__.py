"""Pools found, not listed: one server for every InferencePool that names it.

A layer of its own, beside the rest of discovery. `PoolWatcher` follows the cluster (the
InferencePools that name this server, the pods of their namespaces, the HTTPRoutes sending
to them) and hands a `FleetSnapshot` to the composition root at every change; the root builds
one model runtime and director per pool (`model_config`: the pool as a model named
`<namespace>/<pool>` answering to its served model names) and installs them in a
`PoolDispatcher`, which gives each request to the director of the pool its route names.

Turning it on (`pools:` in the config): `picker_names` (the Service names pools give as their
`endpointPickerRef`), or `labels` (pools carrying them), and optionally `namespaces`. Each
pool's settings come from its `lb.extproc.io/*` annotations (`spec.POOL_ANNOTATIONS`); its
routes' annotations still set per-route behaviour. A request's pool is the one its route
sends to: an InferencePool backendRef, or the route's `lb.extproc.io/pool` label (Envoy
Gateway, which sends to the pods' Service and lets our pick override the endpoint).

What it costs: one watch of InferencePools, one of HTTPRoutes, one of pods per namespace
holding a pool; a director and indexes per pool (measured in docs/benchmarks.md, the fleet
section). How it fails: while the API server is unreachable the last snapshot keeps routing;
a pool that cannot be parsed (no selector, no port) is left out and logged, the others
served; a bad annotation is logged and that setting keeps its default; a request whose route
names no pool this server serves goes to the config file's models (404 if none has it).
"""

from __future__ import annotations

from extproc.discovery.pools.dispatch import PoolDispatcher, PoolHandlers, RequestHandler
from extproc.discovery.pools.fleet import (
    FleetChanges,
    FleetSnapshot,
    PoolState,
    model_config,
    snapshot_of,
)
from extproc.discovery.pools.spec import (
    POOL_ANNOTATIONS,
    POOL_LABEL,
    PoolKey,
    PoolSelection,
    PoolSettings,
    PoolSpec,
    parse_pool,
    pool_settings,
    route_backend_pools,
)
from extproc.discovery.pools.watcher import PoolWatcher

__all__ = [
    "POOL_ANNOTATIONS",
    "POOL_LABEL",
    "FleetChanges",
    "FleetSnapshot",
    "PoolDispatcher",
    "PoolHandlers",
    "PoolKey",
    "PoolSelection",
    "PoolSettings",
    "PoolSpec",
    "PoolState",
    "PoolWatcher",
    "RequestHandler",
    "model_config",
    "parse_pool",
    "pool_settings",
    "route_backend_pools",
    "snapshot_of",
]
