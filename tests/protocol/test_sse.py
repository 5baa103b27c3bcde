"""SSEDecoder: events split at every byte offset, CR/LF/CRLF, bounded memory, fuzzed."""

from __future__ import annotations

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.protocol import SSEDecoder
from tests.protocol.vllm_stream import VLLM_CHAT_STREAM


def decode_all(chunks: list[bytes], **kw: int) -> list[str]:
    dec = SSEDecoder(**kw)
    out: list[str] = []
    for c in chunks:
        out.extend(dec.feed(c))
    out.extend(dec.flush())
    return out


def test_whole_vllm_stream() -> None:
    events = decode_all([VLLM_CHAT_STREAM])
    assert len(events) == 6 and events[-1] == "[DONE]"
    objs = [orjson.loads(e) for e in events[:-1]]
    assert objs[-1]["usage"]["completion_tokens"] == 3
    assert "".join(o["choices"][0]["delta"].get("content", "") for o in objs[:-1]) == "Hello wörld!"


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"])
def test_every_split_offset_gives_identical_events(eol: bytes) -> None:
    stream = VLLM_CHAT_STREAM.replace(b"\n", eol)
    want = decode_all([stream])
    assert len(want) == 6
    for i in range(len(stream) + 1):
        assert decode_all([stream[:i], stream[i:]]) == want, f"split at {i}"


def test_byte_by_byte() -> None:
    stream = VLLM_CHAT_STREAM.replace(b"\n", b"\r\n")
    assert decode_all([stream[i : i + 1] for i in range(len(stream))]) == decode_all([stream])


def test_multiline_data_comments_and_fields() -> None:
    body = b": keep-alive\nevent: message\nid: 7\ndata: a\ndata:b\nretry: 10\n\ndata\n\n"
    assert decode_all([body]) == ["a\nb", ""]


def test_trailing_event_without_blank_line_is_flushed() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: x") == []
    assert dec.flush() == ["x"]


def test_overlong_line_is_dropped_and_counted() -> None:
    dec = SSEDecoder(max_line_bytes=64)
    out = dec.feed(b"data: " + b"x" * 50)
    out += dec.feed(b"y" * 50)  # crosses the limit across chunks
    out += dec.feed(b"z" * 1000 + b"\n\ndata: ok\n\n")
    assert out == ["ok"]
    assert dec.dropped == 1
    dec.feed(b"data: " + b"q" * 500 + b"\n\n")  # overlong inside one chunk
    assert dec.dropped == 2


def test_oversized_event_is_dropped() -> None:
    dec = SSEDecoder(max_line_bytes=100, max_event_bytes=150)
    out = dec.feed(b"data: " + b"a" * 90 + b"\ndata: " + b"b" * 90 + b"\n\ndata: next\n\n")
    assert out == ["next"]
    assert dec.dropped == 1


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400), cuts=st.lists(st.integers(0, 400), max_size=8))
def test_arbitrary_bytes_never_raise_and_chunking_is_irrelevant(
    data: bytes, cuts: list[int]
) -> None:
    points = sorted({min(c, len(data)) for c in cuts})
    chunks = [data[a:b] for a, b in zip([0, *points], [*points, len(data)], strict=True)]
    assert decode_all(chunks, max_line_bytes=64) == decode_all([data], max_line_bytes=64)


@settings(max_examples=200, deadline=None)
@given(
    payloads=st.lists(st.text().filter(lambda s: "\r" not in s and "\n" not in s), max_size=6),
    eol=st.sampled_from(["\n", "\r\n", "\r"]),
    cuts=st.lists(st.integers(0, 2000), max_size=10),
)
def test_roundtrip_of_encoded_events(payloads: list[str], eol: str, cuts: list[int]) -> None:
    stream = "".join(f"data: {p}{eol}{eol}" for p in payloads).encode()
    points = sorted({min(c, len(stream)) for c in cuts})
    chunks = [stream[a:b] for a, b in zip([0, *points], [*points, len(stream)], strict=True)]
    assert decode_all(chunks) == payloads
