"""Virtual time: an asyncio event loop whose clock jumps to the next timer instead of waiting.

The twin runs the production request path (the director's steps, flow control's waits, the
lease book's expiries) and the simulator's engine step loop unchanged: they sleep, wait and
read `loop.time()` as they do live. Here no wall time passes between events: when nothing is
ready, the selector moves the clock to the earliest timer and returns. An hour of traffic
then costs only the CPU its events need, and two runs of the same input give the same events
in the same order (nothing depends on how fast the machine is).

The loop has no I/O (the twin opens no socket) and runs no thread: `run_in_executor` runs the
function inline (a thread would finish at a wall-time moment the virtual clock cannot see).
A loop with nothing ready and no timer can never wake again: `Stalled` says so rather than
blocking forever.

Background work (the simulated engines' step loops, started with `start_background`) sets
timers no other part waits on: `next_event` is the earliest of the *other* timers, the next
moment anything could look at or change an engine. An engine may run its steps up to it in
one sleep (`extproc.sim.engine.Engine`'s `horizon`): without that, an engine stepping every
10 ms would make every other engine wake at its pace too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import heapq
import math
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["Stalled", "VirtualLoop", "run_virtual"]

T = TypeVar("T")

# True in the context of background tasks (their timers do not count for `next_event`).
_BACKGROUND: contextvars.ContextVar[bool] = contextvars.ContextVar("background", default=False)


class Stalled(RuntimeError):
    """Every task waits on something no timer will ever bring: the run cannot go on."""


class _JumpingSelector(selectors.SelectSelector):
    """Registers file objects like any selector (the loop's self-pipe) but never polls them:
    `select` advances the loop's clock by the timeout and reports nothing ready."""

    def __init__(self, loop: VirtualLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:
            raise Stalled("nothing is ready and no timer is set: the twin cannot advance")
        if timeout > 0:
            self._loop.advance(timeout)
        return []


class VirtualLoop(asyncio.SelectorEventLoop):
    """An event loop in virtual seconds from `start`."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start
        # Foreground timers as a heap of (when, order, handle): `next_event` is asked at every
        # decode run and every arrival is a timer set at the start (an hour of traffic holds
        # thousands), so a scan per question would make the replay quadratic.
        self._timers: list[tuple[float, int, asyncio.TimerHandle]] = []
        self._order = 0
        self.jumps = 0  # times the clock moved (each one wait of the loop's)
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def call_at(  # type: ignore[override]  # typeshed's is generic over the callback's args
        self,
        when: float,
        callback: Callable[..., object],
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> asyncio.TimerHandle:
        handle = super().call_at(when, callback, *args, context=context)
        if not _BACKGROUND.get():
            self._order += 1
            heapq.heappush(self._timers, (handle.when(), self._order, handle))
            if self._order % 4096 == 0:  # cancelled timers deep in the heap go too
                now = self._now
                self._timers = [t for t in self._timers if t[0] >= now and not t[2].cancelled()]
                heapq.heapify(self._timers)
        return handle

    def next_event(self) -> float:
        """The earliest pending timer that is not background work's (inf: none)."""
        now, timers = self._now, self._timers
        while timers and (timers[0][0] < now or timers[0][2].cancelled()):
            heapq.heappop(timers)
        return timers[0][0] if timers else math.inf

    def start_background(self, start: Callable[[], object]) -> None:
        """Call `start` (which creates the background task) in a context whose timers do not
        count for `next_event`."""
        ctx = contextvars.copy_context()
        ctx.run(_BACKGROUND.set, True)
        ctx.run(start)

    def advance(self, seconds: float) -> None:
        """Move the clock forward (the selector does, when the loop would wait)."""
        self._now += seconds
        self.jumps += 1

    def run_in_executor(  # type: ignore[override]
        self, executor: Any, func: Callable[..., T], *args: Any
    ) -> asyncio.Future[T]:
        done: concurrent.futures.Future[T] = concurrent.futures.Future()
        try:
            done.set_result(func(*args))
        except BaseException as exc:  # the caller's await raises it, as from a thread
            done.set_exception(exc)
        return asyncio.wrap_future(done, loop=self)


def run_virtual(main: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run `main` to completion on a fresh virtual-time loop, then close the loop."""
    loop = VirtualLoop(start)
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()
