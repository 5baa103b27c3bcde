"""The gRPC server: ExternalProcessor and AccessLogService, health, TLS, graceful shutdown.

Constructing an `ExtProcServer` does no I/O: `start()` reads the TLS files, binds the port
and serves. Its shutdown waits on injected `Timers`, so tests move time instead of sleeping.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc._pb.envoy.service.accesslog.v3 import als_pb2_grpc
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.director.api import RequestHandler
from extproc.server.accesslog import AccessLogService
from extproc.server.processor import StreamProcessor
from extproc.server.timers import LoopTimers, Timers
from extproc.server.tls import CertificateFiles

__all__ = ["EXT_PROC_SERVICE", "ExtProcServer", "ServerOptions"]

log = logging.getLogger("extproc.server")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS = "liveness"
READINESS = "readiness"
EOF_GRACE_S = 0.01  # after EOF, how long a reset's cancel notice may take to reach the handler


@dataclass(frozen=True, slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 9002
    max_concurrent_streams: int = 4096
    max_message_bytes: int = 8 * 1024 * 1024  # >= the body limit, so a big body gets our 413
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None
    tls_reload_interval_s: float = 30.0
    # Tracing is on: each stream's trace context (gRPC metadata, else the request's header)
    # goes on to the director. Off: not even looked at.
    trace_context: bool = False


def _traceparent(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The W3C trace context Envoy's ext_proc call carries (its span, when Envoy traces)."""
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent":
            return value if isinstance(value, str) else None
    return None


class _ExternalProcessor:
    """The ExternalProcessor service's one method. gRPC registers it as stream-unary although
    Envoy calls it as a bidirectional stream (the wire is the same): grpc.aio then sends the
    handler's returned message and the stream's end (its status) in one batch. Written as a
    stream-stream method, the last answer and the status were two batches with an event-loop
    turn between them, and a process killed in that gap (a busy loop made it tens of
    milliseconds) left Envoy with a routing stream that failed *after* its answer: Envoy's
    ext_proc filter, fail-closed, then resets the request, cutting a response already
    streaming. Answers before the last are written as they come (`_serialized`: the stream's
    context has no serializer in this shape)."""

    def __init__(
        self, handler: RequestHandler, ends: Counter[str], timers: Timers, *, traced: bool = False
    ) -> None:
        self._handler = handler
        self._ends = ends
        self._timers = timers
        self._traced = traced
        self.open = 0  # streams in progress (a count: nothing per stream is kept)
        self.last_opened = -math.inf  # when the newest stream began (the timers' clock)

    def method_handlers(self) -> dict[str, grpc.RpcMethodHandler[Any, Any]]:
        return {
            "Process": grpc.stream_unary_rpc_method_handler(
                self.Process,
                request_deserializer=ep.ProcessingRequest.FromString,
                response_serializer=ep.ProcessingResponse.SerializeToString,
            )
        }

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        self.open += 1
        self.last_opened = self._timers.now()
        if self._traced:
            proc = StreamProcessor(self._handler, traced=True, traceparent=_traceparent(context))
        else:
            proc = StreamProcessor(self._handler)
        end = "error"
        try:
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    # Envoy half-closed (the HTTP request is over) or reset the stream: a reset
                    # reads as EOF too. Ending normally after a reset makes grpc-python send
                    # a status on the dead call and never free that batch (grpc/grpc#43360,
                    # ~110 bytes per stream, measured by bench/stream_ends.py). A moment's wait
                    # lets the core's cancel notice arrive: it cancels this task, and no status
                    # is sent. After a real half-close nothing arrives and the end goes out,
                    # with an empty message Envoy no longer reads (it closed its side once it
                    # was done with the stream).
                    # (Real time on purpose: it waits for grpc's core, not for our schedule.)
                    await asyncio.sleep(EOF_GRACE_S)
                    end = "eof"
                    return _NOTHING
                answers = await proc.on_message(msg)
                last = proc.ending
                for resp in answers[:-1] if last else answers:
                    await context.write(_serialized(resp))
                proc.sent()
                if last:
                    # This side ends it: the routing answer is delivered (the request goes on
                    # without this stream), an immediate reply, or a response seen. The answer
                    # and the end leave together.
                    end = "done"
                    return answers[-1] if answers else _NOTHING
        except asyncio.CancelledError:
            # Envoy reset the stream (at the end of the HTTP request, or because the client went
            # away): settle state, then let it cancel.
            end = "cancelled"
            raise
        finally:
            self._ends[end] += 1
            proc.close()
            self.open -= 1


_NOTHING = ep.ProcessingResponse()


def _serialized(resp: ep.ProcessingResponse) -> bytes:
    return resp.SerializeToString()


class ExtProcServer:
    """Owns the grpc.aio server. `start()` binds and serves, then `stop(grace)` drains
    in-flight streams. Nothing is bound or read before `start()`."""

    def __init__(
        self, handler: RequestHandler, options: ServerOptions, *, timers: Timers | None = None
    ) -> None:
        self._handler = handler
        self._options = options
        self._timers = timers or LoopTimers()
        self.stream_ends: Counter[str] = Counter()  # how streams ended: done|eof|cancelled|error
        self._processor = _ExternalProcessor(
            handler, self.stream_ends, self._timers, traced=options.trace_context
        )
        self._health = health.aio.HealthServicer()
        # Envoy's access log for accounting records, on the same port: whichever process
        # Envoy's access-log stream reaches can account any request.
        self.access_log = AccessLogService(handler, timers=self._timers)
        self.tls: CertificateFiles | None = None
        self._server: grpc.aio.Server | None = None
        self._port = 0

    @property
    def port(self) -> int:
        """The bound port (the OS's pick when the options ask for port 0)."""
        if self._server is None:
            raise RuntimeError("the server is not started: no port is bound yet")
        return self._port

    @property
    def active_streams(self) -> int:
        return self._processor.open

    def _bind(self) -> grpc.aio.Server:
        options = self._options
        server = grpc.aio.server(
            options=[
                ("grpc.max_concurrent_streams", options.max_concurrent_streams),
                ("grpc.max_receive_message_length", options.max_message_bytes),
                ("grpc.max_send_message_length", options.max_message_bytes),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ],
        )
        handlers = self._processor.method_handlers()
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(EXT_PROC_SERVICE, handlers),)
        )
        server.add_registered_method_handlers(EXT_PROC_SERVICE, handlers)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self.access_log, server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        address = f"{options.host}:{options.port}"
        if options.tls_cert_file and options.tls_key_file:
            # Files are re-read on change (certificate rotation) at most every reload interval.
            self.tls = CertificateFiles(
                options.tls_cert_file,
                options.tls_key_file,
                options.tls_client_ca_file,
                check_interval_s=options.tls_reload_interval_s,
            )
            port = server.add_secure_port(address, self.tls.credentials())
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"cannot bind the gRPC server to {address}")
        self._port = port
        return server

    async def start(self) -> None:
        if self._server is not None:
            raise RuntimeError("the server is already started")
        server = self._bind()
        await server.start()
        self._server = server
        await self._health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(False)
        log.info("ext_proc gRPC server listening on %s:%d", self._options.host, self._port)

    async def set_ready(self, ready: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in (READINESS, EXT_PROC_SERVICE, ""):
            await self._health.set(service, status)

    async def stop(
        self,
        grace: float,
        *,
        on_draining: Callable[[], None] | None = None,
        announce_s: float = 0.0,
    ) -> None:
        """Drain decisions, not responses. Health goes NOT_SERVING; once Envoy has sent no
        new routing stream for `announce_s` (its health check saw NOT_SERVING and sends them
        elsewhere), new streams are refused and the decisions in progress get `grace` (a
        routing stream lives only as long as its decision; held streams, without an access
        log, as long as their request). While no other process is healthy (a peer restarted a
        moment ago and Envoy has not checked it yet), Envoy's panic mode goes on sending here:
        those streams are served, and the announcement lasts until they stop, `grace` at most.
        Each access-log stream ends right after its next batch, so Envoy sends the following
        one to another process and none is lost. The responses this process routed go on:
        their leases are the app's to hand to a peer (`App.stop`)."""
        server = self._server
        if server is None:
            return  # never started: nothing is bound, nothing to drain
        await self.set_ready(False)
        if on_draining is not None:
            on_draining()
        log.info("draining %d ext_proc streams (grace %.1fs)", self.active_streams, grace)
        if announce_s > 0:
            await self._announce(announce_s, grace)
        self.access_log.close_streams()
        await server.stop(grace)
        await self._health.enter_graceful_shutdown()

    async def _announce(self, quiet_s: float, limit_s: float) -> None:
        """Wait until no routing stream has begun for `quiet_s`, `limit_s` at most (and
        `quiet_s` at least)."""
        timers = self._timers
        began = timers.now()
        end = began + max(limit_s, quiet_s)
        await timers.sleep(quiet_s)
        while (now := timers.now()) < end:
            quiet_until = self._processor.last_opened + quiet_s
            if quiet_until <= now:
                if self._processor.last_opened > began:
                    log.info("routing streams came %.1fs into the drain; none since %.1fs",
                             self._processor.last_opened - began, quiet_s)  # fmt: skip
                return
            await timers.sleep(min(quiet_until, end) - now)
        log.warning("routing streams still came after %.1fs of NOT_SERVING (no other healthy "
                    "process to take them?): refusing new ones now", limit_s)  # fmt: skip

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
