"""The flow controller's policies: one signature per kind, as llm-d's flowcontrol framework.

    fairness (inside a band):   FairnessPolicy.pick(flows) -> the flow that dispatches next
    ordering (inside a flow):   OrderingPolicy.key(item)   -> smaller goes first

Between bands there is no policy: strict priority (the highest band with anything waiting
goes first, always). A new policy is a class here plus its name in `FAIRNESS` / `ORDERING`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "FAIRNESS",
    "ORDERING",
    "Deadline",
    "FairnessPolicy",
    "Fcfs",
    "Flow",
    "GlobalStrict",
    "OrderingPolicy",
    "Queued",
    "RoundRobin",
    "TokenFair",
]


@dataclass(eq=False, slots=True)
class Queued:
    """One waiting request, as the policies see it."""

    flow: str  # the fairness id (or the user the VTC counters know), "" when none
    enqueued: float  # monotonic
    expires: float  # monotonic: enqueue + the request's TTL
    deadline: float  # monotonic: expiry, or enqueue + its TTFT SLO when it has one
    size: int  # body bytes (what the band's byte cap counts)
    seq: int  # arrival order, the final tie-break


class OrderingPolicy(Protocol):
    """Inside one flow: which waiting request goes first (the smallest key)."""

    name: str

    def key(self, item: Queued) -> tuple[float, int]: ...


class Fcfs:
    """First come, first served."""

    name = "fcfs"

    def key(self, item: Queued) -> tuple[float, int]:
        return (item.enqueued, item.seq)


class Deadline:
    """Earliest deadline first: the enqueue time plus the request's TTFT SLO when it sent one
    (`x-slo-ttft-ms`), else its TTL (llm-d's EDF and SLO-deadline orderings in one)."""

    name = "edf"

    def key(self, item: Queued) -> tuple[float, int]:
        return (item.deadline, item.seq)


@dataclass(eq=False)
class Flow:
    """One flow's queue inside one band (a heap by the ordering policy's key)."""

    name: str
    heap: list[tuple[tuple[float, int], Queued]] = field(default_factory=list)

    def push(self, item: Queued, ordering: OrderingPolicy) -> None:
        heapq.heappush(self.heap, (ordering.key(item), item))

    def head(self) -> Queued:
        return self.heap[0][1]

    def pop(self) -> Queued:
        return heapq.heappop(self.heap)[1]

    def __len__(self) -> int:
        return len(self.heap)


class FairnessPolicy(Protocol):
    """Inside one band: which flow dispatches next (every flow given has a request waiting)."""

    name: str

    def pick(self, flows: Sequence[Flow]) -> Flow: ...


class GlobalStrict:
    """No fairness: the best head across every flow of the band (llm-d's default)."""

    name = "global-strict"

    def __init__(self, ordering: OrderingPolicy) -> None:
        self._ordering = ordering

    def pick(self, flows: Sequence[Flow]) -> Flow:
        return min(flows, key=lambda f: self._ordering.key(f.head()))


class RoundRobin:
    """Each flow with a request waiting takes a turn, in the order the flows first came."""

    name = "round-robin"

    def __init__(self, ordering: OrderingPolicy) -> None:
        del ordering
        self._turn = itertools.count()
        self._last: dict[str, int] = {}

    def pick(self, flows: Sequence[Flow]) -> Flow:
        # The flow served longest ago (never served: first); ties by arrival of its head.
        flow = min(flows, key=lambda f: (self._last.get(f.name, -1), f.head().seq))
        self._last[flow.name] = next(self._turn)
        if len(self._last) > 4 * max(16, len(flows)):  # forget flows gone quiet
            live = {f.name for f in flows}
            self._last = {k: v for k, v in self._last.items() if k in live}
        return flow


class TokenFair:
    """The flow whose tokens used so far are fewest goes next: the VTC counters (Sheng et al.)
    the response accounting keeps per user and shares between replicas, so a tenant sending
    5x more does not get 5x the pool."""

    name = "token"

    def __init__(self, ordering: OrderingPolicy, tokens: Callable[[str], float]) -> None:
        del ordering
        self._tokens = tokens

    def pick(self, flows: Sequence[Flow]) -> Flow:
        return min(flows, key=lambda f: (self._tokens(f.name), f.head().seq))


ORDERING: dict[str, Callable[[], OrderingPolicy]] = {"fcfs": Fcfs, "edf": Deadline}


def _global_strict(ordering: OrderingPolicy, _tokens: Callable[[str], float]) -> FairnessPolicy:
    return GlobalStrict(ordering)


def _round_robin(ordering: OrderingPolicy, _tokens: Callable[[str], float]) -> FairnessPolicy:
    return RoundRobin(ordering)


FAIRNESS: dict[str, Callable[[OrderingPolicy, Callable[[str], float]], FairnessPolicy]] = {
    "global-strict": _global_strict,
    "round-robin": _round_robin,
    "token": TokenFair,
}
