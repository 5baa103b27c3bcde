"""What the status page shows, as JSON: endpoints per model, this process's recent decisions,
the config in force and its reload state, and the last tuning it took (`tuning.py`).

Decisions are kept per process in a bounded ring (`DecisionLog`, a pre-request step): the
hot path appends a reference, and the JSON is built only when the page asks for it.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from extproc.accounting.inflight import InflightTracker
from extproc.admin.series import PodSeries
from extproc.director.explain import explain_json
from extproc.director.lifecycle import Outgoing, Placement, Request
from extproc.kvcache.approx import ApproximateIndex
from extproc.kvcache.exact import ExactIndex
from extproc.metrics.store import EndpointState, EndpointStore
from extproc.routing.base import Decision, PodState, RoutingRequest

if TYPE_CHECKING:
    from extproc.admin.source import AdminSource

__all__ = [
    "DecisionLog",
    "DecisionRecord",
    "ReloadStatus",
    "all_pools_totals",
    "chosen_models",
    "endpoint_rows",
    "pool_rows",
    "pool_totals",
    "redacted",
    "status_json",
]

MAX_CANDIDATES_SHOWN = 32  # per decision: a 512-pod model would make every poll megabytes
# With more endpoints than this, the page details only some pools (a summary row for each):
# 100 pools of 10 made every poll a 1,000-row page.
DETAIL_ALL_ENDPOINTS = 64
DEFAULT_TOP_POOLS = 5


@dataclass(slots=True)  # not frozen: a frozen __init__ costs ~4 us more on the request path
class DecisionRecord:
    """One routing decision as the director made it (references, no copies; never changed)."""

    at: float  # wall clock
    request_id: str
    route: str
    model: str
    prompt_tokens: int
    estimated: bool
    tokenize_s: float
    decision: Decision
    pods: Sequence[PodState]

    def to_json(self) -> dict[str, Any]:
        req = RoutingRequest(
            request_id=self.request_id, model=self.model, prompt_tokens=self.prompt_tokens
        )
        out = explain_json(
            self.decision,
            self.pods[:MAX_CANDIDATES_SHOWN],
            req,
            tokenize_s=self.tokenize_s,
            estimated=self.estimated,
        )
        out["at"] = self.at
        out["request_id"] = self.request_id
        out["route"] = self.route
        out["candidates_total"] = len(self.pods)
        return out


class DecisionLog:
    """The last `size` decisions of this process, newest last (a pre-request step)."""

    def __init__(self, size: int = 50, *, wall_clock: Callable[[], float] = time.time) -> None:
        self._ring: deque[DecisionRecord] = deque(maxlen=size)
        self._wall_clock = wall_clock
        self.size = size
        self.total = 0  # decisions recorded since start (the ring keeps the last `size`)

    async def pre_request(
        self, req: Request, place: Placement, decision: Decision, out: Outgoing
    ) -> None:
        self.record(req, place, decision)

    def record(self, req: Request, place: Placement, decision: Decision) -> None:
        self._ring.append(
            DecisionRecord(
                at=self._wall_clock(),
                request_id=req.head.request_id,
                route=req.head.route_name or "",
                model=req.runtime.name,
                prompt_tokens=req.prompt.tokens,
                estimated=req.prompt.estimated,
                tokenize_s=req.prompt.tokenize_s,
                decision=decision,
                pods=place.pods,
            )
        )
        self.total += 1

    def newest_first(self) -> Iterator[DecisionRecord]:
        return reversed(self._ring)

    def recent_scores(self, endpoints: int | None = None) -> dict[str, dict[str, Any]]:
        """Per endpoint address, its scores in the newest decision that ranked it (the search
        stops once `endpoints` addresses are found: usually the newest decision has them all)."""
        out: dict[str, dict[str, Any]] = {}
        for rec in self.newest_first():
            if endpoints is not None and len(out) >= endpoints:
                break
            pick = rec.decision.endpoint.address
            for pod in rec.pods:
                if pod.address in out:
                    continue
                out[pod.address] = {
                    "at": rec.at,
                    "picked": pod.address == pick,
                    "strategy": rec.decision.strategy,
                    "scores": dict(rec.decision.scores.get(pod.address, {})),
                }
        return out


@dataclass
class ReloadStatus:
    """The config in force: where it came from, when, and how the last reload went."""

    path: str | None
    loaded_at: float  # wall clock of the load that is in force
    last_attempt_at: float | None = None
    last_result: str | None = None  # "ok" | "error"; None: never reloaded
    last_error: str | None = None
    reloads_ok: int = 0
    reloads_failed: int = 0

    def succeeded(self, now: float) -> None:
        self.loaded_at = self.last_attempt_at = now
        self.last_result, self.last_error = "ok", None
        self.reloads_ok += 1

    def failed(self, now: float, error: str) -> None:
        self.last_attempt_at = now
        self.last_result, self.last_error = "error", error
        self.reloads_failed += 1


def endpoint_rows(
    store: EndpointStore,
    inflight: InflightTracker,
    kv_healthy: Callable[[str], bool],
    stall_after_s: float,
    now: float,
    models: Iterable[str] | None = None,
) -> Iterator[tuple[dict[str, Any], EndpointState | None]]:
    """Every endpoint the store knows (of `models` only, when given), with its scrape state and
    our own load on it (`/debug/endpoints` and the status page), and its state for more detail."""
    failing = inflight.failing_addresses()
    for model in store.models() if models is None else models:
        for ep in store.endpoints(model):
            state = store.state(ep)
            load = inflight.load(ep.address)
            ready = state is not None and store.is_ready(state, now)
            row = {
                "model": model,
                "address": ep.address,
                "role": str(ep.role),
                "ready": ready,
                "metrics_age_s": state.age(now) if state else None,
                "last_error": state.last_error if state else None,
                # The last scrape could not connect at all: nothing listens there.
                "unreachable": bool(state is not None and state.unreachable),
                "failed_scrapes": state.failures if state else 0,
                "in_flight": load.requests,
                "stalled": inflight.stalled(ep.address, stall_after_s),
                # Its last picks failed (5xx, or retried elsewhere): out of the candidates a while.
                "failing": ep.address in failing,
                "failed_picks": inflight.failed_total(ep.address),
                # A pod whose metrics stopped is not vouched for by a quiet event stream
                # (a dead engine's ZMQ socket says nothing for a long while).
                "kv_events_healthy": ready and kv_healthy(ep.address),
            }
            yield row, state


def pool_rows(
    store: EndpointStore, inflight: InflightTracker, stall_after_s: float, now: float
) -> list[dict[str, Any]]:
    """One summary row per pool (model), the ones that need attention first: most endpoints
    not ready, then most requests in flight, then by name. The engine figures are those of
    the ready endpoints: KV-cache usage their mean, the prefix hit rate the pool's (hits over
    queries, summed)."""
    out: list[dict[str, Any]] = []
    for model in store.models():
        eps = store.endpoints(model)
        ready = in_flight = in_flight_tokens = running = waiting = unreachable = stalled = 0
        kv: list[float] = []
        hits = queries = 0.0
        oldest: float | None = None
        for ep in eps:
            state = store.state(ep)
            if state is not None and store.is_ready(state, now):
                ready += 1
                m = state.metrics
                if m is not None:
                    running += int(m.running or 0)
                    waiting += int(m.waiting or 0)
                    if m.kv_cache_usage is not None:
                        kv.append(m.kv_cache_usage)
                    if m.prefix_cache_queries:
                        hits += m.prefix_cache_hits or 0.0
                        queries += m.prefix_cache_queries
            if state is not None and state.unreachable:
                unreachable += 1
            age = state.age(now) if state is not None else None
            if age is not None and (oldest is None or age > oldest):
                oldest = age
            load = inflight.load(ep.address)
            in_flight += load.requests
            in_flight_tokens += load.tokens
            stalled += inflight.stalled(ep.address, stall_after_s)
        out.append(
            {
                "model": model,
                "endpoints": len(eps),
                "ready": ready,
                "unreachable": unreachable,
                "stalled": stalled,
                "in_flight": in_flight,
                "in_flight_tokens": in_flight_tokens,
                "running": running,
                "waiting": waiting,
                "kv_cache_usage": sum(kv) / len(kv) if kv else None,
                "prefix_hit_rate": hits / queries if queries else None,
                "oldest_metrics_age_s": oldest,
            }
        )
    out.sort(key=lambda r: (-(r["endpoints"] - r["ready"]), -r["in_flight"], r["model"]))
    return out


# The figures of a pool's summary row that add up across pools.
_SUMMED = (
    "endpoints", "ready", "unreachable", "stalled", "in_flight", "in_flight_tokens", "running",
    "waiting",
)  # fmt: skip


def all_pools_totals(pools: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Every pool's summary row added up (the status page's last pools row)."""
    out: dict[str, Any] = {key: sum(int(p[key]) for p in pools) for key in _SUMMED}
    out["pools"] = len(pools)
    return out


def pool_totals(pool: Mapping[str, Any], rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A pool's totals row under its endpoints: its summary row (`pool_rows`) and, over the
    page's rows of its endpoints, the cached blocks, the healthy KV-event streams and the
    newest served and failed rates (None where no endpoint has the figure)."""
    out = dict(pool)

    def total(values: Iterable[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return sum(known) if known else None

    def newest(row: Mapping[str, Any], key: str) -> float | None:
        series = row.get("series") or {}
        return next((v for v in reversed(series.get(key) or []) if v is not None), None)

    out["cached_blocks_exact"] = total(r["cached_blocks_exact"] for r in rows)
    out["cached_blocks_approx"] = total(r["cached_blocks_approx"] for r in rows)
    out["kv_events_healthy"] = sum(bool(r["kv_events_healthy"]) for r in rows)
    out["requests_per_s"] = total(newest(r, "requests_per_s") for r in rows)
    out["errors_per_s"] = total(newest(r, "errors_per_s") for r in rows)
    return out


def chosen_models(
    pools: Sequence[Mapping[str, Any]], models: Sequence[str] | None, top: int | None
) -> tuple[list[str], bool]:
    """The pools whose endpoints to show, and whether that is all of them: the ones named
    (unknown names skipped), else every pool while there are at most `DETAIL_ALL_ENDPOINTS`
    endpoints, else the first `top` (default `DEFAULT_TOP_POOLS`) of `pools` (attention order)."""
    known = [str(p["model"]) for p in pools]
    if models:
        wanted = set(models)
        return [m for m in known if m in wanted], False
    total = sum(int(p["endpoints"]) for p in pools)
    if top is None and total <= DETAIL_ALL_ENDPOINTS:
        return known, True
    n = DEFAULT_TOP_POOLS if top is None else max(0, top)
    return known[:n], n >= len(known)


def status_json(
    src: AdminSource,
    *,
    now: float,
    wall: float,
    series: PodSeries | None = None,
    models: Sequence[str] | None = None,
    top: int | None = None,
    tuning: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the status page shows, read from the live runtime at this moment: a summary
    row per pool, the endpoints of the pools `chosen_models` picks, and their decisions; and
    `tuning`, the last `extproc tune --publish` report this process took (tuning.py)."""
    cfg = src.config
    stall = cfg.routing.stall_after_s
    pools = pool_rows(src.store, src.inflight, stall, now)
    shown, everything = chosen_models(pools, models, top)
    if everything:  # the store's order, as before there were pool summaries
        shown = list(src.store.models())
    scores = src.decisions.recent_scores(endpoints=sum(len(src.store.endpoints(m)) for m in shown))
    by_model: dict[str, list[dict[str, Any]]] = {m: [] for m in shown}
    for row, state in endpoint_rows(src.store, src.inflight, src.kv.is_healthy, stall, now, shown):
        model, address = row["model"], row["address"]
        # A pod that is not ready shows no engine figures: its last ones would look live.
        row.update(_engine_view(state if row["ready"] else None))
        row["in_flight_tokens"] = src.inflight.load(address).tokens
        row["cached_blocks_exact"] = _pod_blocks(src.exact_indexes, model, address)
        row["cached_blocks_approx"] = _pod_blocks(src.approx_indexes, model, address)
        row["recent"] = scores.get(address)
        row["series"] = series.json(address) if series is not None else None
        by_model[model].append(row)
    strategies = {m.name: m.strategy or cfg.routing.default_strategy for m in cfg.models}
    for pool in pools:
        pool["strategy"] = strategies.get(pool["model"], cfg.routing.default_strategy)
    pool_of = {p["model"]: p for p in pools}
    sync = src.sync
    shown_set = set(shown)
    recent = [
        rec.to_json()
        for rec in src.decisions.newest_first()
        if everything or rec.model in shown_set
    ]
    return {
        "replica": src.replica,
        "generated_at": wall,
        "ready": src.is_ready(),
        "stale_after_s": cfg.metrics.stale_after_s,
        "processes": {
            "shared_state": sync is not None,
            "members": sync.members() if sync is not None else [src.replica],
        },
        "pools": pools,
        "totals": all_pools_totals(pools),
        "shown": {"models": shown, "all": everything, "filtered": bool(models)},
        "models": [
            {
                "name": name,
                "strategy": strategies.get(name, ""),
                "endpoints": rows,
                "totals": pool_totals(pool_of[name], rows),
            }
            for name, rows in by_model.items()
        ],
        "decisions": {"total": src.decisions.total, "kept": src.decisions.size, "recent": recent},
        "config": {"in_force": redacted(cfg), "reload": dataclasses.asdict(src.reload_status)},
        "tuning": tuning,
    }


def redacted(obj: Any) -> Any:
    """`obj` (a config dataclass) as plain data with every secret (a `repr=False` field: the
    session key, the admin token) shown as "<redacted>": /status.json never hands them out."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: (
                "<redacted>"
                if not f.repr and getattr(obj, f.name) is not None
                else redacted(getattr(obj, f.name))
            )
            for f in dataclasses.fields(obj)
        }
    if isinstance(obj, dict):
        return {k: redacted(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [redacted(v) for v in obj]
    return obj


def _engine_view(state: EndpointState | None) -> dict[str, Any]:
    """The engine's own figures from its last good scrape (None where it exports none)."""
    m = state.metrics if state is not None else None
    if m is None:
        return {"running": None, "waiting": None, "kv_cache_usage": None, "prefix_hit_rate": None}
    hit_rate = None
    if m.prefix_cache_queries:
        hit_rate = (m.prefix_cache_hits or 0.0) / m.prefix_cache_queries
    return {
        "running": m.running,
        "waiting": m.waiting,
        "kv_cache_usage": m.kv_cache_usage,
        "prefix_hit_rate": hit_rate,
    }


def _pod_blocks(
    indexes: Mapping[str, ExactIndex] | Mapping[str, ApproximateIndex], model: str, address: str
) -> int | None:
    index = indexes.get(model)
    return None if index is None else index.pod_block_count(address)
