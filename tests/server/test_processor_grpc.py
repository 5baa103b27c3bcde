"""Drive real gRPC streams into the ext_proc server and compare whole response sequences."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
import pytest
from google.protobuf import struct_pb2

from extproc._pb.envoy.config.core.v3 import base_pb2
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.director.api import BodyMode, ImmediateReply
from extproc.server.service import ExtProcServer, ServerOptions
from tests.server._messages import body_msg, exchange, headers_msg, response_msgs
from tests.server.fake_handler import FakeHandler

DEST = "10.0.0.1:8000,10.0.0.2:8000"
OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def expected_mutation(headers: dict[str, str]) -> ep.HeaderMutation:
    return ep.HeaderMutation(
        set_headers=[
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=OVERWRITE
            )
            for k, v in headers.items()
        ]
    )


def lb_metadata(value: str, *, lease: int | None = 1) -> struct_pb2.Struct:
    """What the fake's decision writes: the pick list, and what the access log carries back
    (the lease's key, which the record brings back to end it)."""
    s = struct_pb2.Struct()
    s.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"].string_value = value
    req = s.fields["extproc.request"].struct_value.fields
    if lease is not None:
        req["lease"].number_value = lease
        req["replica"].string_value = "fake:1"
    req["model"].string_value = "m"
    req["endpoint"].string_value = value.split(",")[0]
    req["strategy"].string_value = "fake"
    req["prompt_tokens"].number_value = 7
    req["estimated"].bool_value = False
    req["stream"].bool_value = False
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


async def test_buffered_mode_sets_destination_in_body_response(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    body = b'{"model":"m","messages":[]}'
    got = await exchange(port, [headers_msg(), body_msg(body)])
    want_body = ep.ProcessingResponse()
    want_body.request_body.response.header_mutation.CopyFrom(
        expected_mutation({"x-routing-strategy": "fake", "x-gateway-destination-endpoint": DEST})
    )
    want_body.dynamic_metadata.CopyFrom(lb_metadata(DEST))
    assert got == [ep.ProcessingResponse(request_headers=ep.HeadersResponse()), want_body]
    assert handler.seen[0][1] == body
    assert handler.seen[0][0].path == "/v1/chat/completions"


async def test_buffered_mode_with_body_rewrite_sets_content_length(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    handler.new_body = b'{"rewritten":true}'
    got = await exchange(port, [headers_msg(), body_msg(b'{"model":"m"}')])
    common = got[1].request_body.response
    assert common.status == ep.CommonResponse.CONTINUE_AND_REPLACE
    assert common.body_mutation.body == handler.new_body
    hdrs = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    assert hdrs["content-length"] == str(len(handler.new_body)).encode()


async def test_full_duplex_holds_headers_then_echoes_body_in_chunks(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    handler.max_body_bytes = 1 << 20
    part1, part2 = b"a" * 70_000, b"b" * 10_000
    got = await exchange(
        port,
        [
            headers_msg(body_mode=BodyMode.FULL_DUPLEX_STREAMED),
            body_msg(part1, eos=False),
            body_msg(part2, eos=False),
            body_msg(b"", eos=True),  # Envoy's separate empty end_of_stream message
        ],
    )
    assert [r.WhichOneof("response") for r in got] == [
        "request_headers",
        "request_body",
        "request_body",
    ]
    assert got[0].request_headers.response.header_mutation == expected_mutation(
        {"x-routing-strategy": "fake", "x-gateway-destination-endpoint": DEST}
    )
    assert got[0].dynamic_metadata == lb_metadata(DEST)
    chunks = [r.request_body.response.body_mutation.streamed_response for r in got[1:]]
    assert b"".join(c.body for c in chunks) == part1 + part2
    assert [len(c.body) for c in chunks] == [62_000, 18_000]
    assert [c.end_of_stream for c in chunks] == [False, True]
    assert handler.seen[0][1] == part1 + part2


async def test_bodyless_request_routes_at_headers(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    got = await exchange(port, [headers_msg("/health", eos=True)])
    assert len(got) == 1
    assert got[0].request_headers.response.clear_route_cache is True
    assert handler.seen[0][1] is None and handler.seen[0][0].has_body is False


async def test_body_over_limit_is_413(server_and_handler: tuple[int, FakeHandler]) -> None:
    port, handler = server_and_handler
    got = await exchange(port, [headers_msg(), body_msg(b"x" * 2000)])
    assert got[-1].immediate_response.status.code == 413
    assert handler.seen == []


async def test_immediate_reply_from_handler(server_and_handler: tuple[int, FakeHandler]) -> None:
    port, handler = server_and_handler
    handler.reply = ImmediateReply(status=404, body=b'{"error":{}}')
    got = await exchange(port, [headers_msg(), body_msg(b"{}")])
    imm = got[-1].immediate_response
    assert (imm.status.code, imm.body) == (404, b'{"error":{}}')
    assert {h.header.key for h in imm.headers.set_headers} == {"content-type"}


@pytest.mark.parametrize(
    ("response_mode", "echoed"),
    [(BodyMode.STREAMED, False), (BodyMode.FULL_DUPLEX_STREAMED, True)],
)
async def test_response_messages_of_a_misconfigured_filter_still_flow(
    server_and_handler: tuple[int, FakeHandler], response_mode: BodyMode, echoed: bool
) -> None:
    port, handler = server_and_handler
    handler.hold = True  # a held stream (no access log) stays open for the response
    got = await exchange(
        port, [headers_msg(response_mode=response_mode), body_msg(b"{}"), *response_msgs()]
    )
    assert [r.WhichOneof("response") for r in got] == [
        "request_headers",
        "request_body",
        "response_headers",
        "response_body",
        "response_body",
        None,  # Envoy's half-close ends it: an empty last word, which Envoy no longer reads
    ]
    body = got[3].response_body.response.body_mutation
    # FULL_DUPLEX_STREAMED forwards only what the server sends back: every chunk is echoed.
    assert (body.streamed_response.body == b"data: x\n\n") is echoed
    assert handler.tickets["rid-1"].closes == 1  # the stream ended with the request


async def test_observability_stream_gets_no_answers_and_ends_at_eos(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    got = await exchange(port, response_msgs(observability=True))
    # No answer: the end of the stream carries an empty message (the method is stream-unary
    # on this side), which Envoy ignores in observability mode like any other.
    assert got == [ep.ProcessingResponse()]
    assert handler.seen == [] and handler.tickets == {}


async def test_the_answer_and_the_end_of_the_stream_leave_together(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    """A process killed between its routing answer and the stream's end leaves Envoy a stream
    that fails after its answer, and Envoy's fail-closed filter then resets the request, cutting
    a response already streaming. So the answer and the end go out in one batch: the end reaches
    the client even while the server's event loop is held right after the decision (two batches
    would wait for the loop's next turn between them)."""
    port, handler = server_and_handler
    client_saw_the_end = threading.Event()
    released_by_the_client: list[bool] = []

    def hold_the_loop() -> None:  # the loop's next turn after the decision
        released_by_the_client.append(client_saw_the_end.wait(5.0))

    handler.after_route = lambda: asyncio.get_running_loop().call_soon(hold_the_loop)

    def client() -> list[str | None]:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process
            kinds = [r.WhichOneof("response") for r in call(iter([headers_msg(), body_msg(b"{}")]))]
        client_saw_the_end.set()
        return kinds

    kinds = await asyncio.to_thread(client)
    assert kinds == ["request_headers", "request_body"]
    assert released_by_the_client == [True]


@pytest.mark.parametrize("mode", [BodyMode.BUFFERED, BodyMode.FULL_DUPLEX_STREAMED])
async def test_the_server_ends_the_stream_once_the_answer_is_delivered(
    server_and_handler: tuple[int, FakeHandler], mode: BodyMode
) -> None:
    port, handler = server_and_handler
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers_msg(body_mode=mode))
        if mode is BodyMode.BUFFERED:
            await call.read()  # the headers answer
        await call.write(body_msg(b"{}"))
        kinds = []
        while (resp := await call.read()) is not grpc.aio.EOF:
            kinds.append(resp.WhichOneof("response"))
        # The server closed the stream with OK while Envoy's side was still open: Envoy goes
        # on with the request without it.
        assert await call.code() == grpc.StatusCode.OK
        assert kinds == (["request_body"] if mode is BodyMode.BUFFERED else
                         ["request_headers", "request_body"])  # fmt: skip
    # The request is not over: the ticket lives on, for the access record to end it.
    assert handler.tickets["rid-1"].closes == 0


async def test_a_held_ticket_is_closed_once_at_the_stream_end(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    handler.hold = True
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = ep_grpc.ExternalProcessorStub(channel).Process()
        await call.write(headers_msg())
        await call.read()
        await call.write(body_msg(b"{}"))
        await call.read()
        await asyncio.sleep(0.05)
        assert handler.tickets["rid-1"].closes == 0  # the HTTP request is still going on
        call.cancel()  # Envoy resets the stream when the request ends (or the client leaves)
    for _ in range(200):
        if handler.tickets["rid-1"].closes:
            break
        await asyncio.sleep(0.01)
    assert handler.tickets["rid-1"].closes == 1


async def test_a_rejected_request_claims_nothing(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    handler.reply = ImmediateReply(status=429, body=b"{}")
    got = await exchange(port, [headers_msg(), body_msg(b"{}")])
    assert got[-1].immediate_response.status.code == 429
    assert handler.tickets == {}


async def test_route_name_and_subset_hint_reach_the_handler(
    server_and_handler: tuple[int, FakeHandler],
) -> None:
    port, handler = server_and_handler
    msg = headers_msg(route_name="httproute/default/llm/rule/0/match/0/*")
    subset = msg.metadata_context.filter_metadata["envoy.lb.subset_hint"]
    subset.fields[
        "x-gateway-destination-endpoint-subset"
    ].list_value.values.add().string_value = "10.0.0.2:8000"
    await exchange(port, [msg, body_msg(b"{}")])
    head = handler.seen[0][0]
    assert head.route_name == "httproute/default/llm/rule/0/match/0/*"
    assert head.subset == ("10.0.0.2:8000",)


async def test_stream_ends_are_counted_by_how_they_ended() -> None:
    handler = FakeHandler()
    server = ExtProcServer(handler, ServerOptions(port=0))
    await server.start()
    try:
        # routed in BUFFERED mode: the server ends the stream once the answer is out: done
        await exchange(server.port, [headers_msg(), body_msg(b"{}")])
        # held (no access log), then Envoy half-closes: eof
        handler.hold = True
        await exchange(server.port, [headers_msg(), body_msg(b"{}")])
        handler.hold = False
        # an immediate reply ends the stream from the server's side: done
        await exchange(server.port, [headers_msg(), body_msg(b"x" * 2000)])  # 413
        # Envoy resets the stream while the server waits for the next message: cancelled
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            call = ep_grpc.ExternalProcessorStub(channel).Process()
            await call.write(headers_msg())
            await call.read()
            call.cancel()
        for _ in range(200):
            if sum(server.stream_ends.values()) == 4:
                break
            await asyncio.sleep(0.01)
        assert dict(server.stream_ends) == {"eof": 1, "done": 2, "cancelled": 1}
    finally:
        await server.stop(0.5)
