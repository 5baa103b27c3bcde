"""One error shape on every path the gateway answers, through real Envoy, the real server and
real simulators: OpenAI's `{"error": {"message", "type", "param", "code"}}` with the right
status, and a rejection keeps the client's connection open."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.stack.local import LocalStack
from tests.e2e.harness import running_stack, stack_options

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    with running_stack(stack_options(tmp_path_factory.mktemp("stack"), sims=1)) as s:
        yield s


@pytest.fixture
def http(stack: LocalStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=10) as client:
        yield client


def _openai_error(resp: httpx.Response, status: int) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert not error["message"].startswith("{")  # never our JSON wrapped again by Envoy's
    return dict(error)


def test_one_model_by_id(http: httpx.Client) -> None:
    resp = http.get("/v1/models/qwen3")
    assert resp.status_code == 200
    assert resp.json()["id"] == "qwen3"
    assert resp.json()["object"] == "model"
    error = _openai_error(http.get("/v1/models/nope"), 404)
    assert error["param"] == "model"


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [
        ("GET", "/no/such/path", None, 404),
        ("POST", "/v1/audio/transcriptions", {"model": "qwen3"}, 404),  # not a speech model
        ("GET", "/v1/chat/completions", None, 405),
    ],
)
def test_what_the_engine_answers_is_openai_json_too(
    http: httpx.Client, method: str, path: str, body: object, status: int
) -> None:
    resp = http.request(method, path, json=body)
    _openai_error(resp, status)
    assert "x-inference-pod" in resp.headers  # the pod answered, in its own words


@pytest.mark.parametrize("body", [b"", b"{not json"])
def test_an_empty_or_broken_body_is_the_gateways_400(http: httpx.Client, body: bytes) -> None:
    resp = http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    error = _openai_error(resp, 400)
    assert error["type"] == "invalid_request_error"
    assert "x-inference-pod" not in resp.headers  # no pod was bothered


def test_a_rejection_keeps_the_connection_alive(http: httpx.Client) -> None:
    rejected = http.post("/v1/chat/completions", json={"model": "qwen3"})  # no messages
    _openai_error(rejected, 400)
    assert rejected.headers.get("connection") != "close"
    missing = http.post("/v1/chat/completions", json={"model": "nope", "messages": []})
    assert missing.headers.get("connection") != "close"
    ok = http.get("/v1/models")
    assert ok.status_code == 200
    # httpx opened one connection for all three: none was closed under it.
    pool = http._transport._pool  # type: ignore[attr-defined]
    assert len(pool.connections) == 1


def test_a_dead_pool_answers_the_same_shape(stack: LocalStack, http: httpx.Client) -> None:
    """Whoever notices first, the server (no ready endpoint) or Envoy (connection refused,
    its local reply mapper), the 503 is OpenAI JSON."""
    stack.kill("sim-0")
    try:
        error = _openai_error(http.get("/health"), 503)
    finally:
        stack.respawn("sim-0")
    # The server's own 503 (no ready endpoint) or Envoy's mapped local reply: the same shape.
    assert error["type"] in ("service_unavailable", "server_error"), error
