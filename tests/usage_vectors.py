"""Response bodies and the token usage Envoy's accounting must find in them: the one table that
extproc/stack/usage.lua is held to, under LuaJIT in tests/stack/test_usage_lua.py and through
real Envoy in tests/e2e/test_usage_accounting.py.

Each vector's `usage` is what the access record must carry, as the server reads the Lua
filter's metadata (extproc/server/accesslog.py): the engine's usage when one was found whole;
else, for a stream, the content events counted (`counted=True`); else unknown (every field
None), never 0. `events` is the `extproc.usage.events` the filter writes (streams only).

Bodies are byte-for-byte what the engines send: chat and completions as vLLM writes them
(reference/engine.md 4.2: `data: <json>\\n\\n`, usage only in the last chunk), the Responses
API and Anthropic Messages from the simulator's builders (extproc/sim/agents.py, which follow
vLLM's serving code), and bodies no engine should send.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Mapping
from dataclasses import dataclass

from extproc.sim.agents import (
    AnthropicEvents,
    ResponseEvents,
    anthropic_body,
    anthropic_usage,
    response_body,
    responses_usage,
)
from extproc.types import TokenUsage

__all__ = ["JSON", "SSE", "VECTORS", "UsageVector"]

SSE = "text/event-stream"
JSON = "application/json"


@dataclass(frozen=True, slots=True)
class UsageVector:
    name: str
    body: bytes
    usage: TokenUsage  # what the access record must say
    content_type: str = SSE
    content_encoding: str | None = None
    events: int | None = None  # extproc.usage.events; None: not written (not a stream)
    # io.envoy.ai_gateway (Envoy Gateway's rate limits), when not simply the exact `usage`
    # (None: a key set to null).
    tokens: Mapping[str, float | None] | None = None

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        extra = (("content-encoding", self.content_encoding),) if self.content_encoding else ()
        return (("content-type", self.content_type), *extra)


def _data(obj: object) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"
_CHAT = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "qwen3"}


def _chat_chunk(delta: dict[str, object], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    return _data({**_CHAT, "choices": [choice]})


def _chat_usage(prompt: int, completion: int, cached: int | None = None) -> dict[str, object]:
    usage: dict[str, object] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
    }
    if cached is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return usage


def _chat_stream(pieces: list[str], usage: dict[str, object] | None) -> bytes:
    """vLLM's chat stream: the role chunk (empty content), one chunk per piece, the usage
    chunk (`choices: []`) when asked for, then [DONE]."""
    out = _chat_chunk({"role": "assistant", "content": ""})
    for i, piece in enumerate(pieces):
        out += _chat_chunk({"content": piece}, "stop" if i == len(pieces) - 1 else None)
    if usage is not None:
        out += _data({**_CHAT, "choices": [], "usage": usage})
    return out + _DONE


def _chat_body(usage: object, text: str = "Hello wörld!") -> bytes:
    message = {"role": "assistant", "content": text}
    body = {
        "id": "chatcmpl-2",
        "object": "chat.completion",
        "created": 1,
        "model": "qwen3",
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
        "usage": usage,
    }
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def _completion_stream(pieces: list[str], usage: dict[str, object] | None) -> bytes:
    head = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "qwen3"}
    out = b""
    for piece in pieces:
        out += _data({**head, "choices": [{"index": 0, "text": piece, "finish_reason": None}]})
    if usage is not None:
        out += _data({**head, "choices": [], "usage": usage})
    return out + _DONE


def _responses_stream(prompt: int, pieces: list[str], cached: int, *, complete: bool) -> bytes:
    ev = ResponseEvents({}, rid="resp_1", item_id="msg_1", model="qwen3", created=1)
    out = b"".join(ev.start()) + b"".join(ev.delta(p) for p in pieces)
    if complete:
        out += b"".join(ev.finish("stop", responses_usage(prompt, len(pieces), cached)))
    return out


def _responses_body(prompt: int, completion: int, cached: int) -> bytes:
    body = response_body({}, rid="resp_2", item_id="msg_2", model="qwen3", created=1,
                         text="Hi.", reason="stop", usage=responses_usage(prompt, completion, cached))  # fmt: skip
    return json.dumps(body, separators=(",", ":")).encode()


def _anthropic_stream(
    prompt: int, pieces: list[str], cached: int, *, complete: bool = True
) -> bytes:
    ev = AnthropicEvents(mid="msg_1", model="qwen3")
    out = b"".join(ev.start(anthropic_usage(prompt, 0, cached)))
    out += b"".join(ev.delta(p) for p in pieces)
    return out + (b"".join(ev.finish("stop", len(pieces))) if complete else b"")


def _anthropic_body(usage: dict[str, object]) -> bytes:
    body = anthropic_body(mid="msg_2", model="qwen3", text="Hi.", reason="stop", usage=usage)
    return json.dumps(body, separators=(",", ":")).encode()


PIECES = ["Hello", " wörld", "!"]
# Model text that spells a usage object: inside a JSON string its quotes are escaped.
FORGED = '"usage":{"prompt_tokens":999,"completion_tokens":999}'
PRETTY_CHAT = (
    b'{\n  "id": "chatcmpl-3",\n  "choices": [],\n  "usage": {\n    "prompt_tokens": 21,\n'
    b'    "completion_tokens": 8,\n    "total_tokens": 29,\n'
    b'    "prompt_tokens_details": {"cached_tokens": 16}\n  }\n}\n'
)
UNKNOWN = TokenUsage()

VECTORS: tuple[UsageVector, ...] = (
    # -- chat completions -------------------------------------------------------------------
    UsageVector(
        "chat-stream", _chat_stream(PIECES, _chat_usage(12, 3, 8)), TokenUsage(12, 3, 8), events=3
    ),
    UsageVector(
        "chat-stream-no-cached-count",
        _chat_stream(PIECES, _chat_usage(12, 3)),
        TokenUsage(12, 3),
        events=3,
    ),
    UsageVector(
        "chat-stream-zero-tokens",
        _chat_stream([], _chat_usage(0, 0, 0)),
        TokenUsage(0, 0, 0),
        events=0,
    ),
    # Without usage the content events are the count; the empty role chunk is not one.
    UsageVector(
        "chat-stream-usage-absent",
        _chat_stream(PIECES, None),
        TokenUsage(completion_tokens=3, counted=True),
        events=3,
    ),
    UsageVector(
        "chat-stream-crlf",
        _chat_stream(PIECES, _chat_usage(12, 3, 8)).replace(b"\n", b"\r\n"),
        TokenUsage(12, 3, 8),
        events=3,
    ),
    UsageVector(
        "chat-stream-forged-usage-in-text",
        _chat_stream([FORGED, "x"], None),
        TokenUsage(completion_tokens=2, counted=True),
        events=2,
    ),
    # OpenAI's own servers send `"usage":null` in every chunk before the last.
    UsageVector(
        "chat-stream-usage-null-until-last",
        _chat_stream(PIECES, _chat_usage(12, 3, 8)).replace(
            b'"finish_reason":null}]}', b'"finish_reason":null}],"usage":null}'
        ),
        TokenUsage(12, 3, 8),
        events=3,
    ),
    UsageVector(
        "chat-json", _chat_body(_chat_usage(5, 7, 4)), TokenUsage(5, 7, 4), content_type=JSON
    ),
    UsageVector(
        "chat-json-charset",
        _chat_body(_chat_usage(5, 7)),
        TokenUsage(5, 7),
        content_type="application/json; charset=utf-8",
    ),
    UsageVector("chat-json-pretty", PRETTY_CHAT, TokenUsage(21, 8, 16), content_type=JSON),
    UsageVector(
        "chat-json-zero-tokens", _chat_body(_chat_usage(0, 0)), TokenUsage(0, 0), content_type=JSON
    ),
    UsageVector("chat-json-usage-absent", b'{"id":"x","choices":[]}', UNKNOWN, content_type=JSON),
    UsageVector("chat-json-usage-null", _chat_body(None), UNKNOWN, content_type=JSON),
    UsageVector(
        "chat-json-forged-usage-in-text", _chat_body(None, text=FORGED), UNKNOWN, content_type=JSON
    ),
    # -- completions ------------------------------------------------------------------------
    UsageVector(
        "completions-stream",
        _completion_stream(["a", "", "b"], _chat_usage(4, 2)),
        TokenUsage(4, 2),
        events=2,
    ),
    UsageVector(
        "completions-stream-usage-absent",
        _completion_stream(["a", "", "b"], None),
        TokenUsage(completion_tokens=2, counted=True),
        events=2,
    ),
    UsageVector(
        "completions-json",
        b'{"object":"text_completion","choices":[{"index":0,"text":"ab"}],'
        b'"usage":{"prompt_tokens":4,"total_tokens":6,"completion_tokens":2}}',
        TokenUsage(4, 2),
        content_type=JSON,
    ),
    # -- the Responses API: usage in `response.completed`; only delta events are content ----
    UsageVector(
        "responses-stream",
        _responses_stream(40, ["a", "b", "c"], 16, complete=True),
        TokenUsage(40, 3, 16),
        events=3,
    ),
    UsageVector(
        "responses-stream-cut-before-completed",
        _responses_stream(40, ["a", "b", "c"], 16, complete=False),
        TokenUsage(completion_tokens=3, counted=True),
        events=3,
    ),
    UsageVector(
        "responses-json", _responses_body(30, 4, 16), TokenUsage(30, 4, 16), content_type=JSON
    ),
    # -- Anthropic Messages: input_tokens without cache reads and writes --------------------
    UsageVector(
        "anthropic-stream",
        _anthropic_stream(40, ["a", "b", "c"], 16),
        TokenUsage(40, 3, 16),
        events=3,
    ),
    # message_start's usage is an opening count (output 0): content after it withdraws the
    # output count, so a stream cut before message_delta is counted, not accounted 0 tokens.
    UsageVector(
        "anthropic-stream-cut-before-message-delta",
        _anthropic_stream(40, ["a", "b", "c"], 16, complete=False),
        TokenUsage(completion_tokens=3, counted=True),
        events=3,
        tokens={
            "llm_input_token": 40.0,
            "llm_cached_input_token": 16.0,
            "llm_output_token": None,
            "llm_total_token": None,
        },
    ),
    UsageVector(
        "anthropic-json",
        _anthropic_body(anthropic_usage(30, 4, 16)),
        TokenUsage(30, 4, 16),
        content_type=JSON,
    ),
    UsageVector(
        "anthropic-json-cache-writes-are-prompt",
        b'{"type":"message","usage":{"input_tokens":2,"cache_creation_input_tokens":8,'
        b'"output_tokens":1}}',
        TokenUsage(10, 1),
        content_type=JSON,
    ),
    # A message_delta that carries the input counts too replaces message_start's.
    UsageVector(
        "anthropic-stream-delta-with-input",
        b'event: message_start\ndata: {"type":"message_start","message":{"usage":'
        b'{"input_tokens":3,"output_tokens":0}}}\n\n'
        b'event: message_delta\ndata: {"type":"message_delta","delta":{},"usage":'
        b'{"input_tokens":5,"output_tokens":9}}\n\n',
        TokenUsage(5, 9),
        events=0,
    ),
    # -- not what an engine should send: never an error, never a count made up -------------
    UsageVector(
        "sse-malformed-events-then-usage",
        b"data: {oops\n\ndata: [1]\n\ndata: \xff\xfe\n\n"
        + _chat_stream(PIECES, _chat_usage(12, 3, 8)),
        TokenUsage(12, 3, 8),
        events=3,
    ),
    # An error frame inside a stream: no usage, no content; 0 events counted.
    UsageVector(
        "sse-error-frame",
        b'data: {"error":{"message":"boom","type":"InternalServerError","code":500}}\n\n',
        TokenUsage(completion_tokens=0, counted=True),
        events=0,
    ),
    UsageVector(
        "sse-usage-never-closes",
        _chat_chunk({"content": "a"}) + b'data: {"choices":[],"usage":{"prompt_tokens":4,',
        TokenUsage(completion_tokens=1, counted=True),
        events=1,
    ),
    UsageVector(
        "sse-negative-count",
        _chat_stream(["a"], _chat_usage(-4, 1)),
        TokenUsage(completion_tokens=1, counted=True),
        events=1,
    ),
    UsageVector(
        "sse-count-beyond-2-53",
        _chat_stream(["a"], _chat_usage(2**63, 1)),
        TokenUsage(completion_tokens=1, counted=True),
        events=1,
    ),
    UsageVector("json-not-json", b"not json", UNKNOWN, content_type=JSON),
    UsageVector("json-binary", b"\xff\xfe\x00{", UNKNOWN, content_type=JSON),
    UsageVector("json-empty", b"", UNKNOWN, content_type=JSON),
    UsageVector("json-array", b"[1,2]", UNKNOWN, content_type=JSON),
    UsageVector(
        "json-counts-as-strings",
        b'{"usage":{"prompt_tokens":"5","completion_tokens":"7"}}',
        UNKNOWN,
        content_type=JSON,
    ),
    UsageVector(
        "json-counts-negative",
        b'{"usage":{"prompt_tokens":5,"completion_tokens":-1}}',
        UNKNOWN,
        content_type=JSON,
    ),
    UsageVector(
        "json-counts-fractional",
        b'{"usage":{"prompt_tokens":5,"completion_tokens":2.5}}',
        UNKNOWN,
        content_type=JSON,
    ),
    UsageVector(
        "json-counts-exponent",
        b'{"usage":{"prompt_tokens":5,"completion_tokens":1e3}}',
        UNKNOWN,
        content_type=JSON,
    ),
    UsageVector(
        "json-counts-boolean",
        b'{"usage":{"prompt_tokens":true,"completion_tokens":false}}',
        UNKNOWN,
        content_type=JSON,
    ),
    UsageVector(
        "json-count-beyond-2-53",
        b'{"usage":{"prompt_tokens":99999999999999999999,"completion_tokens":3}}',
        UNKNOWN,
        content_type=JSON,
    ),
    UsageVector(
        "json-count-of-400-digits",
        b'{"usage":{"prompt_tokens":' + b"9" * 400 + b',"completion_tokens":3}}',
        UNKNOWN,
        content_type=JSON,
    ),
    UsageVector(
        "json-usage-not-an-object", b'{"usage":[1,2],"x":{"usage":7}}', UNKNOWN, content_type=JSON
    ),
    # Compressed bytes cannot be read: unknown, whatever they hold.
    UsageVector(
        "json-gzip",
        gzip.compress(_chat_body(_chat_usage(5, 7)), mtime=0),
        UNKNOWN,
        content_type=JSON,
        content_encoding="gzip",
    ),
    # Neither JSON nor SSE: not read.
    UsageVector("text-plain", _chat_body(_chat_usage(5, 7)), UNKNOWN, content_type="text/plain"),
)
