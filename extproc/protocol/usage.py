"""Token usage from response bodies (JSON or SSE). Never raises: unknown stays None."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import orjson

from extproc.protocol.sse import SSEDecoder
from extproc.types import TokenUsage

__all__ = ["StreamUsageAccumulator", "merge_usage", "usage_from_json", "usage_from_object"]


def _count(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def _usage_of(usage: Mapping[str, object]) -> TokenUsage:
    """One `usage` object in any of the three shapes vLLM answers with.

    - chat / completions: `prompt_tokens`, `completion_tokens`, `prompt_tokens_details.cached_tokens`
    - Responses: `input_tokens` (cached included), `output_tokens`, `input_tokens_details.cached_tokens`
    - Anthropic: `input_tokens` (without cache reads and writes), `output_tokens`,
      `cache_read_input_tokens`, `cache_creation_input_tokens`; a `message_delta` may carry
      `output_tokens` alone
    """
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        details = usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
        return TokenUsage(
            prompt_tokens=_count(usage.get("prompt_tokens")),
            completion_tokens=_count(usage.get("completion_tokens")),
            cached_tokens=cached,
        )
    prompt = _count(usage.get("input_tokens"))
    details = usage.get("input_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    read = _count(usage.get("cache_read_input_tokens"))
    if read is not None:  # Anthropic: input_tokens counts only what was neither read nor written
        cached = read
        if prompt is not None:
            prompt += read + (_count(usage.get("cache_creation_input_tokens")) or 0)
    elif prompt is not None:
        prompt += _count(usage.get("cache_creation_input_tokens")) or 0
    return TokenUsage(
        prompt_tokens=prompt,
        completion_tokens=_count(usage.get("output_tokens")),
        cached_tokens=cached,
    )


def usage_from_object(obj: object) -> TokenUsage | None:
    """The `usage` of a parsed response object or stream event, or None when it carries none:
    top level (chat, completions, a Responses or Anthropic body, `message_delta`), or inside
    `response` (`response.completed`) or `message` (`message_start`)."""
    if not isinstance(obj, Mapping):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, Mapping):
        inner = obj.get("response")
        if not isinstance(inner, Mapping):
            inner = obj.get("message")
        usage = inner.get("usage") if isinstance(inner, Mapping) else None
        if not isinstance(usage, Mapping):
            return None
    return _usage_of(usage)


def merge_usage(old: TokenUsage | None, new: TokenUsage) -> TokenUsage:
    """A later usage event over an earlier one: known counts replace, unknown ones keep the
    earlier value (Anthropic's `message_delta` carries the output count alone)."""
    if old is None:
        return new
    return TokenUsage(
        prompt_tokens=new.prompt_tokens if new.prompt_tokens is not None else old.prompt_tokens,
        completion_tokens=(
            new.completion_tokens if new.completion_tokens is not None else old.completion_tokens
        ),
        cached_tokens=new.cached_tokens if new.cached_tokens is not None else old.cached_tokens,
    )


def usage_from_json(body: bytes) -> TokenUsage:
    """Usage of a non-streamed JSON response; all-unknown TokenUsage when absent or invalid."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return TokenUsage()
    return usage_from_object(obj) or TokenUsage()


_CONTENT_EVENTS = frozenset(
    {
        "response.output_text.delta",
        "response.reasoning_text.delta",
        "response.function_call_arguments.delta",
    }
)


def _is_content_event(obj: Mapping[str, object]) -> bool:
    """A Responses delta event, or an Anthropic `content_block_delta` with text in it."""
    kind = obj.get("type")
    if not isinstance(kind, str):
        return False
    if kind in _CONTENT_EVENTS:
        return True
    if kind == "content_block_delta":
        delta = obj.get("delta")
        if isinstance(delta, Mapping):
            for key in ("text", "thinking", "partial_json"):
                v = delta.get(key)
                if isinstance(v, str) and v:
                    return True
    return False


def _has_content(choice: object) -> bool:
    if not isinstance(choice, Mapping):
        return False
    text = choice.get("text")  # /v1/completions
    if isinstance(text, str) and text:
        return True
    delta = choice.get("delta")
    if not isinstance(delta, Mapping):
        return False
    for key in ("content", "reasoning_content", "reasoning"):
        v = delta.get(key)
        if isinstance(v, str) and v:
            return True
    return bool(delta.get("tool_calls"))


class StreamUsageAccumulator:
    """Follows one response body: latest `usage`, content chunk count, first-content time.

    Feed every body chunk; call `finish()` once at end of stream. A body that does not
    start like SSE (an engine answering JSON, e.g. an error) is buffered up to
    `max_json_bytes` and read as JSON instead.
    """

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_json_bytes: int = 1 << 20,
        decoder: SSEDecoder | None = None,
    ) -> None:
        self._clock = clock
        self._max_json = max_json_bytes
        self._sse = decoder or SSEDecoder()
        self._mode: str | None = None  # "sse" or "json", decided by the first byte
        self._json = bytearray()
        self._usage: TokenUsage | None = None
        self.content_chunks = 0
        self.first_content_at: float | None = None
        self.error: Mapping[str, object] | None = None  # the engine's {"error": ...} object
        self.done = False  # saw data: [DONE]
        self.malformed = 0  # data payloads that were not JSON objects

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self._mode is None:
            head = chunk.lstrip()
            if not head:
                return
            self._mode = "json" if head[:1] in (b"{", b"[") else "sse"
        if self._mode == "json":
            if len(self._json) + len(chunk) <= self._max_json:
                self._json += chunk
            else:
                self._json.clear()
                self._max_json = -1  # too large to inspect; stays unknown
            return
        for payload in self._sse.feed(chunk):
            self._event(payload)

    def _event(self, payload: str) -> None:
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self.malformed += 1
            return
        if not isinstance(obj, Mapping):
            self.malformed += 1
            return
        self._object(obj)
        choices = obj.get("choices")
        if (isinstance(choices, list) and any(_has_content(c) for c in choices)) or (
            _is_content_event(obj)
        ):
            self.content_chunks += 1
            if self.first_content_at is None:
                self.first_content_at = self._clock()

    def _object(self, obj: Mapping[str, object]) -> None:
        err = obj.get("error")
        if isinstance(err, Mapping):
            self.error = err
        usage = usage_from_object(obj)
        if usage is not None:
            self._usage = merge_usage(self._usage, usage)

    def finish(self) -> TokenUsage:
        """Final usage: reported if any, else the content-chunk count (counted=True)."""
        if self._mode == "sse":
            for payload in self._sse.flush():
                self._event(payload)
        elif self._mode == "json" and self._json:
            try:
                obj = orjson.loads(bytes(self._json))
            except orjson.JSONDecodeError:
                obj = None
            self._json.clear()
            if isinstance(obj, Mapping):
                self._object(obj)
        if self._usage is not None and self._usage.completion_tokens is not None:
            return self._usage
        if self._mode == "sse" and self.error is None:
            prompt = self._usage.prompt_tokens if self._usage else None
            cached = self._usage.cached_tokens if self._usage else None
            return TokenUsage(
                prompt_tokens=prompt,
                completion_tokens=self.content_chunks,
                cached_tokens=cached,
                counted=True,
            )
        return self._usage or TokenUsage()

    @property
    def is_json(self) -> bool:
        """True when the body was not SSE (an engine answering JSON, often an error)."""
        return self._mode == "json"
