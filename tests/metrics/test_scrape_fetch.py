"""PageFetcher against real HTTP servers: one kept connection per pod, the framings a metrics
endpoint answers with, every failure kind, and httpx for what it does not read."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
from aiohttp import web

from extproc.metrics.names import VLLM
from extproc.metrics.poller import MetricsPoller
from extproc.metrics.scrape import PageFetcher, ScrapeError
from extproc.metrics.store import EndpointStore
from extproc.types import Endpoint
from tests.metrics.expositions import VLLM_DP2

pytestmark = pytest.mark.usefixtures("no_leaked_tasks")
PAGE = VLLM_DP2.encode()


@dataclass
class Pod:
    """A real /metrics server; `mode` switches its answer; it counts connections."""

    mode: str = "ok"  # ok | chunked | 500 | big | redirect | gzip
    peers: set[tuple[str, int]] = field(default_factory=set)
    hits: int = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer is not None:
            self.peers.add(peer)
        if self.mode == "chunked":
            resp = web.StreamResponse()
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for i in range(0, len(PAGE), 1000):
                await resp.write(PAGE[i : i + 1000])
            await resp.write_eof()
            return resp
        if self.mode == "500":
            return web.Response(status=500, text="boom")
        if self.mode == "big":
            return web.Response(body=b"x 1\n" * 100_000)
        if self.mode == "redirect":
            raise web.HTTPFound("/metrics2")
        return web.Response(body=PAGE, content_type="text/plain")

    async def handle2(self, request: web.Request) -> web.StreamResponse:
        return web.Response(body=PAGE, content_type="text/plain")


@dataclass
class Servers:
    runners: list[web.AppRunner] = field(default_factory=list)

    async def start(self, pod: Pod, keepalive: float = 75.0) -> str:
        app = web.Application()
        app.router.add_get("/metrics", pod.handle)
        app.router.add_get("/metrics2", pod.handle2)
        runner = web.AppRunner(app, shutdown_timeout=0.1, keepalive_timeout=keepalive)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}/metrics"


@pytest.fixture
async def servers() -> AsyncIterator[Servers]:
    s = Servers()
    yield s
    for runner in s.runners:
        await runner.cleanup()


@pytest.fixture
async def fetcher() -> AsyncIterator[PageFetcher]:
    async with httpx.AsyncClient() as client:
        f = PageFetcher(client, max_bytes=100_000)
        yield f
        await f.aclose()


@pytest.mark.parametrize("mode", ["ok", "chunked"])
async def test_pages_read_whole_over_one_kept_connection(
    servers: Servers, fetcher: PageFetcher, mode: str
) -> None:
    pod = Pod(mode=mode)
    url = await servers.start(pod)
    for _ in range(5):
        assert await fetcher.fetch(url) == PAGE
    assert pod.hits == 5 and len(pod.peers) == 1  # one connection, kept
    assert fetcher.connections() == 1


async def test_a_connection_the_pod_closed_while_idle_is_replaced(
    servers: Servers, fetcher: PageFetcher
) -> None:
    pod = Pod()
    url = await servers.start(pod, keepalive=0.05)
    assert await fetcher.fetch(url) == PAGE
    await asyncio.sleep(0.3)  # the server closes the idle keep-alive connection
    assert await fetcher.fetch(url) == PAGE
    assert len(pod.peers) == 2


@pytest.mark.parametrize(("mode", "result"), [("500", "http_error"), ("big", "too_large")])
async def test_failures_are_classified(
    servers: Servers, fetcher: PageFetcher, mode: str, result: str
) -> None:
    url = await servers.start(Pod(mode=mode))
    with pytest.raises(ScrapeError) as info:
        await fetcher.fetch(url)
    assert info.value.result == result
    pod_ok = Pod()  # and the next page on the same fetcher is fine
    assert await fetcher.fetch(await servers.start(pod_ok)) == PAGE


async def test_a_closed_port_is_a_connection_error(fetcher: PageFetcher) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectionRefusedError):
        await fetcher.fetch(f"http://127.0.0.1:{port}/metrics")


async def test_redirects_and_https_go_to_httpx() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(200, content=PAGE)

    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        fetcher = PageFetcher(client)
        assert await fetcher.fetch("https://pod.example:8443/metrics") == PAGE
    assert seen == ["https://pod.example:8443/metrics"]


async def test_a_redirect_is_followed_by_httpx(servers: Servers) -> None:
    url = await servers.start(Pod(mode="redirect"))
    async with httpx.AsyncClient(follow_redirects=True) as client:
        fetcher = PageFetcher(client)
        assert await fetcher.fetch(url) == PAGE
        await fetcher.aclose()


async def test_the_poller_reads_pods_through_it(servers: Servers) -> None:
    pods = [Pod(), Pod(mode="chunked")]
    urls = [await servers.start(p) for p in pods]
    eps = [Endpoint(u.split("/")[2], "qwen3", metrics_url=u) for u in urls]
    store = EndpointStore(stale_after=10.0)
    store.set_endpoints({"qwen3": eps})
    async with httpx.AsyncClient() as client:
        fetcher = PageFetcher(client)
        poller = MetricsPoller(store, client, fetch=fetcher.fetch, names=VLLM)
        await poller.poll_once()
        await poller.poll_once()
        await fetcher.aclose()
    ready = dict(store.ready("qwen3"))
    assert [ready[ep].running for ep in eps] == [5.0, 5.0]
    assert [len(p.peers) for p in pods] == [1, 1]
