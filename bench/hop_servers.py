"""Reference ext_proc servers for the hop budget (bench/hop.py), one process each.

`python -m bench.hop_servers floor|edge --grpc-port P --ready-port R --destinations a,b,...`

floor  grpc.aio with raw bytes and no work: the same message pattern as our server (a headers
       message gets a CONTINUE, a body message gets the header mutation and metadata our server
       writes, prebuilt, round robin over the destinations; the stream then ends, as ours does),
       an access-log stream read and dropped, the gRPC health service. What any grpc.aio server
       of this shape costs on this machine: the floor of the budget.
edge   our protocol edge (`extproc.server.ExtProcServer`: processor, service, access-log
       records) with a handler that decides nothing (a fixed round robin) and accounts nothing:
       the edge's own cost above the floor, without the director.

Both serve `GET /` on the ready port once they accept streams (for `Cluster.spawn`).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from extproc._pb.envoy.config.core.v3 import base_pb2
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.director.api import (
    AccessRecord,
    ImmediateReply,
    RequestHead,
    RoutedRequest,
    RouteResult,
)
from extproc.wire import DESTINATION_HEADER, LB_NAMESPACE, REQUEST_NAMESPACE

__all__ = ["main"]

_PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
_ACCESS_LOG = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
# The first byte of a ProcessingRequest is its first field's tag (Envoy serializes in field
# order): request_headers is field 2, request_body field 4 (length-delimited).
_HEADERS_TAG = 0x12
_BODY_TAG = 0x22


def _routed(destination: str) -> RoutedRequest:
    return RoutedRequest(
        model="qwen3", endpoint=destination, strategy="least-request", prompt_tokens=2000,
        estimated=True, stream=True, replica="bench:1",
    )  # fmt: skip


def _body_answer(destination: str) -> bytes:
    """What our server writes for a routed BUFFERED body (processor.py), built once."""
    resp = ep.ProcessingResponse()
    common = resp.request_body.response
    common.header_mutation.set_headers.append(
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=destination.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    )
    fields = resp.dynamic_metadata.fields
    fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = destination
    ns = fields[REQUEST_NAMESPACE].struct_value.fields
    for key, v in _routed(destination).metadata().items():
        if isinstance(v, bool):
            ns[key].bool_value = v
        elif isinstance(v, str):
            ns[key].string_value = v
        else:
            ns[key].number_value = v
    return resp.SerializeToString()


class _Floor:
    def __init__(self, destinations: Sequence[str]) -> None:
        self._answers = itertools.cycle([_body_answer(d) for d in destinations])
        self._continue = ep.ProcessingResponse(
            request_headers=ep.HeadersResponse()
        ).SerializeToString()

    async def process(self, _it: Any, context: grpc.aio.ServicerContext) -> None:
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            if msg[:1] == bytes((_HEADERS_TAG,)):
                await context.write(self._continue)
                continue
            if msg[:1] == bytes((_BODY_TAG,)):
                await context.write(next(self._answers))
                return  # delivered: the server ends the stream, as ours does

    async def access_log(self, _it: Any, context: grpc.aio.ServicerContext) -> bytes:
        while (await context.read()) is not grpc.aio.EOF:
            pass
        return b""

    def handlers(self) -> grpc.GenericRpcHandler:
        def lookup(details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
            if details.method == _PROCESS:
                return grpc.stream_stream_rpc_method_handler(self.process)
            if details.method == _ACCESS_LOG:
                return grpc.stream_unary_rpc_method_handler(self.access_log)
            return None

        class _Handler(grpc.GenericRpcHandler):  # type: ignore[misc]
            def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
                return lookup(handler_call_details)

        return _Handler()


class _NoDecision:
    """A RequestHandler that routes round robin and accounts nothing."""

    def __init__(self, destinations: Sequence[str]) -> None:
        self._next = itertools.cycle(
            [RouteResult(destinations=(d,), routed=_routed(d)) for d in destinations]
        )

    @property
    def max_body_bytes(self) -> int:
        return 4 * 1024 * 1024

    async def route(self, head: RequestHead, body: bytes | None) -> RouteResult | ImmediateReply:
        return next(self._next)

    def reject(self, head: RequestHead | None, status: int, message: str) -> ImmediateReply:
        return ImmediateReply(status=status, body=message.encode())

    def account(self, record: AccessRecord) -> None:
        return None


async def _ready_http(port: int) -> asyncio.Server:
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", port)


async def _serve_floor(args: argparse.Namespace) -> None:
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    server.add_generic_rpc_handlers((_Floor(args.destinations.split(",")).handlers(),))
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    server.add_insecure_port(f"127.0.0.1:{args.grpc_port}")
    await server.start()
    for name in ("readiness", ""):
        await hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    ready = await _ready_http(args.ready_port)
    async with ready:
        await server.wait_for_termination()


async def _serve_edge(args: argparse.Namespace) -> None:
    from extproc.server.service import ExtProcServer, ServerOptions

    server = ExtProcServer(
        _NoDecision(args.destinations.split(",")), ServerOptions(port=args.grpc_port)
    )
    await server.start()
    await server.set_ready(True)
    ready = await _ready_http(args.ready_port)
    async with ready:
        await server.wait()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.hop_servers")
    p.add_argument("kind", choices=("floor", "edge"))
    p.add_argument("--grpc-port", type=int, required=True)
    p.add_argument("--ready-port", type=int, required=True)
    p.add_argument("--destinations", required=True)
    args = p.parse_args(argv)
    import uvloop

    uvloop.install()
    asyncio.run(_serve_floor(args) if args.kind == "floor" else _serve_edge(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
