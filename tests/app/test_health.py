"""gRPC health: liveness while the process runs; readiness only with a fresh endpoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from aiohttp import web
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.app import App
from extproc.config import load_config_text
from tests.app._engines import free_port, serve_metrics

VLLM_METRICS = """# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


@pytest.fixture
async def engine_metrics() -> AsyncIterator[tuple[int, dict[str, bool]]]:
    state = {"up": True}

    async def metrics(_request: web.Request) -> web.Response:
        if not state["up"]:
            return web.Response(status=500)
        return web.Response(text=VLLM_METRICS)

    runner, port = await serve_metrics(metrics)
    try:
        yield port, state
    finally:
        await runner.cleanup()


async def health(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        return int(resp.status)


async def wait_status(port: int, service: str, want: int) -> int:
    status = -1
    for _ in range(60):
        status = await health(port, service)
        if status == want:
            break
        await asyncio.sleep(0.1)
    return status


async def test_readiness_follows_fresh_metrics(engine_metrics: tuple[int, dict[str, bool]]) -> None:
    eng_port, state = engine_metrics
    grpc_port = free_port()
    cfg = load_config_text(f"""
server: {{grpc_port: {grpc_port}, metrics_port: {free_port()}}}
metrics: {{poll_interval_s: 0.1, stale_after_s: 0.5}}
flow_control: {{enabled: false}}  # with it, the server serves (queues) with no ready pod
models:
  - name: m
    endpoints: [{{address: "127.0.0.1:{eng_port}", metrics_url: "http://127.0.0.1:{eng_port}/metrics"}}]
""")
    app = App(cfg)
    await app.start()
    serving, not_serving = (
        health_pb2.HealthCheckResponse.SERVING,
        health_pb2.HealthCheckResponse.NOT_SERVING,
    )
    try:
        assert await health(grpc_port, "liveness") == serving
        assert await wait_status(grpc_port, "readiness", serving) == serving
        assert await health(grpc_port, "envoy.service.ext_proc.v3.ExternalProcessor") == serving
        state["up"] = False  # scrapes fail: the last good value goes stale after 0.5 s
        assert await wait_status(grpc_port, "readiness", not_serving) == not_serving
        assert await health(grpc_port, "liveness") == serving
        state["up"] = True
        assert await wait_status(grpc_port, "readiness", serving) == serving
    finally:
        await app.stop()


async def test_the_tokenizers_are_loaded_when_the_server_starts_listening(
    engine_metrics: tuple[int, dict[str, bool]], qwen_tokenizer_dir: Path
) -> None:
    # A tokenizer's load holds the GIL: done after SERVING, it stalled the health check past
    # Envoy's timeout (CI's 503s of 2026-12-06). Loaded before the port opens, none is left.
    eng_port, _ = engine_metrics
    grpc_port = free_port()
    cfg = load_config_text(f"""
server: {{grpc_port: {grpc_port}, metrics_port: {free_port()}}}
flow_control: {{enabled: false}}
models:
  - name: m
    tokenizer: {qwen_tokenizer_dir}
    endpoints: [{{address: "127.0.0.1:{eng_port}", metrics_url: "http://127.0.0.1:{eng_port}/metrics"}}]
""")
    app = App(cfg)
    assert app.tokenizers.loaded_count() == 0
    await app.start()
    try:
        assert app.tokenizers.loaded_count() == 1
        assert await health(grpc_port, "liveness") == health_pb2.HealthCheckResponse.SERVING
    finally:
        await app.stop()
