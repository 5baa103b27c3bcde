"""A stopping process waits for one more scrape of /metrics (`server.final_scrape_s`), so the
counts of its last records reach Prometheus; one nobody scraped exits at once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest
from aiohttp import web

from extproc.app import App
from extproc.config import load_config_text
from tests.app._engines import free_port, serve_metrics

VLLM_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
"""
WAIT_S = 60.0  # far beyond the test's own timeouts: a stop that returns did not wait it out


@pytest.fixture
async def engine_port() -> AsyncIterator[int]:
    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text=VLLM_METRICS)

    runner, port = await serve_metrics(metrics)
    try:
        yield port
    finally:
        await runner.cleanup()


async def started(engine_port: int, wait_s: float) -> tuple[App, str]:
    admin = free_port()
    cfg = load_config_text(f"""
server: {{grpc_port: {free_port()}, metrics_port: {admin}, final_scrape_s: {wait_s}}}
flow_control: {{enabled: false}}
models:
  - name: m
    endpoints: [{{address: "127.0.0.1:{engine_port}", metrics_url: "http://127.0.0.1:{engine_port}/metrics"}}]
""")
    app = App(cfg)
    await app.start()
    return app, f"http://127.0.0.1:{admin}/metrics"


async def test_a_scraped_process_stops_after_the_next_scrape_and_that_scrape_is_whole(
    engine_port: int,
) -> None:
    app, url = await started(engine_port, WAIT_S)
    async with httpx.AsyncClient(timeout=5) as http:
        assert (await http.get(url)).status_code == 200
        stopping = asyncio.create_task(app.stop())
        # Drained (the gRPC port is closed) but still waiting: nobody scraped since.
        await asyncio.sleep(1.5)
        assert not stopping.done()
        final = await http.get(url)
        assert final.status_code == 200
        assert "extproc_access_records_total" in final.text  # the whole exposition
        assert int(final.headers["content-length"]) == len(final.content)
        await asyncio.wait_for(stopping, 10)  # the scrape ended the wait, not WAIT_S
    async with httpx.AsyncClient(timeout=2) as http:
        with pytest.raises(httpx.ConnectError):
            await http.get(url)  # gone after it


async def test_a_process_never_scraped_stops_without_waiting(engine_port: int) -> None:
    app, _ = await started(engine_port, WAIT_S)
    await asyncio.wait_for(app.stop(), 10)


async def test_no_wait_by_default(engine_port: int) -> None:
    app, url = await started(engine_port, 0.0)
    async with httpx.AsyncClient(timeout=5) as http:
        assert (await http.get(url)).status_code == 200
    await asyncio.wait_for(app.stop(), 10)
