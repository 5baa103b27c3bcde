"""PerHostTransport against real HTTP servers: one pool per host, reused, LRU-bounded."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from extproc.metrics.transport import PerHostTransport


@pytest.fixture
async def hosts() -> AsyncIterator[list[str]]:
    """Three HTTP servers answering /metrics with their own port, and the peer port each
    connection came from (to tell a reused connection from a new one)."""
    runners = []
    urls = []
    for _ in range(3):

        async def handle(request: web.Request) -> web.Response:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            return web.Response(text=f"{request.url.port} {peer[1] if peer else 0}")

        app = web.Application()
        app.router.add_get("/metrics", handle)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}/metrics")
    yield urls
    for runner in runners:
        await runner.cleanup()


async def test_each_host_has_its_own_reused_pool(hosts: list[str]) -> None:
    transport = PerHostTransport()
    async with httpx.AsyncClient(transport=transport) as client:
        first = [(await client.get(u)).text for u in hosts]
        again = [(await client.get(u)).text for u in hosts]
        assert [t.split()[0] for t in first] == [u.split(":")[2].split("/")[0] for u in hosts]
        assert again == first  # same client port: the keep-alive connection was reused
        assert transport.hosts() == 3


async def test_least_recently_used_host_is_closed_beyond_the_bound(hosts: list[str]) -> None:
    transport = PerHostTransport(max_hosts=2)
    async with httpx.AsyncClient(transport=transport) as client:
        a = (await client.get(hosts[0])).text
        await client.get(hosts[1])
        await client.get(hosts[0])  # hosts[0] is now the most recent
        await client.get(hosts[2])  # evicts hosts[1]
        assert transport.hosts() == 2
        assert (await client.get(hosts[0])).text == a  # still pooled: same connection
        assert (await client.get(hosts[1])).status_code == 200  # a fresh pool, still served
        assert transport.hosts() == 2


def test_rejects_non_positive_bounds() -> None:
    with pytest.raises(ValueError):
        PerHostTransport(max_hosts=0)
