"""The single place a GatewayError becomes an HTTP response body."""

from __future__ import annotations

import orjson

from extproc.types import GatewayError

__all__ = ["error_json", "is_anthropic_path"]

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def is_anthropic_path(path: str) -> bool:
    """An Anthropic Messages API path, whose clients expect Anthropic's error shape."""
    bare = path.split("?", 1)[0].rstrip("/")
    return bare == "/v1/messages" or bare.startswith("/v1/messages/")


def error_json(err: GatewayError, *, path: str = "") -> bytes:
    """OpenAI-style `{"error": {"message", "type", "param", "code"}}` for `err.status`; on an
    Anthropic path (`/v1/messages`) Anthropic's `{"type": "error", "error": {"type",
    "message"}}`, which its SDK reads."""
    if is_anthropic_path(path):
        kind = _ANTHROPIC_TYPES.get(
            err.status, "api_error" if err.status >= 500 else "invalid_request_error"
        )
        return orjson.dumps({"type": "error", "error": {"type": kind, "message": err.message}})
    return orjson.dumps(
        {
            "error": {
                "message": err.message,
                "type": err.error_type,
                "param": err.param,
                "code": err.code,
            }
        }
    )
