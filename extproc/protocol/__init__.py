"""OpenAI protocol: request parsing, SSE decoding, usage extraction, error bodies (no I/O)."""

from __future__ import annotations

from extproc.protocol.errors import error_json
from extproc.protocol.openai import kind_for_path, parse_request, rewrite_body
from extproc.protocol.sse import SSEDecoder
from extproc.protocol.usage import StreamUsageAccumulator, usage_from_json, usage_from_object

__all__ = [
    "SSEDecoder",
    "StreamUsageAccumulator",
    "error_json",
    "kind_for_path",
    "parse_request",
    "rewrite_body",
    "usage_from_json",
    "usage_from_object",
]
