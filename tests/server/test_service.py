"""ExtProcServer: no I/O before `start()`; its shutdown schedule runs on injected time."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.server.service import EXT_PROC_SERVICE, ExtProcServer, ServerOptions
from tests._clock import ManualClock
from tests.server._messages import body_msg, exchange, headers_msg
from tests.server.fake_handler import FakeHandler


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port some other socket is listening on."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_constructing_binds_nothing_and_start_binds(taken_port: int) -> None:
    # On a port in use, the constructor succeeds (nothing bound yet); start() is what fails.
    busy = ExtProcServer(FakeHandler(), ServerOptions(port=taken_port))
    with pytest.raises(RuntimeError, match="not started"):
        _ = busy.port
    with pytest.raises((OSError, RuntimeError)):
        await busy.start()
    await busy.stop(0.1)  # never started: a no-op
    # And a constructed server leaves its port free until it starts.
    port = free_port()
    server = ExtProcServer(FakeHandler(), ServerOptions(port=port))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", port))
    await server.start()
    try:
        assert server.port == port
        got = await exchange(port, [headers_msg(), body_msg(b"{}")])
        assert got[-1].HasField("request_body")
        with pytest.raises(RuntimeError, match="already started"):
            await server.start()
    finally:
        await server.stop(0.5)


async def _health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE), timeout=3.0
        )
        return int(resp.status)


async def _draining(
    clock: ManualClock, grace: float, announce_s: float
) -> tuple[int, asyncio.Task[None]]:
    """A ready server on the manual clock told to stop: its port and the stop in progress
    (once its announcement has begun)."""
    server = ExtProcServer(FakeHandler(), ServerOptions(port=0), timers=clock)
    await server.start()
    await server.set_ready(True)
    stopping = asyncio.create_task(server.stop(grace, announce_s=announce_s))
    await clock.until_sleeping(1)
    return server.port, stopping


async def _served_while_draining(port: int) -> bool:
    got = await exchange(port, [headers_msg(), body_msg(b"{}")])
    return got[-1].HasField("request_body")


async def _refused_once_stopped(port: int, stopping: asyncio.Task[None]) -> None:
    await asyncio.wait_for(stopping, 5.0)
    with pytest.raises(grpc.aio.AioRpcError):
        await exchange(port, [headers_msg(), body_msg(b"{}")])


async def test_new_streams_are_served_while_not_serving_is_announced() -> None:
    # For announce_s Envoy's health checks learn NOT_SERVING; streams that still arrive in that
    # time are served, not refused.
    clock = ManualClock()
    port, stopping = await _draining(clock, 0.5, 1.5)
    assert await _health(port) == health_pb2.HealthCheckResponse.NOT_SERVING
    assert await _served_while_draining(port)  # routed
    assert not stopping.done()
    clock.advance(1.5)
    await _refused_once_stopped(port, stopping)


async def test_the_announcement_lasts_while_new_streams_still_come() -> None:
    # Issue 32 #4: a peer restarted a moment ago is not healthy in Envoy's eyes yet, so Envoy's
    # panic mode sends new streams to this NOT_SERVING process. Closing the port then (after a
    # fixed announce_s) refused them: a 500 each, fail-closed. The port stays open, serving
    # them, until none has come for announce_s.
    clock = ManualClock()
    port, stopping = await _draining(clock, 10.0, 1.5)
    for _ in range(3):  # a stream every second: never 1.5 s of quiet
        clock.advance(1.0)
        await asyncio.sleep(0)
        assert await _served_while_draining(port)
        assert not stopping.done()
    await clock.until_sleeping(1)
    clock.advance(1.0)  # 1.0 s since the last stream: still announcing
    await clock.until_sleeping(1)
    assert not stopping.done()
    assert await _served_while_draining(port)
    clock.advance(1.5)  # 1.5 s of quiet: new streams are refused from now on
    await _refused_once_stopped(port, stopping)


async def test_streams_that_never_stop_coming_end_the_announcement_at_the_grace() -> None:
    # A single process (or every process draining at once): Envoy has nowhere else to send.
    # The announcement ends at the grace period all the same.
    clock = ManualClock()
    port, stopping = await _draining(clock, 4.0, 1.5)
    for _ in range(4):
        assert await _served_while_draining(port)
        clock.advance(1.0)
        await asyncio.sleep(0)
    await _refused_once_stopped(port, stopping)
