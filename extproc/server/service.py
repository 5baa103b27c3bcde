"""The gRPC server: ExternalProcessor and AccessLogService, health, TLS, graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc._pb.envoy.service.accesslog.v3 import als_pb2_grpc
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.director.api import RequestHandler
from extproc.server.accesslog import AccessLogService
from extproc.server.processor import StreamProcessor
from extproc.server.tls import CertificateFiles

__all__ = ["EXT_PROC_SERVICE", "ExtProcServer", "ServerOptions"]

log = logging.getLogger("extproc.server")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
LIVENESS = "liveness"
READINESS = "readiness"
ACCESS_LOG_LINGER_S = 2.0  # after the last routing stream, for its record to arrive (flush 0.5 s)
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


class _ExternalProcessor(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    def __init__(
        self, handler: RequestHandler, streams: set[asyncio.Task[Any]], ends: Counter[str]
    ) -> None:
        self._handler = handler
        self._streams = streams
        self._ends = ends

    async def Process(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> None:  # type: ignore[override]
        task = asyncio.current_task()
        if task is not None:
            self._streams.add(task)
        proc = StreamProcessor(self._handler)
        end = "error"
        try:
            while not proc.done:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    # Envoy half-closed (the HTTP request is over) or reset the stream: a reset
                    # reads as EOF too. Returning normally after a reset makes grpc-python send
                    # a status on the dead call and never free that batch (grpc/grpc#43360,
                    # ~110 bytes per stream, measured by bench/stream_ends.py). A moment's wait
                    # lets the core's cancel notice arrive: it cancels this task, and no status
                    # is sent. After a real half-close nothing arrives and the status goes out.
                    await asyncio.sleep(EOF_GRACE_S)
                    end = "eof"
                    break
                for resp in await proc.on_message(msg):
                    await context.write(resp)
            else:
                end = "done"  # this side ended it (response seen, or an immediate reply)
        except asyncio.CancelledError:
            # Envoy reset the stream (at the end of the HTTP request, or because the client went
            # away): settle state, then let it cancel.
            end = "cancelled"
            raise
        finally:
            self._ends[end] += 1
            proc.close()
            if task is not None:
                self._streams.discard(task)


class ExtProcServer:
    """Owns the grpc.aio server. `start()`, then `stop(grace)` drains in-flight streams."""

    def __init__(self, handler: RequestHandler, options: ServerOptions) -> None:
        self._options = options
        self._streams: set[asyncio.Task[Any]] = set()
        self.stream_ends: Counter[str] = Counter()  # how streams ended: done|eof|cancelled|error
        self._health = health.aio.HealthServicer()
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_concurrent_streams", options.max_concurrent_streams),
                ("grpc.max_receive_message_length", options.max_message_bytes),
                ("grpc.max_send_message_length", options.max_message_bytes),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ],
        )
        ep_grpc.add_ExternalProcessorServicer_to_server(
            _ExternalProcessor(handler, self._streams, self.stream_ends), self._server
        )
        # Envoy's access log for accounting records, on the same port: whichever process
        # Envoy's access-log stream reaches can account any request.
        self.access_log = AccessLogService(handler)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(self.access_log, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        address = f"{options.host}:{options.port}"
        self.tls: CertificateFiles | None = None
        if options.tls_cert_file and options.tls_key_file:
            # Files are re-read on change (certificate rotation) at most every reload interval.
            self.tls = CertificateFiles(
                options.tls_cert_file,
                options.tls_key_file,
                options.tls_client_ca_file,
                check_interval_s=options.tls_reload_interval_s,
            )
            self.port = self._server.add_secure_port(address, self.tls.credentials())
        else:
            self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise OSError(f"cannot bind the gRPC server to {address}")

    @property
    def active_streams(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        await self._server.start()
        await self._health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self.set_ready(False)
        log.info("ext_proc gRPC server listening on %s:%d", self._options.host, self.port)

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
        """Health goes NOT_SERVING; after `announce_s` (for Envoy's health check to see it and
        send new streams elsewhere) new streams are refused, in-flight ones get `grace`."""
        await self.set_ready(False)
        if on_draining is not None:
            on_draining()
        log.info("draining %d ext_proc streams (grace %.1fs)", len(self._streams), grace)
        if announce_s > 0:
            await asyncio.sleep(announce_s)
        # Access-log streams never end by themselves: keep reading them while routing streams
        # drain (their requests' records are still coming), then one flush interval more,
        # then end them so Envoy reconnects to another process.
        closer = asyncio.create_task(self._close_access_logs(grace))
        try:
            await self._server.stop(grace)
        finally:
            closer.cancel()
        await self._health.enter_graceful_shutdown()

    async def _close_access_logs(self, grace: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        while self._streams and loop.time() < deadline:  # noqa: ASYNC110 (polls a set)
            await asyncio.sleep(0.05)
        await asyncio.sleep(min(ACCESS_LOG_LINGER_S, max(0.0, deadline - loop.time())))
        self.access_log.close_streams()

    async def wait(self) -> None:
        await self._server.wait_for_termination()
