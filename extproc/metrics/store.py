"""The metrics cache: known endpoints per model and their last good engine metrics.

Every update replaces an immutable `EndpointState`, so a reader (one routing decision)
always sees a consistent value without locks; everything runs on one event loop.

Per model the store also keeps the engine signals routing reads as numpy columns, one slot
per endpoint in the model's endpoint order, written in place when a scrape lands (and
rebuilt only when the endpoint set changes). `ready()` answers a `ReadyEndpoints` whose
`columns` are those arrays (gathered by slot when some endpoint is not ready): a decision
reads them instead of building them from objects. The arrays a ready
list hands out are made read-only, and the next write copies them first (copy on write), so
a decision's columns never change under it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from extproc.types import Endpoint, EngineMetrics

__all__ = [
    "ENGINE_FIELDS",
    "EndpointState",
    "EndpointStore",
    "EngineColumns",
    "LoraKey",
    "ReadyEndpoint",
    "ReadyEndpoints",
]

ReadyEndpoint = tuple[Endpoint, EngineMetrics]
# An endpoint fit for routing: its last metrics and until when they may be used (inf: no
# metrics URL, so they never go stale).
_Routable = tuple[Endpoint, EngineMetrics | None, float]
FloatArray: TypeAlias = npt.NDArray[np.float64]
IntArray: TypeAlias = npt.NDArray[np.intp]
ObjectArray: TypeAlias = npt.NDArray[np.object_]

# The `EngineMetrics` fields kept as columns (the ones routing ranks by), NaN where None.
ENGINE_FIELDS = (
    "waiting", "running", "kv_cache_usage", "ttft_avg_s", "itl_avg_s", "itl_recent_s",
    "itl_baseline_s",
)  # fmt: skip
_FIELD_ROW = {name: row for row, name in enumerate(ENGINE_FIELDS)}
# A LoRA adapter set as routing reads it: running adapters, waiting adapters, max_lora.
LoraKey: TypeAlias = tuple[tuple[str, ...], tuple[str, ...], int | None]
_NO_LORA: LoraKey = ((), (), None)


@dataclass(frozen=True, slots=True)
class EndpointState:
    endpoint: Endpoint
    metrics: EngineMetrics | None = None  # last good scrape; None if never scraped
    failures: int = 0  # consecutive failed scrapes since the last good one
    last_error: str | None = None  # reason of the most recent failure, None after a success
    unreachable: bool = False  # the last attempt could not connect at all
    # How long `metrics` may be used after its scrape; None: the store's `stale_after`. The
    # poller trusts an idle pod's figures longer (extproc/metrics/poller.py, "Freshness").
    trusted_for: float | None = None

    def age(self, now: float) -> float | None:
        return None if self.metrics is None else now - self.metrics.updated_at


_Progress = tuple[float | None, ...]

# An engine's step time as its inter-token latency (ITL), from consecutive scrapes of its
# lifetime histogram: the mean of the gaps since the last such mean (at least `ITL_MIN_GAPS` of
# them), blended into two running means. `itl_recent_s`, with this time constant, shows a pod that turns slow within a second
# or two (one noisy scrape moves it part way) ...
ITL_RECENT_TAU_S = 1.0
# ... and is forgotten this long after the last new mean: nothing says any
# more that the pod is slow, so a pod avoided for being slow is tried again after a while.
ITL_RECENT_FOR_S = 30.0
# `itl_baseline_s`, with this one, is what the pod's steps usually take: what a recent value
# is compared with (the engine's lifetime mean would be that too, but after hours it no longer
# moves, and early on a few seconds of a fault already move it).
ITL_BASELINE_TAU_S = 60.0
# A new mean needs at least this many new gaps (fewer wait for the next scrapes): one request
# held behind long prefills for half a second is one gap of 480 ms, and alone it made a pod
# look 40x slow for seconds (the twin of docqa met it at its first scrape, and shunned the pod
# holding the cached documents). Among 32 it weighs a 32nd; a slow engine, whose every step is
# slow, still shows at once under any load (a 4x slower pod decoding 4 requests brings ~50 gaps
# per scrape).
ITL_MIN_GAPS = 32


@dataclass(slots=True)
class _Itl:
    """What the scrapes of an endpoint said about its inter-token gaps."""

    total_s: float  # the engine's lifetime sum of gaps, at the last new mean (`ITL_MIN_GAPS`)
    count: float  # and their number
    recent_s: float | None  # the running means, as last set (None: no gap seen yet)
    baseline_s: float | None
    moved_at: float  # the scrape that last brought a new mean


def _blend(old: float | None, value: float, dt: float, tau: float) -> float:
    """`value` blended into `old` by the time `old` has stood (`dt`) over `tau`."""
    return value if old is None else old + (1.0 - math.exp(-max(0.0, dt) / tau)) * (value - old)


def _next_itl(old: _Itl | None, metrics: EngineMetrics) -> _Itl | None:
    """The endpoint's ITL figures after the scrape `metrics` (None: its engine exports no gap
    count)."""
    count, now = metrics.itl_count, metrics.updated_at
    if count is None:
        return None
    total = (metrics.itl_avg_s or 0.0) * count
    if old is None or count < old.count:  # first scrape, or the engine restarted
        return _Itl(total, count, None, None, now)
    if count - old.count < ITL_MIN_GAPS:  # too few new gaps to say: the means stand (a while)
        expired = now - old.moved_at > ITL_RECENT_FOR_S
        recent = None if expired else old.recent_s
        return _Itl(old.total_s, old.count, recent, old.baseline_s, old.moved_at)
    gap = max(0.0, (total - old.total_s) / (count - old.count))
    dt = now - old.moved_at
    return _Itl(
        total,
        count,
        _blend(old.recent_s, gap, dt, ITL_RECENT_TAU_S),
        _blend(old.baseline_s, gap, dt, ITL_BASELINE_TAU_S),
        now,
    )


def _progress_of(metrics: EngineMetrics) -> _Progress | None:
    """The figures of a scrape that move only when its engine does work (None: it exports
    none of them)."""
    figures = (
        metrics.prompt_tokens_total,
        metrics.generation_tokens_total,
        metrics.running,
        metrics.waiting,
        metrics.kv_cache_usage,
    )
    return None if all(f is None for f in figures) else figures


def _lora_key(metrics: EngineMetrics | None) -> LoraKey:
    if metrics is None:
        return _NO_LORA
    return metrics.running_lora_adapters, metrics.waiting_lora_adapters, metrics.max_lora


def _objects(items: Sequence[object]) -> ObjectArray:
    """`items` as a 1-D object array (element by element: a tuple stays one element)."""
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


def _freeze(array: np.ndarray) -> None:  # type: ignore[type-arg]
    if array.flags.writeable:
        array.flags.writeable = False


class _AdapterSets:
    """Every LoRA adapter set some endpoint slot holds, interned to a small id.

    Counted per slot: an id whose count drops to 0 is reused by the next new set, so the
    table stays as small as the most distinct sets held at once. `keys` is copied before an
    id is reused while a ready list holds it (a decision reads the keys it was given).
    """

    def __init__(self) -> None:
        self.keys: list[LoraKey] = []
        self.shared = False
        self._ids: dict[LoraKey, int] = {}
        self._refs: list[int] = []
        self._free: list[int] = []

    def acquire(self, key: LoraKey) -> int:
        i = self._ids.get(key)
        if i is None:
            if self._free:
                i = self._free.pop()
                if self.shared:
                    self.keys = self.keys.copy()
                    self.shared = False
                self.keys[i] = key
            else:
                i = len(self.keys)
                self.keys.append(key)
                self._refs.append(0)
            self._ids[key] = i
        self._refs[i] += 1
        return i

    def release(self, i: int) -> None:
        self._refs[i] -= 1
        if not self._refs[i]:
            del self._ids[self.keys[i]]
            self._free.append(i)

    def live(self) -> int:
        """How many distinct sets are held (for tests)."""
        return len(self._ids)


class EngineColumns:
    """The engine signals of a ready list, in its order: one float64 array per field of
    `ENGINE_FIELDS` (NaN where the engine does not export it), each endpoint's adapter-set
    id, and the endpoints and addresses. Arrays are read-only; each read gathers anew when
    the list is a subset of the model's endpoints (take what you need once)."""

    __slots__ = (
        "_addresses",
        "_by_address",
        "_endpoints",
        "_lora",
        "_slots",
        "_values",
        "lora_sets",
        "n",
    )

    def __init__(
        self,
        values: FloatArray,
        lora: IntArray,
        lora_sets: list[LoraKey],
        endpoints: ObjectArray,
        addresses: list[str],
        by_address: IntArray,
        slots: IntArray | None,
    ) -> None:
        self._values = values
        self._by_address = by_address  # the slots sorted by address (read-only)
        self._lora = lora
        self.lora_sets = lora_sets  # keys by id: the same list for every id in `lora_ids`
        self._endpoints = endpoints
        self._addresses = addresses
        self._slots = slots  # positions in the model's slot order; None: every slot
        self.n = len(addresses) if slots is None else len(slots)

    def column(self, field: str) -> FloatArray:
        row: FloatArray = self._values[_FIELD_ROW[field]]
        return row if self._slots is None else row.take(self._slots)

    @property
    def lora_ids(self) -> IntArray:
        return self._lora if self._slots is None else self._lora.take(self._slots)

    @property
    def endpoint_array(self) -> ObjectArray:
        """The endpoints as an object array (a `take` by index is one C call)."""
        return self._endpoints if self._slots is None else self._endpoints.take(self._slots)

    def endpoints(self) -> list[Endpoint]:
        out: list[Endpoint] = self.endpoint_array.tolist()
        return out

    def addresses(self) -> list[str]:
        if self._slots is None:
            return self._addresses.copy()
        return [self._addresses[i] for i in self._slots.tolist()]

    def address_order(self) -> IntArray:
        """Positions in this list sorted by address (equal addresses in list order)."""
        if self._slots is None:
            return self._by_address
        rank = np.empty(len(self._addresses), np.intp)
        rank[self._by_address] = np.arange(len(self._addresses))
        order: IntArray = np.argsort(rank.take(self._slots), kind="stable")
        return order

    def subset(self, at: IntArray) -> EngineColumns:
        """The columns of the entries at `at` (indices into this list)."""
        slots = at if self._slots is None else self._slots.take(at)
        return EngineColumns(
            self._values,
            self._lora,
            self.lora_sets,
            self._endpoints,
            self._addresses,
            self._by_address,
            slots,
        )


class ReadyEndpoints(tuple[ReadyEndpoint, ...]):
    """`EndpointStore.ready()`: the (endpoint, metrics) pairs, and the same endpoints' engine
    signals as `columns` (what the director's snapshot reads)."""

    columns: EngineColumns

    @classmethod
    def of(cls, pairs: Iterable[ReadyEndpoint], columns: EngineColumns) -> ReadyEndpoints:
        made = tuple.__new__(cls, pairs)
        made.columns = columns
        return made

    def keep(self, mask: Sequence[bool] | npt.NDArray[np.bool_]) -> ReadyEndpoints:
        """The entries where `mask` is true, with their columns (a gather by slot)."""
        at = np.flatnonzero(np.asarray(mask, dtype=np.bool_))
        return ReadyEndpoints.of([self[i] for i in at.tolist()], self.columns.subset(at))


_EMPTY_READY: tuple[ReadyEndpoint, ...] = ()


class _ModelTable:
    """One model's endpoints by slot: what `ready()` needs, and the engine columns."""

    __slots__ = (
        "addresses",
        "aged",
        "by_address",
        "endpoint_array",
        "endpoints",
        "entries",
        "expires",
        "lora",
        "n_routable",
        "pair_array",
        "pairs",
        "routable",
        "routable_slots",
        "soonest",
        "unscraped",
        "values",
    )

    def __init__(self, endpoints: tuple[Endpoint, ...]) -> None:
        n = len(endpoints)
        self.endpoints = endpoints
        self.addresses = [ep.address for ep in endpoints]
        self.endpoint_array = _objects(endpoints)
        self.by_address = np.array(sorted(range(n), key=self.addresses.__getitem__), np.intp)
        _freeze(self.by_address)
        self.entries: list[_Routable | None] = [None] * n  # see `EndpointStore._routable_entry`
        self.pairs: list[ReadyEndpoint | None] = [None] * n  # scraped and routable
        self.pair_array = _objects(self.pairs)
        self.unscraped: set[int] = set()  # routable without a metrics URL (metrics made per read)
        self.values: FloatArray = np.full((len(ENGINE_FIELDS), n), np.nan)
        self.lora: IntArray = np.zeros(n, np.intp)
        self.expires: FloatArray = np.zeros(n)  # until when each slot's metrics may be used
        self.routable = np.zeros(n, np.bool_)  # every condition of `is_ready` but freshness
        self.aged = np.zeros(n, np.bool_)  # goes stale (scraped), else ready while routable
        self.n_routable = 0
        # Soonest expiry of a routable aged slot; None: unknown (found again on the next read).
        self.soonest: float | None = math.inf
        self.routable_slots: IntArray | None = None  # cached `flatnonzero(routable)`

    def write(self, i: int, entry: _Routable | None, lora_id: int) -> None:
        """Slot `i` now holds `entry` (see `EndpointStore._routable_entry`)."""
        was = bool(self.routable[i])
        if was and self.aged[i] and self.soonest is not None and self.expires[i] <= self.soonest:
            self.soonest = None  # the soonest may have moved: found again on the next read
        if not self.values.flags.writeable:  # a ready list holds them: copy on write
            self.values = self.values.copy()
            self.lora = self.lora.copy()
        values, metrics = self.values, None if entry is None else entry[1]
        if metrics is None:
            values[:, i] = math.nan
        else:
            for row, name in enumerate(ENGINE_FIELDS):
                v = getattr(metrics, name)
                values[row, i] = math.nan if v is None else v
        self.lora[i] = lora_id
        now_routable = entry is not None
        if now_routable != was:
            self.n_routable += 1 if now_routable else -1
            self.routable[i] = now_routable
            self.routable_slots = None
        self.unscraped.discard(i)
        pair: ReadyEndpoint | None = None
        if entry is not None:
            ep, m, expires = entry
            aged = expires != math.inf
            self.aged[i] = aged
            if m is None:
                self.unscraped.add(i)
            else:
                pair = (ep, m)
                self.expires[i] = expires
                if aged and self.soonest is not None and expires < self.soonest:
                    self.soonest = expires
        self.entries[i] = entry
        self.pairs[i] = pair
        self.pair_array[i] = pair

    def ready(self, now: float, sets: _AdapterSets) -> tuple[ReadyEndpoint, ...]:
        """`EndpointStore.ready` from the arrays: one comparison with the soonest expiry when
        every routable endpoint is fresh, else one mask."""
        if not self.n_routable:
            return _EMPTY_READY
        soonest = self.soonest
        if soonest is None:
            timed = self.routable & self.aged
            soonest = self.soonest = float(self.expires[timed].min()) if timed.any() else math.inf
        slots: IntArray | None
        if not now > soonest:  # every routable endpoint is fresh
            if self.n_routable == len(self.pairs):
                slots = None
            else:
                if self.routable_slots is None:
                    self.routable_slots = np.flatnonzero(self.routable)
                slots = self.routable_slots
        else:
            fresh = ~(self.aged & (now > self.expires))
            slots = np.flatnonzero(self.routable & fresh)
            if not len(slots):
                return _EMPTY_READY
        pairs: list[ReadyEndpoint | None]
        pairs = self.pairs if slots is None else self.pair_array.take(slots).tolist()
        if self.unscraped:
            pairs = self._with_unscraped(pairs.copy(), slots, now)
        _freeze(self.values)
        _freeze(self.lora)
        sets.shared = True
        columns = EngineColumns(
            self.values,
            self.lora,
            sets.keys,
            self.endpoint_array,
            self.addresses,
            self.by_address,
            slots,
        )
        return ReadyEndpoints.of(pairs, columns)  # type: ignore[arg-type]

    def _with_unscraped(
        self, pairs: list[ReadyEndpoint | None], slots: IntArray | None, now: float
    ) -> list[ReadyEndpoint | None]:
        """Fill in the endpoints without a metrics URL: routable, nothing known."""
        empty = EngineMetrics(updated_at=now)
        at = sorted(self.unscraped)
        pos = at if slots is None else np.searchsorted(slots, at).tolist()
        for p, i in zip(pos, at, strict=True):
            if p < len(pairs) and (slots is None or slots[p] == i):
                pairs[p] = (self.endpoints[i], empty)
        return pairs


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
        # Per model, by slot (endpoint order): every condition of `is_ready` but freshness,
        # the metrics to route on and the engine columns, kept up to date by each scrape,
        # so `ready()` only checks ages per request.
        self._tables: dict[str, _ModelTable] = {}
        self._slots: dict[Endpoint, list[tuple[_ModelTable, int]]] = {}
        self._lora_sets = _AdapterSets()
        # Per address: what its engine reported that moves only with work done, and when a
        # scrape last saw it move (`progressed_at`).
        self._progress: dict[str, tuple[_Progress, float]] = {}
        self._itl: dict[Endpoint, _Itl] = {}  # per endpoint: its inter-token latency means

    @property
    def stale_after(self) -> float:
        return self._stale_after

    @property
    def version(self) -> int:
        """Incremented on every endpoint-set change (pollers watch it)."""
        return self._version

    def set_endpoints(self, by_model: Mapping[str, Iterable[Endpoint]]) -> None:
        """Replace the whole endpoint set; endpoints kept keep their scrape state. A model
        whose endpoints are unchanged keeps its table."""
        new_by_model = {model: tuple(dict.fromkeys(eps)) for model, eps in by_model.items()}
        new_states: dict[Endpoint, EndpointState] = {}
        for eps in new_by_model.values():
            for ep in eps:
                new_states[ep] = self._states.get(ep) or EndpointState(ep)
        self._states = new_states
        tables: dict[str, _ModelTable] = {}
        for model, eps in new_by_model.items():
            old = self._tables.get(model)
            if old is not None and old.endpoints == eps:
                tables[model] = old
                continue
            table = tables[model] = _ModelTable(eps)
            for i, ep in enumerate(eps):
                state = new_states[ep]
                lora = self._lora_sets.acquire(_lora_key(state.metrics))
                table.write(i, self._routable_entry(state), lora)
        for model, old in self._tables.items():
            if tables.get(model) is not old:
                for lora in old.lora.tolist():
                    self._lora_sets.release(lora)
        self._tables = tables
        self._by_model = new_by_model
        self._by_address = {
            (model, ep.address): ep for model, eps in new_by_model.items() for ep in eps
        }
        addresses = {ep.address for ep in new_states}
        self._progress = {a: p for a, p in self._progress.items() if a in addresses}
        self._itl = {ep: i for ep, i in self._itl.items() if ep in new_states}
        self._slots = {}
        for table in tables.values():
            for i, ep in enumerate(table.endpoints):
                self._slots.setdefault(ep, []).append((table, i))
        self._version += 1

    def _routable_entry(self, state: EndpointState) -> _Routable | None:
        """What a slot holds for `state`: `is_ready` without the age check."""
        if state.endpoint.metrics_url is None:
            return (state.endpoint, state.metrics, math.inf) if self._ready_without_url else None
        if state.metrics is None:
            return None
        if self._exclude_unreachable and state.unreachable:
            return None
        if self._max_failures is not None and state.failures >= self._max_failures:
            return None
        return state.endpoint, state.metrics, self._expires(state.metrics, state.trusted_for)

    def _expires(self, metrics: EngineMetrics, trusted_for: float | None) -> float:
        return metrics.updated_at + (self._stale_after if trusted_for is None else trusted_for)

    def progressed_at(self, address: str) -> float | None:
        """When a scrape of `address` last showed its engine doing work: a token counter, the
        running or waiting count or the KV-cache usage changed since the scrape before (the
        first scrape counts as a change). None when its engine exports none of them, or it was
        never scraped: nothing can be said. Requests the engine never got, or an engine that
        stopped, change none of them; a prefill in chunks moves the KV usage, a decode the
        generation counter."""
        found = self._progress.get(address)
        return None if found is None else found[1]

    def _note_progress_of(self, address: str, metrics: EngineMetrics) -> None:
        figures = _progress_of(metrics)
        if figures is None:
            return
        old = self._progress.get(address)
        if old is None:
            self._progress[address] = (figures, metrics.updated_at)
        elif old[0] != figures:  # never earlier: a peer's scrape may be older than our last
            self._progress[address] = (figures, max(old[1], metrics.updated_at))

    def _put(self, state: EndpointState) -> None:
        old = self._states[state.endpoint]
        if state.metrics is not None and state.metrics is not old.metrics:
            self._note_progress_of(state.endpoint.address, state.metrics)
            itl = _next_itl(self._itl.get(state.endpoint), state.metrics)
            if itl is not None:
                self._itl[state.endpoint] = itl
                metrics = replace(
                    state.metrics, itl_recent_s=itl.recent_s, itl_baseline_s=itl.baseline_s
                )
                state = replace(state, metrics=metrics)
        self._states[state.endpoint] = state
        entry = self._routable_entry(state)
        key = _lora_key(state.metrics)
        same_set = key == _lora_key(old.metrics)
        sets = self._lora_sets
        for table, i in self._slots.get(state.endpoint, ()):
            lora = int(table.lora[i])
            if not same_set:
                sets.release(lora)
                lora = sets.acquire(key)
            table.write(i, entry, lora)

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

    def record_success(
        self, endpoint: Endpoint, metrics: EngineMetrics, *, trusted_for: float | None = None
    ) -> None:
        """Store a good (possibly partial) scrape, usable for `trusted_for` seconds after it
        was taken (None: `stale_after`). Ignored for removed endpoints."""
        if endpoint in self._states:
            self._put(EndpointState(endpoint, metrics, trusted_for=trusted_for))

    def record_failure(self, endpoint: Endpoint, reason: str, *, unreachable: bool = False) -> None:
        state = self._states.get(endpoint)
        if state is not None:
            trusted = state.trusted_for
            if trusted is not None and state.metrics is not None:
                # An idle pod's figures, trusted long, are used at most `stale_after` past its
                # first failed scrape: a pod that stopped answering is not vouched for as long.
                age = self._clock() - state.metrics.updated_at
                trusted = min(trusted, age + self._stale_after)
            self._put(
                replace(
                    state,
                    failures=state.failures + 1,
                    last_error=reason,
                    unreachable=unreachable,
                    trusted_for=trusted,
                )
            )

    def is_ready(self, state: EndpointState, now: float) -> bool:
        if state.endpoint.metrics_url is None:
            return self._ready_without_url
        if state.metrics is None or now > self._expires(state.metrics, state.trusted_for):
            return False
        if self._exclude_unreachable and state.unreachable:
            return False
        return self._max_failures is None or state.failures < self._max_failures

    def ready(self, model: str, now: float | None = None) -> tuple[ReadyEndpoint, ...]:
        """Endpoints of `model` fit for routing, with the metrics to route on: a
        `ReadyEndpoints` (with columns), or an empty tuple."""
        if now is None:
            now = self._clock()
        table = self._tables.get(model)
        if table is None:
            return _EMPTY_READY
        return table.ready(now, self._lora_sets)

    def cache_blocks(self, model: str, *, unknown: int) -> int:
        """KV-cache blocks the model's pods can hold together, as their engines report it
        (`num_gpu_blocks`); `unknown` for a pod not scraped yet or not saying. What sizes the
        pool's prefix indexes: a pool of ten pods needs a tenth of a hundred-pod pool's."""
        total = 0
        for ep in self._by_model.get(model, ()):
            state = self._states.get(ep)
            blocks = (
                None if state is None or state.metrics is None else state.metrics.num_gpu_blocks
            )
            total += blocks if blocks is not None and blocks > 0 else unknown
        return total

    def any_ready(self, now: float | None = None) -> bool:
        """True when at least one endpoint of any model is ready (readiness probe)."""
        if now is None:
            now = self._clock()
        return any(self.is_ready(s, now) for s in self._states.values())

    def adapter_sets(self) -> int:
        """How many distinct LoRA adapter sets the endpoints hold (interned once each)."""
        return self._lora_sets.live()
