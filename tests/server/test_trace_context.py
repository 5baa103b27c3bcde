"""The trace context reaches the director as a plain value: Envoy's (the ext_proc call's gRPC
metadata) before the client's (the request's `traceparent` header), and with tracing off,
none at all."""

from __future__ import annotations

import grpc
import pytest

from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.server.service import ExtProcServer, ServerOptions
from tests.server._messages import body_msg, headers_msg
from tests.server.fake_handler import FakeHandler

ENVOY = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(
    ("traced", "metadata", "header", "seen"),
    [
        (True, ENVOY, CLIENT, ENVOY),  # Envoy's span is the parent
        (True, None, CLIENT, CLIENT),  # Envoy does not trace: the client's
        (True, None, None, None),
        (False, ENVOY, CLIENT, None),  # tracing off: not even looked at
    ],
)
async def test_the_trace_context_comes_from_envoys_call_else_the_request(
    traced: bool, metadata: str | None, header: str | None, seen: str | None
) -> None:
    handler = FakeHandler()
    server = ExtProcServer(handler, ServerOptions(port=0, trace_context=traced))
    await server.start()
    try:
        extra = {"traceparent": header} if header else {}
        messages = [headers_msg(extra=extra), body_msg(b'{"model":"m"}')]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process(
                iter(messages), metadata=(("traceparent", metadata),) if metadata else None
            )
            answers = [resp async for resp in call]
    finally:
        await server.stop(0.5)
    assert len(answers) == 2
    ((head, _),) = handler.seen
    assert head.traceparent == seen
