"""Access-log entries in, accounting records out: the conversion (table-driven) and the real
gRPC AccessLogService stream, as Envoy drives it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest

from extproc._pb.envoy.data.accesslog.v3 import accesslog_pb2 as al
from extproc._pb.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from extproc.director.api import LeaseKey, Outcome, RoutedRequest
from extproc.server.accesslog import (
    CLOSE_AFTER_BATCH_WAIT_S,
    ENVOY_BUFFER_BYTES,
    record_from_entry,
)
from extproc.server.service import ExtProcServer, ServerOptions
from extproc.types import TokenUsage
from extproc.wire import ACCESS_LOG_NAME
from tests._clock import ManualClock
from tests.server.fake_handler import FakeHandler

ROUTED: dict[str, Any] = {
    "model": "qwen3",
    "endpoint": "10.0.0.1:8000",
    "strategy": "least-request",
    "route": "httproute/ns/llm/rule/0/match/0/*",
    "user": "alice",
    "prompt_tokens": 12,
    "estimated": False,
    "stream": True,
    "replica": "gw-0:17",
}


def entry(
    *,
    status: int | None = 200,
    routed: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None,
    flags: tuple[str, ...] = (),
    upstream: tuple[str, int] | None = ("10.0.0.2", 8000),
) -> al.HTTPAccessLogEntry:
    e = al.HTTPAccessLogEntry()
    c = e.common_properties
    c.start_time.seconds, c.start_time.nanos = 1_800_000_000, 500_000_000
    c.time_to_last_rx_byte.nanos = 500_000
    c.time_to_first_upstream_tx_byte.nanos = 2_000_000
    c.time_to_first_upstream_rx_byte.nanos = 30_000_000
    c.time_to_last_upstream_rx_byte.seconds = 2
    c.upstream_request_attempt_count = 1
    if upstream is not None:
        c.upstream_remote_address.socket_address.address = upstream[0]
        c.upstream_remote_address.socket_address.port_value = upstream[1]
    for flag in flags:
        setattr(c.response_flags, flag, True)
    for ns, values in (("extproc.request", routed), ("extproc.usage", usage)):
        if values is None:
            continue
        fields = c.metadata.filter_metadata[ns].fields
        for k, v in values.items():
            if isinstance(v, bool):
                fields[k].bool_value = v
            elif isinstance(v, str):
                fields[k].string_value = v
            else:
                fields[k].number_value = v
    e.request.request_id = "rid-9"
    if status is not None:
        e.response.response_code.value = status
    return e


def test_a_complete_streamed_answer() -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 40, "cached_tokens": 8, "events": 40}
    usage["first_token_ms"] = 1_800_000_000_500 + 130  # 130 ms after the start
    rec = record_from_entry(entry(routed=ROUTED, usage=usage))
    assert rec.request_id == "rid-9"
    assert rec.status == 200 and rec.outcome is Outcome.COMPLETE
    assert rec.routed == RoutedRequest(**ROUTED)
    assert rec.upstream == "10.0.0.2:8000"  # the host that served it (a retry may differ)
    assert rec.usage == TokenUsage(12, 40, 8)
    assert rec.start_time == pytest.approx(1_800_000_000.5)
    assert rec.received_s == pytest.approx(0.0005)
    assert rec.upstream_sent_s == pytest.approx(0.002)
    assert rec.upstream_first_byte_s == pytest.approx(0.03)
    assert rec.first_token_s == pytest.approx(0.13, abs=1e-6)
    assert rec.upstream_done_s == pytest.approx(2.0)


def test_the_routing_span_comes_back_with_the_record() -> None:
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    routed = RoutedRequest(**{**ROUTED, "trace": trace})
    rec = record_from_entry(entry(routed=routed.metadata()))
    assert rec.routed == routed and rec.routed.trace == trace


@pytest.mark.parametrize(
    ("status", "flags", "outcome"),
    [
        (200, (), Outcome.COMPLETE),
        (400, (), Outcome.COMPLETE),  # the engine answered: a complete (error) response
        (200, ("downstream_connection_termination",), Outcome.CLIENT_ABORTED),
        (0, ("downstream_connection_termination",), Outcome.CLIENT_ABORTED),
        (200, ("upstream_remote_reset",), Outcome.UPSTREAM_FAILED),
        (503, ("upstream_connection_failure",), Outcome.UPSTREAM_FAILED),
        (200, ("upstream_connection_failure",), Outcome.COMPLETE),  # a retry then succeeded
        (504, ("upstream_request_timeout",), Outcome.UPSTREAM_FAILED),
        (None, (), Outcome.UPSTREAM_FAILED),  # no response at all
    ],
)
def test_outcome(status: int | None, flags: tuple[str, ...], outcome: Outcome) -> None:
    assert record_from_entry(entry(status=status, routed=ROUTED, flags=flags)).outcome is outcome


@pytest.mark.parametrize(
    ("usage", "want"),
    [
        ({"prompt_tokens": 5, "completion_tokens": 3}, TokenUsage(5, 3)),
        ({"events": 17}, TokenUsage(completion_tokens=17, counted=True)),  # no usage: counted
        ({"events": 17, "prompt_tokens": 5}, TokenUsage(completion_tokens=17, counted=True)),
        ({}, TokenUsage()),
        (None, TokenUsage()),  # compressed or not JSON: unknown, never 0
        ({"prompt_tokens": -4, "completion_tokens": 3}, TokenUsage()),
        ({"prompt_tokens": "5", "completion_tokens": 3}, TokenUsage()),
        ({"prompt_tokens": float("nan"), "completion_tokens": 3}, TokenUsage()),
    ],
)
def test_usage(usage: dict[str, Any] | None, want: TokenUsage) -> None:
    assert record_from_entry(entry(routed=ROUTED, usage=usage)).usage == want


@pytest.mark.parametrize(
    "routed",
    [None, {}, {"model": "qwen3"}, {"endpoint": "10.0.0.1:8000"}, {"model": 3, "endpoint": 4}],
)
def test_entries_without_a_routing_decision_are_unrouted(routed: dict[str, Any] | None) -> None:
    assert record_from_entry(entry(routed=routed)).routed is None


@pytest.mark.parametrize(
    ("request_meta", "lease"),
    [
        pytest.param({**ROUTED, "lease": 41}, LeaseKey("gw-0:17", 41), id="routed"),
        # A route with accounting off carries only the lease: it still ends it.
        pytest.param({"replica": "gw-0:17", "lease": 7}, LeaseKey("gw-0:17", 7), id="lease-only"),
        pytest.param(ROUTED, None, id="no-lease-number"),
        pytest.param({"lease": 7}, None, id="no-replica"),
        pytest.param({"replica": "gw-0:17", "lease": -1}, None, id="negative"),
        pytest.param({"replica": "gw-0:17", "lease": "7"}, None, id="not-a-number"),
        pytest.param(None, None, id="no-metadata"),
    ],
)
def test_the_record_names_the_lease_the_decision_took(
    request_meta: dict[str, Any] | None, lease: LeaseKey | None
) -> None:
    assert record_from_entry(entry(routed=request_meta)).lease == lease


def test_an_empty_entry_converts() -> None:
    rec = record_from_entry(al.HTTPAccessLogEntry())
    assert rec.status == 0 and rec.routed is None and rec.upstream is None
    assert rec.usage == TokenUsage() and rec.first_token_s is None


@pytest.fixture
async def server() -> AsyncIterator[tuple[ExtProcServer, FakeHandler]]:
    handler = FakeHandler()
    srv = ExtProcServer(handler, ServerOptions(port=0))
    await srv.start()
    try:
        yield srv, handler
    finally:
        await srv.stop(0.5)


def batches(log_name: str, entries: list[al.HTTPAccessLogEntry], per: int) -> Iterator[Any]:
    for i in range(0, len(entries), per):
        msg = als_pb2.StreamAccessLogsMessage()
        if i == 0:
            msg.identifier.log_name = log_name
        msg.http_logs.log_entry.extend(entries[i : i + per])
        yield msg


async def send(port: int, messages: Iterator[Any]) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs(messages)


async def test_every_entry_of_every_batch_is_accounted_once(
    server: tuple[ExtProcServer, FakeHandler],
) -> None:
    srv, handler = server
    entries = [
        entry(routed=ROUTED, usage={"prompt_tokens": 1, "completion_tokens": i}) for i in range(45)
    ]
    await send(srv.port, batches(ACCESS_LOG_NAME, entries, per=20))
    assert [r.usage.completion_tokens for r in handler.records] == list(range(45))
    assert srv.access_log.entries["accounted"] == 45


async def test_another_log_pointed_here_is_skipped(
    server: tuple[ExtProcServer, FakeHandler],
) -> None:
    srv, handler = server
    await send(srv.port, batches("someone-elses-log", [entry(routed=ROUTED)] * 3, per=2))
    assert handler.records == []
    assert srv.access_log.entries["skipped"] == 3


async def test_an_accounting_error_never_ends_the_stream(
    server: tuple[ExtProcServer, FakeHandler],
) -> None:
    srv, handler = server
    handler.fail_accounting = True
    await send(srv.port, batches(ACCESS_LOG_NAME, [entry(routed=ROUTED)] * 3, per=1))
    assert srv.access_log.entries["error"] == 3


async def _wait_for(predicate: Any) -> None:
    """Until gRPC has delivered (real I/O, bounded)."""
    for _ in range(500):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not delivered")


def _batch(entries: int = 1) -> als_pb2.StreamAccessLogsMessage:
    msg = als_pb2.StreamAccessLogsMessage()
    for _ in range(entries):
        msg.http_logs.log_entry.append(entry(routed=ROUTED))
    return msg


async def _open_log_stream(channel: grpc.aio.Channel, handler: FakeHandler) -> Any:
    """Envoy's access-log stream, its first batch (one record) accounted."""
    call = als_pb2_grpc.AccessLogServiceStub(channel).StreamAccessLogs()
    first = _batch()
    first.identifier.log_name = ACCESS_LOG_NAME
    await call.write(first)
    await _wait_for(lambda: handler.records)
    return call


@contextlib.asynccontextmanager
async def _log_server() -> AsyncIterator[tuple[ManualClock, FakeHandler, ExtProcServer, Any]]:
    """A server on a hand-moved clock with one access-log stream open, its first record in."""
    clock = ManualClock()
    handler = FakeHandler()
    srv = ExtProcServer(handler, ServerOptions(port=0), timers=clock)
    await srv.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}") as channel:
        yield clock, handler, srv, await _open_log_stream(channel, handler)


async def _close_after(
    call: Any, clock: ManualClock, srv: ExtProcServer, stopping: Any, *, last_batch: bool
) -> None:
    """Envoy sends one more (small: its timer's) batch, or none within the wait; either way
    the stopping server ends the stream."""
    if last_batch:
        await call.write(_batch())
    else:
        clock.advance(CLOSE_AFTER_BATCH_WAIT_S)
    await asyncio.wait_for(stopping, timeout=5.0)
    assert srv.access_log.streams == 0


async def _ended_unavailable(call: Any) -> None:
    """The server ended the stream as a stopping process does: Envoy reconnects elsewhere."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


@pytest.mark.parametrize("batch_while_closing", [False, True])
async def test_shutdown_ends_an_access_log_stream_after_its_next_batch(
    batch_while_closing: bool,
) -> None:
    async with _log_server() as (clock, handler, srv, call):
        assert srv.access_log.streams == 1
        # Envoy never closes it: shutdown must, once the announce period is over (the leases
        # of what this process routed do not wait for records here: any process ends them).
        stopping = asyncio.create_task(srv.stop(30.0, announce_s=1.0))
        await clock.until_sleeping(1)
        clock.advance(0.9)
        await asyncio.sleep(0.05)
        assert srv.access_log.streams == 1  # still announcing NOT_SERVING
        clock.advance(0.1)
        # Asked to close, it waits for Envoy's next batch so that batch is not lost.
        await clock.until_sleeping(1)
        assert srv.access_log.streams == 1
        await _close_after(call, clock, srv, stopping, last_batch=batch_while_closing)
        assert len(handler.records) == (2 if batch_while_closing else 1)
        await _ended_unavailable(call)


@pytest.mark.parametrize("timer_batch_follows", [True, False])
async def test_shutdown_after_a_size_flush_waits_for_the_timers_batch_behind_it(
    timer_batch_follows: bool,
) -> None:
    """Envoy flushes when its buffer reaches 16 KiB and on its timer, which a size flush does
    not reset: the timer's batch can come right behind. Ending the stream after the big batch
    would lose the small one (a record lost on a SIGTERM of the sink under load)."""
    async with _log_server() as (clock, handler, srv, call):
        stopping = asyncio.create_task(srv.stop(30.0, announce_s=0.0))
        await clock.until_sleeping(1)  # waiting for the next batch
        big = _batch()
        while sum(e.ByteSize() for e in big.http_logs.log_entry) < ENVOY_BUFFER_BYTES:
            big.http_logs.log_entry.append(entry(routed=ROUTED))
        await call.write(big)
        await _wait_for(lambda: len(handler.records) == 1 + len(big.http_logs.log_entry))
        await clock.until_sleeping(1)
        assert srv.access_log.streams == 1  # a size flush: the timer's batch may be behind it
        await _close_after(call, clock, srv, stopping, last_batch=timer_batch_follows)
        want = 1 + len(big.http_logs.log_entry) + (1 if timer_batch_follows else 0)
        assert len(handler.records) == want
        await _ended_unavailable(call)
