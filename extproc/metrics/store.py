"""The metrics cache: known endpoints per model and their last good engine metrics.

Every update replaces an immutable `EndpointState`, so a reader (one routing decision)
always sees a consistent value without locks; everything runs on one event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

from extproc.types import Endpoint, EngineMetrics

__all__ = ["EndpointState", "EndpointStore", "ReadyEndpoint"]

ReadyEndpoint = tuple[Endpoint, EngineMetrics]
_Routable = tuple[Endpoint, EngineMetrics | None, bool]


@dataclass(frozen=True, slots=True)
class EndpointState:
    endpoint: Endpoint
    metrics: EngineMetrics | None = None  # last good scrape; None if never scraped
    failures: int = 0  # consecutive failed scrapes since the last good one
    last_error: str | None = None  # reason of the most recent failure, None after a success
    unreachable: bool = False  # the last attempt could not connect at all

    def age(self, now: float) -> float | None:
        return None if self.metrics is None else now - self.metrics.updated_at


class EndpointStore:
    """Endpoints per model, replaced wholesale by discovery, with scrape health.

    `ready()` admits an endpoint whose last good scrape is at most `stale_after` seconds
    old. One failed scrape does not drop a pod (its last value stays usable until stale),
    except a refused connection when `exclude_unreachable` is set: nothing listens there,
    so requests would fail too. `max_failures` (if set) excludes a pod after that many
    consecutive failures even before it goes stale. A success re-admits at once.
    Endpoints without a metrics URL are ready with empty metrics when
    `ready_without_metrics_url` is set, never ready otherwise.
    """

    def __init__(
        self,
        *,
        stale_after: float,
        clock: Callable[[], float] = time.monotonic,
        ready_without_metrics_url: bool = True,
        exclude_unreachable: bool = True,
        max_failures: int | None = None,
    ) -> None:
        if stale_after <= 0:
            raise ValueError("stale_after must be positive")
        self._stale_after = stale_after
        self._clock = clock
        self._ready_without_url = ready_without_metrics_url
        self._exclude_unreachable = exclude_unreachable
        self._max_failures = max_failures
        self._by_model: dict[str, tuple[Endpoint, ...]] = {}
        self._states: dict[Endpoint, EndpointState] = {}
        self._by_address: dict[tuple[str, str], Endpoint] = {}  # (model, address), per set
        self._version = 0
        # Per model, in endpoint order: (endpoint, metrics, aged) where every condition of
        # `is_ready` but freshness holds (aged False: no metrics URL, never stale), else None.
        # Kept up to date by each scrape, so `ready()` only checks ages per request.
        self._routable: dict[str, list[_Routable | None]] = {}
        self._slots: dict[Endpoint, list[tuple[str, int]]] = {}

    @property
    def stale_after(self) -> float:
        return self._stale_after

    @property
    def version(self) -> int:
        """Incremented on every endpoint-set change (pollers watch it)."""
        return self._version

    def set_endpoints(self, by_model: Mapping[str, Iterable[Endpoint]]) -> None:
        """Replace the whole endpoint set; endpoints kept keep their scrape state."""
        new_by_model = {model: tuple(dict.fromkeys(eps)) for model, eps in by_model.items()}
        new_states: dict[Endpoint, EndpointState] = {}
        for eps in new_by_model.values():
            for ep in eps:
                new_states[ep] = self._states.get(ep) or EndpointState(ep)
        self._by_model = new_by_model
        self._states = new_states
        self._by_address = {
            (model, ep.address): ep for model, eps in new_by_model.items() for ep in eps
        }
        self._slots = {}
        self._routable = {}
        for model, eps in new_by_model.items():
            self._routable[model] = [self._routable_entry(new_states[ep]) for ep in eps]
            for i, ep in enumerate(eps):
                self._slots.setdefault(ep, []).append((model, i))
        self._version += 1

    def _routable_entry(self, state: EndpointState) -> _Routable | None:
        """What `_routable` holds for `state`: `is_ready` without the age check."""
        if state.endpoint.metrics_url is None:
            return (state.endpoint, state.metrics, False) if self._ready_without_url else None
        if state.metrics is None:
            return None
        if self._exclude_unreachable and state.unreachable:
            return None
        if self._max_failures is not None and state.failures >= self._max_failures:
            return None
        return state.endpoint, state.metrics, True

    def _put(self, state: EndpointState) -> None:
        self._states[state.endpoint] = state
        entry = self._routable_entry(state)
        for model, i in self._slots.get(state.endpoint, ()):
            self._routable[model][i] = entry

    def models(self) -> tuple[str, ...]:
        return tuple(self._by_model)

    def endpoints(self, model: str | None = None) -> tuple[Endpoint, ...]:
        """Endpoints of `model`, or every endpoint (each once) when model is None."""
        if model is None:
            return tuple(self._states)
        return self._by_model.get(model, ())

    def state(self, endpoint: Endpoint) -> EndpointState | None:
        return self._states.get(endpoint)

    def find(self, model: str, address: str) -> Endpoint | None:
        """The endpoint of `model` at `address`, if it is in the set."""
        return self._by_address.get((model, address))

    def record_success(self, endpoint: Endpoint, metrics: EngineMetrics) -> None:
        """Store a good (possibly partial) scrape. Ignored for removed endpoints."""
        if endpoint in self._states:
            self._put(EndpointState(endpoint, metrics))

    def record_failure(self, endpoint: Endpoint, reason: str, *, unreachable: bool = False) -> None:
        state = self._states.get(endpoint)
        if state is not None:
            self._put(
                replace(
                    state, failures=state.failures + 1, last_error=reason, unreachable=unreachable
                )
            )

    def is_ready(self, state: EndpointState, now: float) -> bool:
        if state.endpoint.metrics_url is None:
            return self._ready_without_url
        if state.metrics is None or now - state.metrics.updated_at > self._stale_after:
            return False
        if self._exclude_unreachable and state.unreachable:
            return False
        return self._max_failures is None or state.failures < self._max_failures

    def ready(self, model: str, now: float | None = None) -> tuple[ReadyEndpoint, ...]:
        """Endpoints of `model` fit for routing, with the metrics to route on."""
        if now is None:
            now = self._clock()
        stale = self._stale_after
        out: list[ReadyEndpoint] = []
        for entry in self._routable.get(model, ()):
            if entry is None:
                continue
            ep, metrics, aged = entry
            if metrics is None:  # no metrics URL: routable, nothing known
                out.append((ep, EngineMetrics(updated_at=now)))
            elif not aged or not now - metrics.updated_at > stale:  # `is_ready`'s age check
                out.append((ep, metrics))
        return tuple(out)

    def any_ready(self, now: float | None = None) -> bool:
        """True when at least one endpoint of any model is ready (readiness probe)."""
        if now is None:
            now = self._clock()
        return any(self.is_ready(s, now) for s in self._states.values())
