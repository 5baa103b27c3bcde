"""The Responses API and Anthropic Messages bodies and stream events, as vLLM writes them.

Pure builders: the simulator's handlers (server.py) run the engine and call these for the
JSON body or the SSE events. Shapes follow vLLM's `ResponsesResponse` / response stream
events (entrypoints/openai/serving_responses.py) and its Anthropic `serving_messages.py`;
Anthropic usage follows Anthropic's own meaning (`input_tokens` without the cache reads,
which are `cache_read_input_tokens`), so `input + cache_read` is the prompt.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AnthropicEvents",
    "ResponseEvents",
    "StoredResponse",
    "anthropic_body",
    "anthropic_error",
    "anthropic_usage",
    "response_body",
    "responses_usage",
]


def sse_event(kind: str, obj: Mapping[str, Any]) -> bytes:
    """`event: <kind>` + `data: <json>`: both APIs name their events."""
    data = json.dumps(obj, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


@dataclass(slots=True)
class StoredResponse:
    """What vLLM keeps of a stored response, in this engine's memory only: the response
    object and the messages it was generated from (for `previous_response_id`)."""

    body: dict[str, Any]
    messages: list[dict[str, object]] = field(default_factory=list)


def responses_usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def response_body(
    request: Mapping[str, Any],
    *,
    rid: str,
    item_id: str,
    model: str,
    created: int,
    text: str | None,
    reason: str | None,
    usage: dict[str, Any] | None,
) -> dict[str, Any]:
    """A `response` object: in progress (text None) or finished with its output and usage."""
    if text is None:
        status, output, incomplete = "in_progress", [], None
    else:
        status = "incomplete" if reason == "length" else "completed"
        incomplete = {"reason": "max_output_tokens"} if reason == "length" else None
        output = [_message_item(item_id, text, "completed")]
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "model": model,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "metadata": request.get("metadata"),
        "output": output,
        "parallel_tool_calls": bool(request.get("parallel_tool_calls", True)),
        "previous_response_id": request.get("previous_response_id"),
        "reasoning": None,
        "service_tier": "auto",
        "temperature": request.get("temperature", 1.0),
        "text": {"format": {"type": "text"}},
        "tool_choice": request.get("tool_choice", "auto"),
        "tools": request.get("tools") or [],
        "top_p": request.get("top_p", 1.0),
        "truncation": "disabled",
        "user": request.get("user"),
        "usage": usage,
    }


class ResponseEvents:
    """The event sequence of one streamed response, numbered as vLLM numbers them."""

    def __init__(self, request: Mapping[str, Any], *, rid: str, item_id: str, model: str,
                 created: int) -> None:  # fmt: skip
        self._request = request
        self._rid, self._item, self._model, self._created = rid, item_id, model, created
        self._seq = 0
        self._text: list[str] = []
        self.final: dict[str, Any] | None = None  # the completed response

    def _event(self, kind: str, **fields: Any) -> bytes:
        obj = {**fields, "sequence_number": self._seq, "type": kind}
        self._seq += 1
        return sse_event(kind, obj)

    def _body(self, text: str | None, reason: str | None, usage: dict[str, Any] | None) -> Any:
        return response_body(
            self._request, rid=self._rid, item_id=self._item, model=self._model,
            created=self._created, text=text, reason=reason, usage=usage,
        )  # fmt: skip

    def start(self) -> Iterator[bytes]:
        yield self._event("response.created", response=self._body(None, None, None))
        yield self._event("response.in_progress", response=self._body(None, None, None))
        yield self._event(
            "response.output_item.added",
            item=_message_item(self._item, "", "in_progress"),
            output_index=0,
        )
        yield self._event(
            "response.content_part.added",
            item_id=self._item, output_index=0, content_index=0, part=_text_part(""),
        )  # fmt: skip

    def delta(self, text: str) -> bytes:
        self._text.append(text)
        return self._event(
            "response.output_text.delta",
            item_id=self._item, output_index=0, content_index=0, delta=text, logprobs=[],
        )  # fmt: skip

    def finish(self, reason: str | None, usage: dict[str, Any]) -> Iterator[bytes]:
        text = "".join(self._text)
        yield self._event(
            "response.output_text.done",
            item_id=self._item, output_index=0, content_index=0, text=text, logprobs=[],
        )  # fmt: skip
        yield self._event(
            "response.content_part.done",
            item_id=self._item, output_index=0, content_index=0, part=_text_part(text),
        )  # fmt: skip
        yield self._event(
            "response.output_item.done",
            item=_message_item(self._item, text, "completed"),
            output_index=0,
        )
        self.final = self._body(text, reason, usage)
        yield self._event("response.completed", response=self.final)


def anthropic_usage(prompt: int, completion: int, cached: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": completion,
    }


def _stop_reason(reason: str | None) -> str:
    return "max_tokens" if reason == "length" else "end_turn"


def anthropic_body(
    *, mid: str, model: str, text: str, reason: str | None, usage: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": text}],
        "model": model,
        "stop_reason": _stop_reason(reason),
        "stop_sequence": None,
        "usage": usage,
    }


class AnthropicEvents:
    """message_start, one text block's start / deltas / stop, message_delta, message_stop."""

    def __init__(self, *, mid: str, model: str) -> None:
        self._mid, self._model = mid, model

    def start(self, usage: dict[str, Any]) -> Iterator[bytes]:
        message: dict[str, Any] = {
            "id": self._mid, "type": "message", "role": "assistant", "content": [],
            "model": self._model, "stop_reason": None, "stop_sequence": None,
            "usage": {**usage, "output_tokens": 0},
        }  # fmt: skip
        yield sse_event("message_start", {"type": "message_start", "message": message})
        yield sse_event(
            "content_block_start",
            {"type": "content_block_start", "index": 0,
             "content_block": {"type": "text", "text": ""}},
        )  # fmt: skip

    @staticmethod
    def delta(text: str) -> bytes:
        return sse_event(
            "content_block_delta",
            {"type": "content_block_delta", "index": 0,
             "delta": {"type": "text_delta", "text": text}},
        )  # fmt: skip

    @staticmethod
    def finish(reason: str | None, output_tokens: int) -> Iterator[bytes]:
        yield sse_event("content_block_stop", {"type": "content_block_stop", "index": 0})
        # As Anthropic sends it: the final output count, without the input counts.
        yield sse_event(
            "message_delta",
            {"type": "message_delta",
             "delta": {"stop_reason": _stop_reason(reason), "stop_sequence": None},
             "usage": {"output_tokens": output_tokens}},
        )  # fmt: skip
        yield sse_event("message_stop", {"type": "message_stop"})


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 413: "request_too_large",
             429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip
    return {"type": "error", "error": {"type": kinds.get(status, "api_error"), "message": message}}
