"""What the gateway measures about each pod itself: throughput, busy time, latencies.

AIBrix's `least-busy-time` and `throughput` read signals vLLM does not export; we derive
them from what the gateway sees: busy time from its own in-flight requests (start and end of
the routing stream), tokens and latencies from each response's access-log record.

Rates and busy time are continuous-time exponential averages with time constant `tau`
(seconds): a quantity observed `tau` seconds ago weighs 1/e of one observed now. For busy
time B, dB/dt = busy(t) - B/tau, so B tends to tau for an always-busy pod and
`busy_time_s / tau` is the busy fraction. Latencies are per-sample EWMAs with weight
`alpha` for the newest sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from extproc.routing.base import PodStats

__all__ = ["PodStatsTracker", "StatsColumns"]

FloatArray = npt.NDArray[np.float64]


class StatsColumns(NamedTuple):
    """`PodStatsTracker.stats` of many pods as arrays, in their order (NaN for None)."""

    requests_total: FloatArray
    throughput_tokens_per_s: FloatArray
    busy_time_s: FloatArray
    ttft_avg_s: FloatArray
    tpot_avg_s: FloatArray
    latency_avg_s: FloatArray

    def row(self, i: int) -> PodStats:
        """Pod `i`'s `PodStats`, equal to what `stats` gives for it."""
        return PodStats(
            requests_total=int(self.requests_total[i]),
            throughput_tokens_per_s=float(self.throughput_tokens_per_s[i]),
            busy_time_s=float(self.busy_time_s[i]),
            ttft_avg_s=_optional(self.ttft_avg_s[i]),
            tpot_avg_s=_optional(self.tpot_avg_s[i]),
            latency_avg_s=_optional(self.latency_avg_s[i]),
        )

    def rows(self) -> list[PodStats]:
        """Every pod's `PodStats` (as `row` gives them), in one pass over plain lists."""
        return list(
            map(
                PodStats,
                map(int, self.requests_total.tolist()),
                self.throughput_tokens_per_s.tolist(),
                self.busy_time_s.tolist(),
                _nones(self.ttft_avg_s),
                _nones(self.tpot_avg_s),
                _nones(self.latency_avg_s),
            )
        )


def _nones(column: FloatArray) -> list[float | None]:
    return [None if x != x else x for x in column.tolist()]  # NaN is the only x != x


def _optional(x: np.float64) -> float | None:
    return None if math.isnan(x) else float(x)


@dataclass(slots=True)
class _Pod:
    updated_at: float
    in_flight: int = 0
    busy: float = 0.0  # decayed busy seconds as of updated_at
    tokens: float = 0.0  # decayed token count as of updated_at
    requests_total: int = 0
    ttft: float | None = None
    tpot: float | None = None
    latency: float | None = None
    longest: float = 0.0  # the longest response time seen (not in the table: leases read it)


# Each pod's `_Pod` mirrored as one row of a float64 table, for `columns`: copied after
# changes (a dirty set, flushed on read), so events and `stats` stay plain-float work.
_ROW_FIELDS = (
    "updated_at",
    "in_flight",
    "busy",
    "tokens",
    "requests_total",
    "ttft",
    "tpot",
    "latency",
)
_UPDATED, _IN_FLIGHT, _BUSY, _TOKENS, _REQUESTS, _TTFT, _TPOT, _LATENCY = range(len(_ROW_FIELDS))
_row_of = attrgetter(*_ROW_FIELDS)
# Row 0: an address never seen (no decay: updated "at infinity"; zeros; NaN for unknowns).
_UNSEEN = (math.inf, 0.0, 0.0, 0.0, 0.0, math.nan, math.nan, math.nan)


def _ewma(old: float | None, sample: float, alpha: float) -> float:
    return sample if old is None else old + alpha * (sample - old)


class PodStatsTracker:
    def __init__(self, *, tau: float = 30.0, alpha: float = 0.2) -> None:
        if tau <= 0 or not 0 < alpha <= 1:
            raise ValueError("tau must be positive and alpha in (0, 1]")
        self._tau = tau
        self._alpha = alpha
        self._pods: dict[str, _Pod] = {}
        self._slot: dict[str, int] = {}  # address -> its row in `_table`
        self._free: list[int] = []
        # The last `columns` rows: the candidates are mostly the same list request after
        # request, and comparing two lists of the same strings is cheaper than a dict pass.
        self._last_rows: tuple[list[str], npt.NDArray[np.intp]] | None = None
        self._table = np.array([_UNSEEN] * 64, dtype=np.float64)
        self._dirty: set[str] = set()

    @property
    def tau(self) -> float:
        return self._tau

    def _advance(self, address: str, now: float) -> _Pod:
        pod = self._pods.get(address)
        self._dirty.add(address)
        if pod is None:
            pod = self._pods[address] = _Pod(updated_at=now)
            self._slot[address] = self._take_slot()
            self._last_rows = None
            return pod
        dt = now - pod.updated_at
        if dt <= 0:  # a non-monotonic caller: never run time backwards
            return pod
        decay = math.exp(-dt / self._tau)
        pod.tokens *= decay
        pod.busy *= decay
        if pod.in_flight > 0:
            pod.busy += self._tau * (1.0 - decay)
        pod.updated_at = now
        return pod

    def request_started(self, address: str, now: float) -> None:
        self._advance(address, now).in_flight += 1

    def request_ended(self, address: str, now: float) -> None:
        """A request this process routed to `address` is over (busy time stops counting)."""
        pod = self._advance(address, now)
        pod.in_flight = max(0, pod.in_flight - 1)

    def observe_response(
        self,
        address: str,
        *,
        now: float,
        latency_s: float | None,
        ttft_s: float | None,
        decode_s: float | None,
        tokens: int | None,
        completion_tokens: int | None,
    ) -> None:
        """One successful response served by `address` (from any process's routing):
        total and first-token latency from the upstream's view, decode time after the first
        token, and its tokens."""
        pod = self._advance(address, now)
        pod.requests_total += 1
        if tokens is not None and tokens > 0:
            pod.tokens += tokens
        if latency_s is not None:
            pod.latency = _ewma(pod.latency, max(0.0, latency_s), self._alpha)
            pod.longest = max(pod.longest, latency_s)
        if ttft_s is not None:
            pod.ttft = _ewma(pod.ttft, max(0.0, ttft_s), self._alpha)
            if decode_s is not None and completion_tokens is not None and completion_tokens > 1:
                # The first token arrives with the first byte; the rest share the decode time.
                tpot = max(0.0, decode_s) / (completion_tokens - 1)
                pod.tpot = _ewma(pod.tpot, tpot, self._alpha)

    def latency_of(self, address: str) -> float | None:
        """`address`'s mean response time (sent upstream to last byte), else the longest of
        any pod's (a pod that has answered nothing yet is like the others), else None."""
        pod = self._pods.get(address)
        if pod is not None and pod.latency is not None:
            return pod.latency
        known = [p.latency for p in self._pods.values() if p.latency is not None]
        return max(known) if known else None

    def longest_of(self, address: str) -> float | None:
        """The longest response `address` has given (sent upstream to last byte), else the
        longest of any pod's, else None: how long a request there may reasonably take."""
        pod = self._pods.get(address)
        if pod is not None and pod.longest > 0:
            return pod.longest
        return max((p.longest for p in self._pods.values() if p.longest > 0), default=None)

    def stats(self, address: str, now: float) -> PodStats:
        if address not in self._pods:
            return PodStats()
        pod = self._advance(address, now)
        return PodStats(
            requests_total=pod.requests_total,
            throughput_tokens_per_s=pod.tokens / self._tau,
            busy_time_s=pod.busy,
            ttft_avg_s=pod.ttft,
            tpot_avg_s=pod.tpot,
            latency_avg_s=pod.latency,
        )

    def columns(self, addresses: Sequence[str], now: float) -> StatsColumns:
        """`stats(address, now)` for every address at once, without advancing any pod: the
        decay to `now` is one numpy expression (the same formula as `_advance`)."""
        self._flush()
        n = len(addresses)
        last = self._last_rows
        if last is not None and last[0] == addresses:
            at = last[1]
        else:
            at = np.fromiter(map(self._slot.get, addresses, repeat(0)), np.intp, n)
            self._last_rows = (list(addresses), at)
        rows = self._table[at].T
        dt = np.maximum(now - rows[_UPDATED], 0.0)  # never run time backwards
        decay = np.exp(-dt / self._tau)
        busy = rows[_BUSY] * decay + np.where(rows[_IN_FLIGHT] > 0, self._tau * (1.0 - decay), 0.0)
        return StatsColumns(
            requests_total=rows[_REQUESTS],
            throughput_tokens_per_s=rows[_TOKENS] * decay / self._tau,
            busy_time_s=busy,
            ttft_avg_s=rows[_TTFT],
            tpot_avg_s=rows[_TPOT],
            latency_avg_s=rows[_LATENCY],
        )

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        slot = len(self._slot) + 1  # row 0 is `_UNSEEN`; slots in use are 1..len(_slot)
        if slot >= len(self._table):
            grown = np.array([_UNSEEN] * len(self._table), dtype=np.float64)
            self._table = np.concatenate([self._table, grown])
        return slot

    def _flush(self) -> None:
        """Copy the pods changed since the last read into their rows."""
        table, slot, pods = self._table, self._slot, self._pods
        for address in self._dirty:
            pod = pods.get(address)
            if pod is not None:
                row = _row_of(pod)
                table[slot[address]] = tuple(math.nan if v is None else v for v in row)
        self._dirty.clear()

    def forget(self, address: str) -> None:
        """Drop a removed endpoint (keeps memory bounded under churn)."""
        if self._pods.pop(address, None) is not None:
            slot = self._slot.pop(address)
            self._last_rows = None
            self._table[slot] = _UNSEEN
            self._free.append(slot)
        self._dirty.discard(address)
