"""Pod signals as numpy columns, for strategies that decide over many pods.

A decision over hundreds of pods spends its time in per-pod Python (a key tuple, a random
draw and a dict per pod). Above `VECTOR_MIN_PODS` the built-in strategies read the snapshot
as columns (one float64 array per signal, NaN for "unknown", each built on first use) and
rank with one `lexsort`. Below it numpy's fixed cost per call is more than the loop it
replaces, so they keep their per-pod code; both give the same decision for the same seed
(tests/routing/test_columns.py): the vector rankings draw the same random tie-breaks, in
the same order, as `signals.rank_by`.

`PodRows` is a tuple of pods that keeps its columns, so the filters, scorers and picker of
one profile (or the director and the strategy) build each column once.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Iterator, Sequence
from functools import cached_property
from itertools import repeat, starmap
from operator import attrgetter, is_not
from typing import Any, TypeGuard, overload

import numpy as np
import numpy.typing as npt

from extproc.routing.base import PodState, PodStats, RoutingRequest
from extproc.routing.signals import expected_output_tokens
from extproc.types import Endpoint, EndpointRole, EngineMetrics

__all__ = [
    "CHEAP_RULE",
    "COSTLY_RULE",
    "PROFILE_RULE",
    "TABLE_MIN_PODS",
    "VECTOR_MIN_PODS",
    "FloatArray",
    "IntArray",
    "PodColumns",
    "PodRows",
    "PodTable",
    "columns_of",
    "draws",
    "endpoints_of",
    "is_table",
    "lora_set_state",
    "predicted_latency_column",
    "rank_order",
    "rows_at",
    "vectorised",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.intp]

# Where the columns start to pay (numpy's fixed cost per call against the per-pod loop it
# replaces), measured rule by rule with both paths in one process on this 2-core machine:
# `len(pods) >= VECTOR_MIN_PODS * factor`, the factor by how much fixed work a rule's
# vectorised path has (a profile runs each scorer and the picker: the most).
VECTOR_MIN_PODS = 48
CHEAP_RULE = 0.5  # kv-aware, vtc-basic: the per-pod path builds a dict per pod
COSTLY_RULE = 4 / 3  # pd, session-affinity
PROFILE_RULE = 2.0  # profiles and their scorers
# From here on the director's snapshot is a `PodTable`, whose columns are arrays already:
# on one, every rule reads the columns (measured: level with rows at 32 pods, ahead above).
TABLE_MIN_PODS = 32


def vectorised(pods: Sequence[PodState], factor: float = 1.0) -> bool:
    """Whether a decision over `pods` should use the columns."""
    return len(pods) >= VECTOR_MIN_PODS * factor or is_table(pods)


def is_table(pods: Sequence[PodState]) -> TypeGuard[PodTable]:
    """Whether `pods` is a `PodTable` (the length first: the ABC check would cost more than a
    rule over a few pods can spare)."""
    return len(pods) >= TABLE_MIN_PODS and isinstance(pods, PodTable)


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

    A column is built on first use and kept: a strategy pays only for what it reads.
    """

    def __init__(self, pods: Sequence[PodState]) -> None:
        self.pods = pods
        self.n = len(pods)

    @cached_property
    def endpoints(self) -> list[Endpoint]:
        return list(map(attrgetter("endpoint"), self.pods))

    def address(self, i: int | np.integer[Any]) -> str:
        """One pod's address (without building the `addresses` column)."""
        return self.pods[int(i)].endpoint.address

    @cached_property
    def addresses(self) -> list[str]:
        return list(map(attrgetter("address"), self.endpoints))

    @cached_property
    def roles(self) -> list[EndpointRole]:
        return list(map(attrgetter("role"), self.endpoints))

    @cached_property
    def _role_codes(self) -> npt.NDArray[np.int8]:
        return np.fromiter(map(_ROLE_CODES.__getitem__, self.roles), np.int8, self.n)

    def role_is(self, role: EndpointRole) -> npt.NDArray[np.bool_]:
        """A mask of the pods whose role is exactly `role`."""
        mask: npt.NDArray[np.bool_] = self._role_codes == _ROLE_CODES[role]
        return mask

    @cached_property
    def in_flight(self) -> FloatArray:
        return _numbers(self.pods, "in_flight")

    @cached_property
    def in_flight_tokens(self) -> FloatArray:
        return _numbers(self.pods, "in_flight_tokens")

    @cached_property
    def prefill_tokens(self) -> FloatArray:
        return _optional(self.pods, "prefill_tokens")  # NaN where not measured

    @cached_property
    def prefix_match_tokens(self) -> FloatArray:
        return _numbers(self.pods, "prefix_match_tokens")

    @cached_property
    def cached_blocks(self) -> FloatArray:
        return _numbers(self.pods, "cached_blocks")

    @cached_property
    def _metrics(self) -> list[EngineMetrics]:
        return [m or _NO_METRICS for m in map(attrgetter("metrics"), self.pods)]

    @cached_property
    def has_metrics(self) -> npt.NDArray[np.bool_]:
        raw = map(attrgetter("metrics"), self.pods)
        return np.fromiter(map(is_not, raw, repeat(None)), np.bool_, self.n)

    def lora_states(self, lora: str) -> FloatArray:
        """`signals.lora_state` for every pod (NaN without metrics), computed once per
        distinct adapter set: pods share a handful of those."""
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

    @cached_property
    def waiting(self) -> FloatArray:
        return self._metric("waiting")

    @cached_property
    def running(self) -> FloatArray:
        return self._metric("running")

    @cached_property
    def kv_usage(self) -> FloatArray:
        return self._metric("kv_cache_usage")

    @cached_property
    def engine_ttft(self) -> FloatArray:
        return self._metric("ttft_avg_s")

    @cached_property
    def engine_itl(self) -> FloatArray:
        return self._metric("itl_avg_s")

    @cached_property
    def _stats(self) -> list[PodStats]:
        return list(map(attrgetter("stats"), self.pods))

    def _stat(self, field: str) -> FloatArray:
        """One `PodStats` field of every pod (the `_avg_s` ones may be None: NaN)."""
        if field.endswith("_avg_s"):
            return _optional(self._stats, field)
        return _numbers(self._stats, field)

    @cached_property
    def requests_total(self) -> FloatArray:
        return self._stat("requests_total")

    @cached_property
    def throughput(self) -> FloatArray:
        return self._stat("throughput_tokens_per_s")

    @cached_property
    def busy_time(self) -> FloatArray:
        return self._stat("busy_time_s")

    @cached_property
    def stats_ttft(self) -> FloatArray:
        return self._stat("ttft_avg_s")

    @cached_property
    def stats_tpot(self) -> FloatArray:
        return self._stat("tpot_avg_s")

    @cached_property
    def stats_latency(self) -> FloatArray:
        return self._stat("latency_avg_s")

    def take(self, order: IntArray) -> list[PodState]:
        """The pods at `order`, in that order."""
        return list(map(self.pods.__getitem__, order.tolist()))

    def rows(self, order: IntArray) -> Sequence[PodState]:
        """The pods at `order` as a view: nothing is copied until it is read (explain scores)."""
        return _RowsView(self.pods, order)

    def address_order(self) -> IntArray:
        """Pod indices sorted by address (equal addresses in pod order)."""
        return np.array(sorted(range(self.n), key=self.addresses.__getitem__), dtype=np.intp)

    def endpoints_at(self, order: IntArray | Sequence[int]) -> tuple[Endpoint, ...]:
        if isinstance(order, np.ndarray):
            order = order.tolist()
        return tuple(map(self.endpoints.__getitem__, order))


class _RowsView(Sequence[PodState]):
    """Pods at `order` of a sequence of pods; a row is read (on a `PodTable`: built) only
    when asked for."""

    __slots__ = ("_order", "_pods")

    def __init__(self, pods: Sequence[PodState], order: IntArray | Sequence[int]) -> None:
        self._pods = pods
        self._order = np.asarray(order, dtype=np.intp)

    def endpoints(self) -> tuple[Endpoint, ...]:
        """The endpoints in this order, from the columns (no row is built)."""
        return columns_of(self._pods).endpoints_at(self._order)

    def __add__(self, other: Sequence[PodState]) -> list[PodState]:
        return [*self, *other]  # `ranked += fallbacks` on a picker's answer, as on a list

    def __len__(self) -> int:
        return len(self._order)

    @overload
    def __getitem__(self, i: int) -> PodState: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[PodState]: ...

    def __getitem__(self, i: int | slice) -> PodState | Sequence[PodState]:
        if isinstance(i, slice):
            return [self._pods[j] for j in self._order[i].tolist()]
        return self._pods[int(self._order[i])]

    def __iter__(self) -> Iterator[PodState]:
        return map(self._pods.__getitem__, self._order.tolist())


def lora_set_state(
    lora: str, running: tuple[str, ...], waiting: tuple[str, ...], max_lora: int | None
) -> float:
    """`signals.lora_state` of one adapter set (the same tiers)."""
    if lora in running:
        return 1.0
    if max_lora is not None and len(set(running) | set(waiting)) < max_lora:
        return 0.8
    if lora in waiting:
        return 0.6
    return 0.0


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
    director's snapshot over many pods, where most decisions read only the columns)."""

    __slots__ = ()

    @property
    @abc.abstractmethod
    def columns(self) -> PodColumns:
        """The pods' columns, kept with the table."""


def columns_of(pods: Sequence[PodState]) -> PodColumns:
    """`pods`' columns: kept on a `PodRows` or a `PodTable`, built afresh for any other sequence."""
    if isinstance(pods, (PodRows, PodTable)):
        return pods.columns
    return PodColumns(pods)


def rows_at(pods: Sequence[PodState], order: IntArray | Sequence[int]) -> Sequence[PodState]:
    """The pods at `order`: a lazy view over a `PodTable` (its rows are built on read, and
    `endpoints_of` reads the view's endpoints from the columns), a list otherwise."""
    if isinstance(pods, PodTable):
        return _RowsView(pods, order)
    if isinstance(order, np.ndarray):
        order = order.tolist()
    return list(map(pods.__getitem__, order))


def endpoints_of(ranked: Sequence[PodState]) -> tuple[Endpoint, ...]:
    """The endpoints of `ranked`, in order; without building a `rows_at` view's rows."""
    if type(ranked) is _RowsView:  # not isinstance: an ABC check costs a small decision ~2 %
        return ranked.endpoints()
    return tuple([p.endpoint for p in ranked])


def draws(rng: random.Random, n: int) -> FloatArray:
    """`n` draws of `rng.random()`, as `signals.rank_by` makes them (same values, same order)."""
    return np.fromiter(starmap(rng.random, repeat((), n)), np.float64, n)


def rank_order(keys: Sequence[FloatArray], rng: random.Random) -> IntArray:
    """Indices sorted ascending by `keys` (primary first), equal keys in random order.

    The same order as `signals.rank_by` with key `(keys[0][i], keys[1][i], ...)` and the same
    `rng` state: it draws one number per pod, in pod order, as the tie-break.
    """
    n = len(keys[0]) if keys else 0
    if n == 0:
        return np.empty(0, dtype=np.intp)
    tie = draws(rng, n)
    return np.lexsort((tie, *reversed(keys)))


def predicted_latency_column(req: RoutingRequest, cols: PodColumns) -> FloatArray:
    """`signals.predicted_latency_s` for every pod (NaN for None), in the same float steps."""
    out = float(expected_output_tokens(req))
    gateway = cols.stats_ttft + cols.stats_tpot * out
    engine = cols.engine_ttft + cols.engine_itl * out
    latency = cols.stats_latency
    result: FloatArray = np.where(
        ~np.isnan(gateway), gateway, np.where(~np.isnan(latency), latency, engine)
    )
    return result
