"""The pods of one decision as numpy columns: what every built-in rule reads.

A rule reads the candidates as columns (one float64 array per signal, in pod order, NaN for
"unknown", each built on first read) and ranks them with one `lexsort`, at every pool size:
one implementation of each rule. A `PodState` row is built only where one is read (the
director's pick, a filter, explain).

`PodRows` is a tuple of pods that keeps its columns (tests, filters' output), so the filters,
scorers and picker of one profile build each column once; a `PodTable` is pods held as
columns first (the director's snapshot, `extproc.director.snapshot`), its rows built on read.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable, Sequence
from itertools import repeat, starmap
from operator import attrgetter, is_not
from typing import Any, Generic, TypeVar, overload

import numpy as np
import numpy.typing as npt

from extproc.routing.base import PodState, PodStats, RoutingRequest
from extproc.routing.signals import expected_output_tokens, lora_set_state
from extproc.types import Endpoint, EndpointRole, EngineMetrics

__all__ = [
    "FloatArray",
    "IntArray",
    "PodColumns",
    "PodRows",
    "PodTable",
    "column",
    "columns_of",
    "draws",
    "keeping_columns",
    "predicted_latency_column",
    "rank_order",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]
T = TypeVar("T")


class column(Generic[T]):
    """A column computed on first read and kept in the instance: `functools.cached_property`
    without its lock (Python 3.11 takes one on every first read, a cost a decision over a
    few pods notices; a decision is one thread)."""

    def __init__(self, compute: Callable[[Any], T]) -> None:
        self._compute = compute
        self._name = compute.__name__
        self.__doc__ = compute.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, cls: type) -> column[T]: ...

    @overload
    def __get__(self, obj: object, cls: type) -> T: ...

    def __get__(self, obj: object, cls: type) -> T | column[T]:
        if obj is None:
            return self
        value = obj.__dict__[self._name] = self._compute(obj)
        return value


_NO_METRICS = EngineMetrics(updated_at=0.0)  # every signal unknown (NaN)
_ROLE_CODES = {role: code for code, role in enumerate(EndpointRole)}


def _numbers(items: Sequence[object], attr: str) -> FloatArray:
    """A numeric field that is never None, read in one C-level pass."""
    return np.fromiter(map(attrgetter(attr), items), np.float64, len(items))


def _optional(items: Sequence[object], attr: str) -> FloatArray:
    """A field that may be None: numpy reads None as NaN."""
    return np.array(list(map(attrgetter(attr), items)), dtype=np.float64)


class PodColumns:
    """One snapshot's per-pod signals, each a float64 array in pod order, NaN when unknown.

    Built here from `PodState` rows; the director's table (`extproc.director.snapshot`)
    overrides the sources and reads the trackers' arrays instead. A column is built on first
    read and kept: a rule pays only for what it reads.
    """

    def __init__(self, pods: Sequence[PodState]) -> None:
        self.pods = pods
        self.n = len(pods)

    @column
    def endpoints(self) -> list[Endpoint]:
        return list(map(attrgetter("endpoint"), self.pods))

    def address(self, i: int | np.integer[Any]) -> str:
        """One pod's address (without building the `addresses` column)."""
        return self.pods[int(i)].endpoint.address

    @column
    def addresses(self) -> list[str]:
        return list(map(attrgetter("address"), self.endpoints))

    def addresses_text(self, at: IntArray) -> str:
        """The addresses of the pods at `at`, comma-separated (for a reason)."""
        addresses = self.addresses
        return ",".join([addresses[i] for i in at.tolist()])

    @column
    def _role_codes(self) -> npt.NDArray[np.int8]:
        roles = map(attrgetter("role"), self.endpoints)
        return np.fromiter(map(_ROLE_CODES.__getitem__, roles), np.int8, self.n)

    def role_is(self, role: EndpointRole) -> npt.NDArray[np.bool_]:
        """A mask of the pods whose role is exactly `role`."""
        mask: npt.NDArray[np.bool_] = self._role_codes == _ROLE_CODES[role]
        return mask

    @column
    def in_flight(self) -> FloatArray:
        return _numbers(self.pods, "in_flight")

    @column
    def in_flight_tokens(self) -> FloatArray:
        return _numbers(self.pods, "in_flight_tokens")

    @column
    def prefill_tokens(self) -> FloatArray:
        return _optional(self.pods, "prefill_tokens")  # NaN where not measured

    @column
    def prefix_match_tokens(self) -> FloatArray:
        return _numbers(self.pods, "prefix_match_tokens")

    @column
    def cached_blocks(self) -> FloatArray:
        return _numbers(self.pods, "cached_blocks")

    @column
    def _metrics(self) -> list[EngineMetrics]:
        return [m or _NO_METRICS for m in map(attrgetter("metrics"), self.pods)]

    @column
    def has_metrics(self) -> npt.NDArray[np.bool_]:
        raw = map(attrgetter("metrics"), self.pods)
        return np.fromiter(map(is_not, raw, repeat(None)), np.bool_, self.n)

    def lora_states(self, lora: str) -> FloatArray:
        """`signals.lora_set_state` for every pod (NaN without metrics), computed once per distinct
        adapter set: pods share a handful of those."""
        keys = list(
            map(
                attrgetter("running_lora_adapters", "waiting_lora_adapters", "max_lora"),
                self._metrics,
            )
        )
        state = {key: lora_set_state(lora, *key) for key in set(keys)}
        out = np.array(list(map(state.__getitem__, keys)), dtype=np.float64)
        out[~self.has_metrics] = np.nan
        return out

    def _metric(self, field: str) -> FloatArray:
        """One `EngineMetrics` field of every pod (each column below reads it once)."""
        return _optional(self._metrics, field)

    @column
    def waiting(self) -> FloatArray:
        return self._metric("waiting")

    @column
    def running(self) -> FloatArray:
        return self._metric("running")

    @column
    def kv_usage(self) -> FloatArray:
        return self._metric("kv_cache_usage")

    @column
    def engine_ttft(self) -> FloatArray:
        return self._metric("ttft_avg_s")

    @column
    def engine_itl(self) -> FloatArray:
        return self._metric("itl_avg_s")

    @column
    def engine_itl_recent(self) -> FloatArray:
        return self._metric("itl_recent_s")

    @column
    def engine_itl_baseline(self) -> FloatArray:
        return self._metric("itl_baseline_s")

    @column
    def _stats(self) -> list[PodStats]:
        return list(map(attrgetter("stats"), self.pods))

    def _stat(self, field: str) -> FloatArray:
        """One `PodStats` field of every pod (the `_avg_s` ones may be None: NaN)."""
        if field.endswith("_avg_s"):
            return _optional(self._stats, field)
        return _numbers(self._stats, field)

    @column
    def requests_total(self) -> FloatArray:
        return self._stat("requests_total")

    @column
    def throughput(self) -> FloatArray:
        return self._stat("throughput_tokens_per_s")

    @column
    def busy_time(self) -> FloatArray:
        return self._stat("busy_time_s")

    @column
    def stats_ttft(self) -> FloatArray:
        return self._stat("ttft_avg_s")

    @column
    def stats_tpot(self) -> FloatArray:
        return self._stat("tpot_avg_s")

    @column
    def stats_latency(self) -> FloatArray:
        return self._stat("latency_avg_s")

    def address_order(self) -> IntArray:
        """Pod indices sorted by address (equal addresses in pod order)."""
        return np.array(sorted(range(self.n), key=self.addresses.__getitem__), dtype=np.intp)

    def endpoints_at(self, order: IntArray | Sequence[int]) -> tuple[Endpoint, ...]:
        """The endpoints of the pods at `order`, in that order (no row is read)."""
        if isinstance(order, np.ndarray):
            order = order.tolist()
        return tuple(map(self.endpoints.__getitem__, order))


class PodRows(tuple[PodState, ...]):
    """A tuple of pods that keeps its `PodColumns` (built on first use)."""

    _columns: PodColumns | None

    def __new__(cls, pods: Sequence[PodState] = ()) -> PodRows:
        made = super().__new__(cls, pods)
        made._columns = None
        return made

    @property
    def columns(self) -> PodColumns:
        if self._columns is None:
            self._columns = PodColumns(self)
        return self._columns


class PodTable(Sequence[PodState]):
    """Pods held as columns first: a `PodState` is built only when a row is read (the
    director's snapshot, where most decisions read only the columns)."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def columns(self) -> PodColumns:
        """The pods' columns, kept with the table."""


_KEEPS_COLUMNS: dict[type, bool] = {}


def _keeps_columns(pods: Sequence[PodState]) -> bool:
    kind = type(pods)
    keeps = _KEEPS_COLUMNS.get(kind)
    if keeps is None:  # once per type: an ABC check costs what a small decision can't spare
        keeps = _KEEPS_COLUMNS[kind] = issubclass(kind, (PodRows, PodTable))
    return keeps


def columns_of(pods: Sequence[PodState]) -> PodColumns:
    """`pods`' columns: kept on a `PodRows` or a `PodTable`, built afresh for any other sequence."""
    if _keeps_columns(pods):
        kept: PodColumns = pods.columns  # type: ignore[attr-defined]
        return kept
    return PodColumns(pods)


def keeping_columns(pods: Sequence[PodState]) -> Sequence[PodState]:
    """`pods` as a sequence that keeps its columns (a `PodRows` unless it already does), for
    several plugins reading the same pods."""
    return pods if _keeps_columns(pods) else PodRows(pods)


def draws(rng: random.Random, n: int) -> FloatArray:
    """`n` draws of `rng.random()`, in order."""
    return np.fromiter(starmap(rng.random, repeat((), n)), np.float64, n)


def rank_order(keys: Sequence[FloatArray], rng: random.Random) -> IntArray:
    """Indices sorted ascending by `keys` (primary first), equal keys in random order: one
    draw of `rng` per pod, in pod order, is the last key."""
    n = len(keys[0]) if keys else 0
    if n == 0:
        return np.empty(0, dtype=np.intp)
    return np.lexsort((draws(rng, n), *reversed(keys)))


def predicted_latency_column(req: RoutingRequest, cols: PodColumns) -> FloatArray:
    """ttft + tpot * expected output tokens per pod, preferring the gateway's recent EWMAs,
    then its end-to-end EWMA, then the engine's lifetime means; NaN where none is known."""
    out = float(expected_output_tokens(req))
    gateway = cols.stats_ttft + cols.stats_tpot * out
    engine = cols.engine_ttft + cols.engine_itl * out
    latency = cols.stats_latency
    result: FloatArray = np.where(
        ~np.isnan(gateway), gateway, np.where(~np.isnan(latency), latency, engine)
    )
    return result
