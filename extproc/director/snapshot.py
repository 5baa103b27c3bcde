"""The candidates as one decision sees them: a `SnapshotTable`, one row per ready endpoint.

Built once per request, and only with what the strategy reads (its declared `capabilities`):
the gateway's pod statistics only for a rule that reads accounting, each pod's cache size only
for one that reads prefix matches. The contract test (tests/routing/test_contract.py) checks
that a rule decides the same without what it does not declare, so leaving it out changes no
decision.

Every built-in rule reads numpy columns, so the table holds the pods as columns, whatever
their number: the in-flight counts, pod stats and prefix matches arrive as arrays (each read in
C-level passes over the trackers; the prefix index answers matches and cache sizes for all pods
in one `lookup`), the engine signals, endpoints and adapter-set ids are the metrics store's
columns when the candidates are its `ReadyEndpoints` (built from the metrics objects
otherwise: a list the caller filtered, or few endpoints), and a `PodState` is built only for a
row someone reads (the pick, a filter, explain, the status page). Rows and columns come from
the same values, so they agree.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import repeat
from operator import is_not
from typing import TYPE_CHECKING, cast, overload

import numpy as np

from extproc.metrics.store import EngineColumns, ReadyEndpoints
from extproc.routing.base import Capabilities, PodState, PodStats
from extproc.routing.columns import FloatArray, IntArray, PodColumns, PodTable, column
from extproc.routing.signals import lora_set_state
from extproc.types import Endpoint, EngineMetrics

if TYPE_CHECKING:
    from extproc.accounting.inflight import InflightTracker
    from extproc.accounting.podstats import PodStatsTracker, StatsColumns
    from extproc.kvcache.prefix import PrefixArrays, PrefixIndex

__all__ = ["SnapshotTable", "pod_at", "pod_states"]

_NO_STATS = PodStats()  # frozen: one shared "nothing measured" for rules that never read it
_NO_METRICS = EngineMetrics(updated_at=0.0)  # every signal unknown (NaN), as in `PodColumns`
_ONE_BY_ONE = 16  # rows built singly (by index or iteration) before the rest are built at once


def pod_states(
    candidates: Sequence[tuple[Endpoint, EngineMetrics]],
    *,
    prefix: PrefixIndex,
    block_hashes: Sequence[int],
    now: float,
    inflight: InflightTracker,
    podstats: PodStatsTracker,
    capabilities: Capabilities,
) -> SnapshotTable:
    """One `PodState` per candidate, in candidate order, held as columns."""
    return SnapshotTable(
        candidates,
        prefix=prefix,
        block_hashes=block_hashes,
        now=now,
        inflight=inflight,
        podstats=podstats,
        capabilities=capabilities,
    )


def pod_at(pods: Sequence[PodState], address: str) -> PodState | None:
    """The candidate at `address`, or None. On a `PodTable` it reads the address column and
    builds that one row (a loop over the pods would build them all)."""
    if isinstance(pods, PodTable):
        try:
            return pods[pods.columns.addresses.index(address)]
        except ValueError:
            return None
    return next((p for p in pods if p.address == address), None)


class _TableColumns(PodColumns):
    """A `SnapshotTable`'s columns, read from the trackers' arrays rather than from rows."""

    def __init__(
        self,
        table: SnapshotTable,
        candidates: Sequence[tuple[Endpoint, EngineMetrics]],
        *,
        prefix: Callable[[], PrefixArrays],
        blocks: bool,
        in_flight: tuple[FloatArray, FloatArray],
        recent: Callable[[Sequence[str], FloatArray], FloatArray],
        stats: StatsColumns | None,
        engine: EngineColumns | None,
    ) -> None:
        super().__init__(table)
        self._candidates = candidates
        self._recent = recent
        self._engine = engine  # the store's columns of `candidates`, if it answered them
        self._lookup = prefix
        self._blocks = blocks  # whether rows carry cache sizes (else 0)
        self.stats = stats
        self.__dict__["in_flight"], self.__dict__["in_flight_tokens"] = in_flight

    # What `PodColumns` reads from rows, read here from the candidates and the trackers.

    @column
    def _metrics(self) -> list[EngineMetrics]:
        raw = self.raw_metrics
        if all(raw):  # the store's candidates always carry metrics (truthy): no second pass
            return cast("list[EngineMetrics]", raw)
        return [m or _NO_METRICS for m in raw]

    def _stat(self, field: str) -> FloatArray:
        if self.stats is None:  # rows hold `PodStats()`: zeros, and NaN for the unknowns
            return np.full(self.n, np.nan) if field.endswith("_avg_s") else np.zeros(self.n)
        column: FloatArray = getattr(self.stats, field)
        return column

    def address(self, i: int | np.integer) -> str:  # type: ignore[type-arg]
        return self._candidates[int(i)][0].address

    @column
    def endpoints(self) -> list[Endpoint]:
        if self._engine is not None:
            return self._engine.endpoints()
        return [ep for ep, _ in self._candidates]

    def endpoints_at(self, order: IntArray | Sequence[int]) -> tuple[Endpoint, ...]:
        if self._engine is None:
            return super().endpoints_at(order)
        return tuple(self._engine.endpoint_array.take(order).tolist())

    def address_order(self) -> IntArray:
        if self._engine is None:
            return super().address_order()
        return self._engine.address_order()  # sorted once per endpoint set

    # The engine signals: the store's columns when it answered the candidates.

    def _metric(self, field: str) -> FloatArray:
        if self._engine is None:
            return super()._metric(field)
        return self._engine.column(field)

    def lora_states(self, lora: str) -> FloatArray:
        """One state per distinct adapter set the store interned, gathered by id (every
        candidate of the store has metrics: none is NaN)."""
        if self._engine is None:
            return super().lora_states(lora)
        by_set = np.array([lora_set_state(lora, *key) for key in self._engine.lora_sets])
        out: FloatArray = by_set.take(self._engine.lora_ids)
        return out

    @column
    def raw_metrics(self) -> list[EngineMetrics | None]:
        return [m for _, m in self._candidates]

    @column
    def has_metrics(self) -> np.ndarray:  # type: ignore[type-arg]
        if self._engine is not None or all(self.raw_metrics):
            return np.ones(self.n, np.bool_)
        return np.fromiter(map(is_not, self.raw_metrics, repeat(None)), np.bool_, self.n)

    @column
    def prefix(self) -> PrefixArrays:
        return self._lookup()

    @column
    def prefix_match_tokens(self) -> FloatArray:
        return self.prefix.tokens.astype(np.float64)

    @column
    def cached_blocks(self) -> FloatArray:
        if not self._blocks:
            return np.zeros(self.n)
        return self.prefix.cached_blocks.astype(np.float64)

    @column
    def _prefix_lists(self) -> tuple[list[int], list[bool], list[int]]:
        """The prefix arrays as Python ints and bools, what a `PodState` holds."""
        found = self.prefix
        blocks = found.cached_blocks.tolist() if self._blocks else [0] * self.n
        return found.tokens.tolist(), found.exact.tolist(), blocks

    def stats_of(self, i: int) -> PodStats:
        return _NO_STATS if self.stats is None else self.stats.row(i)

    @column
    def prefill_tokens(self) -> FloatArray:
        if self.stats is None:  # rows hold None: not read
            return np.full(self.n, np.nan)
        return self._recent(self.addresses, self.stats.ttft_avg_s)

    @column
    def _prefill_list(self) -> list[int | None]:
        return [None if x != x else int(x) for x in self.prefill_tokens.tolist()]

    def all_rows(self) -> list[PodState]:
        """Every `PodState`, in one pass over plain lists (a rule that reads every row)."""
        tokens, exact, blocks = self._prefix_lists
        if self.stats is None:
            stats: Iterable[PodStats] = repeat(_NO_STATS, self.n)
        else:
            stats = self.stats.rows()
        return list(
            map(
                PodState,
                self.endpoints,
                self.raw_metrics,
                map(int, self.in_flight.tolist()),
                map(int, self.in_flight_tokens.tolist()),
                tokens,
                exact,
                blocks,
                stats,
                self._prefill_list,
            )
        )

    def take(self, order: IntArray) -> list[PodState]:
        rows = self.pods
        assert isinstance(rows, SnapshotTable)
        if len(order) * 4 >= self.n:  # most rows: build them all at once
            rows.fill()
        return list(map(rows.__getitem__, order.tolist()))

    def row(self, i: int) -> PodState:
        ep, metrics = self._candidates[i]
        tokens, exact, blocks = self._prefix_lists
        return PodState(
            ep,
            metrics,
            int(self.in_flight[i]),
            int(self.in_flight_tokens[i]),
            tokens[i],
            exact[i],
            blocks[i],
            self.stats_of(i),
            self._prefill_list[i],
        )


class SnapshotTable(PodTable):
    """The candidates as columns; each `PodState` is built on first read and kept."""

    __slots__ = ("_columns", "_rows", "_singles")

    def __init__(
        self,
        candidates: Sequence[tuple[Endpoint, EngineMetrics]],
        *,
        prefix: PrefixIndex,
        block_hashes: Sequence[int],
        now: float,
        inflight: InflightTracker,
        podstats: PodStatsTracker,
        capabilities: Capabilities,
    ) -> None:
        engine = candidates.columns if type(candidates) is ReadyEndpoints else None
        addresses = (
            engine.addresses() if engine is not None else [ep.address for ep, _ in candidates]
        )

        def lookup() -> PrefixArrays:
            return prefix.lookup(addresses, block_hashes, now)

        self._rows: list[PodState | None] = [None] * len(addresses)
        self._singles = 0  # rows built one by one so far
        self._columns = _TableColumns(
            self,
            candidates,
            prefix=lookup,
            blocks=capabilities.prefix_matches,
            in_flight=inflight.columns(addresses),
            recent=inflight.recent_columns,
            stats=podstats.columns(addresses, now) if capabilities.accounting else None,
            engine=engine,
        )
        self._columns.__dict__["addresses"] = addresses  # the column, already built

    @property
    def columns(self) -> PodColumns:
        return self._columns

    def __len__(self) -> int:
        return len(self._rows)

    def _row(self, i: int) -> PodState:
        row = self._rows[i]
        if row is None:
            self._singles += 1
            if self._singles > _ONE_BY_ONE:  # a reader of many rows (a ranking): all at once
                self.fill()
                return cast(PodState, self._rows[i])
            row = self._rows[i] = self._columns.row(i)
        return row

    @overload
    def __getitem__(self, i: int) -> PodState: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[PodState]: ...

    def __getitem__(self, i: int | slice) -> PodState | Sequence[PodState]:
        if isinstance(i, slice):
            return [self._row(j) for j in range(len(self._rows))[i]]
        n = len(self._rows)
        if not -n <= i < n:
            raise IndexError("pod index out of range")
        return self._row(i % n)

    def fill(self) -> None:
        """Build every row not built yet (all at once: cheaper than one by one)."""
        if None in self._rows:
            built = self._rows
            self._rows = [
                b if b is not None else a
                for a, b in zip(self._columns.all_rows(), built, strict=True)
            ]

    def __iter__(self) -> Iterator[PodState]:
        # The first rows one by one (a search that stops early builds few), then all at once.
        head = min(len(self._rows), _ONE_BY_ONE)
        for i in range(head):
            yield self._row(i)
        if head < len(self._rows):
            self.fill()
            yield from cast("list[PodState]", self._rows)[head:]
