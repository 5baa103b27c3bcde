"""How much more a model's pool can take now: the flow controller's saturation detector.

A pod is full when its KV cache is at `kv_threshold`, when its waiting queue is at
`queue_threshold`, or (if set) when the gateway holds `max_concurrency` requests on it. Its free
slots are how many more requests fit under the queue threshold. Stale pods are not ready (the
endpoint store drops them), so they offer nothing: stale metrics count as saturated, as in llm-d.

The waiting queue is scraped every poll (0.5 s); between scrapes the requests dispatched since
are counted onto it: estimated waiting = scraped waiting + (in-flight now - in-flight when that
scrape was first seen). In-flight is the shared view (this replica's leases and its peers'), so
every replica estimates the same queue. Pool saturation is llm-d's: the mean over pods of
max(waiting / queue_threshold, kv / kv_threshold), 1.0 with no pod (what KEDA reads).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from extproc.types import Endpoint, EngineMetrics

__all__ = ["Capacity", "PoolCapacity"]


@dataclass(frozen=True, slots=True)
class Capacity:
    endpoints: int  # ready pods of the model
    free: int  # requests the pool takes now before any pod is full
    saturation: float  # llm-d's pool saturation (>= 1.0: saturated)


class PoolCapacity:
    """`capacity(model)` from the endpoint store and the in-flight tracker (both injected)."""

    def __init__(
        self,
        *,
        ready: Callable[[str], Sequence[tuple[Endpoint, EngineMetrics]]],
        in_flight: Callable[[str], int],
        queue_threshold: float,
        kv_threshold: float,
        max_concurrency: int = 0,
    ) -> None:
        self._ready = ready
        self._in_flight = in_flight
        self._qt = queue_threshold
        self._kvt = kv_threshold
        self._max = max_concurrency
        # address -> (scrape time, in-flight when this process first saw that scrape)
        self._base: dict[str, dict[str, tuple[float, int]]] = {}  # per model

    def __call__(self, model: str) -> Capacity:
        ready = self._ready(model)
        if not ready:
            return Capacity(endpoints=0, free=0, saturation=1.0)
        bases = self._base.setdefault(model, {})
        free = 0
        total = 0.0
        for ep, m in ready:
            address = ep.address
            flight = self._in_flight(address)
            if m.waiting is None or m.kv_cache_usage is None:
                total += 1.0  # no queue or KV signal: count it saturated, offer nothing
                continue
            base = bases.get(address)
            if base is None or base[0] != m.updated_at:
                base = bases[address] = (m.updated_at, flight)
            waiting = max(0.0, m.waiting + flight - base[1])
            total += max(waiting / self._qt, m.kv_cache_usage / self._kvt)
            if m.kv_cache_usage >= self._kvt:
                continue
            slots = max(0, math.ceil(self._qt - waiting))
            if self._max > 0:
                slots = min(slots, max(0, self._max - flight))
            free += slots
        if len(bases) > 2 * len(ready) + 16:  # forget pods gone away
            live = {ep.address for ep, _ in ready}
            self._base[model] = {a: b for a, b in bases.items() if a in live}
        return Capacity(endpoints=len(ready), free=free, saturation=total / len(ready))
