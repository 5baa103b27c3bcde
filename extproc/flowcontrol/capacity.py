"""How much more a model's pool can take now, and where: the flow controller's view of room.

Two dispatch rules (`flow_control.dispatch`):

- `slots` (default): a pod takes a request when it has a free running slot, or a place in
  its engine's queue under `engine_queue` (1: the next request is already in the engine when a
  slot frees, instead of a round trip through the gateway later, which cost 7-18 % of the
  pool's throughput at 0), so the engines' waiting queues stay near empty and what waits,
  waits in the gateway, where priority and fairness apply. A pod's slots are learned from its scrapes: a scrape with requests waiting
  (and KV below the threshold) shows the engine full at its running count (two such scrapes
  in a row before a first or a lower limit is believed: a request caught between two engine
  steps waits a moment in any engine); a scrape with nothing waiting and more running than
  believed raises it. Room is slots minus the pod's
  load of the moment: the gateway's in-flight count (immediate for dispatches, every
  replica's leases) less the ends it has not heard of yet (an access-log record arrives up to
  Envoy's flush interval late, 1 s under Envoy Gateway: at every scrape the gateway learns how
  many more it counts than the engine holds, a moving average, and counts that many fewer),
  or more if the last scrape showed requests the gateway does not know (traffic that
  bypasses it). Until a pod has shown its limit it is filled as under `queue`. With
  `engine_queue` 0, every `PROBE_S` a pod at its limit whose limit was not seen again may take
  one more (one request waits in its engine until the next scrape): a limit learned too low,
  or an engine given more KV, is found again (with a queue allowed, the scrapes show it).
- `queue` (llm-d's): a pod takes requests while its estimated waiting queue is under
  `saturation.queue_threshold`. The queue is scraped every poll (0.5 s); between scrapes the
  requests dispatched since count onto it: scraped waiting + (in flight now - in flight when
  that scrape was first seen).

Either way a pod at `saturation.kv_threshold` takes nothing, nor one the gateway holds
`max_concurrency` requests on. A pod without a queue or KV signal offers nothing (one without
any metrics, e.g. no metrics URL configured, is not held back: only `max_concurrency` caps
it), and a pod
whose metrics went stale is not ready (the endpoint store drops it): stale metrics halt its
dispatch, as llm-d's detector fails closed. Between a pod's last good scrape and staleness the
`slots` rule keeps working from the in-flight view alone (the learned limit does not age).

`Capacity.pods` lists the pods with room: the director routes a dispatched request among them
(late binding into room, not into the pool), so a dispatch never lands on a full pod.

Pool saturation (the gauge an autoscaler reads) is the saturation model's mean over pods
(`extproc.routing.saturation`), with each pod's load over its learned slots as one more term:
under `slots` the engines' queues stay empty, and a full pool must still read 1.0.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from extproc.config import SaturationConfig
from extproc.types import Endpoint, EngineMetrics

__all__ = ["PROBE_S", "Capacity", "DispatchRule", "PodSlots", "PoolCapacity"]

PROBE_S = 5.0  # a pod at its learned limit may take one more this often
OVERCOUNT_WEIGHT = 0.2
UNKNOWN_ROOM = (
    1 << 20
)  # what a pod without metrics offers: no limit flow control can know  # the overcount's moving average weighs each new scrape this much
DispatchRule = str  # "slots" | "queue" (flow_control.dispatch)


@dataclass(frozen=True, slots=True)
class Capacity:
    endpoints: int  # ready pods of the model
    free: int  # requests the pool takes now before any pod is full
    saturation: float  # pool saturation (>= 1.0: saturated)
    pods: tuple[str, ...] = ()  # addresses of the pods with room now
    # Pods whose running slots are all taken and whose engine queue is empty (`slots` only): a
    # request sent there now is the next its engine starts. Flow control lets a band above the
    # default priority wait there rather than in the gateway (it starts at the next release on
    # that pod, without waiting for the gateway to hear of it).
    line: tuple[str, ...] = ()
    # Free running slots (a request sent there starts at the next engine step, not when a
    # running one ends) and the pods that have them; part of `free`. A pod whose limit is not
    # learned yet counts all its room as running slots.
    running: int = 0
    running_pods: tuple[str, ...] = ()
    queued: int = 0  # the rest of `free`: on the pods with no free running slot,
    queued_pods: tuple[str, ...] = ()  # these (places in their engines' queues)
    slots: int = 0  # running slots learned over the ready pods (`slots` only)


@dataclass(slots=True)
class PodSlots:
    """What one pod's scrapes taught: its running slots, and how its last scrape is bridged."""

    scraped_at: float = -1.0  # `updated_at` of the scrape the baseline belongs to
    base: int = 0  # in flight when that scrape was first seen
    slots: int | None = None  # running requests the engine takes at most; None: not seen full
    full_at: int | None = None  # running at the previous scrape if it showed the engine full
    confirmed: float = field(default=-math.inf)  # when it was last seen full at `slots`
    # How many more the gateway counts in flight than the engine holds, on average over its
    # recent scrapes: ends not heard yet (an access-log record arrives up to Envoy's flush
    # interval late, and a peer's lease ends one sync tick later still).
    overcount: float = 0.0

    def bridge(self, flight: int, running: float, waiting: float) -> None:
        """A new scrape: the baseline for the dispatches and ends after it, and one more sample
        of the overcount."""
        self.base = flight
        sample = flight - (running + waiting)
        self.overcount = max(0.0, (1 - OVERCOUNT_WEIGHT) * self.overcount
                             + OVERCOUNT_WEIGHT * sample)  # fmt: skip

    def learn(self, running: float, waiting: float, kv_full: bool, now: float) -> None:
        """One new scrape. Requests waiting below the KV threshold: the engine is full at
        `running`. Believed at once when that raises a known limit; else (the first limit, or a
        lower one) only when the previous scrape showed it full too, and then the larger of the
        two: a request that arrived between two engine steps waits for a moment in any engine,
        and one such scrape of a lightly loaded pod must not cap it. Nothing waiting and more
        running than believed: the engine takes more."""
        r = int(running)
        if kv_full or r < 1:
            self.full_at = None
            return
        if waiting >= 1:
            if self.slots is not None and r >= self.slots:
                self.slots, self.full_at, self.confirmed = r, None, now
            elif self.full_at is not None:
                self.slots, self.full_at, self.confirmed = max(r, self.full_at), None, now
            else:
                self.full_at = r
        else:
            self.full_at = None
            if self.slots is not None and r > self.slots:
                self.slots = r


class PoolCapacity:
    """`capacity(model)` from the endpoint store and the in-flight tracker (both injected)."""

    def __init__(
        self,
        *,
        ready: Callable[[str], Sequence[tuple[Endpoint, EngineMetrics]]],
        in_flight: Callable[[str], int],
        saturation: SaturationConfig,
        dispatch: DispatchRule = "slots",
        engine_queue: int = 1,
        max_concurrency: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if dispatch not in ("slots", "queue"):
            raise ValueError(f"unknown dispatch rule {dispatch!r}")
        self._ready = ready
        self._in_flight = in_flight
        self._sat = saturation
        self._slots_rule = dispatch == "slots"
        self._queue = engine_queue
        self._max = max_concurrency
        self._clock = clock
        self._pods: dict[str, dict[str, PodSlots]] = {}  # model -> address -> what it taught

    def __call__(self, model: str) -> Capacity:
        ready = self._ready(model)
        if not ready:
            return Capacity(endpoints=0, free=0, saturation=1.0)
        views = self._pods.get(model)
        if views is None:
            views = self._pods[model] = {}
        now = self._clock()
        free = 0
        total = 0.0
        pods: list[str] = []
        line: list[str] = []
        running_free = queued_room = learned = 0
        running_pods: list[str] = []
        queued_pods: list[str] = []
        # One pass, no allocation per pod: at hundreds of pods this runs for every request
        # admitted at once and at every dispatch.
        in_flight = self._in_flight
        qt, kvt = self._sat.queue_threshold, self._sat.kv_threshold
        slots_rule, queue, cap = self._slots_rule, self._queue, self._max
        for ep, m in ready:
            address = ep.address
            waiting, kv = m.waiting, m.kv_cache_usage
            if waiting is None and kv is None:
                total += 1.0  # no queue or KV signal: count it saturated
                # No metrics (no metrics URL), or an engine that reports neither its queue nor
                # its KV cache: nothing can say it is full, so flow control does not hold it
                # back (it would wait out every request's TTL); `max_concurrency` caps it.
                room = UNKNOWN_ROOM if cap <= 0 else cap - in_flight(address)
                if room > 0:
                    free += room
                    pods.append(address)
                    running_free += room
                    running_pods.append(address)
                continue
            if waiting is None:
                waiting = 0.0  # the KV signal alone says when it is full
            if kv is None:
                kv = 0.0  # the queue alone says when it is full
            flight = in_flight(address)
            running = m.running or 0.0
            view = views.get(address)
            if view is None:
                view = views[address] = PodSlots()
            kv_full = kv >= kvt
            if view.scraped_at != m.updated_at:  # a new scrape: the truth again
                view.scraped_at = m.updated_at
                view.bridge(flight, running, waiting)
                view.learn(running, waiting, kv_full, now)
            since = flight - view.base  # dispatched minus finished since the scrape
            queued = waiting + since
            if queued < 0.0:
                queued = 0.0
            # The engine's load now: the gateway's own count (every dispatch at once), less
            # the ends it has not heard of yet (the overcount), or what the scrape saw plus the
            # gateway's changes since when that is more (traffic that bypasses the gateway).
            # Not the scrape's alone: it misses requests still in the engine's front end
            # (tokenizing, not queued yet), and the engines' queues grow.
            seen = running + waiting + since
            load = math.floor(max(flight - view.overcount, seen, 0.0) + 0.5)
            sat = max(_over(queued, qt), _over(kv, kvt))
            limit = view.slots if slots_rule else None
            if limit is not None:
                learned += limit
                if load / limit > sat:
                    sat = load / limit
            total += sat
            if kv_full or (cap > 0 and flight >= cap):
                continue
            if limit is not None:
                full = limit + queue  # running slots and the engine queue allowed
                probe = 1 if queue == 0 and now - view.confirmed >= PROBE_S else 0
                room = full + probe - load
                if room <= 0 and load == full:
                    line.append(address)
            else:
                room = math.ceil(qt - queued)
            if cap > 0 and room > cap - flight:
                room = cap - flight
            if room > 0:
                free += room
                pods.append(address)
                idle = room if limit is None else min(room, limit - load)
                if idle > 0:
                    running_free += idle
                    running_pods.append(address)
                else:
                    queued_room += room
                    queued_pods.append(address)
        if len(views) > 2 * len(ready) + 16:  # forget pods gone away
            live = {ep.address for ep, _ in ready}
            self._pods[model] = {a: v for a, v in views.items() if a in live}
        return Capacity(
            endpoints=len(ready), free=free, saturation=total / len(ready), pods=tuple(pods),
            line=tuple(line), running=running_free, running_pods=tuple(running_pods),
            queued=queued_room, queued_pods=tuple(queued_pods), slots=learned,
        )  # fmt: skip

    def slots(self, model: str, address: str) -> int | None:
        """The running slots learned for a pod (None: not seen full yet)."""
        view = self._pods.get(model, {}).get(address)
        return None if view is None else view.slots


def _over(value: float, threshold: float) -> float:
    return value / threshold if threshold > 0 else 1.0 + value  # a zero threshold: always full
