"""Token usage from response bodies (JSON or SSE). Never raises: unknown stays None."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import orjson

from extproc.protocol.sse import SSEDecoder
from extproc.types import TokenUsage

__all__ = ["StreamUsageAccumulator", "usage_from_json", "usage_from_object"]


def _count(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def usage_from_object(obj: object) -> TokenUsage | None:
    """The `usage` of a parsed response object, or None when it carries none."""
    if not isinstance(obj, Mapping):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, Mapping):
        return None
    details = usage.get("prompt_tokens_details")
    cached = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
    return TokenUsage(
        prompt_tokens=_count(usage.get("prompt_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        cached_tokens=cached,
    )


def usage_from_json(body: bytes) -> TokenUsage:
    """Usage of a non-streamed JSON response; all-unknown TokenUsage when absent or invalid."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return TokenUsage()
    return usage_from_object(obj) or TokenUsage()


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
        if isinstance(choices, list) and any(_has_content(c) for c in choices):
            self.content_chunks += 1
            if self.first_content_at is None:
                self.first_content_at = self._clock()

    def _object(self, obj: Mapping[str, object]) -> None:
        err = obj.get("error")
        if isinstance(err, Mapping):
            self.error = err
        usage = usage_from_object(obj)
        if usage is not None:
            self._usage = usage

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
