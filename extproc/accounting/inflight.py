"""Requests the gateway has routed and not yet seen finish, per endpoint address.

Keyed by address, not by (model, address): several models served by one server share
its load. Every count is held by a `Lease` whose `finish()` is idempotent and which is a
context manager, so a cancelled stream (CancelledError through `async with`/`with`, or a
`finally`) can never leak a count. A lease ends with the request (its access-log record, through
the routing process's lease book: extproc/director/leases.py); what the response was
(status, tokens, timings) arrives in that record too, on any process (`answered`).
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from itertools import repeat
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from extproc.types import Endpoint

if TYPE_CHECKING:
    from extproc.accounting.gateway_metrics import GatewayMetrics
    from extproc.accounting.podstats import PodStatsTracker
    from extproc.routing.base import PodStats

__all__ = [
    "FAILING_AFTER",
    "FAILING_COOLDOWN_S",
    "STALL_LATENCY_MULTIPLE",
    "InflightTracker",
    "Lease",
    "Load",
]

# A pod is not hung for holding a request as long as its answers take: a stall needs at least
# this many times its mean response time (long streams of 800 tokens take 12 s on an A100).
STALL_LATENCY_MULTIPLE = 3.0
# A pod is quiet (what it holds counts as not yet started) no sooner than this after its last
# sign of progress, however fast its answers usually come.
QUIET_FLOOR_S = 0.1
LAG_DECAY = 0.99  # per record: the record lag's maximum fades over a few hundred records
# A pod whose picks failed this many times in a row (its answer was a 5xx, or Envoy had to retry
# the request elsewhere) leaves the candidates for FAILING_COOLDOWN_S; one served pick clears it.
FAILING_AFTER = 3
FAILING_COOLDOWN_S = 10.0
# Arrivals (when tokens were routed to an address) kept for `recent_tokens`: at most this many
# per address, none older than ARRIVALS_KEPT_S (no pod's first token takes longer).
ARRIVALS_MAX = 512
ARRIVALS_KEPT_S = 60.0


@dataclass(frozen=True, slots=True)
class Load:
    requests: int = 0
    tokens: int = 0


_NO_LOAD = Load()


class _LoadTable:
    """Every address's load (own + peers') as two float64 rows by slot, set on each change,
    so a snapshot reads many addresses with one slot lookup (none while its candidate list
    and the slots stay the same). An address without load holds no slot: slot 0 reads 0."""

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self._free: list[int] = []
        self._rows = np.zeros((2, 64))  # requests, tokens
        self._last: tuple[list[str], npt.NDArray[np.intp]] | None = None

    def set(self, address: str, requests: int, tokens: int) -> None:
        slot = self._slot.get(address)
        if requests <= 0 and tokens <= 0:
            if slot is not None:
                del self._slot[address]
                self._rows[:, slot] = 0.0
                self._free.append(slot)
                self._last = None
            return
        if slot is None:
            slot = self._free.pop() if self._free else len(self._slot) + 1
            if slot >= self._rows.shape[1]:
                self._rows = np.concatenate((self._rows, np.zeros_like(self._rows)), axis=1)
            self._slot[address] = slot
            self._last = None
        self._rows[0, slot] = requests
        self._rows[1, slot] = tokens

    def columns(
        self, addresses: Sequence[str]
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        last = self._last
        if last is not None and last[0] == addresses:
            at = last[1]
        else:
            at = np.fromiter(map(self._slot.get, addresses, repeat(0)), np.intp, len(addresses))
            self._last = (list(addresses), at)
        return self._rows[0, at], self._rows[1, at]


class _Arrivals:
    """When tokens were routed to one address, oldest first, with running sums: the tokens
    routed since any time are one bisect and one subtraction, however many arrived."""

    __slots__ = ("_base", "_head", "_sums", "_times")

    def __init__(self) -> None:
        self._times: list[float] = []
        self._sums: list[int] = []  # tokens up to and including each entry (since _base)
        self._base = 0  # the running sum before _times[0]
        self._head = 0  # entries before it are forgotten

    def __len__(self) -> int:
        return len(self._times) - self._head

    def add(self, at: float, tokens: int) -> None:
        times = self._times
        if times and at < times[-1]:
            at = times[-1]  # an adopted lease that started earlier: kept in order
        times.append(at)
        self._sums.append((self._sums[-1] if self._sums else self._base) + tokens)
        head = self._head
        while times[head] < at - ARRIVALS_KEPT_S or len(times) - head > ARRIVALS_MAX:
            head += 1
        if head > 64 and head * 2 > len(times):
            self._base = self._sums[head - 1]
            del times[:head], self._sums[:head]
            head = 0
        self._head = head

    def since(self, cutoff: float) -> int:
        """Tokens that arrived after `cutoff`."""
        times, sums = self._times, self._sums
        j = bisect_right(times, cutoff, self._head)
        if j >= len(times):
            return 0
        return sums[-1] - (sums[j - 1] if j > 0 else self._base)


class Lease:
    """One routed request's claim on an endpoint. Obtain from `InflightTracker.start`."""

    __slots__ = ("_finished", "_tracker", "endpoint", "started_at", "tokens")

    def __init__(self, tracker: InflightTracker, endpoint: Endpoint, tokens: int, now: float):
        self._tracker = tracker
        self._finished = False
        self.endpoint = endpoint
        self.tokens = tokens
        self.started_at = now

    @property
    def finished(self) -> bool:
        return self._finished

    def finish(self) -> None:
        """Release the count. Idempotent: only the first call has any effect."""
        if self._finished:
            return
        self._finished = True
        self._tracker._release(self)

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.finish()


class InflightTracker:
    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        stats: PodStatsTracker | None = None,
        metrics: GatewayMetrics | None = None,
        progress: Callable[[str], float | None] | None = None,
        hang_after_s: float = 0.0,
        quiet_after_s: float = 1.0,
    ) -> None:
        """`progress`: when an address's engine was last seen doing work (its scrapes:
        `EndpointStore.progressed_at`; None: unknown). `hang_after_s` (0: off): a pod holding
        requests (any replica's) that long, whose engine and answers have shown no progress for
        as long, is stalled. `quiet_after_s`: a pod without progress for that long counts every request
        routed there since as still before its first token (`recent_columns`)."""
        self._clock = clock
        self._stats = stats
        self._progress = progress
        self.hang_after_s = hang_after_s  # settable: a config reload changes it
        self.quiet_after_s = quiet_after_s
        self._metrics = metrics
        self._requests: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        # Stall detection: watched leases per address in start order, and the last time each
        # address was seen answering (from access-log records, which any process may get).
        # Armed by the first answer ever seen: only then are responses being watched at all.
        self._waiting: dict[str, dict[Lease, None]] = {}
        self._open: dict[Lease, None] = {}  # every watched lease, in start order (oldest first)
        self._answered_at: dict[str, float] = {}
        # Since when each address has held requests without a break, by this replica's count
        # plus its peers' (in order of that time, oldest first): the progress rule's clock, the
        # same on every replica whichever one routed the requests.
        self._held_since: dict[str, float] = {}
        # The progress rule kept without a pass over every held pod per decision: each held
        # pod's earliest time to be called hung (`_hang_due`) in a heap (one entry per pod),
        # looked at again only when that time comes; the pods found hung, looked at each time.
        self._due: list[tuple[float, str]] = []
        self._queued: set[str] = set()
        self._hung: set[str] = set()
        self._due_hang = hang_after_s  # the limit the queued times were computed with
        self._record_lag = 0.0  # how late answers arrive (see `answered`)
        self._watching = False
        # Failing picks: consecutive failures per address and the last one's time.
        self._failures: dict[str, tuple[int, float]] = {}
        self._failed_total: dict[str, int] = {}  # every failed pick, for the status page
        # Other replicas' in-flight counts (absolute, per replica), and their sum per address.
        self._remote: dict[str, dict[str, Load]] = {}
        self._remote_total: dict[str, Load] = {}
        self._loads = _LoadTable()  # `load` of every address with any, as arrays
        # (time, tokens) routed to each address while it holds load, oldest first: this
        # replica's leases as they start, peers' as their published tokens grow.
        self._arrivals: dict[str, _Arrivals] = {}
        self._index: tuple[list[str], dict[str, int]] | None = None  # recent_columns' last

    def now(self) -> float:
        return self._clock()

    def start(
        self,
        endpoint: Endpoint,
        tokens: int = 0,
        *,
        watched: bool = True,
        started_at: float | None = None,
    ) -> Lease:
        """Count a request routed to `endpoint`; `tokens` = prompt + expected output.
        `watched`: its response will be accounted (a missing answer then means something).
        `started_at`: when it was routed, if earlier than now (a lease adopted from a peer)."""
        tokens = max(0, tokens)
        addr = endpoint.address
        now = self._clock()
        lease = Lease(self, endpoint, tokens, now if started_at is None else min(now, started_at))
        if watched:
            self._waiting.setdefault(addr, {})[lease] = None
            self._open[lease] = None
        count = self._requests.get(addr, 0) + 1
        self._requests[addr] = count
        self._tokens[addr] = self._tokens.get(addr, 0) + tokens
        self._arrived(addr, lease.started_at, tokens)
        self._sync(addr)
        if self._stats is not None:
            self._stats.request_started(addr, lease.started_at)
        if self._metrics is not None:
            self._metrics.set_in_flight(addr, count)
        return lease

    def answered(self, address: str, at: float) -> None:
        """`address` was seen answering at `at` (this tracker's clock): a response's last
        upstream byte, from its access-log record."""
        self._watching = True
        if at > self._answered_at.get(address, float("-inf")):
            self._answered_at[address] = at
        # How late records come (Envoy batches them: 0.1 s locally, 1 s on Envoy Gateway): a
        # slowly decaying maximum, so a pause between batches is not taken for silence.
        self._record_lag = max(self._clock() - at, self._record_lag * LAG_DECAY)

    def pick_failed(self, address: str, at: float) -> None:
        """A request routed to `address` failed there (a 5xx, or retried on a fallback)."""
        count, _ = self._failures.get(address, (0, at))
        self._failures[address] = (count + 1, at)
        self._failed_total[address] = self._failed_total.get(address, 0) + 1

    def pick_served(self, address: str) -> None:
        """A request routed to `address` was served there: it is not failing."""
        self._failures.pop(address, None)

    def failed_total(self, address: str) -> int:
        """Picks of `address` that failed since start (5xx, or retried elsewhere)."""
        return self._failed_total.get(address, 0)

    def pod_stats(self, address: str) -> PodStats | None:
        """What this process measured of `address` (None without a stats tracker)."""
        return None if self._stats is None else self._stats.stats(address, self._clock())

    def failing_addresses(self) -> frozenset[str]:
        """Addresses whose last `FAILING_AFTER` picks failed, the last one within
        `FAILING_COOLDOWN_S` (after it a pod gets a request again: a probe). O(1) while no
        pick has failed."""
        if not self._failures:
            return frozenset()
        now = self._clock()
        return frozenset(
            a
            for a, (count, at) in self._failures.items()
            if count >= FAILING_AFTER and now - at < FAILING_COOLDOWN_S
        )

    def _unwait(self, addr: str, lease: Lease) -> None:
        self._open.pop(lease, None)
        waiting = self._waiting.get(addr)
        if waiting is not None:
            waiting.pop(lease, None)
            if not waiting:
                del self._waiting[addr]

    def stalled_addresses(self, after_s: float) -> frozenset[str]:
        """Every address `stalled(address, after_s)` is true for. The progress rule: O(hung)
        while no held pod's time to be looked at again has come (each busy pod is looked at
        about once per `hang_after_s`, not once per call). The answer rule: O(1) while no
        watched request is older than `after_s` (one look at the oldest); otherwise one pass
        over the addresses holding watched requests, not over the pool."""
        now = self._clock()
        found = set(self._hung_now(now))
        if (
            self._watching
            and after_s > 0
            and self._open
            and now - next(iter(self._open)).started_at > after_s
        ):
            found.update(a for a in self._waiting if self.stalled(a, after_s))
        return frozenset(found)

    def stalled(self, address: str, after_s: float) -> bool:
        """True when `address` accepts work and completes none: hung, not just busy. Two
        rules, either suffices:

        - its engine shows no progress (`hang_after_s`): it has held requests (this replica's
          or a peer's, watched or not) for longer than that, and neither its scrapes (token counters, running and waiting, KV usage) nor an
          answer have shown it doing anything for as long. A request the engine never got
          (a hung server in front of it) or an engine that stopped moves none of them; a busy
          engine moves them at every scrape (every `poll_interval_s` while busy).
        - no answers (`after_s`, for engines whose scrapes say nothing): it holds a request for
          `after_s` and has answered nothing for as long. Where answers take long (the pod's
          mean response time, else the pool's longest), the limit is at least
          `STALL_LATENCY_MULTIPLE` times that: a pod streaming 12-s answers that all began
          together has completed nothing for 12 s, and is busy, not hung. False until answers
          are seen at all."""
        now = self._clock()
        if self._no_progress(address, now):
            return True
        waiting = self._waiting.get(address)
        if not waiting:
            return False
        oldest = next(iter(waiting)).started_at
        if not self._watching or after_s <= 0 or now - oldest <= after_s:
            return False
        latency = self._stats.latency_of(address) if self._stats is not None else None
        limit = after_s if latency is None else max(after_s, STALL_LATENCY_MULTIPLE * latency)
        last = self._answered_at.get(address)
        return now - oldest > limit and (last is None or now - last > limit)

    def _no_progress(self, address: str, now: float) -> bool:
        due = self._hang_due(address)
        return due is not None and now > due

    def _hang_due(self, address: str) -> float | None:
        """The time after which the progress rule calls `address` hung if nothing moves
        before: `hang_after_s` past both when it began holding requests and its last progress
        (None: it holds none, the rule is off, or its engine's scrapes cannot tell). Progress
        only moves forward, so this time only moves later."""
        hang = self.hang_after_s
        since = self._held_since.get(address)
        if hang <= 0 or since is None or self._progress is None:
            return None
        seen = self._progress(address)
        if seen is None:
            return None
        answered = self._answered_at.get(address)
        if answered is not None and answered > seen:
            seen = answered
        return max(since, seen) + hang

    def _hung_now(self, now: float) -> set[str]:
        """Every address `_no_progress` is true for: the hung ones looked at again, and the
        queued ones whose time has come (an address that moved meanwhile goes back in the
        queue at its new time). O(hung) while no queued time has come."""
        if self._progress is None or self.hang_after_s <= 0:
            return set()
        if self.hang_after_s != self._due_hang:  # a reload changed the limit: every time did
            self._due_hang = self.hang_after_s
            self._due = [(since, a) for a, since in self._held_since.items()]
            heapify(self._due)
            self._queued = set(self._held_since)
            self._hung.clear()
        for address in [a for a in self._hung if not self._no_progress(a, now)]:
            self._hung.discard(address)
            self._queue(address, now)
        due = self._due
        while due and due[0][0] < now:
            address = heappop(due)[1]
            self._queued.discard(address)
            self._queue(address, now)
        return self._hung

    def _queue(self, address: str, now: float) -> None:
        """Queue a held `address` at its `_hang_due`, or count it hung if that has passed."""
        if address not in self._held_since or address in self._queued:
            return
        due = self._hang_due(address)
        if due is not None and now > due:
            self._hung.add(address)
            return
        # Not yet (or its engine cannot tell now: look again a limit later).
        heappush(self._due, (now + self.hang_after_s if due is None else due, address))
        self._queued.add(address)

    def _quiet_for(self, address: str, now: float) -> float | None:
        """Seconds since `address` last showed progress (a scrape that moved, an answer);
        None when its engine's scrapes cannot tell."""
        if self._progress is None:
            return None
        seen = self._progress(address)
        if seen is None:
            return None
        answered = self._answered_at.get(address)
        return now - (seen if answered is None or answered < seen else answered)

    def _release(self, lease: Lease) -> None:
        addr = lease.endpoint.address
        self._unwait(addr, lease)
        count = self._requests.get(addr, 0) - 1
        if count <= 0:
            self._requests.pop(addr, None)
            self._tokens.pop(addr, None)
            count = 0
        else:
            self._requests[addr] = count
            self._tokens[addr] = max(0, self._tokens.get(addr, 0) - lease.tokens)
        self._sync(addr)
        if self._metrics is not None:
            self._metrics.set_in_flight(addr, count)
        if self._stats is not None:
            self._stats.request_ended(addr, self._clock())

    def load(self, address: str) -> Load:
        """This replica's requests in flight on `address` plus every live peer's share."""
        remote = self._remote_total.get(address)
        if remote is None:
            return Load(self._requests.get(address, 0), self._tokens.get(address, 0))
        return Load(
            self._requests.get(address, 0) + remote.requests,
            self._tokens.get(address, 0) + remote.tokens,
        )

    def columns(
        self, addresses: Sequence[str]
    ) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
        """`load` of every address as two arrays (requests, tokens): the director's snapshot
        over many pods reads these instead of one `Load` per pod."""
        return self._loads.columns(addresses)

    def recent_tokens(self, address: str, within_s: float) -> int:
        """Of `load(address).tokens`, those routed there in the last `within_s` seconds (by
        any replica: a peer's as its published count grew). With `within_s` a pod's time to
        first token, these are the requests still expected to be before their first token:
        queued or in prefill, where a new request waits behind them. A request that finished
        early still counts until its window passes; never more than the load."""
        arrivals = self._arrivals.get(address)
        if not arrivals or not within_s > 0:
            return 0
        now = self._clock()
        within_s = self._window(address, within_s, now)
        return min(arrivals.since(now - within_s), self.load(address).tokens)

    def _window(self, address: str, within_s: float, now: float) -> float:
        """`within_s`, or longer for a pod that has shown no progress for a while: every
        request routed there since its last progress (nothing shows that any of them got past
        its first token: they are not counted as cheap decodes). A while is `quiet_after_s`
        (two scrapes of a busy pod), or sooner where answers are seen here: three times the
        pod's mean response time, but never less than twice how late records come."""
        quiet = self._quiet_for(address, now)
        if quiet is None or quiet <= within_s:
            return within_s
        limit = self.quiet_after_s
        if self._watching and self._stats is not None:
            latency = self._stats.latency_of(address)
            if latency is not None:
                floor = max(QUIET_FLOOR_S, 2 * self._record_lag)
                limit = min(limit, max(floor, STALL_LATENCY_MULTIPLE * latency))
        return quiet if quiet > limit else within_s

    def recent_columns(
        self, addresses: Sequence[str], within_s: Sequence[float] | npt.NDArray[np.float64]
    ) -> npt.NDArray[np.float64]:
        """`recent_tokens` of every address with its own window (NaN where the window is
        NaN: not measured), as one array. One pass over the addresses holding arrivals (those
        with load), in plain floats; the cap at the load is one array minimum."""
        within = np.asarray(within_s, dtype=np.float64)  # no copy for an array
        measured = within == within  # NaN != NaN: not measured
        if not self._arrivals:
            return np.where(measured, 0.0, np.nan)
        last = self._index
        if last is None or last[0] != addresses:
            last = self._index = (list(addresses), {a: i for i, a in enumerate(addresses)})
        index = last[1]
        windows = within.tolist()
        recent = [0.0] * len(windows)
        now = self._clock()
        for address, arrivals in self._arrivals.items():
            i = index.get(address)
            if i is None or not windows[i] > 0:  # not a candidate, not measured, or no window
                continue
            recent[i] = arrivals.since(now - self._window(address, windows[i], now))
        out = np.minimum(np.array(recent), self._loads.columns(addresses)[1])
        return np.where(measured, out, np.nan)

    def _arrived(self, address: str, at: float, tokens: int) -> None:
        if tokens <= 0:
            return
        arrivals = self._arrivals.get(address)
        if arrivals is None:
            arrivals = self._arrivals[address] = _Arrivals()
        arrivals.add(at, tokens)

    def _sync(self, address: str) -> None:
        """Set `address`'s row of the load table to its `load` now (and forget its arrivals
        once it holds none: nothing routed there is still waiting)."""
        remote = self._remote_total.get(address, _NO_LOAD)
        requests = self._requests.get(address, 0) + remote.requests
        tokens = self._tokens.get(address, 0) + remote.tokens
        self._loads.set(address, requests, tokens)
        if requests <= 0:
            if self._held_since.pop(address, None) is not None:
                self._hung.discard(address)  # its queued time, if any, is dropped when it comes
        elif address not in self._held_since:
            now = self._held_since[address] = self._clock()
            if self._progress is not None and self.hang_after_s > 0:
                self._queue(address, now)
        if requests <= 0 and tokens <= 0:
            self._arrivals.pop(address, None)

    def snapshot(self) -> Mapping[str, Load]:
        """This replica's own requests in flight, by address (a copy)."""
        return {a: Load(n, self._tokens.get(a, 0)) for a, n in self._requests.items()}

    def set_remote(self, replica: str, loads: Mapping[str, Load]) -> None:
        """Replace peer `replica`'s share with its latest absolute counts (a lost update is
        corrected by the next; an empty mapping clears it). Tokens a count grew by are
        arrivals now (`recent_tokens`)."""
        old = self._remote.pop(replica, None) or {}
        if loads:
            self._remote[replica] = dict(loads)
        now = self._clock()
        for address in old.keys() | loads.keys():
            was, new = old.get(address, _NO_LOAD), loads.get(address, _NO_LOAD)
            if was == new:
                continue
            cur = self._remote_total.get(address, _NO_LOAD)
            total = Load(
                cur.requests - was.requests + new.requests, cur.tokens - was.tokens + new.tokens
            )
            if total.requests <= 0 and total.tokens <= 0:
                self._remote_total.pop(address, None)
            else:
                self._remote_total[address] = total
            self._arrived(address, now, new.tokens - was.tokens)
            self._sync(address)

    def drop_remote(self, replica: str) -> None:
        """A peer left or went silent: its share no longer counts."""
        self.set_remote(replica, {})

    def remote_replicas(self) -> list[str]:
        return list(self._remote)

    def remote_snapshot(self) -> Mapping[str, Load]:
        """Peers' requests in flight, summed, by address (a copy)."""
        return dict(self._remote_total)

    def total(self) -> int:
        return sum(self._requests.values())
