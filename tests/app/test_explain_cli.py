"""`extproc explain` against a real App's admin port (two engines' real /metrics over HTTP): a
person gets the decision, the reason and the candidates' scores as a table; `--json` gives the
server's answer as it is; a refused token says how to give one."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from extproc.admin.guard import ADMIN_TOKEN_HEADER
from extproc.app import App
from extproc.cli import main
from extproc.config import load_config
from tests.app._engines import free_port, serve_metrics

TOKEN = "explain-" + "7e" * 16
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


def _exposition(running: int, kv: float) -> str:
    return (
        f'vllm:num_requests_running{{model_name="m"}} {running}.0\n'
        f'vllm:num_requests_waiting{{model_name="m"}} 0.0\n'
        f'vllm:kv_cache_usage_perc{{model_name="m"}} {kv}\n'
    )


@dataclass
class Running:
    url: str
    engines: list[str]
    token_file: Path


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    runners, ports = [], []
    for running_requests, kv in ((0, 0.1), (3, 0.6)):

        async def metrics(
            _r: web.Request, text: str = _exposition(running_requests, kv)
        ) -> web.Response:
            return web.Response(text=text)

        runner, port = await serve_metrics(metrics)
        runners.append(runner)
        ports.append(port)
    engines = [f"127.0.0.1:{p}" for p in ports]
    token_file = tmp_path / "admin.token"
    token_file.write_text(TOKEN + "\n")
    admin = free_port()
    endpoints = ", ".join(f"{{address: '{e}', metrics_url: 'http://{e}/metrics'}}" for e in engines)
    path = tmp_path / "config.yaml"
    path.write_text(
        f"server: {{grpc_port: {free_port()}, metrics_port: {admin}}}\n"
        "routing: {default_strategy: least-kv-cache, session_secret: the-session-key-0123}\n"
        f"admin: {{token_file: {token_file}, explain_rate_per_s: 100, explain_queue: 8}}\n"
        f"models:\n  - name: m\n    endpoints: [{endpoints}]\n"
    )
    app = App(load_config(path))
    await app.start()
    try:
        await _scraped(f"http://127.0.0.1:{admin}", len(engines))
        yield Running(f"http://127.0.0.1:{admin}", engines, token_file)
    finally:
        await app.stop()
        for runner in runners:
            await runner.cleanup()


async def _scraped(url: str, n: int) -> None:
    """Until the router has every engine's figures (the table shows them)."""
    async with httpx.AsyncClient(base_url=url, headers={ADMIN_TOKEN_HEADER: TOKEN}) as client:
        for _ in range(200):
            answer = (await client.post("/debug/explain", content=BODY)).json()
            usage = [c["kv_cache_usage"] for c in answer.get("candidates", [])]
            if len(usage) == n and None not in usage:
                return
            await asyncio.sleep(0.1)
    raise AssertionError(f"no figures from the engines: {answer}")


@pytest.fixture
def body(tmp_path: Path) -> Path:
    path = tmp_path / "body.json"
    path.write_text(BODY)
    return path


async def test_explain_prints_the_decision_and_a_table_of_the_candidates(
    running: Running, body: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["explain", str(body), "--server", running.url, "--token-file", str(running.token_file)]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    with pytest.raises(ValueError):
        json.loads(out)  # for a person, not one line of JSON
    lines = out.splitlines()
    pick, other = running.engines  # least-kv-cache: the one at 10 %
    assert lines[0] == f"model m: route to {pick} (strategy least-kv-cache)"
    assert f"  fallbacks (Envoy's retries, in order): {other}" in lines
    assert any(line.startswith("  why: ") for line in lines)
    assert any(line.startswith("  prompt: ") and " token" in line for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    assert lines[header].split()[:8] == [
        "rank",
        "endpoint",
        "role",
        "in-flight",
        "running",
        "waiting",
        "kv-cache",
        "prefix",
    ]
    assert any(c.startswith("score:") for c in lines[header].split())
    first, second = (line.split() for line in lines[header + 1 : header + 3])
    assert first[:2] == ["1", pick] and second[:2] == ["2", other]
    assert (first[4], first[6]) == ("0", "10%") and (second[4], second[6]) == ("3", "60%")


async def test_explain_json_prints_the_servers_answer(
    running: Running, body: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["explain", str(body), "--server", running.url, "--json"]
    argv += ["--token-file", str(running.token_file)]
    assert await asyncio.to_thread(main, argv) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["pick"] == running.engines[0]
    assert {c["address"] for c in answer["candidates"]} == set(running.engines)


@pytest.mark.parametrize("json_output", [False, True])
async def test_a_refused_token_says_how_to_give_one(
    running: Running,
    body: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    json_output: bool,
) -> None:
    monkeypatch.delenv("EXTPROC_ADMIN_TOKEN", raising=False)
    monkeypatch.chdir(tmp_path)  # no .run/admin.token here
    argv = ["explain", str(body), "--server", running.url] + (["--json"] if json_output else [])
    assert await asyncio.to_thread(main, argv) == 1
    out, err = capsys.readouterr()
    assert "--token-file" in err and "EXTPROC_ADMIN_TOKEN" in err
    assert "no token was sent" in err
    if json_output:
        assert json.loads(out)["error"]["code"] == "admin_token_required"
    else:
        assert out == ""
        assert "HTTP 401: /debug/explain needs the admin token" in err
    monkeypatch.setenv("EXTPROC_ADMIN_TOKEN", "wrong-" + TOKEN)
    assert await asyncio.to_thread(main, argv) == 1
    assert "the token in $EXTPROC_ADMIN_TOKEN was sent" in capsys.readouterr().err
