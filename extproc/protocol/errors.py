"""The single place a GatewayError becomes an HTTP response body."""

from __future__ import annotations

import orjson

from extproc.types import GatewayError

__all__ = ["error_json"]


def error_json(err: GatewayError) -> bytes:
    """OpenAI-style `{"error": {"message", "type", "param", "code"}}` for `err.status`."""
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
