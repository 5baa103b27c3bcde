"""The poller's pace follows the need: idle pods slow down to `idle_interval`, busy or changing
ones stay at `interval`, traffic brings an idle pod back at once; idle figures stay usable
until their next scrape is due (plus `stale_after`), busy ones for `stale_after`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web

from extproc.metrics.poller import MetricsPoller
from extproc.metrics.store import EndpointStore
from extproc.types import Endpoint, EngineMetrics

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


def page(running: int, waiting: int, generated: int) -> str:
    lv = 'engine="0",model_name="m"'
    return (
        f"vllm:num_requests_running{{{lv}}} {running}\n"
        f"vllm:num_requests_waiting{{{lv}}} {waiting}\n"
        f"vllm:kv_cache_usage_perc{{{lv}}} 0.0\n"
        f"vllm:generation_tokens_total{{{lv}}} {generated}\n"
    )


@dataclass
class Pod:
    """A /metrics server; `busy` pods report a request running and tokens growing."""

    busy: bool = False
    changing: bool = False  # tokens grow with nothing running (a quick request in between)
    hits: list[float] = field(default_factory=list)
    generated: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        self.hits.append(asyncio.get_running_loop().time())
        if self.busy or self.changing:
            self.generated += 7
        return web.Response(text=page(1 if self.busy else 0, 0, self.generated))


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Pod], asyncio.Future[Endpoint]]]:
    runners: list[web.AppRunner] = []

    async def start(pod: Pod) -> Endpoint:
        app = web.Application()
        app.router.add_get("/metrics", pod.handle)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        addr = f"127.0.0.1:{runner.addresses[0][1]}"
        return Endpoint(addr, "m", metrics_url=f"http://{addr}/metrics")

    yield start  # type: ignore[misc]
    for runner in runners:
        await runner.cleanup()


async def eventually(cond: Callable[[], bool], within: float = 10.0) -> None:
    async with asyncio.timeout(within):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_idle_pods_slow_down_busy_ones_keep_the_pace(serve: Callable[..., object]) -> None:
    idle_pod, busy_pod = Pod(), Pod(busy=True)
    idle, busy = await serve(idle_pod), await serve(busy_pod)  # type: ignore[misc]
    store = EndpointStore(stale_after=0.5)
    store.set_endpoints({"m": [idle, busy]})
    async with httpx.AsyncClient() as client:
        poller = MetricsPoller(store, client, interval=0.02, idle_interval=0.32, timeout=1.0)
        poller.start()
        try:
            await eventually(lambda: poller.interval_of(idle.metrics_url or "") == 0.32)
            assert poller.interval_of(busy.metrics_url or "") == 0.02
            n_idle, n_busy = len(idle_pod.hits), len(busy_pod.hits)
            await asyncio.sleep(0.64)
            # ~2 idle scrapes against ~32 busy ones in the same time.
            assert len(idle_pod.hits) - n_idle <= 3
            assert len(busy_pod.hits) - n_busy >= 10
            # The idle pod's last figures are still usable though older than stale_after.
            state = store.state(idle)
            assert state is not None and state.trusted_for == pytest.approx(0.32 + 0.5)
            assert {ep for ep, _ in store.ready("m")} == {idle, busy}
        finally:
            await poller.stop()


async def test_traffic_to_an_idle_pod_scrapes_it_at_once_and_at_the_busy_pace(
    serve: Callable[..., object],
) -> None:
    pod = Pod()
    ep = await serve(pod)  # type: ignore[misc]
    store = EndpointStore(stale_after=0.5)
    store.set_endpoints({"m": [ep]})
    async with httpx.AsyncClient() as client:
        poller = MetricsPoller(store, client, interval=0.02, idle_interval=5.0, timeout=1.0)
        poller.start()
        try:
            await eventually(lambda: (poller.interval_of(ep.metrics_url or "") or 0) >= 0.6)
            before = len(pod.hits)
            routed_at = asyncio.get_running_loop().time()
            poller.note_traffic(ep.address)
            await eventually(lambda: len(pod.hits) > before, within=1.0)
            assert pod.hits[before] - routed_at < 0.3  # not at the idle pace (>= 0.6 s)
            assert poller.interval_of(ep.metrics_url or "") == 0.02
            poller.note_traffic("10.9.9.9:1")  # not ours: nothing happens
        finally:
            await poller.stop()


async def test_a_changing_pod_is_busy_even_with_nothing_running(
    serve: Callable[..., object],
) -> None:
    pod = Pod(changing=True)
    ep = await serve(pod)  # type: ignore[misc]
    store = EndpointStore(stale_after=0.5)
    store.set_endpoints({"m": [ep]})
    async with httpx.AsyncClient() as client:
        poller = MetricsPoller(store, client, interval=0.02, idle_interval=1.0, timeout=1.0)
        poller.start()
        try:
            await eventually(lambda: len(pod.hits) >= 10)
            assert poller.interval_of(ep.metrics_url or "") == 0.02
            state = store.state(ep)
            assert state is not None and state.trusted_for is None
        finally:
            await poller.stop()


async def test_a_pod_another_replica_owns_is_scraped_here_only_when_the_copy_runs_out(
    serve: Callable[..., object],
) -> None:
    pod = Pod()
    ep = await serve(pod)  # type: ignore[misc]
    store = EndpointStore(stale_after=0.5)
    store.set_endpoints({"m": [ep]})
    async with httpx.AsyncClient() as client:
        poller = MetricsPoller(store, client, interval=0.1, idle_interval=1.0, timeout=1.0)
        poller.owns = lambda url: False  # another replica scrapes the pod and publishes
        published = time.monotonic()
        poller.record_peer(ep, EngineMetrics(updated_at=published, running=0, waiting=0))
        state = store.state(ep)
        assert state is not None and state.trusted_for == pytest.approx(1.0 + 0.5)
        ready_throughout = True

        def still_ready() -> bool:
            nonlocal ready_throughout
            ready_throughout &= bool(store.ready("m"))
            return bool(pod.hits)

        poller.start()
        try:
            # The owner's idle figures hold for 1.5 s: nothing is scraped here meanwhile. Then
            # no newer ones came (the owner is gone): scraped here a poll before they run out.
            await eventually(still_ready, within=5.0)
            assert time.monotonic() - published >= 1.0, pod.hits
            assert ready_throughout
        finally:
            await poller.stop()


async def test_routing_to_a_pod_another_replica_owns_wants_a_copy_younger_than_two_polls(
    serve: Callable[..., object],
) -> None:
    pod = Pod()
    ep = await serve(pod)  # type: ignore[misc]
    store = EndpointStore(stale_after=0.5)
    store.set_endpoints({"m": [ep]})
    async with httpx.AsyncClient() as client:
        poller = MetricsPoller(store, client, interval=0.05, idle_interval=5.0, timeout=1.0)
        poller.owns = lambda url: False
        poller.record_peer(ep, EngineMetrics(updated_at=time.monotonic(), running=0, waiting=0))
        poller.start()
        try:
            await asyncio.sleep(0.3)  # the copy is 0.3 s old: good for an idle pod (5.5 s)
            assert pod.hits == []
            poller.note_traffic(ep.address)  # this replica routes there: it must be fresh
            await eventually(lambda: bool(pod.hits), within=2.0)
        finally:
            await poller.stop()


async def test_a_peers_figures_with_requests_in_flight_are_trusted_for_stale_after() -> None:
    store = EndpointStore(stale_after=0.5)
    ep = Endpoint("10.0.0.1:8000", "m", metrics_url="http://10.0.0.1:8000/metrics")
    store.set_endpoints({"m": [ep]})
    poller = MetricsPoller(store, httpx.AsyncClient(), interval=0.1, idle_interval=5.0)
    poller.owns = lambda url: False
    poller.record_peer(ep, EngineMetrics(time.monotonic(), running=0, waiting=0))
    poller.tick()  # follows the store's endpoints (a fresh copy: nothing to scrape here)
    assert poller.started == 0
    for running, waiting, trusted_for in ((1, 0, None), (0, 2, None), (0, 0, 5.5)):
        poller.record_peer(ep, EngineMetrics(time.monotonic(), running=running, waiting=waiting))
        state = store.state(ep)
        assert state is not None and state.trusted_for == trusted_for, (running, waiting)
    poller.note_traffic(ep.address)  # routed here just now: the pod is not idle for us
    poller.record_peer(ep, EngineMetrics(time.monotonic(), running=0, waiting=0))
    state = store.state(ep)
    assert state is not None and state.trusted_for is None


@pytest.mark.parametrize(
    ("trusted_for", "age", "ready"),
    [
        (None, 2.9, True),  # the store's stale_after (3 s)
        (None, 3.1, False),
        (12.0, 11.9, True),  # an idle pod's figures: until its next scrape is due + 3 s
        (12.0, 12.1, False),
        (1.0, 1.5, False),  # shorter than stale_after is honoured too
    ],
)
def test_figures_are_used_for_as_long_as_they_are_trusted(
    trusted_for: float | None, age: float, ready: bool
) -> None:
    now = [100.0]
    store = EndpointStore(stale_after=3.0, clock=lambda: now[0])
    ep = Endpoint("10.0.0.1:8000", "m", metrics_url="http://10.0.0.1:8000/metrics")
    store.set_endpoints({"m": [ep]})
    store.record_success(ep, EngineMetrics(updated_at=100.0, running=0), trusted_for=trusted_for)
    now[0] = 100.0 + age
    assert bool(store.ready("m")) is ready
    state = store.state(ep)
    assert state is not None and store.is_ready(state, now[0]) is ready
    store.record_failure(ep, "timeout")  # one failed scrape keeps the figures usable...
    assert bool(store.ready("m")) is ready


def test_a_failed_scrape_cuts_an_idle_pods_long_trust_to_stale_after() -> None:
    now = [100.0]
    store = EndpointStore(stale_after=3.0, clock=lambda: now[0])
    ep = Endpoint("10.0.0.1:8000", "m", metrics_url="http://10.0.0.1:8000/metrics")
    store.set_endpoints({"m": [ep]})
    store.record_success(ep, EngineMetrics(updated_at=100.0, running=0), trusted_for=13.0)
    now[0] = 105.0
    store.record_failure(ep, "timeout")  # ...for stale_after past the failure (108), not 113
    now[0] = 107.0
    store.record_failure(ep, "timeout")  # a later failure does not extend it (not 110)
    for t, ready in ((107.9, True), (108.1, False), (109.9, False)):
        now[0] = t
        assert bool(store.ready("m")) is ready, t


def test_idle_interval_below_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="idle_interval"):
        MetricsPoller(
            EndpointStore(stale_after=1.0), httpx.AsyncClient(), interval=1, idle_interval=0.5
        )


async def test_an_unchanged_page_gives_the_same_figures_newly_dated_and_garbage_still_fails(
    serve: Callable[..., object],
) -> None:
    pages = [page(0, 0, 5), page(0, 0, 5), page(2, 1, 9), "<html>upstream error</html>"]

    @dataclass
    class Scripted:
        hits: int = 0

        async def handle(self, request: web.Request) -> web.Response:
            self.hits += 1
            return web.Response(text=pages[min(self.hits, len(pages)) - 1])

    pod = Scripted()
    ep = await serve(pod)  # type: ignore[misc]
    now = [10.0]
    store = EndpointStore(stale_after=100.0, clock=lambda: now[0])
    store.set_endpoints({"m": [ep]})
    async with httpx.AsyncClient() as client:
        poller = MetricsPoller(store, client, clock=lambda: now[0])
        seen = []
        for t in (10.0, 11.0, 12.0, 13.0):
            now[0] = t
            await poller.poll_once()
            state = store.state(ep)
            assert state is not None
            seen.append(state)
    first, again, changed, garbage = seen
    assert first.metrics is not None and again.metrics is not None
    assert again.metrics.updated_at == 11.0
    assert (again.metrics.running, again.metrics.generation_tokens_total) == (0, 5)
    assert changed.metrics is not None and (changed.metrics.running, changed.metrics.waiting) == (
        2,
        1,
    )
    assert garbage.last_error == "garbage" and garbage.failures == 1
