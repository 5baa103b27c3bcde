"""The engine's waiting queue under vLLM's two scheduling policies (`--scheduling-policy`).

    fcfs      a deque: arrivals at the back, preempted requests back at the front
    priority  a heap ordered by (priority, arrival time, request id): lower priority value
              first; a preempted request goes back to its place by that order (there is no
              front in a heap)

As vLLM's `vllm/v1/core/sched/request_queue.py` (`FCFSRequestQueue`, `PriorityRequestQueue`)
and `Request.__lt__` (`vllm/v1/request.py`). Who is preempted when a running request cannot get
a KV block is the scheduler's choice (`Engine._victim`): the newest running request under
fcfs, the one with the largest (priority, arrival time) under priority.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

from extproc.sim.config import SchedulingPolicy

if TYPE_CHECKING:
    from extproc.sim.engine import SimRequest

__all__ = ["FcfsQueue", "PriorityQueue", "RequestQueue", "request_queue"]


class RequestQueue(Protocol):
    def add(self, req: SimRequest) -> None: ...

    def prepend(self, req: SimRequest) -> None:
        """A preempted request, back in the queue."""

    def peek(self) -> SimRequest: ...

    def pop(self) -> SimRequest: ...

    def remove(self, req: SimRequest) -> None: ...

    def __contains__(self, req: object) -> bool: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[SimRequest]: ...


class FcfsQueue:
    def __init__(self) -> None:
        self._q: deque[SimRequest] = deque()

    def add(self, req: SimRequest) -> None:
        self._q.append(req)

    def prepend(self, req: SimRequest) -> None:
        self._q.appendleft(req)

    def peek(self) -> SimRequest:
        return self._q[0]

    def pop(self) -> SimRequest:
        return self._q.popleft()

    def remove(self, req: SimRequest) -> None:
        self._q.remove(req)

    def __contains__(self, req: object) -> bool:
        return req in self._q

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[SimRequest]:
        return iter(self._q)


class PriorityQueue:
    def __init__(self) -> None:
        # (priority, arrival, request id, insertion order, request): vLLM breaks the last tie by
        # object identity; the insertion order does the same job without comparing requests.
        self._heap: list[tuple[int, float, str, int, SimRequest]] = []
        self._seq = itertools.count()

    def add(self, req: SimRequest) -> None:
        heapq.heappush(
            self._heap, (req.priority, req.arrival_wall, req.request_id, next(self._seq), req)
        )

    prepend = add  # a heap has no front: back to its place by (priority, arrival)

    def peek(self) -> SimRequest:
        return self._heap[0][4]

    def pop(self) -> SimRequest:
        return heapq.heappop(self._heap)[4]

    def remove(self, req: SimRequest) -> None:
        self._heap = [e for e in self._heap if e[4] is not req]
        heapq.heapify(self._heap)

    def __contains__(self, req: object) -> bool:
        return any(e[4] is req for e in self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[SimRequest]:
        """In scheduling order."""
        return (e[4] for e in sorted(self._heap))


def request_queue(policy: SchedulingPolicy) -> RequestQueue:
    if policy is SchedulingPolicy.PRIORITY:
        return PriorityQueue()
    return FcfsQueue()
