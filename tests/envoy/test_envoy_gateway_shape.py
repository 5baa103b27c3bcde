"""Real Envoy configured the way Envoy Gateway translates deploy/overlays/envoy-gateway.

Envoy Gateway itself cannot run here (nor envoyproxy/ratelimit, a Go service no registry
here packages: tests/envoy/rls_server.py is a small real one), so this takes the local bootstrap and changes what Envoy
Gateway does differently (docs/operations.md §1), with the values read from the rendered
manifests:
- the listener's per-connection buffer: the ClientTrafficPolicy's `bufferLimit`, or Envoy
  Gateway's 32 KiB default without it;
- the filter order: Lua before ext_proc (Envoy Gateway orders filters by type), and no
  request header_mutation filter (Envoy Gateway generates none);
- the route's response headers: the HTTPRoute's ResponseHeaderModifier as Envoy Gateway renders
  it (`buildXdsAddedHeaders`: OVERWRITE_IF_EXISTS_OR_ADD, keep_empty_value only for an empty
  value), replacing the local echo.
A small real ext_proc answers the BUFFERED body as the server does (header mutations in the
body answer). It proves that a prompt over 32 KiB gets Envoy's own 413 on Envoy Gateway's
default and reaches the server with the manifests' limit, that the HTTPRoute's echo brings
what the ext_proc set on the request back to the client, and (token-limits overlay) that the
budget is checked at the request for nothing and charged the answer's total tokens, which the
Lua filter wrote, when the answer is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from aiohttp import web

from extproc._pb.envoy.config.core.v3 import base_pb2 as core
from extproc._pb.envoy.service.accesslog.v3 import als_pb2, als_pb2_grpc
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from extproc._pb.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from extproc.stack.envoy_config import (
    ROUTING_FILTER,
    USAGE_FILTER,
    EnvoyOptions,
    HostPort,
    render_bootstrap,
)
from tests.deploy.test_manifests import (
    EG_DEFAULT_BUFFER_LIMIT,
    echoed_headers,
    find,
    quantity_bytes,
    render,
)
from tests.envoy._envoy_process import envoy_process, free_port, wait_ready

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


def eg_route_headers(route: dict[str, Any]) -> list[dict[str, Any]]:
    """The HTTPRoute's ResponseHeaderModifier `set` as Envoy Gateway renders it."""
    return [
        {
            "header": {"key": h["name"], "value": h["value"]},
            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
            "keep_empty_value": h["value"] == "",
        }
        for h in echoed_headers(route)
    ]


def eg_shaped_bootstrap(opts: EnvoyOptions, buffer_limit: int) -> dict[str, Any]:
    bootstrap = render_bootstrap(opts)
    (listener,) = bootstrap["static_resources"]["listeners"]
    listener["per_connection_buffer_limit_bytes"] = buffer_limit
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    by_name = {f["name"]: f for f in hcm["http_filters"]}
    hcm["http_filters"] = [
        by_name[USAGE_FILTER],
        by_name[ROUTING_FILTER],
        by_name["envoy.filters.http.router"],
    ]
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    route["response_headers_to_add"] = eg_route_headers(find(render("envoy-gateway"), "HTTPRoute"))
    return bootstrap


RATE_LIMIT_CLUSTER = "ratelimit"


def token_limit_rule() -> dict[str, Any]:
    policy = find(render("envoy-gateway-token-limits"), "BackendTrafficPolicy")
    (rule,) = policy["spec"]["rateLimit"]["global"]["rules"]
    assert isinstance(rule, dict)
    return rule


def eg_hits_addend(cost: dict[str, Any]) -> dict[str, Any]:
    """A BackendTrafficPolicy cost as Envoy Gateway renders it (ratelimit.go)."""
    if cost["from"] == "Number":
        return {"number": cost["number"]}
    meta = cost["metadata"]
    return {"format": f"%DYNAMIC_METADATA({meta['namespace']}:{meta['key']})%"}


def add_token_limits(bootstrap: dict[str, Any], port: int) -> None:
    """The token-limits overlay's global rule as Envoy Gateway renders it (ratelimit.go):
    Envoy's rate limit filter after ext_proc (EG order: lua, ext_proc, ratelimit, router), the
    route's limits in its RateLimitPerRoute (typed_per_filter_config), one entry with the
    request cost, one with the response cost applied when the stream is done. (Envoy 1.40
    ignores hits_addend on RouteAction.rate_limits: the charge must be carried this way.)"""
    rule = token_limit_rule()
    ((selector,),) = [s["headers"] for s in rule["clientSelectors"]]
    assert selector["type"] == "Distinct"
    actions = [{"request_headers": {"header_name": selector["name"], "descriptor_key": "user"}}]
    (listener,) = bootstrap["static_resources"]["listeners"]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(
        len(hcm["http_filters"]) - 1,
        {
            "name": "envoy.filters.http.ratelimit",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit",
                "domain": "llm-gateway",
                "rate_limit_service": {
                    "grpc_service": {"envoy_grpc": {"cluster_name": RATE_LIMIT_CLUSTER}},
                    "transport_api_version": "V3",
                },
            },
        },
    )
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    route["typed_per_filter_config"] = {
        "envoy.filters.http.ratelimit": {
            "@type": "type.googleapis.com/"
            "envoy.extensions.filters.http.ratelimit.v3.RateLimitPerRoute",
            "rate_limits": [
                {"actions": actions, "hits_addend": eg_hits_addend(rule["cost"]["request"])},
                {
                    "actions": actions,
                    "hits_addend": eg_hits_addend(rule["cost"]["response"]),
                    "apply_on_stream_done": True,
                },
            ],
        }
    }
    bootstrap["static_resources"]["clusters"].append(
        {
            "name": RATE_LIMIT_CLUSTER,
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": {
                "cluster_name": RATE_LIMIT_CLUSTER,
                "endpoints": [
                    {
                        "lb_endpoints": [
                            {
                                "endpoint": {
                                    "address": {
                                        "socket_address": {
                                            "address": "127.0.0.1",
                                            "port_value": port,
                                        }
                                    }
                                }
                            }
                        ]
                    }
                ],
            },
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                    "@type": "type.googleapis.com/"
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                    "explicit_http_config": {"http2_protocol_options": {}},
                }
            },
        }
    )


@dataclass
class Gateway:
    url: str
    extproc: BufferedExtProc
    model: Model


@contextlib.asynccontextmanager
async def eg_gateway(
    tmp_path: Path, buffer_limit: int, rate_limit_port: int | None = None
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
        )
        config = tmp_path / "envoy.yaml"
        bootstrap = eg_shaped_bootstrap(opts, buffer_limit)
        if rate_limit_port is not None:
            add_token_limits(bootstrap, rate_limit_port)
        config.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        log = tmp_path / "envoy.log"
        with envoy_process(config, log) as proc:
            await wait_ready(admin, proc, log)
            yield Gateway(f"http://127.0.0.1:{listener}", extproc, model)


def manifest_buffer_limit() -> int:
    policy = find(render("envoy-gateway"), "ClientTrafficPolicy")
    return quantity_bytes(policy["spec"]["connection"]["bufferLimit"])


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
    async with eg_gateway(tmp_path, EG_DEFAULT_BUFFER_LIMIT) as gw:
        status, _ = await _post(gw.url, prompt(64 * 1024))
        assert status == 413
        assert gw.extproc.bodies == [] and gw.model.bodies == []  # Envoy's own answer


async def test_the_manifests_buffer_limit_lets_a_large_prompt_reach_the_server(
    tmp_path: Path,
) -> None:
    size = 3 * 1024 * 1024  # under the server's 4 MiB max_body_bytes
    body = prompt(size)
    async with eg_gateway(tmp_path, manifest_buffer_limit()) as gw:
        status, headers = await _post(gw.url, body)
        assert status == 200
        assert gw.extproc.bodies == [len(body)] and gw.model.bodies == [len(body)]
        # The HTTPRoute's echo, as Envoy Gateway renders it, brings back what the ext_proc
        # set on the request: session-affinity's id round-trips, explain is visible.
        assert headers.get("x-session-id") == SESSION
        assert headers.get("x-routing-explain") == EXPLAIN


# -- token limits (deploy/overlays/envoy-gateway-token-limits) ----------------------------

RLS_SERVER = Path(__file__).with_name("rls_server.py")


@contextlib.contextmanager
def rate_limit_service(tmp_path: Path, limit: int) -> Iterator[tuple[int, Path]]:
    port_file, record = tmp_path / "rls.port", tmp_path / "rls.jsonl"
    record.touch()
    proc = subprocess.Popen(
        [sys.executable, str(RLS_SERVER), str(port_file), str(record), str(limit)],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "rls.log").open("wb"),
    )
    try:
        for _ in range(200):
            assert proc.poll() is None, (tmp_path / "rls.log").read_text()
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        yield int(port_file.read_text()), record
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _calls(record: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in record.read_text().splitlines()]


async def _calls_settled(record: Path, count: int) -> list[dict[str, Any]]:
    for _ in range(100):
        calls = await asyncio.to_thread(_calls, record)
        if len(calls) >= count:
            return calls
        await asyncio.sleep(0.05)
    return await asyncio.to_thread(_calls, record)


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
        async with eg_gateway(tmp_path, manifest_buffer_limit(), port) as gw:
            assert await _post_as(gw.url, "alice") == 200
            calls = await _calls_settled(record, 2)
            # The check costs nothing; the charge, once the answer is done, is its total
            # tokens as the Lua filter wrote them, for the user that sent it.
            assert [c["costs"] for c in calls] == [[0], [total]]
            assert {json.dumps(c["descriptors"]) for c in calls} == {
                json.dumps([[["user", "alice"]]])
            }
            # Under budget (16 of 17): served and charged again; now over budget: 429 before
            # the engine is reached. Another user is not affected.
            assert await _post_as(gw.url, "alice") == 200
            await _calls_settled(record, 4)
            served = len(gw.model.bodies)
            assert await _post_as(gw.url, "alice") == 429
            assert len(gw.model.bodies) == served
            assert await _post_as(gw.url, "bob") == 200


async def test_an_answer_without_usage_charges_nothing(tmp_path: Path) -> None:
    with rate_limit_service(tmp_path, limit=1000) as (port, record):
        async with eg_gateway(tmp_path, manifest_buffer_limit(), port) as gw:
            assert await _post_as(gw.url, "carol", "?usage=0") == 200
            assert await _post_as(gw.url, "carol") == 200  # a marker that the first is done
            calls = await _calls_settled(record, 3)
    # The answer without usage: the check (0) and no charge at all, or a charge of 0.
    costs = [c["costs"] for c in calls]
    assert costs[-1] == [PROMPT_TOKENS + COMPLETION_TOKENS]
    assert costs[:-1] == [[0], [0]], costs
