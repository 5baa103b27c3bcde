"""`/v1/responses` and `/v1/messages`: parsed into chat messages as vLLM converts them, their
errors (JSON path in `param`, Anthropic's shape on /v1/messages). Their usage is read by
Envoy's Lua filter: tests/stack/test_usage_lua.py."""

from __future__ import annotations

import json

import orjson
import pytest

from extproc.protocol import error_json, parse_request
from extproc.types import BadRequest, GatewayError, NotFound, RequestKind

RESP = "/v1/responses"
MSGS = "/v1/messages"
LIMIT = 1 << 16


def parse(path: str, obj: object):  # type: ignore[no-untyped-def]
    return parse_request(path, json.dumps(obj).encode(), max_body_bytes=LIMIT)


def test_responses_string_input_with_instructions_and_tools() -> None:
    tool = {"type": "function", "name": "get", "description": "d", "parameters": {}}
    req = parse(
        RESP,
        {"model": "m", "input": "hi", "instructions": "be kind", "max_output_tokens": 9,
         "tools": [tool, {"type": "web_search"}], "stream": True, "user": "u1",
         "previous_response_id": "resp_1"},
    )  # fmt: skip
    assert req.kind is RequestKind.RESPONSES
    assert req.messages == (
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "hi"},
    )
    # Function tools wrapped whole (vLLM's convert_tool_responses_to_completions_format).
    assert req.tools == ({"type": "function", "function": tool},)
    assert (req.max_tokens, req.stream, req.user) == (9, True, "u1")
    assert req.previous_response_id == "resp_1"


def test_responses_items_as_vllm_converts_them() -> None:
    req = parse(
        RESP,
        {"model": "m", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                         {"type": "input_text", "text": "b"}]},
            {"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": "hm"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "42"},
            {"type": "message", "role": "assistant", "id": "o", "status": "completed",
             "content": [{"type": "output_text", "text": "done", "annotations": []}]},
        ]},
    )  # fmt: skip
    assert req.messages == (
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "reasoning": "hm"},
        {"role": "assistant", "tool_calls": [
            {"id": "c1", "function": {"name": "f", "arguments": "{}"}, "type": "function"}]},
        {"role": "tool", "content": "42", "tool_call_id": "c1"},
        {"role": "assistant", "content": "done"},
    )  # fmt: skip


def test_anthropic_system_blocks_tools_and_tool_results() -> None:
    req = parse(
        MSGS,
        {"model": "m", "max_tokens": 5, "metadata": {"user_id": "u"},
         "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
         "tools": [{"name": "f", "input_schema": {"type": "object"}}],
         "messages": [
             {"role": "user", "content": "q"},
             {"role": "assistant", "content": [
                 {"type": "text", "text": "calling"},
                 {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "t1", "content": "7"},
                 {"type": "text", "text": "thanks"}]},
         ]},
    )  # fmt: skip
    assert req.kind is RequestKind.MESSAGES and req.max_tokens == 5 and req.user == "u"
    assert req.messages == (
        {"role": "system", "content": "AB"},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        # vLLM puts a user turn's tool results ahead of its text, as tool messages.
        {"role": "tool", "tool_call_id": "t1", "content": "7"},
        {"role": "user", "content": "thanks"},
    )  # fmt: skip
    assert req.tools == (
        {"type": "function",
         "function": {"name": "f", "description": None, "parameters": {"type": "object"}}},
    )  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (RESP, {"model": "m"}, "input"),
        (RESP, {"model": "m", "input": 3}, "input"),
        (RESP, {"model": "m", "input": []}, "input"),
        (RESP, {"model": "m", "input": [7]}, "input[0]"),
        (RESP, {"model": "m", "input": [{"content": "x"}]}, "input[0].role"),
        (RESP, {"model": "m", "input": [{"role": "user", "content": [{"type": "input_text"}]}]},
         "input[0].content[0].text"),
        (RESP, {"model": "m", "input": [{"type": "function_call", "name": "f"}]},
         "input[0].call_id"),
        (RESP, {"model": "m", "input": "x", "instructions": 1}, "instructions"),
        (RESP, {"model": "m", "input": "x", "tools": {}}, "tools"),
        (RESP, {"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        (RESP, {"model": "m", "input": "x", "previous_response_id": 5}, "previous_response_id"),
        (MSGS, {"model": "m", "messages": [{"role": "user", "content": "x"}]}, "max_tokens"),
        (MSGS, {"model": "m", "max_tokens": 1}, "messages"),
        (MSGS, {"model": "m", "max_tokens": 1, "metadata": {"user_id": 3},
                "messages": [{"role": "user", "content": "x"}]}, "metadata.user_id"),
        (MSGS, {"model": "m", "max_tokens": 1, "messages": [{"role": "system", "content": "x"}]},
         "messages[0].role"),
        (MSGS, {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": 1}]},
         "messages[0].content"),
        (MSGS, {"model": "m", "max_tokens": 1,
                "messages": [{"role": "user", "content": [{"type": "text"}]}]},
         "messages[0].content[0].text"),
        (MSGS, {"model": "m", "max_tokens": 1, "system": 4,
                "messages": [{"role": "user", "content": "x"}]}, "system"),
        (MSGS, {"model": "m", "max_tokens": 1, "tools": [{"input_schema": {}}],
                "messages": [{"role": "user", "content": "x"}]}, "tools[0].name"),
    ],
)  # fmt: skip
def test_bad_bodies_name_the_field(path: str, body: object, param: str) -> None:
    with pytest.raises(BadRequest) as err:
        parse(path, body)
    assert err.value.param == param


def test_errors_on_messages_are_anthropic_shaped() -> None:
    assert orjson.loads(error_json(NotFound("no such model"), path="/v1/messages?beta=true")) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no such model"},
    }
    overloaded = GatewayError("busy")
    overloaded.status = 503
    assert orjson.loads(error_json(overloaded, path=MSGS))["error"]["type"] == "overloaded_error"
    # Every other path keeps OpenAI's shape.
    assert orjson.loads(error_json(NotFound("x"), path=RESP))["error"]["type"] == "not_found_error"
    assert "type" not in orjson.loads(error_json(NotFound("x"), path=RESP))
