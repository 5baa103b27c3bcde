"""Usage extraction from JSON and SSE bodies: exact when reported, counted otherwise."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.protocol import StreamUsageAccumulator, usage_from_json
from extproc.types import TokenUsage
from tests.protocol.vllm_stream import VLLM_CHAT_STREAM, VLLM_CHAT_STREAM_NO_USAGE


@pytest.mark.parametrize(
    ("body", "want"),
    [
        (
            b'{"usage":{"prompt_tokens":5,"completion_tokens":7,"total_tokens":12,'
            b'"prompt_tokens_details":{"cached_tokens":4}}}',
            TokenUsage(5, 7, 4),
        ),
        (b'{"usage":{"prompt_tokens":5,"completion_tokens":7}}', TokenUsage(5, 7, None)),
        (b'{"usage":{"prompt_tokens":"5","completion_tokens":-1}}', TokenUsage()),
        (b'{"usage":{"prompt_tokens":true,"completion_tokens":2.5}}', TokenUsage()),
        (b'{"usage":{"prompt_tokens_details":null,"prompt_tokens":0}}', TokenUsage(0, None)),
        (b'{"usage":null}', TokenUsage()),
        (b'{"choices":[]}', TokenUsage()),
        (b"[1,2]", TokenUsage()),
        (b"not json", TokenUsage()),
        (b"\xff\xfe", TokenUsage()),
        (b"", TokenUsage()),
    ],
)
def test_usage_from_json(body: bytes, want: TokenUsage) -> None:
    assert usage_from_json(body) == want


def test_zero_is_not_unknown() -> None:
    u = usage_from_json(b'{"usage":{"prompt_tokens":0,"completion_tokens":0}}')
    assert u.total_tokens == 0
    assert usage_from_json(b"{}").total_tokens is None


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_stream_with_usage_split_everywhere() -> None:
    for i in range(0, len(VLLM_CHAT_STREAM) + 1, 7):
        clock = FakeClock()
        acc = StreamUsageAccumulator(clock=clock)
        acc.feed(VLLM_CHAT_STREAM[:i])
        clock.now = 101.0
        acc.feed(VLLM_CHAT_STREAM[i:])
        assert acc.finish() == TokenUsage(12, 3, 8, counted=False)
        assert acc.content_chunks == 3  # the role-only first chunk carries no content
        assert acc.done and not acc.is_json and acc.error is None


def test_first_content_time_uses_injected_clock() -> None:
    clock = FakeClock()
    acc = StreamUsageAccumulator(clock=clock)
    first_content = VLLM_CHAT_STREAM.index(b'"Hello"')
    acc.feed(VLLM_CHAT_STREAM[:first_content])  # role chunk only
    assert acc.first_content_at is None
    clock.now = 105.5
    acc.feed(VLLM_CHAT_STREAM[first_content:])
    assert acc.first_content_at == 105.5


def test_stream_without_usage_is_counted() -> None:
    acc = StreamUsageAccumulator()
    acc.feed(VLLM_CHAT_STREAM_NO_USAGE)
    assert acc.finish() == TokenUsage(None, 3, None, counted=True)


def test_completion_stream_counts_text_chunks() -> None:
    body = (
        b'data: {"choices":[{"index":0,"text":"a"}]}\n\n'
        b'data: {"choices":[{"index":0,"text":""}]}\n\n'
        b'data: {"choices":[{"index":0,"text":"b"}]}\n\ndata: [DONE]\n\n'
    )
    acc = StreamUsageAccumulator()
    acc.feed(body)
    assert acc.finish() == TokenUsage(None, 2, None, counted=True)


def test_json_error_body_detected() -> None:
    acc = StreamUsageAccumulator()
    acc.feed(b'  {"error": {"message": "The model `x` does not exist.",')
    acc.feed(b' "type": "NotFoundError", "param": "model", "code": 404}}')
    usage = acc.finish()
    assert acc.is_json
    assert acc.error is not None and acc.error["param"] == "model"
    assert usage == TokenUsage()


def test_non_stream_json_body_through_accumulator() -> None:
    acc = StreamUsageAccumulator()
    acc.feed(b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":4}}')
    assert acc.finish() == TokenUsage(3, 4)


def test_error_frame_inside_stream() -> None:
    acc = StreamUsageAccumulator()
    acc.feed(b'data: {"error":{"message":"boom","type":"InternalServerError","code":500}}\n\n')
    assert acc.finish() == TokenUsage()
    assert acc.error is not None and acc.error["message"] == "boom"


def test_malformed_frames_counted_not_fatal() -> None:
    acc = StreamUsageAccumulator()
    acc.feed(b"data: {oops\n\ndata: [1]\n\n" + VLLM_CHAT_STREAM)
    assert acc.malformed == 2
    assert acc.finish().completion_tokens == 3


def test_oversized_json_body_stays_unknown() -> None:
    acc = StreamUsageAccumulator(max_json_bytes=32)
    acc.feed(b'{"usage":{"prompt_tokens":3,"completion_tokens":4},"pad":"')
    acc.feed(b"x" * 100 + b'"}')
    assert acc.finish() == TokenUsage()


@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.binary(max_size=200), max_size=8))
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_accumulator_never_raises(chunks: list[bytes]) -> None:
    acc = StreamUsageAccumulator()
    for c in chunks:
        acc.feed(c)
    usage = acc.finish()
    assert usage.completion_tokens is None or usage.completion_tokens >= 0
