"""Routed requests' leases, from the decision to the request's access-log record.

The routing stream ends once its answer is delivered: a restart of the server process cuts
no response it routed. What the decision claimed (an in-flight lease on the pick, the user's
active count) is a `Ticket` in the routing process's `LeaseBook` until the request ends, and
the request's end is its access-log record, on whatever process Envoy sends it:

- on the routing process itself, the record ends the ticket at once (`how="record"`);
- on another process, the record names the lease (`LeaseKey`: replica and number) and that
  process forwards it over the replica bus; the holder ends it when it hears (`"peer"`);
- a record that never comes (the access-log sink was down, Envoy restarted) must not leak:
  a ticket older than its bound ends (`"expired"`). The bound is derived from the pod's
  observed response times (`LEASE_LATENCY_MULTIPLE` times the longest seen there, else in the
  pool), within `accounting.lease_min_s` and `accounting.lease_max_s` (the bound while nothing
  has been observed);
- a ticket whose answer never reached Envoy (the stream broke during the decision) ends with
  its stream (`"undelivered"`); so does a held stream's, where no access log is configured
  (`"stream"`);
- a process that shuts down hands its open tickets to a live peer (`handoff_rows` / `adopt`),
  which ends them when their records arrive.

Every way a ticket ends is counted in `extproc_lease_ends_total{how}`; ending is idempotent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.gateway_metrics import GatewayMetrics
from extproc.accounting.inflight import InflightTracker, Lease
from extproc.director.api import LeaseKey
from extproc.types import Endpoint

__all__ = ["LEASE_LATENCY_MULTIPLE", "HandoffRow", "LeaseBook", "Ticket"]

# A lease outlives its pod's longest response seen by this factor before it is presumed lost.
LEASE_LATENCY_MULTIPLE = 3.0

# One open ticket as it travels to the peer that adopts it at shutdown:
# [replica, seq, model, endpoint address, endpoint model, tokens, age_s, user].
HandoffRow = list[Any]


class Ticket:
    """Implements `extproc.director.api.RequestTicket`: one routed request's claim, in the
    lease book of the process that holds it."""

    __slots__ = ("_book", "_ended", "_lease", "_model", "_user", "key")

    def __init__(
        self, book: LeaseBook, key: LeaseKey, lease: Lease, *, user: str | None, model: str
    ) -> None:
        self._book = book
        self.key = key
        self._lease = lease
        self._user = user
        self._model = model
        self._ended = False

    @property
    def closed(self) -> bool:
        return self._ended

    @property
    def address(self) -> str:
        return self._lease.endpoint.address

    @property
    def started_at(self) -> float:
        return self._lease.started_at

    def close(self) -> None:
        """The routing stream is done with it: the answer never reached Envoy, or the
        stream was held for the whole request (no access log)."""
        self.end("undelivered" if self._book.records else "stream")

    def end(self, how: str) -> None:
        if self._ended:
            return
        self._ended = True
        self._book._forget(self)
        self._lease.finish()
        if self._user:
            self._book.fairness.request_finished(self._user)
        m = self._book.metrics
        m.child(m.lease_ends, how).inc()
        m.child(m.routed_requests, self._model).inc()
        if self._book.on_end is not None:
            self._book.on_end()

    def handoff_row(self, now: float) -> HandoffRow:
        ep = self._lease.endpoint
        return [
            self.key.replica, self.key.seq, self._model, ep.address, ep.model,
            self._lease.tokens, max(0.0, now - self._lease.started_at), self._user or "",
        ]  # fmt: skip


class LeaseBook:
    """This process's open tickets, by key, until their request's record (or expiry) ends
    them. One per process: it outlives config reloads, as the in-flight tracker does."""

    def __init__(
        self,
        *,
        replica: str,
        inflight: InflightTracker,
        fairness: FairnessCounters,
        metrics: GatewayMetrics,
        bound: Callable[[str], float],
        min_s: float,
        records: bool = True,
        forward: Callable[[LeaseKey], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replica = replica
        self.inflight = inflight
        self.fairness = fairness
        self.metrics = metrics
        self._bound = bound  # address -> seconds a request there may take, at most
        self._min_s = min_s  # no bound is shorter: younger tickets are never looked at
        self.records = records  # access-log records end tickets (else held streams do)
        self.forward = forward  # tells the peers of a record for a lease held elsewhere
        # Told whenever a ticket ends (flow control: its room may let a waiting request go).
        self.on_end: Callable[[], None] | None = None
        self._clock = clock
        self._seq = 0
        self._open: dict[LeaseKey, Ticket] = {}  # in issue order: oldest first

    def __len__(self) -> int:
        return len(self._open)

    def __iter__(self) -> Iterator[Ticket]:
        return iter(list(self._open.values()))

    def issue(self, lease: Lease, *, user: str | None, model: str) -> Ticket:
        self._seq += 1
        key = LeaseKey(self.replica, self._seq)
        ticket = Ticket(self, key, lease, user=user, model=model)
        self._open[key] = ticket
        return ticket

    def _forget(self, ticket: Ticket) -> None:
        self._open.pop(ticket.key, None)

    # -- how tickets end ---------------------------------------------------------------------

    def settle(self, key: LeaseKey) -> None:
        """An access-log record named `key` (on this process): end it here if it is held
        here, else tell the peers (whoever holds it ends it)."""
        ticket = self._open.get(key)
        if ticket is not None:
            ticket.end("record")
        elif key.replica != self.replica and self.forward is not None:
            self.forward(key)

    def release(self, replica: str, seq: int) -> None:
        """A peer got the record of a lease: end it if it is held here (by number, or
        adopted from a replica that shut down)."""
        ticket = self._open.get(LeaseKey(replica, seq))
        if ticket is not None:
            ticket.end("peer")

    def expire(self) -> int:
        """End every ticket older than its bound (its record is presumed lost); the number
        ended. Looks only at tickets older than `min_s` (oldest first)."""
        now = self._clock()
        overdue = []
        for ticket in self._open.values():
            age = now - ticket.started_at
            if age < self._min_s:
                break
            if age > self._bound(ticket.address):
                overdue.append(ticket)
        for ticket in overdue:
            ticket.end("expired")
        return len(overdue)

    # -- shutdown: open tickets move to a live peer ------------------------------------------

    def handoff_rows(self) -> list[HandoffRow]:
        """Every open ticket as a row for a peer to adopt (`adopt`)."""
        now = self._clock()
        return [ticket.handoff_row(now) for ticket in self._open.values()]

    def end_all(self, how: str) -> None:
        """End every open ticket (`handed_off`: a peer holds them now)."""
        for ticket in list(self._open.values()):
            ticket.end(how)

    def adopt(self, rows: Iterable[HandoffRow]) -> int:
        """Hold a peer's tickets (it shut down) under their own keys until their records or
        expiry end them; the number adopted. Malformed rows are skipped."""
        now = self._clock()
        adopted = 0
        for row in rows:
            try:
                replica, seq, model, address, ep_model, tokens, age, user = row
                key = LeaseKey(str(replica), int(seq))
                endpoint = Endpoint(address=str(address), model=str(ep_model))
                tokens, age = int(tokens), float(age)
            except (TypeError, ValueError):
                continue
            if key in self._open:
                continue
            # Not watched by the stall detector, whose list is oldest first: the pod's own
            # requests routed here tell whether it answers.
            lease = self.inflight.start(
                endpoint, tokens, watched=False, started_at=now - max(0.0, age)
            )
            if user:
                self.fairness.request_started(str(user))
            self._open[key] = Ticket(self, key, lease, user=str(user) or None, model=str(model))
            adopted += 1
        return adopted
