"""Envoy's gRPC access log (AccessLogService) in: one accounting record per finished request.

Envoy keeps one long-lived stream per worker and sends entries in batches, so accounting
costs a fraction of a message per request whatever the length of the answer. Each entry is
self-contained (docs/architecture.md, "Accounting"): the routing decision's metadata
(`extproc.request`, written by whichever process routed it), the usage the Lua filter read
from the body (`extproc.usage`), the host that served it, status, flags and timings. So any
process can account any request: this module turns entries into `AccessRecord`s and hands
them to the director. Converting never raises; a malformed entry becomes a record with
what could be read.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from typing import Any

import grpc

from extproc._pb.envoy.data.accesslog.v3 import accesslog_pb2 as al
from extproc._pb.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from extproc.director.api import AccessRecord, LeaseKey, Outcome, RequestHandler, RoutedRequest
from extproc.server.timers import LoopTimers, Timers, within
from extproc.types import TokenUsage
from extproc.wire import ACCESS_LOG_NAME, LEASE_KEY, REPLICA_KEY, REQUEST_NAMESPACE, USAGE_NAMESPACE

__all__ = ["ACCESS_LOG_SERVICE", "AccessLogService", "record_from_entry"]

log = logging.getLogger("extproc.server")

ACCESS_LOG_SERVICE = "envoy.service.accesslog.v3.AccessLogService"
# At shutdown, how long to wait for Envoy's next batch before ending the stream: 1.5x the
# longest flush interval in use (Envoy's default 1 s under Envoy Gateway, which sets none;
# 0.1 s in our bootstraps), so a batch due is never cut. Under load batches come sooner
# (Envoy also flushes every 16 KiB).
CLOSE_AFTER_BATCH_WAIT_S = 1.5
# Envoy flushes a stream's buffer when its entries reach this many bytes (`buffer_size_bytes`,
# Envoy's default; neither our bootstraps nor Envoy Gateway set it) as well as on its flush
# timer, which a size flush does not reset: the timer's batch can follow a size flush within
# milliseconds. A batch this large was a size flush, so at shutdown the stream is ended only
# after a smaller one (the timer's), never between the two.
ENVOY_BUFFER_BYTES = 16384

# Flags that mean the upstream side broke the exchange (a retry that then succeeded leaves
# connection-failure flags behind, so those alone do not make a 2xx a failure).
_UPSTREAM_BROKE = (
    "upstream_remote_reset",
    "upstream_connection_termination",
    "upstream_request_timeout",
    "stream_idle_timeout",
    "upstream_max_stream_duration_reached",
    "local_reset",
)
_UPSTREAM_UNREACHED = (
    "no_healthy_upstream",
    "upstream_connection_failure",
    "upstream_overflow",
    "upstream_retry_limit_exceeded",
)


def _seconds(common: al.AccessLogCommon, name: str) -> float | None:
    if not common.HasField(name):
        return None
    d = getattr(common, name)
    return float(d.seconds) + float(d.nanos) / 1e9


def _fields(metadata: Any, namespace: str) -> Any:
    """The namespace's Struct fields (a map of google.protobuf.Value), or None."""
    ns = metadata.filter_metadata.get(namespace)
    return None if ns is None else ns.fields


def _int(fields: Any, key: str) -> int | None:
    value = fields.get(key)
    if value is None or value.WhichOneof("kind") != "number_value":
        return None
    v = value.number_value
    if v != v or v < 0 or v > 2**53:  # NaN, negative or absurd: not a count
        return None
    return int(v)


def _str(fields: Any, key: str) -> str:
    value = fields.get(key)
    if value is None or value.WhichOneof("kind") != "string_value":
        return ""
    text: str = value.string_value
    return text


def _flag(fields: Any, key: str) -> bool:
    value = fields.get(key)
    return value is not None and value.WhichOneof("kind") == "bool_value" and value.bool_value


def _routed(fields: Any) -> RoutedRequest | None:
    if fields is None:
        return None
    model, endpoint = _str(fields, "model"), _str(fields, "endpoint")
    if not model or not endpoint:
        return None
    return RoutedRequest(
        model=model,
        endpoint=endpoint,
        strategy=_str(fields, "strategy"),
        route=_str(fields, "route"),
        user=_str(fields, "user"),
        prompt_tokens=_int(fields, "prompt_tokens") or 0,
        estimated=_flag(fields, "estimated"),
        stream=_flag(fields, "stream"),
        replica=_str(fields, "replica"),
        latency=_str(fields, "latency"),
        trace=_str(fields, "trace"),
    )


def _lease(fields: Any) -> LeaseKey | None:
    if fields is None:
        return None
    replica, seq = _str(fields, REPLICA_KEY), _int(fields, LEASE_KEY)
    return LeaseKey(replica, seq) if replica and seq is not None else None


def _usage(fields: Any) -> tuple[TokenUsage, int | None]:
    """The engine's usage when the Lua filter found one; else the content events it counted
    (marked `counted`); else unknown. Also the first-token wall time in ms, if seen."""
    if fields is None:
        return TokenUsage(), None
    first = _int(fields, "first_token_ms")
    prompt, completion = _int(fields, "prompt_tokens"), _int(fields, "completion_tokens")
    if prompt is not None and completion is not None:
        return TokenUsage(prompt, completion, _int(fields, "cached_tokens")), first
    events = _int(fields, "events")
    if events is not None:
        return TokenUsage(completion_tokens=events, counted=True), first
    return TokenUsage(), first


def _address(common: al.AccessLogCommon) -> str | None:
    if not common.HasField("upstream_remote_address"):
        return None
    sock = common.upstream_remote_address.socket_address
    if not sock.address:
        return None
    host = f"[{sock.address}]" if ":" in sock.address else sock.address
    return f"{host}:{sock.port_value}"


def _outcome(status: int, flags: al.ResponseFlags) -> Outcome:
    if flags.downstream_connection_termination:
        return Outcome.CLIENT_ABORTED
    if any(getattr(flags, f) for f in _UPSTREAM_BROKE):
        return Outcome.UPSTREAM_FAILED
    if status == 0 or (status >= 500 and any(getattr(flags, f) for f in _UPSTREAM_UNREACHED)):
        return Outcome.UPSTREAM_FAILED
    return Outcome.COMPLETE


def record_from_entry(entry: al.HTTPAccessLogEntry) -> AccessRecord:
    """One access-log entry as a record. Never raises on what Envoy may send."""
    common = entry.common_properties
    metadata = common.metadata
    status = entry.response.response_code.value if entry.response.HasField("response_code") else 0
    usage, first_ms = _usage(_fields(metadata, USAGE_NAMESPACE))
    request = _fields(metadata, REQUEST_NAMESPACE)
    start = float(common.start_time.seconds) + common.start_time.nanos / 1e9
    first_token_s = None
    if first_ms is not None and start > 0:
        first_token_s = max(0.0, first_ms / 1000.0 - start)
    return AccessRecord(
        request_id=entry.request.request_id,
        status=status,
        outcome=_outcome(status, common.response_flags),
        routed=_routed(request),
        upstream=_address(common),
        usage=usage,
        start_time=start,
        received_s=_seconds(common, "time_to_last_rx_byte"),
        upstream_sent_s=_seconds(common, "time_to_first_upstream_tx_byte"),
        upstream_first_byte_s=_seconds(common, "time_to_first_upstream_rx_byte"),
        first_token_s=first_token_s,
        upstream_done_s=_seconds(common, "time_to_last_upstream_rx_byte"),
        attempts=common.upstream_request_attempt_count,
        lease=_lease(request),
    )


class AccessLogService(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """Receives Envoy's access-log streams; hands each entry to the handler as a record."""

    def __init__(self, handler: RequestHandler, *, timers: Timers | None = None) -> None:
        self._handler = handler
        self._timers = timers or LoopTimers()
        self._closing: set[asyncio.Future[None]] = set()
        self.entries: Counter[str] = Counter()  # entries by result: accounted|skipped|error

    async def StreamAccessLogs(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext
    ) -> als_pb2.StreamAccessLogsResponse:
        closing = asyncio.get_running_loop().create_future()
        self._closing.add(closing)
        log_name: str | None = None
        try:
            while True:
                read = asyncio.ensure_future(context.read())
                await asyncio.wait((read, closing), return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    # Shutting down. Envoy would lose a batch sent while the stream ends: end
                    # it right after the next batch its flush timer sends, so the following
                    # one goes to the stream Envoy opens on another process.
                    await self._last_batches(context, read, log_name)
                    context.set_code(grpc.StatusCode.UNAVAILABLE)
                    context.set_details("server shutting down")
                    break
                msg = read.result()
                if msg is grpc.aio.EOF:
                    break
                if msg.HasField("identifier"):  # first message of a stream only
                    log_name = msg.identifier.log_name
                    log.info("access log stream opened (log %r)", log_name)
                self._take(log_name, msg.http_logs.log_entry)
        finally:
            self._closing.discard(closing)
        return als_pb2.StreamAccessLogsResponse()

    async def _last_batches(
        self, context: grpc.aio.ServicerContext, read: asyncio.Future[Any], log_name: str | None
    ) -> None:
        """Take the stream's batches up to the first its flush timer sent (one smaller than
        Envoy's buffer; a size flush may have the timer's right behind it), waiting at most
        `CLOSE_AFTER_BATCH_WAIT_S` for each and `2 * CLOSE_AFTER_BATCH_WAIT_S` in all."""
        deadline = self._timers.now() + 2 * CLOSE_AFTER_BATCH_WAIT_S
        while True:
            wait = min(CLOSE_AFTER_BATCH_WAIT_S, deadline - self._timers.now())
            if not await within(self._timers, read, wait):
                read.cancel()
                return
            msg = read.result()
            if msg is grpc.aio.EOF:
                return
            entries = msg.http_logs.log_entry
            self._take(log_name, entries)
            if sum(e.ByteSize() for e in entries) < ENVOY_BUFFER_BYTES:
                return  # the timer's batch: the next is a flush interval away
            read = asyncio.ensure_future(context.read())

    def _take(self, log_name: str | None, entries: Any) -> None:
        if log_name != ACCESS_LOG_NAME:
            # Another access log pointed here by mistake: its entries are not ours.
            self.entries["skipped"] += len(entries)
            return
        for entry in entries:
            if entry.common_properties.intermediate_log_entry:
                self.entries["skipped"] += 1
                continue
            try:
                self._handler.account(record_from_entry(entry))
            except Exception:  # one bad entry must never end Envoy's stream
                log.exception("cannot account an access-log entry")
                self.entries["error"] += 1
            else:
                self.entries["accounted"] += 1

    @property
    def streams(self) -> int:
        """Open access-log streams (Envoy keeps one per worker)."""
        return len(self._closing)

    def close_streams(self) -> None:
        """End every access-log stream (shutdown): Envoy reconnects to another process."""
        for closing in list(self._closing):
            if not closing.done():
                closing.set_result(None)
