"""The app serving InferencePools it finds (no model listed): two pools in two namespaces serve
the same model name, each request goes to its own route's pool only, pools appear, change
and go at run time without touching the others. Real App, real director, real /metrics
servers, the fake API server."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from extproc.app import App
from extproc.config import load_config_text
from extproc.director.api import ImmediateReply, RequestHead, RouteResult

from .fake_apiserver import PODS, POOLS, ROUTES, FakeApiServer
from .helpers import make_pod, write_kubeconfig

pytestmark = pytest.mark.slow  # a whole app against a fake API server: a few seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def eventually(cond: Any, within: float = 15.0) -> bool:
    for _ in range(int(within / 0.05)):
        if cond():
            return True
        await asyncio.sleep(0.05)
    return bool(cond())


@pytest.fixture
async def engines() -> AsyncIterator[list[int]]:
    """Three engines' /metrics on 127.0.0.1 (a pool's targetPort is its engine's port)."""
    runners, ports = [], []

    async def metrics(_r: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{engine="0"} 0.0\n')

    for _ in range(3):
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        runners.append(runner)
        ports.append(port)
    yield ports
    for runner in runners:
        await runner.cleanup()


def pool(
    name: str, namespace: str, port: int, *, picker: str = "extproc", models: str = "llama"
) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "annotations": {"lb.extproc.io/models": models, "lb.extproc.io/strategy": "random"},
        },
        "spec": {
            "selector": {"matchLabels": {"pool": name}},
            "targetPorts": [{"number": port}],
            "endpointPickerRef": {"name": picker, "port": {"number": 9002}},
        },
    }


def route(name: str, namespace: str, pool_name: str) -> dict[str, Any]:
    ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool_name}
    return {
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"rules": [{"backendRefs": [ref]}]},
    }


async def ask(
    app: App, route_name: str | None, model: str = "llama"
) -> RouteResult | ImmediateReply:
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    head = RequestHead(
        request_id="r", method="POST", path="/v1/chat/completions", headers={},
        route_name=route_name,
    )  # fmt: skip
    result = await app.handler_for(head).route(head, body)
    if isinstance(result, RouteResult) and result.ticket is not None:
        result.ticket.close()
    return result


def xds(namespace: str, name: str) -> str:
    return f"httproute/{namespace}/{name}/rule/0/match/0/*"


async def test_each_request_goes_to_its_routes_pool_and_pools_come_and_go(
    apiserver: FakeApiServer, tmp_path: Path, engines: list[int], caplog: Any
) -> None:
    a_port, b_port, c_port = engines
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", apiserver.url, token="t")
    cfg = load_config_text(f"""
server: {{grpc_port: {free_port()}, metrics_port: {free_port()}}}
kubernetes: {{in_cluster: false, kubeconfig: "{kubeconfig}"}}
pools: {{picker_names: [extproc], tokenizer: null}}
metrics: {{poll_interval_s: 0.1}}
""")
    for name, ns, port in (("llama", "team-a", a_port), ("llama", "team-b", b_port)):
        apiserver.apply(POOLS, pool(name, ns, port))
        apiserver.apply(PODS, make_pod(f"{ns}-0", "127.0.0.1", labels={"pool": name}, namespace=ns))
        apiserver.apply(ROUTES, route("chat", ns, name))
    apiserver.apply(POOLS, pool("theirs", "team-a", c_port, picker="another-epp"))
    bad = pool("bad", "team-a", c_port, models="bad")
    bad["metadata"]["annotations"]["lb.extproc.io/strategy"] = "no-such-rule"
    apiserver.apply(POOLS, bad)
    app = App(cfg)
    await app.start()
    try:
        a, b, c = (f"127.0.0.1:{p}" for p in (a_port, b_port, c_port))
        assert await eventually(
            lambda: app.is_ready() and len(app.store.ready("team-b/llama")) == 1
        )
        # Not "theirs" (another picker's), not "bad" (its strategy does not exist: logged).
        assert sorted(app.store.models()) == ["team-a/llama", "team-b/llama"]
        assert "inferencepool team-a/bad is not served" in caplog.text
        for _ in range(20):  # random picks: a wrong pool would show
            got_a, got_b = (
                await ask(app, xds("team-a", "chat")),
                await ask(app, xds("team-b", "chat")),
            )
            assert isinstance(got_a, RouteResult) and got_a.destinations == (a,)
            assert isinstance(got_b, RouteResult) and got_b.destinations == (b,)
        # A route that names no pool of ours: the config's models, which have no "llama".
        unrouted = await ask(app, None)
        assert isinstance(unrouted, ImmediateReply) and unrouted.status == 404
        # A pool appears at run time (the other pools' directors are not rebuilt).
        before = app.handler_for(
            RequestHead("x", "POST", "/", {}, route_name=xds("team-a", "chat"))
        )
        apiserver.apply(POOLS, pool("code", "team-c", c_port, models="code"))
        apiserver.apply(
            PODS, make_pod("c-0", "127.0.0.1", labels={"pool": "code"}, namespace="team-c")
        )
        apiserver.apply(ROUTES, route("code", "team-c", "code"))
        assert await eventually(lambda: len(app.store.ready("team-c/code")) == 1)
        got_c = await ask(app, xds("team-c", "code"), model="code")
        assert isinstance(got_c, RouteResult) and got_c.destinations == (c,)
        assert (
            app.handler_for(RequestHead("x", "POST", "/", {}, route_name=xds("team-a", "chat")))
            is before
        )
        # One pool goes: its route no longer routes anywhere; the others are untouched.
        apiserver.delete(POOLS, "team-b", "llama")
        assert await eventually(lambda: "team-b/llama" not in app.store.models())
        gone = await ask(app, xds("team-b", "chat"))
        assert isinstance(gone, ImmediateReply) and gone.status == 404
        still = await ask(app, xds("team-a", "chat"))
        assert isinstance(still, RouteResult) and still.destinations == (a,)
    finally:
        await app.stop()
