"""MetricsPoller against real HTTP servers (aiohttp on port 0) and httpx.MockTransport."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web

from extproc.metrics.names import VLLM
from extproc.metrics.poller import MetricsPoller
from extproc.metrics.store import EndpointStore
from extproc.types import Endpoint
from tests.metrics.expositions import SGLANG, VLLM_DP2, VLLM_TWO_MODELS

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")


@dataclass
class FakePod:
    """A real HTTP /metrics server whose behaviour a test switches at run time."""

    mode: str = "ok"  # ok | hang | garbage | 500 | big
    body: str = VLLM_DP2
    hits: int = 0
    release: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        if self.mode == "hang":
            await self.release.wait()
        if self.mode == "garbage":
            return web.Response(text="<html><body>upstream connect error</body></html>")
        if self.mode == "500":
            return web.Response(status=500, text="boom")
        if self.mode == "big":
            return web.Response(text="x 1\n" * 100_000)
        return web.Response(text=self.body, content_type="text/plain")


@dataclass
class Servers:
    started: list[web.AppRunner] = field(default_factory=list)

    async def start(self, pod: FakePod) -> Endpoint:
        app = web.Application()
        app.router.add_get("/metrics", pod.handle)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.started.append(runner)
        port = runner.addresses[0][1]
        return Endpoint(
            f"127.0.0.1:{port}", "qwen3", metrics_url=f"http://127.0.0.1:{port}/metrics"
        )


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    s = Servers()
    yield s
    for runner in s.started:
        await runner.cleanup()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as c:
        yield c


class Recorder:
    def __init__(self) -> None:
        self.results: list[tuple[str, str]] = []

    def scrape_result(self, endpoint: Endpoint, result: str) -> None:
        self.results.append((endpoint.address, result))

    def of(self, ep: Endpoint) -> list[str]:
        return [r for a, r in self.results if a == ep.address]


def closed_port_endpoint() -> Endpoint:
    with socket.socket() as s:  # bind, then close: nothing listens there afterwards
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return Endpoint(f"127.0.0.1:{port}", "qwen3", metrics_url=f"http://127.0.0.1:{port}/metrics")


async def eventually(cond: Callable[[], bool], within: float = 10.0) -> None:
    """Wait for a condition on state that real servers change (nothing to await on)."""
    async with asyncio.timeout(within):
        while not cond():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


def make(
    store: EndpointStore, client: httpx.AsyncClient, rec: Recorder, **kw: float
) -> MetricsPoller:
    opts: dict[str, float] = {"interval": 0.05, "timeout": 0.5} | kw
    return MetricsPoller(store, client, observer=rec, **opts)  # type: ignore[arg-type]


async def test_each_failure_kind_is_classified_and_others_still_succeed(
    servers: Servers, client: httpx.AsyncClient
) -> None:
    pods = {mode: FakePod(mode=mode) for mode in ("ok", "hang", "garbage", "500", "big")}
    eps = {mode: await servers.start(pod) for mode, pod in pods.items()}
    eps["down"] = closed_port_endpoint()
    store = EndpointStore(stale_after=10.0)
    store.set_endpoints({"qwen3": list(eps.values())})
    rec = Recorder()
    poller = MetricsPoller(store, client, timeout=0.3, max_bytes=100_000, observer=rec)
    await poller.poll_once()
    for p in pods.values():
        p.release.set()

    expected = {
        "ok": "ok",
        "hang": "timeout",
        "garbage": "garbage",
        "500": "http_error",
        "big": "too_large",
        "down": "unreachable",
    }
    assert {mode: rec.of(ep) for mode, ep in eps.items()} == {m: [r] for m, r in expected.items()}
    assert [e for e, _ in store.ready("qwen3")] == [eps["ok"]]
    metrics = dict(store.ready("qwen3"))[eps["ok"]]
    assert metrics.running == 5.0 and metrics.num_gpu_blocks == 27000
    for mode in ("hang", "garbage", "500", "big", "down"):
        state = store.state(eps[mode])
        assert state is not None and state.last_error == expected[mode]


async def test_hanging_pod_never_delays_the_others(
    servers: Servers, client: httpx.AsyncClient
) -> None:
    ok_pod, hang_pod = FakePod(), FakePod(mode="hang")
    ok, hang = await servers.start(ok_pod), await servers.start(hang_pod)
    store = EndpointStore(stale_after=10.0)
    store.set_endpoints({"qwen3": [hang, ok]})
    rec = Recorder()
    poller = make(store, client, rec, timeout=30.0)  # the hang outlives the whole test
    poller.start()
    try:
        await eventually(lambda: rec.of(ok).count("ok") >= 5)
        assert rec.of(hang) == []  # its first scrape is still pending...
        assert hang_pod.hits == 1  # ...and no second one was stacked behind it
    finally:
        await poller.stop()
        hang_pod.release.set()


async def test_recovery_readmits_and_logs_once_per_state_change(
    servers: Servers, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    pod = FakePod()
    ep = await servers.start(pod)
    store = EndpointStore(stale_after=10.0, max_failures=1)
    store.set_endpoints({"qwen3": [ep]})
    rec = Recorder()
    poller = make(store, client, rec)
    caplog.set_level(logging.INFO, logger="extproc.metrics.poller")
    poller.start()
    try:
        await eventually(lambda: rec.of(ep).count("ok") >= 1)
        assert store.ready("qwen3")
        pod.mode = "500"
        await eventually(lambda: rec.of(ep).count("http_error") >= 3)
        assert store.ready("qwen3") == ()
        pod.mode = "ok"
        n_ok = rec.of(ep).count("ok")
        await eventually(lambda: rec.of(ep).count("ok") >= n_ok + 3)
        assert store.ready("qwen3")
    finally:
        await poller.stop()
    messages = [r.getMessage() for r in caplog.records if ep.address in r.getMessage()]
    assert len([m for m in messages if "failing: http_error" in m]) == 1
    assert len([m for m in messages if "recovered" in m]) == 1


async def test_follows_endpoint_set_changes(servers: Servers, client: httpx.AsyncClient) -> None:
    pod_a, pod_b = FakePod(), FakePod(mode="hang")
    a, b = await servers.start(pod_a), await servers.start(pod_b)
    store = EndpointStore(stale_after=10.0)
    store.set_endpoints({"qwen3": [a]})
    rec = Recorder()
    poller = make(store, client, rec, timeout=30.0)
    poller.start()
    try:
        await eventually(lambda: "ok" in rec.of(a))
        assert pod_b.hits == 0
        store.set_endpoints({"qwen3": [a, b]})
        await eventually(lambda: pod_b.hits == 1)
        hits_a = pod_a.hits
        store.set_endpoints({"qwen3": [b]})
        # Removing a endpoint stops its scrapes; the hanging scrape of b keeps running.
        await eventually(lambda: pod_b.hits == 1 and len(rec.results) > 0)
        await asyncio.sleep(0.3)
        assert pod_a.hits <= hits_a + 1  # at most one scrape already in flight
    finally:
        await poller.stop()
        pod_b.release.set()


async def test_names_by_model_with_mock_transport() -> None:
    from extproc.metrics.names import SGLANG as SGLANG_NAMES

    def handler(request: httpx.Request) -> httpx.Response:
        text = SGLANG if request.url.host == "10.0.0.2" else VLLM_DP2
        return httpx.Response(200, text=text)

    v = Endpoint("10.0.0.1:8000", "qwen3", metrics_url="http://10.0.0.1:8000/metrics")
    s = Endpoint("10.0.0.2:8000", "sg", metrics_url="http://10.0.0.2:8000/metrics")
    store = EndpointStore(stale_after=10.0, clock=lambda: 5.0)
    store.set_endpoints({"qwen3": [v], "sg": [s]})
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        poller = MetricsPoller(
            store, c, names=VLLM, names_by_model={"sg": SGLANG_NAMES}, clock=lambda: 5.0
        )
        await poller.poll_once()
    ((_, vm),) = store.ready("qwen3")
    ((_, sm),) = store.ready("sg")
    assert (vm.running, vm.updated_at) == (5.0, 5.0)
    assert sm.kv_cache_usage == pytest.approx(0.42)


@pytest.mark.parametrize(
    ("body", "result"),
    [
        ("", "garbage"),
        ("# HELP only comments\n", "garbage"),
        ("unrelated_metric 1\n", "ok"),  # valid but nothing we read: a partial scrape is good
        ("vllm:num_requests_running 2\n<html>\n", "ok"),
        (b"\xff\xfe\x00garbage", "garbage"),
    ],
)
async def test_body_classification(body: str | bytes, result: str) -> None:
    ep = Endpoint("10.0.0.1:8000", "m", metrics_url="http://10.0.0.1:8000/metrics")
    store = EndpointStore(stale_after=10.0)
    store.set_endpoints({"m": [ep]})
    rec = Recorder()
    transport = httpx.MockTransport(lambda _: httpx.Response(200, content=body))
    async with httpx.AsyncClient(transport=transport) as c:
        await MetricsPoller(store, c, observer=rec).poll_once()
    assert rec.of(ep) == [result]
    assert bool(store.ready("m")) is (result == "ok")


async def test_unexpected_transport_error_is_contained() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("bug in a transport")

    ep = Endpoint("10.0.0.1:8000", "m", metrics_url="http://10.0.0.1:8000/metrics")
    store = EndpointStore(stale_after=10.0)
    store.set_endpoints({"m": [ep]})
    rec = Recorder()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        await MetricsPoller(store, c, observer=rec).poll_once()
    assert rec.of(ep) == ["error"]


async def test_concurrency_is_bounded() -> None:
    active = 0
    peak = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.02)
        active -= 1
        return httpx.Response(200, text="vllm:num_requests_running 1\n")

    eps = [
        Endpoint(f"10.0.0.{i}:8000", "m", metrics_url=f"http://10.0.0.{i}:8000/metrics")
        for i in range(1, 11)
    ]
    store = EndpointStore(stale_after=10.0)
    store.set_endpoints({"m": eps})
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        await MetricsPoller(store, c, max_concurrency=3).poll_once()
    assert peak == 3
    assert len(store.ready("m")) == 10


def test_rejects_bad_options() -> None:
    store = EndpointStore(stale_after=1.0)
    with pytest.raises(ValueError):
        MetricsPoller(store, httpx.AsyncClient(), interval=0)


async def test_models_sharing_a_server_share_one_fetch() -> None:
    fetches = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal fetches
        fetches += 1
        return httpx.Response(200, text=VLLM_TWO_MODELS)

    url = "http://10.0.0.1:8000/metrics"
    a = Endpoint("10.0.0.1:8000", "a", metrics_url=url)
    b = Endpoint("10.0.0.1:8000", "b", metrics_url=url)
    store = EndpointStore(stale_after=10.0)
    store.set_endpoints({"a": [a], "b": [b]})
    rec = Recorder()
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as c:
        await MetricsPoller(store, c, observer=rec).poll_once()
    assert fetches == 1
    assert rec.results == [("10.0.0.1:8000", "ok")]
    assert [m.running for _, m in store.ready("a")] == [1.0]
    assert [m.running for _, m in store.ready("b")] == [7.0]
