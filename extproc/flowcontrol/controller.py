"""The flow controller: a queue in front of routing for when demand exceeds the pool.

    admit(request)  -> Grant          the director's one flow-control step; may wait, may raise
    Grant.release()                   the request's claim is made (or it failed): its slot is
                                      counted by the in-flight view from now on

Below saturation `admit` returns at once (no await, no task switch): the pool has free slots
(`capacity.PoolCapacity`) and nothing of this band or higher is waiting on any replica. Above
it the request waits here, holding its ext_proc answer, and is dispatched when a pod has room;
the director then routes it from the state of that moment among the pods that had room (late
binding: its pod is chosen at dispatch, not at arrival). The highest band waiting, if above
the default priority, may also take a place next in line in a full engine (`Capacity.line`).
Between priority bands the order is strict; inside a band the fairness policy picks the flow
and the ordering policy the request (`policies.py`). Every request ends one way, counted in
`extproc_flow_control_outcomes_total`:

    dispatched      admitted at once, or after a wait
    rejected-saturated     its band is full (requests or bytes), or it is sheddable
                           (priority < 0) while the pool is saturated: 429 at once
    rejected-slo-unmet     it sent a TTFT SLO that no pod can meet: its predicted TTFT (the
                           wait for the requests dispatched before it, at the rate slots have
                           been freeing, plus the best pod's predicted TTFT once it has room)
                           is over the SLO at arrival, or becomes so while it waits: 429 then,
                           rather than a late answer (`deadlines`)
    rejected-ttl-expired   waited its TTL while the pool had pods: 429 + Retry-After
    rejected-no-endpoints  waited its TTL while the model had no ready pod: 503
    cancelled       the client went away while it waited (Envoy reset the stream)
    handed-off      the process is stopping: every waiting request is dispatched at once
                    (over capacity: the engines queue it) rather than cut

Bounds: what a client names (a fairness id of up to 128 characters, a priority clamped to
+-10) is kept only while one of its requests waits. A flow, band or model with nothing left
waiting is forgotten when its last request leaves, however it leaves; the heap entries of
requests that left before their turn are dropped lazily and rebuilt away once they outnumber
the waiting ones. So memory is O(requests waiting) (each band capped by
`max_requests_per_band`; `footprint()`; tests/flowcontrol/test_flood.py), and a dispatch's work
is O(log flows waiting in its band) amortized: the fairness policy's index per band is told
when a flow's head changes and keeps the flows in its order (`policies.FlowHeap`).

Replicas: every replica publishes its depths per (model, band) on the replica bus
(`depths()`, applied with `set_remote`). A replica dispatches a band only after every higher
band, its peers' included, has had its share of the free slots; a band's slots are split
between replicas in proportion to their depths there. The free slots themselves come from the
shared in-flight view. What is approximate: a peer's depths and in-flight are one sync tick old
(~10 ms), so replicas dispatching in the same tick fill the same room: together they send at
most the room plus one per other replica in a pass (each rounds its share up;
tests/flowcontrol/test_replica_overlap.py), the excess waiting in engine queues until a slot
frees (docs/benchmarks.md §4 measures the engines' queues with 2 and 3 processes), and a higher
band that arrives on a peer during that tick can be passed by one dispatch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import heapq
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from extproc.config import FlowControlConfig
from extproc.flowcontrol.capacity import Capacity
from extproc.flowcontrol.policies import (
    FairnessIndex,
    FairnessPolicy,
    Flow,
    FlowHeap,
    OrderingPolicy,
    PolicyRegistry,
    Queued,
    builtin_policies,
)
from extproc.types import GatewayError

__all__ = [
    "DROPPED_HEADER",
    "FlowController",
    "FlowMetrics",
    "FlowOutcome",
    "FlowRejected",
    "FlowRequest",
    "Grant",
]

log = logging.getLogger("extproc.flowcontrol")

DROPPED_HEADER = "x-llm-d-request-dropped-reason"  # llm-d's name, so its clients understand it
TICK_S = 0.02  # how often a non-empty queue looks for room, besides wake-ups
RATE_SAMPLES = 32  # the rate requests leave the queue at: over this many of the last
# How old the pool's room may be for a request admitted at once, and how soon after one
# dispatch the loop runs again (the app's; 0 in tests): reading the room is a pass over the
# model's pods (about 1 us each), not to be paid by every request of a large pool.
ROOM_CACHE_S = 0.005
WAIT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class FlowOutcome(enum.StrEnum):
    DISPATCHED = "dispatched"
    SATURATED = "rejected-saturated"
    SLO_UNMET = "rejected-slo-unmet"
    TTL_EXPIRED = "rejected-ttl-expired"
    NO_ENDPOINTS = "rejected-no-endpoints"
    CANCELLED = "cancelled"
    HANDED_OFF = "handed-off"


class FlowRejected(GatewayError):
    """A request flow control answers itself: 429 (with Retry-After) or 503, and the reason
    in `x-llm-d-request-dropped-reason`."""

    def __init__(self, outcome: FlowOutcome, message: str, *, retry_after_s: int) -> None:
        super().__init__(message, code=str(outcome))
        self.outcome = outcome
        if outcome is FlowOutcome.NO_ENDPOINTS:
            self.status, self.error_type = 503, "service_unavailable"
        else:
            self.status, self.error_type = 429, "rate_limit_error"
        self.headers = {DROPPED_HEADER: str(outcome), "retry-after": str(retry_after_s)}


@dataclass(frozen=True, slots=True)
class FlowRequest:
    model: str
    priority: int
    flow: str  # fairness id (or user); "" for none
    size: int  # body bytes
    ttl_s: float | None = None  # None: the settings' TTL
    slo_ttft_s: float | None = None  # its deadline (429 when unmet), and its order under `edf`
    prompt_tokens: int = 0  # for the predicted TTFT once dispatched


class Grant:
    """A dispatched request's slot, counted by the controller until the request's own claim is
    made (then the in-flight view counts it). `release()` is idempotent. `pods` are the pods
    that had room when it was dispatched (empty: no restriction, e.g. handed off): the request
    is routed among them."""

    __slots__ = ("_controller", "_model", "pods", "waited_s")

    def __init__(
        self, controller: FlowController, model: str, waited_s: float, pods: tuple[str, ...] = ()
    ) -> None:
        self._controller: FlowController | None = controller
        self._model = model
        self.waited_s = waited_s
        self.pods = pods

    def release(self) -> None:
        controller, self._controller = self._controller, None
        if controller is not None:
            controller._released(self._model)


@dataclass(eq=False, slots=True)
class _Waiting:
    item: Queued
    request: FlowRequest
    future: asyncio.Future[Grant]
    done: bool = False
    slo_by: float = math.inf  # monotonic: dispatched after this, it misses its SLO


@dataclass(eq=False)
class _Band:
    index: FairnessIndex  # its flows in the fairness policy's order
    flows: dict[str, Flow] = field(default_factory=dict)
    live: int = 0
    bytes: int = 0


_NO_BAND = _Band(FlowHeap(Flow.head_key))  # read only: a band nothing waits in
_NO_BANDS: dict[int, _Band] = {}  # read only


class FlowMetrics:
    def __init__(self, registry: CollectorRegistry, *, namespace: str = "extproc") -> None:
        p = f"{namespace}_flow_control"
        self.queue_size = Gauge(
            f"{p}_queue_size", "Requests waiting in flow control on this replica.",
            ["model", "priority"], registry=registry,
        )  # fmt: skip
        self.queue_bytes = Gauge(
            f"{p}_queue_bytes", "Request bytes waiting in flow control on this replica.",
            ["model", "priority"], registry=registry,
        )  # fmt: skip
        self.wait = Histogram(
            f"{p}_request_queue_duration_seconds",
            "Time from arrival to dispatch or rejection in flow control.",
            ["model", "priority", "outcome"], buckets=WAIT_BUCKETS, registry=registry,
        )  # fmt: skip
        self.outcomes = Counter(
            f"{p}_outcomes", "How requests left flow control.",
            ["model", "priority", "outcome"], registry=registry,
        )  # fmt: skip
        self.saturation = Gauge(
            f"{p}_pool_saturation",
            "Mean over ready pods of max(waiting/queue threshold, KV usage/KV threshold); "
            "1.0 with no ready pod (the set point flow control gates on).",
            ["model"], registry=registry,
        )  # fmt: skip
        self.demand = Gauge(
            f"{p}_demand_tokens",
            "Tokens waiting in flow control (all replicas' queues as last heard, this "
            "replica's prompt estimates) plus tokens in flight on the model's pods.",
            ["model"], registry=registry,
        )  # fmt: skip


class FlowController:
    """One per process; see the module docstring."""

    def __init__(
        self,
        *,
        settings: FlowControlConfig,
        capacity: Callable[[str], Capacity],
        tokens: Callable[[str], float] = lambda _flow: 0.0,
        policies: PolicyRegistry | None = None,
        ttft: Callable[[FlowRequest], float | None] | None = None,
        metrics: FlowMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
        tick_s: float = TICK_S,
        room_cache_s: float = 0.0,
    ) -> None:
        self.settings = settings
        self._tick_s = tick_s
        self._room_cache_s = room_cache_s
        # model -> (when read, the capacity then, its room then net of grants in transit) and
        # the grants made since: a request admitted at once reads the room at most this old.
        self._room: dict[str, tuple[float, Capacity, int]] = {}
        self._granted: dict[str, int] = {}
        self.capacity = capacity
        policies = policies or builtin_policies(tokens=tokens)
        params = settings.policy_params
        self._ordering: OrderingPolicy = policies.create(
            "ordering", settings.ordering, params.get(settings.ordering),
            where="flow_control.ordering",
            params_where=f"flow_control.policy_params.{settings.ordering}",
        )  # fmt: skip
        self._fairness: FairnessPolicy = policies.create(
            "fairness", settings.fairness, params.get(settings.fairness),
            where="flow_control.fairness",
            params_where=f"flow_control.policy_params.{settings.fairness}",
        )  # fmt: skip
        self.metrics = metrics
        self._clock = clock
        # The TTFT a request would see once dispatched into room (the best pod's prediction);
        # None: unknown (cold models), counted as 0.
        self._ttft = ttft
        # model -> when the last requests left the queue: the rate slots free up at
        self._left: dict[str, deque[float]] = {}
        self._bands: dict[str, dict[int, _Band]] = {}  # model -> priority -> band
        self._waiting: dict[Queued, _Waiting] = {}
        self._expiry: list[tuple[float, int, Queued]] = []  # a heap; done entries skipped
        self._transit: dict[str, int] = {}  # model -> grants not yet released
        self._remote: dict[str, dict[str, dict[int, tuple[int, int]]]] = {}  # replica->model->band
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False

    # -- the director's step -----------------------------------------------------------------

    async def admit(self, request: FlowRequest) -> Grant:
        model, priority = request.model, request.priority
        if self._stopping:
            return self._grant(model, 0.0, FlowOutcome.HANDED_OFF, priority)
        band = self._bands.get(model, _NO_BANDS).get(priority, _NO_BAND)
        s = self.settings
        if band.live >= s.max_requests_per_band or band.bytes + request.size > s.max_bytes_per_band:
            raise self._reject(request, FlowOutcome.SATURATED, 0.0,
                               f"the flow-control queue for priority {priority} is full")  # fmt: skip
        engine = self._engine_ttft(request)
        if not self._waiting_at_or_above(model, priority):
            cap, room = self._room_now(model)
            parts = [part for part in self.parts(cap, room, priority) if part[0] > 0]
            if priority > 0 and room + len(cap.line) > 0:
                parts.append((len(cap.line), cap.line))  # next in line in a full engine
            if parts:
                self._check_slo(request, engine, 0.0)
                return self._grant(model, 0.0, FlowOutcome.DISPATCHED, priority, parts[0][1])
            if priority < 0 and cap.endpoints > 0:
                raise self._reject(request, FlowOutcome.SATURATED, 0.0,
                                   "every endpoint is saturated; sheddable request dropped")  # fmt: skip
        elif priority < 0:
            raise self._reject(request, FlowOutcome.SATURATED, 0.0,
                               "requests are queued; sheddable request dropped")  # fmt: skip
        self._check_slo(request, engine, self._expected_wait(request, band))
        return await self._wait(request, engine)

    def parts(
        self, cap: Capacity, room: int, priority: int
    ) -> tuple[tuple[int, tuple[str, ...]], ...]:
        """Where a band may go now, out of `room` (the pool's room net of grants in transit,
        taken from its free running slots first): how many among which pods, best first.
        Without `reserved_slots`, any room. With it, a band above the default priority takes free
        running slots first, then any room; the default band and below take the free running
        slots beyond `reserved_slots`, then places in the queues of engines whose slots are all
        taken (a request waiting there starts when one ends, as it would have from the
        gateway, and leaves the free slots alone). At most half the pool's learned slots are
        kept (none before any is learned): the default band always has the other half, an
        idle pool included."""
        keep = min(self.settings.reserved_slots, cap.slots // 2)
        if keep <= 0 or room <= 0:
            return ((room, cap.pods),)
        running = max(0, min(room, cap.running - (cap.free - room)))
        if priority > 0:
            return ((running, cap.running_pods), (room - running, cap.pods))
        spare = max(0, running - keep)
        return ((spare, cap.running_pods), (min(room - running, cap.queued), cap.queued_pods))

    def _room_now(self, model: str) -> tuple[Capacity, int]:
        """The pool's capacity and room (free slots net of grants in transit): the last read,
        less the grants made since, while it is fresh and shows room; else read anew."""
        now = self._clock()
        cached = self._room.get(model)
        if cached is not None and now - cached[0] < self._room_cache_s:
            room = cached[2] - self._granted.get(model, 0)
            if room > 0:
                return cached[1], room
        return self._read_room(model, now)

    def _read_room(self, model: str, now: float) -> tuple[Capacity, int]:
        cap = self.capacity(model)
        room = cap.free - self._transit.get(model, 0)
        self._room[model] = (now, cap, room)
        self._granted[model] = 0
        return cap, room

    # -- deadlines ----------------------------------------------------------------------------

    def _engine_ttft(self, request: FlowRequest) -> float:
        if request.slo_ttft_s is None or self._ttft is None:
            return 0.0
        return self._ttft(request) or 0.0

    def _check_slo(self, request: FlowRequest, engine: float, wait: float) -> None:
        """429 now when the request's predicted TTFT is over its SLO."""
        slo = request.slo_ttft_s
        if slo is not None and wait + engine > slo:
            raise self._reject(
                request, FlowOutcome.SLO_UNMET, 0.0,
                f"no endpoint can meet the TTFT SLO of {slo * 1000:.0f} ms: predicted "
                f"{(wait + engine) * 1000:.0f} ms ({wait * 1000:.0f} ms waiting for room, "
                f"{engine * 1000:.0f} ms on the best endpoint)",
            )  # fmt: skip

    def _expected_wait(self, request: FlowRequest, band: _Band) -> float:
        """How long a request arriving now waits for room: the requests dispatched before it
        (higher bands', then its own band's as the fairness policy orders them, on every
        replica) at the rate requests have been leaving the queue. 0 while that rate is not
        known (too few dispatches yet): no request is refused on a guess."""
        if request.slo_ttft_s is None:
            return 0.0
        times = self._left.get(request.model)
        if times is None or len(times) < RATE_SAMPLES // 2 or times[-1] <= times[0]:
            return 0.0
        rate = (len(times) - 1) / (times[-1] - times[0])
        model, priority = request.model, request.priority
        ahead = sum(b.live for p, b in self._bands.get(model, {}).items() if p > priority)
        flows = list(band.flows.values())
        mine = self._fairness.ahead(flows, request.flow) if flows else 0
        ahead += mine
        for peer in self._remote.values():
            for p, v in peer.get(model, {}).items():
                if p > priority:
                    ahead += v[0]
                elif p == priority:  # a peer's band: the same share of it goes first
                    ahead += round(v[0] * mine / band.live) if band.live else v[0]
        return (ahead + 1) / rate

    def fairness_changed(self, flow: str) -> None:
        """What the fairness policy reads of `flow` may have shrunk (the VTC counters forgot
        it): every band where it waits reads it again. (What only grows needs no call.)"""
        for bands in self._bands.values():
            for band in bands.values():
                waiting = band.flows.get(flow)
                if waiting is not None:
                    band.index.update(waiting)

    def wake(self) -> None:
        """Something freed room (a lease ended, a pod appeared): look again now."""
        if self._waiting:
            self._wake.set()

    # -- replicas ----------------------------------------------------------------------------

    def depths(self) -> dict[str, dict[int, tuple[int, int]]]:
        """This replica's waiting requests and their bytes per model and band (what the
        replica bus carries)."""
        return {
            model: {p: (b.live, b.bytes) for p, b in bands.items() if b.live}
            for model, bands in self._bands.items()
            if any(b.live for b in bands.values())
        }

    def set_remote(self, replica: str, depths: Mapping[str, Mapping[int, Sequence[int]]]) -> None:
        """A peer's `depths()` (an empty mapping once its queue is empty or it is gone)."""
        clean: dict[str, dict[int, tuple[int, int]]] = {}
        for model, bands in depths.items():
            rows = {int(p): (int(v[0]), int(v[1])) for p, v in bands.items() if int(v[0]) > 0}
            if rows:
                clean[str(model)] = rows
        if clean:
            self._remote[replica] = clean
        else:
            self._remote.pop(replica, None)
        self.wake()

    def drop_remote(self, replica: str) -> None:
        self._remote.pop(replica, None)
        self.wake()

    def queued_bytes(self, model: str) -> int:
        """Bytes waiting for `model` here and on the peers as last heard (demand)."""
        local = sum(b.bytes for b in self._bands.get(model, {}).values())
        remote = sum(v[1] for peer in self._remote.values() for v in peer.get(model, {}).values())
        return local + remote

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def footprint(self) -> dict[str, int]:
        """What the registry holds, for tests and /debug: every count is bounded by the
        requests waiting (`queued`), never by how many flows or requests came before."""
        bands = [b for by in self._bands.values() for b in by.values()]
        flows = [f for b in bands for f in b.flows.values()]
        return {
            "waiting": len(self._waiting),
            "models": len(self._bands),
            "bands": len(bands),
            "flows": len(flows),
            "flow_entries": sum(len(f.heap) for f in flows),
            "expiry_entries": len(self._expiry),
        }

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="flow-control")

    async def stop(self) -> None:
        """Dispatch everything still waiting (the engines queue it) and stop the loop: a
        stopping process cuts no request it holds."""
        self._stopping = True
        for waiting in list(self._waiting.values()):
            self._finish(waiting, FlowOutcome.HANDED_OFF)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    # -- internals -------------------------------------------------------------------------

    def _band(self, model: str, priority: int) -> _Band:
        bands = self._bands.setdefault(model, {})
        band = bands.get(priority)
        if band is None:
            band = bands[priority] = _Band(self._fairness.index())
        return band

    def _waiting_at_or_above(self, model: str, priority: int) -> bool:
        for p, band in self._bands.get(model, {}).items():
            if p >= priority and band.live:
                return True
        for peer in self._remote.values():
            for p, v in peer.get(model, {}).items():
                if p >= priority and v[0]:
                    return True
        return False

    def _grant(
        self,
        model: str,
        waited: float,
        outcome: FlowOutcome,
        priority: int,
        pods: tuple[str, ...] = (),
    ) -> Grant:
        self._transit[model] = self._transit.get(model, 0) + 1
        self._granted[model] = self._granted.get(model, 0) + 1
        self._observe(model, priority, outcome, waited)
        return Grant(self, model, waited, pods)

    def _released(self, model: str) -> None:
        n = self._transit.get(model, 0) - 1
        if n > 0:
            self._transit[model] = n
        else:
            self._transit.pop(model, None)

    def _observe(self, model: str, priority: int, outcome: FlowOutcome, waited: float) -> None:
        if self.metrics is not None:
            labels = (model, str(priority), str(outcome))
            self.metrics.outcomes.labels(*labels).inc()
            self.metrics.wait.labels(*labels).observe(waited)

    def _reject(
        self, request: FlowRequest, outcome: FlowOutcome, waited: float, message: str
    ) -> FlowRejected:
        self._observe(request.model, request.priority, outcome, waited)
        return FlowRejected(outcome, message, retry_after_s=self.settings.retry_after_s)

    async def _wait(self, request: FlowRequest, engine: float) -> Grant:
        band = self._band(request.model, request.priority)
        now = self._clock()
        ttl = request.ttl_s if request.ttl_s is not None else self.settings.ttl_s
        expires = now + ttl
        deadline = None if request.slo_ttft_s is None else now + request.slo_ttft_s
        item = Queued(flow=request.flow, enqueued=now, expires=expires,
                      deadline=deadline, size=request.size, seq=next(self._seq))  # fmt: skip
        future: asyncio.Future[Grant] = asyncio.get_running_loop().create_future()
        waiting = _Waiting(item=item, request=request, future=future)
        if deadline is not None:
            waiting.slo_by = deadline - engine
        flow = band.flows.get(request.flow)
        if flow is None:
            flow = band.flows[request.flow] = Flow(request.flow)
        head = flow.head() if len(flow) else None
        flow.push(item, self._ordering)
        if flow.head() is not head:  # new to the band, or it goes first in its flow
            band.index.update(flow)
        band.live += 1
        band.bytes += request.size
        self._waiting[item] = waiting
        heapq.heappush(self._expiry, (min(expires, waiting.slo_by), item.seq, item))
        self._gauge(request.model, request.priority, band)
        self._wake.set()
        try:
            return await future
        except asyncio.CancelledError:
            if not waiting.done:  # the client went away while waiting
                self._finish(waiting, FlowOutcome.CANCELLED)
            elif future.done() and not future.cancelled() and future.exception() is None:
                future.result().release()  # dispatched in the same instant: give it back
            raise

    def _finish(
        self,
        waiting: _Waiting,
        outcome: FlowOutcome,
        error: Exception | None = None,
        pods: tuple[str, ...] = (),
        *,
        popped: bool = False,
    ) -> None:
        """Take one request out of its flow (unless `popped` from it already) and its band, and
        end its wait (grant, error or nothing). A flow, band or model left with nothing waiting
        is forgotten at once: what clients name (fairness ids) never outlives their requests."""
        if waiting.done:
            return
        waiting.done = True
        item, request = waiting.item, waiting.request
        self._waiting.pop(item, None)
        if not self._waiting:
            self._expiry.clear()  # every entry left is of an ended request
        elif len(self._expiry) > 2 * len(self._waiting) + 64:  # mostly ended ones: rebuild
            self._expiry = [e for e in self._expiry if e[2] in self._waiting]
            heapq.heapify(self._expiry)
        model, priority = request.model, request.priority
        bands = self._bands[model]
        band = bands[priority]
        band.live -= 1
        band.bytes -= request.size
        flow = band.flows.get(item.flow)
        if flow is not None:
            head = item if popped else flow.head()
            if not popped:
                flow.remove(item)
            if not len(flow):
                del band.flows[item.flow]
                band.index.remove(flow)
            elif flow.head() is not head:
                band.index.update(flow)
        if not band.live:
            del bands[priority]
            if not bands:
                del self._bands[model]
        self._gauge(model, priority, band)
        waited = self._clock() - item.enqueued
        if outcome is FlowOutcome.CANCELLED:  # its future is cancelled already
            self._observe(request.model, request.priority, outcome, waited)
            return
        if waiting.future.done():
            return
        if outcome in (FlowOutcome.DISPATCHED, FlowOutcome.HANDED_OFF):
            waiting.future.set_result(
                self._grant(request.model, waited, outcome, request.priority, pods)
            )
        else:
            assert error is not None
            waiting.future.set_exception(error)

    def _gauge(self, model: str, priority: int, band: _Band) -> None:
        if self.metrics is not None:
            self.metrics.queue_size.labels(model, str(priority)).set(band.live)
            self.metrics.queue_bytes.labels(model, str(priority)).set(band.bytes)

    async def _run(self) -> None:
        while True:
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self._tick_s)
                self._wake.clear()
                if self._waiting:
                    self.dispatch()
                    if self._room_cache_s > 0:  # wake-ups in a burst: one pass for them all
                        await asyncio.sleep(self._room_cache_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must never die: log and go on
                log.exception("flow control dispatch failed")
                await asyncio.sleep(self._tick_s)

    def dispatch(self) -> int:
        """Expire what waited too long, then dispatch into the room each pool has. Returns how
        many were dispatched (the loop calls it; tests call it directly)."""
        now = self._clock()
        self._expire(now)
        sent = 0
        for model, bands in list(self._bands.items()):  # (a band that empties is forgotten)
            cap, room = self._read_room(model, now)
            if room <= 0 and not cap.line:
                continue
            remote: dict[int, int] = {}
            for peer in self._remote.values():
                for p, v in peer.get(model, {}).items():
                    remote[p] = remote.get(p, 0) + v[0]
            top = True
            for priority in sorted({*bands, *remote}, reverse=True):
                band = bands.get(priority)
                mine = band.live if band is not None else 0
                theirs = remote.get(priority, 0)
                if mine + theirs == 0:
                    continue
                # The highest band waiting, above the default priority, may also take the
                # places next in line in full engines; every other band only free slots.
                line = len(cap.line) if top and priority > 0 else 0
                top = False
                # (room below 0: grants in transit beyond it, which take places in line too)
                parts = [*self.parts(cap, max(0, room), priority), (line + min(0, room), cap.line)]
                avail = sum(n for n, _ in parts)
                if avail <= 0:
                    break
                if mine + theirs <= avail:
                    take, used = mine, mine + theirs
                else:  # the band's share of what is left, in proportion to its depths
                    take, used = min(mine, math.ceil(avail * mine / (mine + theirs))), avail
                if band is not None:
                    left = take
                    for n, pods in parts:
                        if left > 0 and n > 0:
                            left -= self._dispatch_band(band, min(left, n), pods)
                    sent += take - left
                room -= min(used, max(0, room))
                if room <= 0:
                    break
        return sent

    def _dispatch_band(self, band: _Band, take: int, pods: tuple[str, ...]) -> int:
        """Dispatch up to `take` of the band's requests, the fairness policy picking the flow
        (every flow of a band has a request waiting at its head: `_finish` keeps it so)."""
        sent = 0
        while sent < take and band.live:
            flow = band.index.pick()
            waiting = self._waiting[flow.pop()]
            self._finish(waiting, FlowOutcome.DISPATCHED, pods=pods, popped=True)
            sent += 1
            left = self._left.get(waiting.request.model)
            if left is None:
                left = self._left[waiting.request.model] = deque(maxlen=RATE_SAMPLES)
            left.append(self._clock())
        return sent

    def _expire(self, now: float) -> None:
        ready_by_model: dict[str, bool] = {}  # one capacity read per model, not per request
        while self._expiry and self._expiry[0][0] <= now:
            _, _, item = heapq.heappop(self._expiry)
            waiting = self._waiting.get(item)
            if waiting is None or waiting.done:
                continue
            request = waiting.request
            waited = now - item.enqueued
            if waiting.slo_by < item.expires:
                outcome = FlowOutcome.SLO_UNMET
                assert request.slo_ttft_s is not None
                message = (
                    f"waited {waited:.1f}s in the flow-control queue: too long to meet the "
                    f"TTFT SLO of {request.slo_ttft_s * 1000:.0f} ms"
                )
            else:
                ready = ready_by_model.get(request.model)
                if ready is None:
                    ready = self.capacity(request.model).endpoints > 0
                    ready_by_model[request.model] = ready
                outcome = FlowOutcome.TTL_EXPIRED if ready else FlowOutcome.NO_ENDPOINTS
                message = (
                    f"waited {waited:.1f}s in the flow-control queue without room on a pod"
                    if ready
                    else f"no ready endpoint for model {request.model!r} within {waited:.1f}s"
                )
            self._observe(request.model, request.priority, outcome, waited)
            error = FlowRejected(outcome, message, retry_after_s=self.settings.retry_after_s)
            self._finish(waiting, outcome, error)
