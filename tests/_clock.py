"""A clock that moves only when a test says so: monotonic and wall time, and sleeps.

Fakes `extproc.server.timers.Timers` (`now`, `sleep`) and the director's and trackers'
`clock` / `wall_clock` callables (`now`, `wall`), so one object drives them all.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

WALL_OFFSET = 1_700_000_000.0  # wall time = monotonic time + this


class ManualClock:
    def __init__(self, start: float = 1000.0) -> None:
        self._now = start
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._order = itertools.count()
        self._changed = asyncio.Event()

    def now(self) -> float:
        return self._now

    def wall(self) -> float:
        return self._now + WALL_OFFSET

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._order), fut))
        self._changed.set()
        await fut

    @property
    def sleeping(self) -> int:
        """Sleeps not yet woken (cancelled ones excluded)."""
        return sum(1 for _, _, f in self._sleepers if not f.done())

    async def until_sleeping(self, n: int = 1, *, timeout_s: float = 5.0) -> None:
        """Let the code under test run until `n` sleeps wait on this clock."""

        async def wait() -> None:
            while self.sleeping < n:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), timeout_s)  # a guard against a hang, not a timing

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleep that is due."""
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():
                fut.set_result(None)
