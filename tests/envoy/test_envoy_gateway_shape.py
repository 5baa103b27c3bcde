"""Real Envoy with the bootstrap Envoy Gateway renders from deploy/overlays/envoy-gateway.

Envoy Gateway itself cannot run here (nor envoyproxy/ratelimit, a Go service no registry
here packages: tests/envoy/rls_server.py is a small real one). The bootstrap is the one
`extproc up --gateway-shape envoy-gateway` runs (extproc/stack/envoy_gateway.py: Envoy
Gateway's translation of the manifests, read from deploy/ at render time), here with a small
real ext_proc that answers the BUFFERED body as the server does (header mutations in the body
answer) and a model that answers with usage. It proves that a prompt over 32 KiB gets Envoy's
own 413 on Envoy Gateway's default (the overlay without its ClientTrafficPolicy) and reaches
the server with the manifests' limit, that the HTTPRoute's echo brings what the ext_proc set
on the request back to the client, and (token-limits overlay) that the budget is checked at
the request for nothing and charged the answer's total tokens, which the Lua filter wrote,
when the answer is done. tests/e2e run the same shape with the real server.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web

from extproc._pb.envoy.config.core.v3 import base_pb2 as core
from extproc._pb.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.stack.envoy_config import EnvoyOptions, HostPort
from extproc.stack.envoy_gateway import DEPLOY_DIR, translate
from extproc.stack.overlay import Overlay, load_overlay
from tests.envoy._envoy_process import envoy_process, free_port, wait_ready
from tests.envoy._rls import calls_settled, rate_limit_service

pytestmark = pytest.mark.e2e

PROMPT_TOKENS, COMPLETION_TOKENS = 11, 5
SESSION = "c2Vzc2lvbg=="  # what the fake ext_proc sets as x-session-id
EXPLAIN = "picked-by-test"


class BufferedExtProc(ep_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """Answers as the server does in BUFFERED mode: headers untouched, the body answer sets
    x-session-id and x-routing-explain (and keeps content-length right)."""

    def __init__(self) -> None:
        self.bodies: list[int] = []

    async def Process(
        self, requests: AsyncIterator[ep.ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ep.ProcessingResponse]:
        async for req in requests:
            kind = req.WhichOneof("request")
            if kind == "request_headers":
                yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                continue
            if kind != "request_body":
                continue
            self.bodies.append(len(req.request_body.body))
            resp = ep.ProcessingResponse()
            mutation = resp.request_body.response.header_mutation
            for key, value in (
                ("x-session-id", SESSION),
                ("x-routing-explain", EXPLAIN),
                ("content-length", str(len(req.request_body.body))),
            ):
                mutation.set_headers.append(
                    core.HeaderValueOption(
                        header=core.HeaderValue(key=key, raw_value=value.encode()),
                        append_action=core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
                    )
                )
            yield resp


class DrainingAccessLog(als_pb2_grpc.AccessLogServiceServicer):  # type: ignore[misc]
    """The accounting access log's other end (its records are tests/envoy/test_envoy_routing's
    subject, not this file's)."""

    async def StreamAccessLogs(
        self, requests: AsyncIterator[als_pb2.StreamAccessLogsMessage], context: object
    ) -> als_pb2.StreamAccessLogsResponse:
        async for _ in requests:
            pass
        return als_pb2.StreamAccessLogsResponse()


@dataclass
class Model:
    port: int = 0
    bodies: list[int] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        self.bodies.append(len(await request.read()))
        if request.query.get("usage") == "0":
            return web.json_response({"choices": []})
        return web.json_response(
            {"usage": {"prompt_tokens": PROMPT_TOKENS, "completion_tokens": COMPLETION_TOKENS}}
        )


OVERLAYS = DEPLOY_DIR / "overlays"


def without(overlay: Overlay, kind: str) -> Overlay:
    """The overlay less its `kind` objects (what Envoy Gateway does without them)."""
    return Overlay(overlay.directory, tuple(o for o in overlay.objects if o["kind"] != kind))


@dataclass
class Gateway:
    url: str
    extproc: BufferedExtProc
    model: Model


@contextlib.asynccontextmanager
async def eg_gateway(
    tmp_path: Path, overlay: Overlay, rate_limit_port: int | None = None
) -> AsyncIterator[Gateway]:
    model, extproc = Model(), BufferedExtProc()
    async with contextlib.AsyncExitStack() as exits:
        app = web.Application(client_max_size=16 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", model.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        exits.push_async_callback(runner.cleanup)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        model.port = sock.getsockname()[1]
        await web.SockSite(runner, sock).start()
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 16 << 20)])
        ep_grpc.add_ExternalProcessorServicer_to_server(extproc, server)
        als_pb2_grpc.add_AccessLogServiceServicer_to_server(DrainingAccessLog(), server)
        grpc_port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        exits.push_async_callback(server.stop, None)
        listener, admin = free_port(), free_port()
        opts = EnvoyOptions(
            listener=HostPort("127.0.0.1", listener),
            admin=HostPort("127.0.0.1", admin),
            extproc=(HostPort("127.0.0.1", grpc_port),),
            endpoints=(HostPort("127.0.0.1", model.port),),
            rate_limit_service=(
                None if rate_limit_port is None else HostPort("127.0.0.1", rate_limit_port)
            ),
            rate_limit_timeout_s=2.0,  # a Python service on a busy machine (Envoy's: 20 ms)
        )
        config = tmp_path / "envoy.yaml"
        bootstrap = translate(overlay, opts).bootstrap
        config.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        log = tmp_path / "envoy.log"
        with envoy_process(config, log) as proc:
            await wait_ready(admin, proc, log)
            yield Gateway(f"http://127.0.0.1:{listener}", extproc, model)


def prompt(size: int) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * size}]}
    return json.dumps(body).encode()


async def _post(url: str, body: bytes) -> tuple[int, dict[str, str]]:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url + "/v1/chat/completions", data=body, headers={"content-type": "application/json"}
        ) as resp,
    ):
        await resp.read()
        return resp.status, {k.lower(): v for k, v in resp.headers.items()}


async def test_a_prompt_over_32_kib_is_refused_by_envoy_at_envoy_gateways_default(
    tmp_path: Path,
) -> None:
    overlay = without(load_overlay(OVERLAYS / "envoy-gateway"), "ClientTrafficPolicy")
    async with eg_gateway(tmp_path, overlay) as gw:
        status, _ = await _post(gw.url, prompt(64 * 1024))
        assert status == 413
        assert gw.extproc.bodies == [] and gw.model.bodies == []  # Envoy's own answer


async def test_the_manifests_buffer_limit_lets_a_large_prompt_reach_the_server(
    tmp_path: Path,
) -> None:
    size = 3 * 1024 * 1024  # under the server's 4 MiB max_body_bytes
    body = prompt(size)
    async with eg_gateway(tmp_path, load_overlay(OVERLAYS / "envoy-gateway")) as gw:
        status, headers = await _post(gw.url, body)
        assert status == 200
        assert gw.extproc.bodies == [len(body)] and gw.model.bodies == [len(body)]
        # The HTTPRoute's echo, as Envoy Gateway renders it, brings back what the ext_proc
        # set on the request: session-affinity's id round-trips, explain is visible.
        assert headers.get("x-session-id") == SESSION
        assert headers.get("x-routing-explain") == EXPLAIN


# -- token limits (deploy/overlays/envoy-gateway-token-limits) ----------------------------

TOKEN_LIMITS = OVERLAYS / "envoy-gateway-token-limits"
ROUTE = "httproute/extproc/llm-route/rule/0/match/0/*"  # Envoy Gateway's name for the route


def descriptors(user: str) -> list[list[list[str]]]:
    # ratelimit.go: the route's generic key, then the Distinct header under rule-0-match-0.
    return [[[ROUTE, ROUTE], ["rule-0-match-0", user]]]


async def _post_as(url: str, user: str, query: str = "") -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            url + "/v1/chat/completions" + query,
            data=prompt(10),
            headers={"content-type": "application/json", "x-user-id": user},
        ) as resp,
    ):
        await resp.read()
        return resp.status


async def test_token_limit_checks_at_the_request_and_charges_the_answers_tokens(
    tmp_path: Path,
) -> None:
    total = PROMPT_TOKENS + COMPLETION_TOKENS
    with rate_limit_service(tmp_path, limit=total + 1) as (port, record):
        async with eg_gateway(tmp_path, load_overlay(TOKEN_LIMITS), port) as gw:
            assert await _post_as(gw.url, "alice") == 200
            calls = await calls_settled(record, 2)
            # The check costs nothing; the charge, once the answer is done, is its total
            # tokens as the Lua filter wrote them, for the user that sent it.
            assert [c["costs"] for c in calls] == [[0], [total]]
            assert all(c["descriptors"] == descriptors("alice") for c in calls)
            # Under budget (16 of 17): served and charged again; now over budget: 429 before
            # the engine is reached. Another user is not affected.
            assert await _post_as(gw.url, "alice") == 200
            await calls_settled(record, 4)
            served = len(gw.model.bodies)
            assert await _post_as(gw.url, "alice") == 429
            assert len(gw.model.bodies) == served
            assert await _post_as(gw.url, "bob") == 200


async def test_an_answer_without_usage_charges_nothing(tmp_path: Path) -> None:
    with rate_limit_service(tmp_path, limit=1000) as (port, record):
        async with eg_gateway(tmp_path, load_overlay(TOKEN_LIMITS), port) as gw:
            assert await _post_as(gw.url, "carol", "?usage=0") == 200
            assert await _post_as(gw.url, "carol") == 200  # a marker that the first is done
            calls = await calls_settled(record, 3)
    # The answer without usage: the check (0) and no charge at all, or a charge of 0.
    costs = [c["costs"] for c in calls]
    assert costs[-1] == [PROMPT_TOKENS + COMPLETION_TOKENS]
    assert costs[:-1] == [[0], [0]], costs
