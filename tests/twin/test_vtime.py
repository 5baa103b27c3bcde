"""The virtual-time loop: timers fire in order at their virtual times, no wall time passes,
an executor call runs inline, and a loop that can never wake says so."""

from __future__ import annotations

import asyncio
import math
import time

import pytest

from extproc.twin.vtime import Stalled, VirtualLoop, run_virtual


def test_sleeps_and_timeouts_run_in_virtual_time() -> None:
    async def main() -> tuple[list[tuple[float, int]], float]:
        loop = asyncio.get_running_loop()
        order: list[tuple[float, int]] = []

        async def sleeper(i: int) -> None:
            await asyncio.sleep(3600.0 - i * 600)
            order.append((loop.time(), i))

        await asyncio.gather(*(sleeper(i) for i in range(4)))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.Event().wait(), 7200.0)
        return order, loop.time()

    started = time.monotonic()
    order, end = run_virtual(main(), start=100.0)
    assert time.monotonic() - started < 5.0  # hours of virtual time, no hours of wall time
    assert order == [(1900.0, 3), (2500.0, 2), (3100.0, 1), (3700.0, 0)]
    assert end == pytest.approx(3700.0 + 7200.0)


def test_executor_calls_run_inline_and_raise_through() -> None:
    async def main() -> int:
        loop = asyncio.get_running_loop()
        value = await loop.run_in_executor(None, lambda: 21 * 2)
        with pytest.raises(ZeroDivisionError):
            await loop.run_in_executor(None, lambda: 1 // 0)
        return value

    assert run_virtual(main()) == 42


def test_a_run_that_cannot_advance_is_reported() -> None:
    async def main() -> None:
        await asyncio.Event().wait()  # no timer will ever set it

    with pytest.raises(Stalled):
        run_virtual(main())


def test_the_next_event_is_the_earliest_live_foreground_timer_among_thousands() -> None:
    """What an engine may run its decode steps up to: the earliest timer that is neither
    cancelled, past nor background work's, with an hour's arrivals (thousands of timers) set."""

    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, VirtualLoop)
        seen = [loop.next_event()]
        handles = [loop.call_later(1.0 + k, lambda: None) for k in range(9000)]
        for h in handles[:10]:
            h.cancel()
        loop.start_background(lambda: loop.call_later(0.5, lambda: None))
        seen.append(loop.next_event())  # the first 10 cancelled, the background one ignored
        loop.advance(20.5)  # past timers no longer count
        seen.append(loop.next_event())
        for h in handles[:-1]:
            h.cancel()
        seen.append(loop.next_event())
        handles[-1].cancel()
        seen.append(loop.next_event())
        return seen

    assert run_virtual(main()) == [math.inf, 11.0, 21.0, 9000.0, math.inf]
