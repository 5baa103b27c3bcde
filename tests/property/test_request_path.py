"""Hostile requests through the real protocol edge and director (the fuzz target's invariants).

Hypothesis drives the same harness as the atheris target (tests/fuzz/request_path.py): wrong
types in every field, deep nesting, huge arrays, invalid UTF-8, forged destination, session and
subset values, arbitrary chunking and body modes. Zero crashes, zero 500s, zero stuck requests,
and no upstream outside the model's pool.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.wire import DESTINATION_HEADER
from tests._director import OTHER_POOL, POOL
from tests.fuzz.request_path import HEADER_NAMES, MAX_BODY, MODES, PATHS, Case, RequestPath


@pytest.fixture(scope="module")
def harness(qwen_tokenizer_dir: Path) -> Iterator[tuple[RequestPath, asyncio.AbstractEventLoop]]:
    loop = asyncio.new_event_loop()
    h = RequestPath(qwen_tokenizer_dir)
    try:
        yield h, loop
    finally:
        h.close()
        loop.close()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=10,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "stream", "stream_options", "tools",
          "prompt_token_ids", "n", "input", "chat_template_kwargs", "add_generation_prompt", "user",
          "max_completion_tokens", "tool_choice", "response_format"]  # fmt: skip


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    base: dict[str, object] = {
        "model": draw(st.sampled_from(["qwen3", "other", "nope", ""])),
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
    }
    for key in draw(st.lists(st.sampled_from(FIELDS), max_size=3)):
        base[key] = draw(json_values)
    body = json.dumps(base).encode() if draw(st.booleans()) else b""  # stdlib: big ints, NaN
    mutation = draw(st.sampled_from(["none", "raw", "utf8", "truncate", "deep", "huge"]))
    if mutation == "raw" or not body:
        return draw(st.binary(max_size=300))
    if mutation == "utf8":
        return body.replace(b"hello", b"hel\xff\xfelo")
    if mutation == "truncate":
        return body[: draw(st.integers(0, len(body)))]
    if mutation == "deep":
        depth = draw(st.integers(100, 20_000))
        return body[:-1] + b',"x":' + b"[" * depth + b"]" * depth + b"}"
    if mutation == "huge":
        n = draw(st.integers(500, 3000))
        return json.dumps({**base, "messages": [{"role": "user", "content": "m"}] * n}).encode()
    return body


header_values = st.binary(max_size=40) | st.sampled_from(
    [
        x.encode()
        for x in (*POOL, "10.9.9.9:80", "127.0.0.1:22", base64.b64encode(b"10.66.0.1:443").decode())
    ]
)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    body = draw(bodies())
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=3)))
    chunks, prev = [], 0
    for cut in [*cuts, len(body)]:
        chunks.append(body[prev:cut])
        prev = cut
    return Case(
        mode=draw(st.sampled_from(MODES)),
        method=draw(st.sampled_from(["POST", "GET"])),
        path=draw(st.sampled_from(PATHS) | st.text(max_size=20)),
        headers=draw(st.lists(st.tuples(st.sampled_from(HEADER_NAMES), header_values), max_size=4)),
        chunks=chunks,
        subset=draw(
            st.none()
            | st.lists(st.sampled_from([*POOL, *OTHER_POOL, "10.9.9.9:1", ""]), max_size=3)
        ),
        trailers=draw(st.booleans()),
        no_wait=draw(st.booleans()),
    )


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=cases())
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_hostile_requests_never_crash_stick_or_escape_the_pool(
    harness: tuple[RequestPath, asyncio.AbstractEventLoop], case: Case
) -> None:
    h, loop = harness
    loop.run_until_complete(h.run(case))


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize(
    "value",
    [None, True, -1, 2**64, 1.5, "x", [], [None], {}, {"role": "user"}, [{"content": {"a": 1}}]],
)
def test_wrong_type_in_every_field(
    harness: tuple[RequestPath, asyncio.AbstractEventLoop], field: str, value: object
) -> None:
    h, loop = harness
    body = json.dumps(
        {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}], field: value}
    )
    body_bytes = body.encode()
    before = dict(h.statuses)
    loop.run_until_complete(h.run(Case(chunks=[body_bytes])))
    # Either routed or a client error: never a 5xx for a bad field.
    assert all(s < 500 for s, n in h.statuses.items() if n != before.get(s, 0))


@pytest.mark.parametrize("mode", MODES)
def test_oversized_body_is_413_in_every_mode(
    harness: tuple[RequestPath, asyncio.AbstractEventLoop], mode: int
) -> None:
    h, loop = harness
    big = b'{"model":"qwen3","prompt":"' + b"a" * (MAX_BODY + 10) + b'"}'
    before = h.statuses.get(413, 0)
    loop.run_until_complete(h.run(Case(mode=mode, chunks=[big[:5000], big[5000:]])))
    assert h.statuses.get(413, 0) == before + 1


def test_forged_destination_and_session_never_pick_outside_the_pool(
    harness: tuple[RequestPath, asyncio.AbstractEventLoop],
) -> None:
    h, loop = harness
    body = orjson.dumps({"model": "qwen3", "messages": [{"role": "user", "content": "hi"}]})
    forged = [
        (DESTINATION_HEADER, b"10.66.0.1:443"),
        ("x-session-id", base64.b64encode(b"10.66.0.1:443")),
        ("x-session-id", base64.b64encode(OTHER_POOL[0].encode())),  # another model's pod
        ("x-session-id", b"s1.AAAAAAAAAAAAAAAAAAAAAA"),  # a forged token
        ("routing-strategy", b"session-affinity"),
    ]
    routed = h.routed
    for subset, expected in ((None, set(POOL)), (["10.66.0.1:443", POOL[1]], {POOL[1]})):
        loop.run_until_complete(h.run(Case(headers=forged, chunks=[body], subset=subset)))
        assert h.last_destinations and set(h.last_destinations) <= expected
    assert h.routed == routed + 2  # both routed (the invariant check ran on each destination)
