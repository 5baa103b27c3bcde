"""Envoy ext_proc messages as the tests send them, and one exchange over a real gRPC stream."""

from __future__ import annotations

import grpc

from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.director.api import BodyMode

__all__ = ["body_msg", "exchange", "headers_msg", "response_msgs"]


def headers_msg(
    path: str = "/v1/chat/completions",
    *,
    eos: bool = False,
    body_mode: BodyMode = BodyMode.BUFFERED,
    response_mode: BodyMode = BodyMode.NONE,
    extra: dict[str, str] | None = None,
    route_name: str | None = None,
) -> ep.ProcessingRequest:
    hdrs = {":method": "POST", ":path": path, "x-request-id": "rid-1", **(extra or {})}
    msg = ep.ProcessingRequest()
    msg.request_headers.end_of_stream = eos
    for k, v in hdrs.items():
        msg.request_headers.headers.headers.add(key=k, raw_value=v.encode())
    msg.protocol_config.request_body_mode = int(body_mode)  # type: ignore[assignment]
    msg.protocol_config.response_body_mode = int(response_mode)  # type: ignore[assignment]
    if route_name:
        msg.attributes["envoy.filters.http.ext_proc"].fields[
            "xds.route_name"
        ].string_value = route_name
    return msg


def body_msg(data: bytes, eos: bool = True) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data, end_of_stream=eos))


async def exchange(port: int, messages: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        call = stub.Process(iter(messages))
        return [resp async for resp in call]


def response_msgs(*, observability: bool = False) -> list[ep.ProcessingRequest]:
    headers = ep.ProcessingRequest(observability_mode=observability)
    headers.response_headers.headers.headers.add(key=":status", raw_value=b"200")
    return [
        headers,
        ep.ProcessingRequest(
            observability_mode=observability,
            response_body=ep.HttpBody(body=b"data: x\n\n", end_of_stream=False),
        ),
        ep.ProcessingRequest(
            observability_mode=observability,
            response_body=ep.HttpBody(body=b"", end_of_stream=True),
        ),
    ]
