"""error_json: the one OpenAI-style error body, for every error class."""

from __future__ import annotations

import orjson
import pytest

from extproc.protocol import error_json
from extproc.types import (
    BadRequest,
    GatewayError,
    InternalError,
    NotFound,
    PayloadTooLarge,
    ServiceUnavailable,
    TooManyRequests,
)


@pytest.mark.parametrize(
    ("err", "type_", "code"),
    [
        (BadRequest("model is required", param="model"), "invalid_request_error", None),
        (
            NotFound("The model `x` does not exist.", param="model"),
            "not_found_error",
            "model_not_found",
        ),
        (PayloadTooLarge("too big"), "invalid_request_error", "request_too_large"),
        (TooManyRequests("busy"), "rate_limit_error", "overloaded"),
        (ServiceUnavailable("no pods"), "service_unavailable", "no_ready_endpoint"),
        (InternalError("bug", code="oops"), "internal_error", "oops"),
    ],
)
def test_error_body_shape(err: GatewayError, type_: str, code: str | None) -> None:
    body = orjson.loads(error_json(err))
    assert list(body) == ["error"]
    assert body["error"] == {
        "message": err.message,
        "type": type_,
        "param": err.param,
        "code": code,
    }


def test_non_ascii_message_is_valid_utf8_json() -> None:
    body = error_json(BadRequest("modèle « x » inconnu", param="model"))
    assert orjson.loads(body)["error"]["message"] == "modèle « x » inconnu"
