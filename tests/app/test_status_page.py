"""The status page's data (`/status.json`) and switch (`server.status_page`), in process: a real
App with its admin port, real engine /metrics expositions over HTTP, decisions made by the real
director. The page itself is driven in a real browser in tests/app/test_status_page_browser.py."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from aiohttp import web

from extproc.admin import DecisionLog
from extproc.admin.http import status_page_html
from extproc.app import App
from extproc.config import load_config, load_config_text
from extproc.director.api import RequestHead, RouteResult
from extproc.director.lifecycle import Outgoing
from extproc.routing.base import Decision
from tests.app._engines import free_port, serve_metrics
from tests.director._prepared import model_runtime, pod, prepared

HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


def exposition(running: int, kv: float) -> str:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0\n'
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} 0.0\n'
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}\n'
    )


@pytest.fixture
async def engines() -> AsyncIterator[list[int]]:
    """Two engines' /metrics: the first runs 1 request at 25 % KV, the second 3 at 50 %."""
    runners, ports = [], []
    for running, kv in ((1, 0.25), (3, 0.5)):

        async def metrics(_r: web.Request, text: str = exposition(running, kv)) -> web.Response:
            return web.Response(text=text)

        runner, port = await serve_metrics(metrics)
        runners.append(runner)
        ports.append(port)
    try:
        yield ports
    finally:
        for runner in runners:
            await runner.cleanup()


def config_text(grpc: int, admin: int, ports: list[int], *, page: bool, extra: str = "") -> str:
    endpoints = ", ".join(
        f'{{address: "127.0.0.1:{p}", metrics_url: "http://127.0.0.1:{p}/metrics"}}' for p in ports
    )
    return (
        f"server: {{grpc_port: {grpc}, metrics_port: {admin}, status_page: {str(page).lower()}}}\n"
        f"routing: {{default_strategy: least-request}}\n"
        f"models:\n  - name: {orjson.dumps(HOSTILE).decode()}\n    endpoints: [{endpoints}]\n"
        + extra
    )


def touch_later(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()
    os.utime(path, (st.st_atime + 5, st.st_mtime + 5))  # mtime granularity must not hide it


async def route(app: App, request_id: str) -> RouteResult:
    body = orjson.dumps(
        {"model": HOSTILE, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )
    head = RequestHead(
        request_id=request_id, method="POST", path="/v1/chat/completions", headers={}
    )
    result = await app.director.route(head, body)
    assert isinstance(result, RouteResult), result
    return result


async def get_json(client: httpx.AsyncClient, path: str, status: int = 200) -> Any:
    resp = await client.get(path)
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    return resp.json()


async def wait_ready(app: App) -> None:
    for _ in range(50):
        if app.is_ready():
            return
        await asyncio.sleep(0.1)
    raise AssertionError("no endpoint became ready")


async def test_off_by_default_answers_404_with_a_json_error(engines: list[int]) -> None:
    admin = free_port()
    text = config_text(free_port(), admin, engines, page=False).replace(", status_page: false", "")
    app = App(load_config_text(text))
    await app.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin}") as client:
            for path in ("/", "/status.json"):
                err = await get_json(client, path, status=404)
                assert err["error"]["type"] == "not_found_error"
                assert err["error"]["code"] == "status_page_disabled"
                assert "server.status_page" in err["error"]["message"]
            assert len(await get_json(client, "/debug/endpoints")) == 2  # the rest still serves
        await wait_ready(app)
        await route(app, "r-off")
        assert app.decisions.total == 0  # nothing is recorded while the page is off
    finally:
        await app.stop()


@pytest.mark.slow  # waits for a real reload: ~4 s
async def test_status_json_shows_endpoints_decisions_and_the_reload_state(
    engines: list[int], tmp_path: Path
) -> None:
    grpc, admin = free_port(), free_port()
    path = tmp_path / "config.yaml"
    path.write_text(config_text(grpc, admin, engines, page=True))
    app = App(load_config(path), config_path=path)
    await app.start()
    tickets = []
    try:
        await wait_ready(app)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin}") as client:
            page = await client.get("/")
            assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
            csp = page.headers["content-security-policy"]
            assert "default-src 'none'" in csp and "script-src 'sha256-" in csp
            assert "unsafe-inline" not in csp

            before = await get_json(client, "/status.json")
            assert before["decisions"]["total"] == 0 and before["decisions"]["recent"] == []
            for i in range(3):
                tickets.append((await route(app, f"r{i}")).ticket)  # held: in flight
            status = await get_json(client, "/status.json")

        [model] = status["models"]
        assert model["name"] == HOSTILE  # data, as given; the page escapes it
        assert model["strategy"] == "least-request"
        rows = {e["address"]: e for e in model["endpoints"]}
        first, second = (rows[f"127.0.0.1:{p}"] for p in engines)
        assert (first["running"], first["kv_cache_usage"]) == (1.0, 0.25)
        assert (second["running"], second["kv_cache_usage"]) == (3.0, 0.5)
        assert first["ready"] and second["ready"]
        assert 0 <= first["metrics_age_s"] <= status["stale_after_s"]
        assert first["in_flight"] + second["in_flight"] == 3
        assert not first["failing"] and first["failed_picks"] == 0  # no pick has failed yet

        decisions = status["decisions"]
        assert decisions["total"] == 3
        assert [d["request_id"] for d in decisions["recent"]] == ["r2", "r1", "r0"]  # newest first
        newest = decisions["recent"][0]
        assert newest["strategy"] == "least-request" and newest["model"] == HOSTILE
        assert {c["address"] for c in newest["candidates"]} == set(rows)
        assert newest["candidates_total"] == 2
        picked = rows[newest["pick"]]["recent"]
        assert picked["picked"] is True and picked["strategy"] == "least-request"
        assert picked["scores"] == next(
            c["scores"] for c in newest["candidates"] if c["address"] == newest["pick"]
        )

        reload = status["config"]["reload"]
        assert reload["path"] == str(path) and reload["last_result"] is None
        assert status["config"]["in_force"]["server"]["status_page"] is True
        assert status["replica"] == app.replica
        assert status["processes"] == {"shared_state": False, "members": [app.replica]}

        # A rejected reload shows with its reason; the config in force stays.
        touch_later(path, config_text(grpc, admin, engines, page=True) + "server: {grpc_prot: 1}\n")
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{admin}") as client:
            for _ in range(50):
                reload = (await get_json(client, "/status.json"))["config"]["reload"]
                if reload["last_result"] == "error":
                    break
                await asyncio.sleep(0.1)
            assert reload["last_result"] == "error" and reload["reloads_failed"] == 1
            assert "grpc_prot" in reload["last_error"] or "server" in reload["last_error"]

            # A reload that turns the page off takes effect at once.
            touch_later(path, config_text(grpc, admin, engines, page=False))
            for _ in range(50):
                if (await client.get("/status.json")).status_code == 404:
                    break
                await asyncio.sleep(0.1)
            err = await get_json(client, "/status.json", status=404)
            assert err["error"]["code"] == "status_page_disabled"
            assert app.reload_status.last_result == "ok" and app.reload_status.reloads_ok == 1
    finally:
        for ticket in tickets:
            if ticket is not None:
                ticket.close()
        await app.stop()


async def test_the_decision_ring_keeps_the_newest_and_counts_all() -> None:
    log = DecisionLog(size=3, wall_clock=lambda: 1000.0)
    with model_runtime() as runtime:
        pods = (pod("10.0.0.1:8000"), pod("10.0.0.2:8000"))
        for i in range(5):
            req, place = prepared(runtime, pods=pods)
            req = replace(req, head=replace(req.head, request_id=f"r{i}"))
            pick = pods[i % 2]
            decision = Decision(
                ranked=(pick.endpoint,), strategy="s", scores={pick.address: {"x": i / 10}}
            )
            await log.pre_request(req, place, decision, Outgoing())
    assert log.total == 5
    assert [r.request_id for r in log.newest_first()] == ["r4", "r3", "r2"]
    scores = log.recent_scores()
    assert scores["10.0.0.1:8000"]["scores"] == {"x": 0.4} and scores["10.0.0.1:8000"]["picked"]
    assert scores["10.0.0.2:8000"]["scores"] == {} and not scores["10.0.0.2:8000"]["picked"]
    assert next(log.newest_first()).to_json()["pick"] == "10.0.0.1:8000"
    assert list(log.recent_scores(endpoints=2)) == ["10.0.0.1:8000", "10.0.0.2:8000"]


def test_the_page_builds_its_dom_with_text_only() -> None:
    """Static guard beside the browser test: no HTML parsing of data anywhere in the page."""
    html, csp = status_page_html()
    text = html.decode()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in text, sink
    assert "<link" not in text and "src=" not in text.split("<script>")[0]  # no external assets
    unfetched = text.replace('"http://www.w3.org/2000/svg"', "")  # SVG's namespace: a name
    assert "http://" not in unfetched and "https://" not in unfetched
    assert "connect-src 'self'" in csp
