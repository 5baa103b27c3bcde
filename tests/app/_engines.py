"""An engine's `/metrics` over real HTTP (aiohttp on a free loopback port), for App tests."""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

from aiohttp import web

__all__ = ["free_port", "serve_metrics"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def serve_metrics(
    handler: Callable[[web.Request], Awaitable[web.Response]],
) -> tuple[web.AppRunner, int]:
    """Serve `handler` at /metrics; the caller cleans the runner up."""
    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port
