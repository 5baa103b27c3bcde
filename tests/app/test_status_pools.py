"""The admin views at many pools: a summary row per pool (those needing attention first), the
endpoints of chosen pools only (`?model=`, `?top=`), in a real App over real HTTP /metrics."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from aiohttp import web

from extproc.app import App
from extproc.config import load_config_text
from tests.app._engines import free_port, serve_metrics

POOLS, PODS = 30, 3  # 90 endpoints: more than the page details at once
DOWN = "pool-07"  # its pods' metrics port is closed


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def running() -> AsyncIterator[tuple[App, httpx.AsyncClient]]:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{engine="0"} 0.0\n')

    runner, port = await serve_metrics(metrics)
    down = closed_port()
    lines = []
    for j in range(POOLS):
        name = f"pool-{j:02d}"
        metrics_port = down if name == DOWN else port
        eps = ", ".join(
            f'{{address: "10.1.{j}.{i}:8000", '
            f'metrics_url: "http://127.0.0.1:{metrics_port}/metrics?pod={j}-{i}"}}'
            for i in range(PODS)
        )
        lines.append(f"  - name: {name}\n    endpoints: [{eps}]")
    admin = free_port()
    text = (
        f"server: {{grpc_port: {free_port()}, metrics_port: {admin}, status_page: true}}\n"
        "models:\n" + "\n".join(lines) + "\n"
    )
    app = App(load_config_text(text))
    await app.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin}", timeout=10) as client:
            for _ in range(100):
                if sum(not e["ready"] for e in (await get(client, "/debug/endpoints"))) == PODS:
                    break
                await asyncio.sleep(0.05)
            yield app, client
    finally:
        await app.stop()
        await runner.cleanup()


async def get(client: httpx.AsyncClient, path: str, status: int = 200) -> Any:
    resp = await client.get(path)
    assert resp.status_code == status, resp.text
    return resp.json()


async def test_a_summary_row_per_pool_the_failing_one_first(
    running: tuple[App, httpx.AsyncClient],
) -> None:
    _, client = running
    pools = await get(client, "/debug/pools")
    assert len(pools) == POOLS
    assert pools[0]["model"] == DOWN and pools[0]["ready"] == 0 and pools[0]["unreachable"] == 3
    assert all(p["ready"] == PODS for p in pools[1:])
    assert [p["model"] for p in pools[1:]] == sorted(p["model"] for p in pools[1:])


async def test_the_page_details_the_pools_needing_attention_or_those_asked_for(
    running: tuple[App, httpx.AsyncClient],
) -> None:
    _, client = running
    default = await get(client, "/status.json")
    assert len(default["pools"]) == POOLS
    assert default["shown"]["all"] is False and default["shown"]["filtered"] is False
    assert default["models"][0]["name"] == DOWN
    assert len(default["models"]) == 5  # the first five in attention order
    chosen = await get(client, "/status.json?model=pool-12,pool-03,nope")
    assert [m["name"] for m in chosen["models"]] == ["pool-03", "pool-12"]
    assert all(len(m["endpoints"]) == PODS for m in chosen["models"])
    assert chosen["shown"]["filtered"] is True
    assert (await get(client, "/status.json?top=0"))["models"] == []
    every = await get(client, f"/status.json?top={POOLS}")
    assert len(every["models"]) == POOLS and every["shown"]["all"] is True
    await get(client, "/status.json?top=many", status=400)


async def test_endpoints_filtered_by_pool_and_readiness(
    running: tuple[App, httpx.AsyncClient],
) -> None:
    _, client = running
    assert len(await get(client, "/debug/endpoints")) == POOLS * PODS
    one = await get(client, "/debug/endpoints?model=pool-12")
    assert {e["address"] for e in one} == {f"10.1.12.{i}:8000" for i in range(PODS)}
    broken = await get(client, "/debug/endpoints?not_ready=1")
    assert {e["model"] for e in broken} == {DOWN} and len(broken) == PODS
    assert await get(client, "/debug/endpoints?model=unknown") == []
