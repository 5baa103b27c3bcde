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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import selectors
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["Stalled", "VirtualLoop", "run_virtual"]

T = TypeVar("T")


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
        super().__init__(_JumpingSelector(self))

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        """Move the clock forward (the selector does, when the loop would wait)."""
        self._now += seconds

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
