"""The table of usage vectors (tests/usage_vectors.py) through real Envoy: the local stack, in
both gateway shapes (the local bootstrap, and Envoy Gateway's translation of the overlay with
its copy of usage.lua), with the engine replaced by an upstream that answers each vector's
bytes. What the server accounts from the access record, read on its metrics, is what the
vector says: exact usage, a count, or unknown (never 0)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml

from extproc.stack.envoy_gateway import GatewayShape
from extproc.stack.local import LocalStack
from tests.e2e.harness import metric_samples, metric_sum, running_stack, stack_options, wait_for
from tests.envoy._envoy_process import envoy_process, free_port
from tests.envoy_lua import UsageLua
from tests.usage_vectors import SSE, VECTORS, UsageVector

pytestmark = pytest.mark.e2e

VECTOR_HEADER = "x-usage-vector"
BY_NAME = {v.name: v for v in VECTORS}
# A subset that covers every API streamed and not, usage absent, and each kind of malformed
# body (all of them are split at every byte under LuaJIT in tests/stack/test_usage_lua.py).
THROUGH_ENVOY = (
    "chat-stream",
    "chat-stream-usage-absent",
    "chat-stream-forged-usage-in-text",
    "chat-json",
    "chat-json-zero-tokens",
    "chat-json-usage-absent",
    "completions-stream",
    "completions-json",
    "responses-stream",
    "responses-json",
    "anthropic-stream",
    "anthropic-stream-cut-before-message-delta",
    "anthropic-json",
    "sse-malformed-events-then-usage",
    "sse-error-frame",
    "sse-count-beyond-2-53",
    "json-not-json",
    "json-empty",
    "json-counts-fractional",
    "json-count-of-400-digits",
    "json-gzip",
)
COUNTERS = {
    "prompt": "extproc_prompt_tokens_total",
    "completion": "extproc_completion_tokens_total",
    "cached": "extproc_cached_tokens_total",
    "counted": "extproc_usage_counted_total",
    "unknown": "extproc_usage_unknown_total",
    "records": "extproc_access_records_total",
}


class _Engine(BaseHTTPRequestHandler):
    """Answers a POST with the bytes of the vector its header names (a stream in pieces, one
    cut inside the usage object); GETs of /health and /metrics as the simulator did."""

    protocol_version = "HTTP/1.1"
    metrics_text = b""

    def log_message(self, format: str, *args: object) -> None:
        return

    def do_GET(self) -> None:
        body = self.metrics_text if self.path.startswith("/metrics") else b"{}"
        self._answer("text/plain; version=0.0.4" if body is self.metrics_text else "application/json",
                     None, [body])  # fmt: skip

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", "0")))
        v = BY_NAME[self.headers[VECTOR_HEADER]]
        pieces = [v.body]
        if v.content_type == SSE and v.body:
            at = v.body.find(b'"usage"')
            cuts = sorted({len(v.body) // 3, at + 4 if at >= 0 else len(v.body) // 2})
            pieces = [v.body[a:b] for a, b in zip([0, *cuts], [*cuts, len(v.body)], strict=True)]
        self._answer(v.content_type, v.content_encoding, pieces)

    def _answer(self, content_type: str, encoding: str | None, pieces: list[bytes]) -> None:
        self.send_response(200)
        self.send_header("content-type", content_type)
        if encoding:
            self.send_header("content-encoding", encoding)
        if len(pieces) == 1:
            self.send_header("content-length", str(len(pieces[0])))
            self.end_headers()
            self.wfile.write(pieces[0])
            return
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for piece in pieces:
            if piece:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                time.sleep(0.005)  # separate reads in Envoy, so separate body chunks
        self.wfile.write(b"0\r\n\r\n")


@contextlib.contextmanager
def canned_engine(host: str, port: int, metrics_text: bytes) -> Iterator[ThreadingHTTPServer]:
    handler = type("Engine", (_Engine,), {"metrics_text": metrics_text})
    server = ThreadingHTTPServer((host, port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@dataclass
class Stack:
    stack: LocalStack

    def counters(self) -> dict[str, float]:
        o = self.stack.options
        samples = metric_samples(f"http://{o.host}:{o.metrics_port}/metrics")
        out = {k: metric_sum(samples, name) for k, name in COUNTERS.items() if k != "records"}
        out["records"] = metric_sum(samples, COUNTERS["records"], result="accounted")
        return out

    def send(self, v: UsageVector) -> int:
        stream = v.content_type == SSE
        body = {"model": "qwen3", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "stream": stream}  # fmt: skip
        r = httpx.post(f"{self.stack.base_url}/v1/chat/completions", json=body,
                       headers={VECTOR_HEADER: v.name}, timeout=30)  # fmt: skip
        return r.status_code


@pytest.fixture(
    scope="module",
    params=[GatewayShape.LOCAL, GatewayShape.ENVOY_GATEWAY],
    ids=["local", "envoy-gateway"],
)
def stack(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    opts = stack_options(
        tmp_path_factory.mktemp("usage"), sims=1, kv_events=False, gateway_shape=request.param
    )
    with running_stack(opts) as s:
        # The engine's place is taken by the canned one, which serves the simulator's metrics.
        metrics_text = httpx.get(f"http://{opts.sim_address(0)}/metrics", timeout=5).content
        s.kill("sim-0")
        with canned_engine(opts.host, opts.sim_port(0), metrics_text):
            running = Stack(s)
            before = running.counters()["records"]
            assert wait_for(lambda: running.send(BY_NAME["chat-json"]) == 200, timeout=15)
            assert wait_for(lambda: running.counters()["records"] > before, timeout=15)
            yield running


def _expected(v: UsageVector) -> dict[str, float]:
    u = v.usage
    return {
        "prompt": u.prompt_tokens or 0,
        "completion": u.completion_tokens or 0,
        "cached": u.cached_tokens or 0,
        "counted": 1 if u.counted else 0,
        # Unknown: either count missing (a counted stream has no prompt count).
        "unknown": 1 if u.prompt_tokens is None or u.completion_tokens is None else 0,
        "records": 1,
    }


@pytest.mark.parametrize("name", THROUGH_ENVOY)
def test_vector_is_accounted_as_the_table_says(stack: Stack, name: str) -> None:
    v = BY_NAME[name]
    before = stack.counters()
    assert stack.send(v) == 200
    moved: dict[str, float] = {}

    def arrived() -> bool:
        now = stack.counters()
        moved.update({k: now[k] - before[k] for k in now})
        return moved["records"] >= 1

    # One record moves every counter at once (the server accounts it in one call).
    assert wait_for(arrived, timeout=10), "no access record"
    assert moved == _expected(v)


def _lua_version_bootstrap(listener: int, admin: int) -> dict[str, object]:
    """Envoy answering every request itself, a Lua filter naming its runtime in a header."""
    script = (
        "function envoy_on_response(h)\n"
        '  h:headers():add("x-lua", tostring(jit and jit.version) .. " / " .. _VERSION)\nend\n'
    )
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager"
        ".v3.HttpConnectionManager",
        "stat_prefix": "t",
        "route_config": {"virtual_hosts": [{"name": "v", "domains": ["*"], "routes": [
            {"match": {"prefix": "/"}, "direct_response": {"status": 200}}]}]},
        "http_filters": [
            {"name": "envoy.filters.http.lua", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": script}}},
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }  # fmt: skip
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin}}},
        "static_resources": {"listeners": [{
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": listener}},
            "filter_chains": [{"filters": [
                {"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
        }]},
    }  # fmt: skip


def test_the_unit_tests_run_the_lua_envoy_embeds(tmp_path: Path) -> None:
    # tests/stack/test_usage_lua.py runs usage.lua under lupa's LuaJIT: the same runtime line
    # (LuaJIT 2.1, Lua 5.1 semantics) as the Envoy that runs it in production.
    listener, admin = free_port(), free_port()
    config = tmp_path / "envoy.yaml"
    config.write_text(yaml.safe_dump(_lua_version_bootstrap(listener, admin)))
    with envoy_process(config, tmp_path / "envoy.log"):
        url = f"http://127.0.0.1:{listener}/"
        assert wait_for(lambda: _status(url) == 200, timeout=15)
        envoy_lua = httpx.get(url, timeout=5).headers["x-lua"]
    jit, lua = envoy_lua.split(" / ")
    ours_jit, ours_lua = UsageLua().version.split(" / ")
    assert jit.startswith("LuaJIT 2.1.") and ours_jit.startswith("LuaJIT 2.1.")
    assert lua == ours_lua == "Lua 5.1"


def _status(url: str) -> int:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return 0
