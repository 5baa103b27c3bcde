"""The status page as a newcomer opens it (issue 39 #1): in a real headless Chromium, with the
login in the URL (`http://me:TOKEN@host:port/`, as the README says), 1,400 px wide. The page
goes live, nothing on it is wider than the window, and each pool and all pools together have
a totals row that adds up the rows above it. A real App with its admin port and real engine
/metrics over HTTP; one endpoint's port is closed (a down pod, with its reason in its row)."""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import pytest
from aiohttp import web

from extproc.app import App
from extproc.config import load_config_text
from extproc.director.api import RequestHead, RouteResult
from tests.app._browser import CHROMIUM, chromium_page
from tests.app._engines import free_port, serve_metrics

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        shutil.which(CHROMIUM) is None,
        reason=f"no Chromium at {CHROMIUM}: apt-get install -y chromium (.ci/run does)",
    ),
]

TOKEN = "t0ken-" + "5e" * 16
WIDTH = 1400
MODELS = ("Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B-Instruct")
ENGINES = 4  # per model, plus one whose metrics port is closed
HELD = 3  # decisions whose requests stay in flight


def exposition(i: int) -> str:
    """Engine i: i running, 2i waiting, KV cache (10i + 5) %, prefix hits 10i % of 1,000."""
    return (
        f'vllm:num_requests_running{{model_name="m"}} {i}.0\n'
        f'vllm:num_requests_waiting{{model_name="m"}} {2 * i}.0\n'
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {0.1 * i + 0.05:.2f}\n'
        f'vllm:prefix_cache_queries_total{{model_name="m"}} 1000.0\n'
        f'vllm:prefix_cache_hits_total{{model_name="m"}} {100 * i}.0\n'
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    app: App
    admin: int


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    runners, ports = [], []
    for i in range(ENGINES):

        async def metrics(_r: web.Request, text: str = exposition(i)) -> web.Response:
            return web.Response(text=text)

        runner, port = await serve_metrics(metrics)
        runners.append(runner)
        ports.append(port)
    down = closed_port()
    admin = free_port()
    lines = []
    for j, model in enumerate(MODELS):
        eps = [
            f'{{address: "127.0.0.{j + 1}:{p}", metrics_url: "http://127.0.0.1:{p}/metrics"}}'
            for p in ports
        ]
        eps.append(
            f'{{address: "127.0.0.{j + 1}:{down}", metrics_url: "http://127.0.0.1:{down}/metrics"}}'
        )
        lines.append(f"  - name: {model}\n    endpoints: [{', '.join(eps)}]")
    text = (
        f"server: {{grpc_port: {free_port()}, metrics_port: {admin}, status_page: true}}\n"
        f"admin: {{token: {TOKEN}}}\n"
        "routing: {default_strategy: kv-aware}\n"  # the most scores per candidate
        "models:\n" + "\n".join(lines) + "\n"
    )
    app = App(load_config_text(text))
    await app.start()
    try:
        for _ in range(100):
            if app.is_ready():
                break
            await asyncio.sleep(0.05)
        yield Running(app, admin)
    finally:
        await app.stop()
        for runner in runners:
            await runner.cleanup()


async def route(app: App, i: int) -> RouteResult:
    body = orjson.dumps(
        {
            "model": MODELS[0],
            "messages": [{"role": "user", "content": f"question {i}: " + "tell me more " * 40}],
            "max_tokens": 8,
        }
    )
    head = RequestHead(
        request_id=f"0b9f3c1e-2d4a-4f7e-9a61-{i:012d}",  # as long as Envoy's x-request-id
        method="POST",
        path="/v1/chat/completions",
        headers={},
    )
    result = await app.director.route(head, body)
    assert isinstance(result, RouteResult), result
    return result


def cells(selector: str) -> str:
    return f"[...document.querySelector({selector!r}).children].map(td => td.textContent)"


async def test_with_the_login_in_the_url_at_1400_px_nothing_is_cut_off_and_totals_add_up(
    running: Running,
) -> None:
    tickets = []
    for i in range(8):
        result = await route(running.app, i)
        if i < HELD:
            tickets.append(result.ticket)
        elif result.ticket is not None:
            result.ticket.close()
    try:
        async with chromium_page() as page:  # no injected headers: the URL's login only
            await page.send(
                "Emulation.setDeviceMetricsOverride",
                width=WIDTH, height=900, deviceScaleFactor=1, mobile=False,
            )  # fmt: skip
            await page.navigate(f"http://me:{TOKEN}@127.0.0.1:{running.admin}/")
            rows = f"document.querySelectorAll('tr.endpoint').length === {2 * (ENGINES + 1)}"
            conn = "document.getElementById('conn').textContent"
            try:
                await page.wait_for(f"{rows} && document.querySelector('tr.decision') !== null")
            except AssertionError:
                raise AssertionError(
                    f"the page did not fill: {await page.evaluate(conn)}"
                ) from None
            assert await page.evaluate(conn) == "live"
            # The down pod shows why, in its row (the longest text a row carries).
            await page.wait_for("[...document.querySelectorAll('tr.endpoint .why')].length === 2")

            # Nothing wider than the window: not the page, not a table inside its box.
            assert await page.evaluate("innerWidth") == WIDTH
            assert await page.evaluate("document.documentElement.scrollWidth") <= WIDTH
            overflowing = await page.evaluate(
                "[...document.querySelectorAll('table, .fit, h3, p')]"
                f".filter(n => n.getBoundingClientRect().right > {WIDTH} "
                "|| n.scrollWidth > n.clientWidth + 1)"
                ".map(n => n.tagName + '.' + n.className + ' ' + n.scrollWidth)"
            )
            assert overflowing == []

            # Each pool's totals row adds up its endpoints' rows.
            model = MODELS[0]
            total = await page.evaluate(cells(f"#endpoints tfoot tr.total[data-model='{model}']"))
            endpoint_rows = await page.evaluate(
                f"[...document.querySelectorAll('tr.endpoint[data-model=\"{model}\"]')]"
                ".map(tr => [...tr.children].map(td => td.textContent))"
            )
            assert total[0] == f"pool total ({ENGINES + 1})"
            assert total[2].split()[0] == f"{ENGINES}/{ENGINES + 1}"  # the down pod is not ready
            running_ = sum(int(r[5]) for r in endpoint_rows if r[5] != "\u2013")
            waiting = sum(int(r[6]) for r in endpoint_rows if r[6] != "\u2013")
            assert (running_, waiting) == (0 + 1 + 2 + 3, 0 + 2 + 4 + 6)
            assert (total[5], total[6]) == (str(running_), str(waiting))
            assert total[7] == "mean 20%"  # (5 + 15 + 25 + 35) / 4, the ready pods
            assert total[8] == "15%"  # (0 + 100 + 200 + 300) hits of 4,000 queries
            in_flight = sum(int(r[4].split()[0]) for r in endpoint_rows)
            tokens = sum(int(r[4].split()[2]) for r in endpoint_rows)
            assert in_flight == HELD
            assert total[4] == f"{in_flight} / {tokens} tok"
            healthy = sum(r[10] == "healthy" for r in endpoint_rows)
            assert total[10] == f"{healthy}/{ENGINES + 1} healthy"

            # All pools together, under the pools table.
            pools = await page.evaluate(cells("#pools tfoot tr.total"))
            assert pools[0] == f"all {len(MODELS)} pools"
            assert pools[2].startswith(f"{2 * ENGINES}/{2 * (ENGINES + 1)}")
            assert "2 unreachable" in pools[2]
            assert pools[3].split()[0] == str(HELD)
            assert (pools[4], pools[5]) == (str(2 * running_), str(2 * waiting))
            count = await page.evaluate("document.getElementById('pools-count').textContent")
            assert count == f"({len(MODELS)} pools, {2 * (ENGINES + 1)} endpoints)"
    finally:
        for ticket in tickets:
            if ticket is not None:
                ticket.close()
