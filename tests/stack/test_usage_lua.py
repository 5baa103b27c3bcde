"""usage.lua, the parser that runs in Envoy, under LuaJIT 2.1 (Envoy's runtime) against the
table of vectors: whole, split at every byte, a byte at a time and at random; what it writes
read back by the server's own access-log reader. It never raises, whatever the bytes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.server.accesslog import record_from_entry
from extproc.types import TokenUsage
from extproc.wire import TOKEN_NAMESPACE, USAGE_NAMESPACE
from tests.envoy_lua import LuaRun, UsageLua, access_entry
from tests.usage_vectors import JSON, SSE, VECTORS, UsageVector

NOW_MS = 1_700_000_000_123
VECTOR_IDS = [v.name for v in VECTORS]
# Every split of a body this long takes over a second (a run costs ~0.3 ms here).
EVERY_SPLIT = [
    pytest.param(v, id=v.name, marks=[pytest.mark.slow] if len(v.body) > 2500 else [])
    for v in VECTORS
]


@pytest.fixture(scope="module")
def lua() -> UsageLua:
    """One Lua state for the module, as Envoy keeps one per worker across requests."""
    return UsageLua()


def reading(run: LuaRun) -> tuple[TokenUsage, float | None, dict[str, object]]:
    """What the server accounts (the access record's usage), the event count, and the token
    metadata Envoy Gateway's rate limits read."""
    assert run.error is None, run.error
    usage = record_from_entry(access_entry(run.metadata)).usage
    events = run.metadata.get(USAGE_NAMESPACE, {}).get("events")
    assert events is None or isinstance(events, float)
    return usage, events, dict(run.metadata.get(TOKEN_NAMESPACE, {}))


def expected(v: UsageVector) -> tuple[TokenUsage, float | None, dict[str, object]]:
    u = v.usage
    tokens: dict[str, object] = {}
    if v.tokens is not None:
        tokens = dict(v.tokens)
    elif not u.counted and u.prompt_tokens is not None and u.completion_tokens is not None:
        # Rate limits are charged the engine's usage, and only that: never a count or a guess.
        tokens = {
            "llm_input_token": float(u.prompt_tokens),
            "llm_output_token": float(u.completion_tokens),
            "llm_total_token": float(u.prompt_tokens + u.completion_tokens),
        }
        if u.cached_tokens is not None:
            tokens["llm_cached_input_token"] = float(u.cached_tokens)
    return u, None if v.events is None else float(v.events), tokens


def splits(body: bytes) -> Iterator[list[bytes]]:
    for i in range(len(body) + 1):
        yield [body[:i], body[i:]]  # an empty chunk included, as Envoy's end-of-stream frame


def test_the_runtime_is_luajit_2_1_as_envoy_embeds(lua: UsageLua) -> None:
    # Envoy's Lua filter runs LuaJIT ("mostly 5.1 with some 5.2 features"); so do these tests.
    assert lua.version.startswith("LuaJIT 2.1")
    assert lua.version.endswith("Lua 5.1")


def test_the_table_covers_every_api_and_both_body_kinds() -> None:
    names = " ".join(VECTOR_IDS)
    for api in ("chat-", "completions-", "responses-", "anthropic-"):
        assert f"{api}stream" in names and f"{api}json" in names
    assert len(set(VECTOR_IDS)) == len(VECTORS)
    assert {v.content_type for v in VECTORS} >= {SSE, JSON}


@pytest.mark.parametrize("v", VECTORS, ids=VECTOR_IDS)
def test_whole_body(lua: UsageLua, v: UsageVector) -> None:
    run = lua.run_response([v.body], v.headers, NOW_MS)
    assert reading(run) == expected(v)
    # The first content event's wall time, on streams that had one.
    first = run.metadata.get(USAGE_NAMESPACE, {}).get("first_token_ms")
    assert first == (float(NOW_MS) if v.events else None)


@pytest.mark.parametrize("v", EVERY_SPLIT)
def test_split_at_every_byte(lua: UsageLua, v: UsageVector) -> None:
    want = expected(v)
    for chunks in splits(v.body):
        assert reading(lua.run_response(chunks, v.headers)) == want, len(chunks[0])


@pytest.mark.parametrize("v", VECTORS, ids=VECTOR_IDS)
def test_a_byte_at_a_time(lua: UsageLua, v: UsageVector) -> None:
    chunks = [v.body[i : i + 1] for i in range(len(v.body))]
    assert reading(lua.run_response(chunks, v.headers)) == expected(v)


@settings(max_examples=300, deadline=None)
@given(
    v=st.sampled_from(VECTORS),
    cuts=st.lists(st.floats(min_value=0, max_value=1), max_size=12),
)
def test_split_anywhere_into_many_chunks(lua: UsageLua, v: UsageVector, cuts: list[float]) -> None:
    at = sorted(int(c * len(v.body)) for c in cuts)
    chunks = [v.body[a:b] for a, b in zip([0, *at], [*at, len(v.body)], strict=True)]
    assert reading(lua.run_response(chunks, v.headers)) == expected(v)


def test_no_state_leaks_from_one_response_to_the_next(lua: UsageLua) -> None:
    # Anthropic's message_delta may carry the output count alone: the input count comes from
    # the same response's message_start, never from the one before on this worker.
    (anthropic,) = [v for v in VECTORS if v.name == "anthropic-stream"]
    lua.run_response([anthropic.body], anthropic.headers)
    delta_only = b'data: {"type":"message_delta","delta":{},"usage":{"output_tokens":9}}\n\n'
    usage, events, tokens = reading(lua.run_response([delta_only]))
    assert (usage, events, tokens) == (TokenUsage(completion_tokens=0, counted=True), 0.0, {})


def test_a_reset_stream_keeps_what_was_set_before(lua: UsageLua) -> None:
    # A reset (client gone, engine died) ends the script mid-loop: no end-of-stream code runs.
    (cut,) = [v for v in VECTORS if v.name == "anthropic-stream-cut-before-message-delta"]
    # message_start's output 0 was withdrawn; 3 events are fewer than one publication (8).
    assert reading(lua.run_response([cut.body], cut.headers, ended=False))[0] == TokenUsage()
    # The event count is published every 8 events: the last few before a reset are lost.
    events = [b'data: {"choices":[{"delta":{"content":"t%d"}}]}\n\n' % i for i in range(13)]
    chunks = [b"".join(events[:10]), b"".join(events[10:])]
    usage, count, _ = reading(lua.run_response(chunks, ended=False))
    assert (usage, count) == (TokenUsage(completion_tokens=10, counted=True), 10.0)


@pytest.mark.parametrize("content_type", [SSE, JSON])
@settings(max_examples=300, deadline=None)
@given(chunks=st.lists(st.binary(max_size=300), max_size=8))
@pytest.mark.slow  # hundreds of runs
def test_any_bytes_never_raise(lua: UsageLua, content_type: str, chunks: list[bytes]) -> None:
    usage, events, tokens = reading(lua.run_response(chunks, [("content-type", content_type)]))
    for count in (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens, events):
        assert count is None or count >= 0
    assert (events is None) == (content_type == JSON)
    # An output count is charged only when it is the engine's, never with a counted one.
    assert tokens.get("llm_output_token") is None or not usage.counted


_KEYS = ["usage", "response", "message", "prompt_tokens", "completion_tokens", "input_tokens",
         "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens",
         "input_tokens_details", "prompt_tokens_details", "cached_tokens", "type", "delta",
         "content", "text"]  # fmt: skip
_SHAPES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.sampled_from(_KEYS), kids, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(obj=_SHAPES, split=st.floats(min_value=0, max_value=1))
@pytest.mark.slow  # hundreds of runs
def test_any_json_shape_never_raises(lua: UsageLua, obj: object, split: float) -> None:
    body = json.dumps(obj).encode()
    for content_type, data in ((JSON, body), (SSE, b"data: " + body + b"\n\n")):
        cut = int(split * len(data))
        usage, _, tokens = reading(
            lua.run_response([data[:cut], data[cut:]], [("content-type", content_type)])
        )
        if tokens.get("llm_output_token") is not None:  # charged is what the server accounts
            assert tokens["llm_input_token"] == usage.prompt_tokens
            assert tokens["llm_output_token"] == usage.completion_tokens


# -- the shim holds the script to Envoy's rules -----------------------------------------------


def _script(tmp_path: Path, body: str) -> UsageLua:
    path = tmp_path / "script.lua"
    path.write_text(f"function envoy_on_response(handle)\n{body}\nend\n")
    return UsageLua(path)


def test_shim_a_chunk_dies_when_the_script_resumes(tmp_path: Path) -> None:
    lua = _script(
        tmp_path,
        "local seen = {}\nfor chunk in handle:bodyChunks() do seen[#seen + 1] = chunk end\n"
        "local m = handle:streamInfo():dynamicMetadata()\n"
        "m:set('t', 'last', seen[#seen]:length())\nm:set('t', 'first', seen[1]:length())",
    )
    # The end-of-stream chunk is still live after the loop (no yield came after it).
    run = lua.run_response([b"ab", b"c"])
    assert run.metadata == {"t": {"last": 1.0}}
    assert run.error is not None and "outside of proper scope" in run.error


def test_shim_get_bytes_is_bounded_as_in_envoy(tmp_path: Path) -> None:
    lua = _script(
        tmp_path,
        "for chunk in handle:bodyChunks() do\n"
        "  local m = handle:streamInfo():dynamicMetadata()\n"
        "  m:set('t', 'all', chunk:getBytes(0, chunk:length()))\n"
        "  m:set('t', 'past', chunk:getBytes(1, chunk:length()))\nend",
    )
    run = lua.run_response([b"abc"])
    assert run.metadata == {"t": {"all": "abc"}}
    assert run.error is not None and "(index + length) must be <= buffer size" in run.error


def test_shim_headers_are_case_insensitive_and_absent_is_nil(tmp_path: Path) -> None:
    lua = _script(
        tmp_path,
        "local h = handle:headers()\nlocal m = handle:streamInfo():dynamicMetadata()\n"
        "m:set('t', 'type', h:get('Content-Type'))\n"
        "m:set('t', 'absent', h:get('content-encoding') == nil)",
    )
    run = lua.run_response([], [("content-type", "a"), ("CONTENT-TYPE", "b")])
    assert run == LuaRun({"t": {"type": "a,b", "absent": True}}, None)


def test_shim_metadata_numbers_are_doubles_and_functions_are_refused(tmp_path: Path) -> None:
    lua = _script(
        tmp_path,
        "local m = handle:streamInfo():dynamicMetadata()\nm:set('t', 'n', 7)\n"
        "m:set('t', 'f', function() end)",
    )
    run = lua.run_response([])
    assert run.metadata == {"t": {"n": 7.0}} and isinstance(run.metadata["t"]["n"], float)
    assert run.error is not None and "unexpected type 'function'" in run.error
