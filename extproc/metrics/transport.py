"""An httpx transport with one small connection pool per host, for scraping many pods.

httpcore's pool is one flat list: every request start and end walks all of its connections
(`_assign_requests_to_connections`), so one client scraping 256 pods twice a second spent
about two thirds of the server's CPU walking 256 keep-alive connections and fell behind
(scrapes timed out, pods went stale). Here each host has its own tiny pool: the walk is over
one or two connections whatever the number of pods. Hosts are kept in LRU order up to
`max_hosts`; the least recently scraped one beyond that is closed (a pod that left). The pools
share one TLS context.
"""

from __future__ import annotations

from collections import OrderedDict

import httpx

__all__ = ["PerHostTransport"]


class PerHostTransport(httpx.AsyncBaseTransport):
    def __init__(self, *, max_hosts: int = 4096, connections_per_host: int = 2) -> None:
        if max_hosts <= 0 or connections_per_host <= 0:
            raise ValueError("max_hosts and connections_per_host must be positive")
        self._max_hosts = max_hosts
        self._limits = httpx.Limits(
            max_connections=connections_per_host, max_keepalive_connections=connections_per_host
        )
        # One TLS context for all pools: building one loads the CA bundle (~75 ms of CPU).
        self._ssl = httpx.create_ssl_context()
        self._pools: OrderedDict[tuple[bytes, bytes, int | None], httpx.AsyncHTTPTransport] = (
            OrderedDict()
        )

    def hosts(self) -> int:
        """How many hosts have a pool now."""
        return len(self._pools)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = httpx.AsyncHTTPTransport(
                verify=self._ssl, limits=self._limits
            )
            while len(self._pools) > self._max_hosts:
                _, oldest = self._pools.popitem(last=False)
                await oldest.aclose()
        else:
            self._pools.move_to_end(key)
        return await pool.handle_async_request(request)

    async def aclose(self) -> None:
        pools = list(self._pools.values())
        self._pools.clear()
        for pool in pools:
            await pool.aclose()
