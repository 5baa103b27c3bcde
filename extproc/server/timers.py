"""Time as the server schedules it: injected, so tests move it instead of sleeping.

`LoopTimers` is the running event loop's clock. A test passes a fake with the same two
methods (tests/_clock.py `ManualClock`) and advances it by hand.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, Protocol

__all__ = ["LoopTimers", "Timers", "within"]


class Timers(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...

    async def sleep(self, seconds: float) -> None: ...


class LoopTimers:
    """Implements `Timers` with the running loop's clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


async def within(timers: Timers, awaitable: Awaitable[Any], seconds: float) -> bool:
    """Wait for `awaitable` at most `seconds` of `timers`' time; True when it finished.

    On time-out a future passed in is left as it is (the caller decides), and a coroutine
    passed in is cancelled."""
    made = not asyncio.isfuture(awaitable)
    fut = asyncio.ensure_future(awaitable)
    timer = asyncio.ensure_future(timers.sleep(max(0.0, seconds)))
    try:
        await asyncio.wait((fut, timer), return_when=asyncio.FIRST_COMPLETED)
    finally:
        timer.cancel()
        if made and not fut.done():
            fut.cancel()
    return fut.done() and not fut.cancelled()
