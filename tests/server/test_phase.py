"""The stream state machine: one `Phase` per stream, driven message by message (no gRPC)."""

from __future__ import annotations

import pytest

from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc.director.api import BodyMode, ImmediateReply
from extproc.server.processor import Phase, StreamModes, StreamProcessor
from tests.server._messages import body_msg, headers_msg, response_msgs
from tests.server.fake_handler import FakeHandler


def trailers_msg() -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_trailers=ep.HttpTrailers())


def observed(messages: list[ep.ProcessingRequest]) -> list[ep.ProcessingRequest]:
    for msg in messages:
        msg.observability_mode = True
    return messages


CASES = [
    # (messages, handler rejects, phases after each message)
    pytest.param([headers_msg(), body_msg(b"{}", eos=False), body_msg(b"{}")], False,
                 [Phase.BODY, Phase.BODY, Phase.ROUTED], id="buffered-body"),
    pytest.param([headers_msg(eos=True)], False, [Phase.ROUTED], id="bodyless-at-headers"),
    pytest.param([headers_msg(body_mode=BodyMode.NONE)], False, [Phase.ROUTED],
                 id="body-mode-none-routes-at-headers"),
    pytest.param([headers_msg(), body_msg(b"{}", eos=False), trailers_msg()], False,
                 [Phase.BODY, Phase.BODY, Phase.ROUTED], id="body-ended-by-trailers"),
    pytest.param([headers_msg(), body_msg(b"{}")], True, [Phase.BODY, Phase.REJECTED],
                 id="handler-rejects"),
    pytest.param([headers_msg(), body_msg(b"x" * 2000)], False, [Phase.BODY, Phase.REJECTED],
                 id="body-too-large"),
    pytest.param([headers_msg(), body_msg(b"{}"), headers_msg()], False,
                 [Phase.BODY, Phase.ROUTED, Phase.ROUTED], id="late-headers-ignored"),
    pytest.param(observed([headers_msg(), body_msg(b"{}"), *response_msgs()]), False,
                 [Phase.BODY, Phase.ROUTED, Phase.ROUTED, Phase.ROUTED, Phase.RESPONSE_ENDED],
                 id="observability-ends-at-the-response-end"),
    pytest.param([headers_msg(), body_msg(b"{}"), *response_msgs()], False,
                 [Phase.BODY, Phase.ROUTED, Phase.ROUTED, Phase.ROUTED, Phase.ROUTED],
                 id="response-messages-answered-not-ended"),
]  # fmt: skip


@pytest.mark.parametrize(("messages", "rejects", "phases"), CASES)
async def test_phases_of_a_held_stream(
    messages: list[ep.ProcessingRequest], rejects: bool, phases: list[Phase]
) -> None:
    """No access log: the stream is held for the request's life (ROUTED, once sent: HELD)."""
    handler = FakeHandler(hold=True)
    if rejects:
        handler.reply = ImmediateReply(status=429, body=b"{}")
    proc = StreamProcessor(handler)
    start = proc.phase
    assert start is Phase.HEADERS and not proc.done
    seen = []
    for msg in messages:
        await proc.on_message(msg)
        seen.append(proc.phase)
        proc.sent()
    # Once its answer is sent, a routed stream is HELD.
    first = phases.index(Phase.ROUTED) if Phase.ROUTED in phases else len(phases)
    assert seen == [Phase.HELD if p is Phase.ROUTED and i > first else p
                    for i, p in enumerate(phases)]  # fmt: skip
    assert proc.done is (phases[-1] in (Phase.REJECTED, Phase.RESPONSE_ENDED))
    proc.close()
    assert proc.phase is Phase.CLOSED
    # Whatever the stream went through, the ticket of a routed request is closed exactly once.
    assert [t.closes for t in handler.tickets.values()] == [1] * len(handler.tickets)
    assert len(handler.tickets) == (1 if Phase.ROUTED in phases else 0)


DELIVERED_CASES = [
    pytest.param([headers_msg(), body_msg(b"{}", eos=False), body_msg(b"{}")], id="buffered"),
    pytest.param([headers_msg(eos=True)], id="bodyless-at-headers"),
    pytest.param([headers_msg(body_mode=BodyMode.FULL_DUPLEX_STREAMED), body_msg(b"{}")],
                 id="full-duplex"),
    pytest.param([headers_msg(body_mode=BodyMode.FULL_DUPLEX_STREAMED),
                  body_msg(b"{}", eos=False), trailers_msg()], id="full-duplex-trailers"),
]  # fmt: skip


@pytest.mark.parametrize("messages", DELIVERED_CASES)
async def test_a_delivered_answer_ends_the_stream_and_leaves_the_ticket_open(
    messages: list[ep.ProcessingRequest],
) -> None:
    handler = FakeHandler()
    proc = StreamProcessor(handler)
    for msg in messages:
        assert not proc.done
        await proc.on_message(msg)
        proc.sent()
    assert proc.phase is Phase.DELIVERED and proc.done
    proc.close()
    # The request goes on without the stream: its access record ends the ticket, not this.
    assert [t.closes for t in handler.tickets.values()] == [0]


async def test_an_answer_never_sent_closes_its_ticket_with_the_stream() -> None:
    handler = FakeHandler()
    proc = StreamProcessor(handler)
    await proc.on_message(headers_msg())
    await proc.on_message(body_msg(b"{}"))
    assert proc.phase is Phase.ROUTED  # decided, but the write failed (Envoy reset)
    proc.close()
    assert handler.tickets["rid-1"].closes == 1


@pytest.mark.parametrize(
    ("mode", "no_wait"),
    [
        (BodyMode.BUFFERED, False),
        (BodyMode.STREAMED, True),
        (BodyMode.FULL_DUPLEX_STREAMED, False),
    ],
)
def test_modes_come_from_the_first_message(mode: BodyMode, no_wait: bool) -> None:
    msg = headers_msg(body_mode=mode, response_mode=BodyMode.STREAMED)
    msg.protocol_config.send_body_without_waiting_for_header_response = no_wait
    assert StreamModes.of(msg) == StreamModes(
        request_body=mode, response_body=BodyMode.STREAMED, no_wait=no_wait
    )
    old_envoy = ep.ProcessingRequest(observability_mode=True)
    assert StreamModes.of(old_envoy) == StreamModes(
        request_body=BodyMode.BUFFERED, observability=True
    )
