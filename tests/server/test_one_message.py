"""One message each way: Envoy skips request headers, the body message carries what the server
reads from them as request attributes, and the answer carries the headers to set as metadata.

Real gRPC streams into the real server; whole response sequences compared."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import struct_pb2

from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.director.api import BodyMode
from extproc.server.service import ExtProcServer, ServerOptions
from extproc.wire import ATTRIBUTE_NAMESPACE, HEADER_ATTRIBUTE, HEADERS_NAMESPACE
from tests.server.fake_handler import FakeHandler

DEST = "10.0.0.1:8000,10.0.0.2:8000"


def one_message(
    body: bytes,
    *,
    headers: dict[str, str] | None = None,
    path: str = "/v1/chat/completions",
    body_mode: BodyMode = BodyMode.BUFFERED,
    subset: list[str] | None = None,
) -> ep.ProcessingRequest:
    """A body message as Envoy sends it with request headers skipped: attributes, the
    protocol config (first message of the stream) and the whole body."""
    msg = ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True))
    attrs = msg.attributes[ATTRIBUTE_NAMESPACE].fields
    attrs["request.path"].string_value = path
    attrs["request.method"].string_value = "POST"
    attrs["request.id"].string_value = "rid-7"
    attrs["xds.route_name"].string_value = "llm"
    for name, value in (headers or {}).items():
        attrs[HEADER_ATTRIBUTE.format(name)].string_value = value
    msg.protocol_config.request_body_mode = int(body_mode)  # type: ignore[assignment]
    if subset is not None:
        hint = msg.metadata_context.filter_metadata["envoy.lb.subset_hint"]
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(subset)
    return msg


def carried(headers: dict[str, str]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    for k, v in headers.items():
        s.fields[k].string_value = v
    return s


@pytest.fixture
async def server_and_handler() -> AsyncIterator[tuple[int, FakeHandler]]:
    handler = FakeHandler()
    server = ExtProcServer(handler, ServerOptions(port=0))
    await server.start()
    try:
        yield server.port, handler
    finally:
        await server.stop(0.5)


async def exchange(port: int, messages: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = ep_grpc.ExternalProcessorStub(channel)
        return [resp async for resp in stub.Process(iter(messages))]


async def test_one_body_message_gets_one_answer_with_headers_as_metadata(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    body = b'{"model":"m","messages":[]}'
    got = await exchange(port, [one_message(body, headers={"x-session-id": "s1"})])
    assert len(got) == 1
    answer = got[0]
    assert answer.WhichOneof("response") == "request_body"  # else Envoy: "spurious message"
    # No header mutation: Envoy drops it when it never held the headers.
    assert not answer.request_body.response.HasField("header_mutation")
    want = carried({"x-routing-strategy": "fake", "x-gateway-destination-endpoint": DEST})
    assert answer.dynamic_metadata.fields[HEADERS_NAMESPACE].struct_value == want
    lb = answer.dynamic_metadata.fields["envoy.lb"].struct_value
    assert lb.fields["x-gateway-destination-endpoint"].string_value == DEST
    request = answer.dynamic_metadata.fields["extproc.request"].struct_value.fields
    assert request["lease"].number_value == 1  # the access record ends the lease, as before
    assert handler.seen == [(handler.seen[0][0], body)]


async def test_the_request_is_rebuilt_from_its_attributes(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    msg = one_message(
        b"{}",
        headers={"X-Session-Id": "s1", "routing-strategy": "random"},
        path="/v1/completions?x=1",
        subset=["10.0.0.9:8000"],
    )
    await exchange(port, [msg])
    head = handler.seen[0][0]
    assert (head.request_id, head.method, head.path) == ("rid-7", "POST", "/v1/completions?x=1")
    assert head.headers == {
        "x-session-id": "s1",
        "routing-strategy": "random",
        ":method": "POST",
        ":path": "/v1/completions?x=1",
        "x-request-id": "rid-7",
    }
    assert head.route_name == "llm"
    assert head.subset == ("10.0.0.9:8000",)
    assert head.has_body


async def test_a_body_rewrite_travels_without_content_length(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    handler.new_body = b'{"rewritten":true}'
    (answer,) = await exchange(port, [one_message(b'{"model":"m"}')])
    common = answer.request_body.response
    assert common.status == ep.CommonResponse.CONTINUE_AND_REPLACE
    assert common.body_mutation.body == b'{"rewritten":true}'
    # Envoy removed content-length when it skipped the headers: none is set back.
    headers = answer.dynamic_metadata.fields[HEADERS_NAMESPACE].struct_value.fields
    assert "content-length" not in headers


@pytest.mark.parametrize("mode", [BodyMode.FULL_DUPLEX_STREAMED, BodyMode.STREAMED])
async def test_a_body_first_stream_that_cannot_route_gets_a_clear_error(
    server_and_handler: tuple[int, FakeHandler], mode: BodyMode
) -> None:
    """Headers skipped in a streamed mode: Envoy already chose the upstream, so the server
    says so at once (500 with a message) instead of leaving Envoy to time out."""
    port, handler = server_and_handler
    (answer,) = await exchange(port, [one_message(b"{}", body_mode=mode)])
    assert answer.immediate_response.status.code == 500
    assert b"BUFFERED" in answer.immediate_response.body
    assert handler.seen == []


async def test_an_oversized_one_message_body_is_413(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    (answer,) = await exchange(port, [one_message(b"x" * (handler.max_body_bytes + 1))])
    assert answer.immediate_response.status.code == 413
    assert handler.seen == []
