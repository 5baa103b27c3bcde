"""OpenAI protocol: request parsing and rewriting, error bodies (no I/O).

Responses are not parsed here: Envoy's Lua filter (extproc/stack/usage.lua) reads their usage."""

from __future__ import annotations

from extproc.protocol.errors import error_json
from extproc.protocol.openai import kind_for_path, parse_request, rewrite_body

__all__ = [
    "error_json",
    "kind_for_path",
    "parse_request",
    "rewrite_body",
]
