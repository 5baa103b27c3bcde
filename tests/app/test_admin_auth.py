"""The admin port's doors, in process: a real App with its admin port and real engine /metrics
over HTTP. `/metrics` and the probes are open; every `/debug/*`, the status page and
`/status.json` need the admin token (three ways to present it), a stranger gets a 401 JSON
error; `/status.json` never hands out a secret; explains are bounded (body size, 429 beyond
the gate). The kubectl plugin's use of it through the API server: tests/kubectl."""

from __future__ import annotations

import asyncio
import base64
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import pytest
from aiohttp import web

from extproc.admin.guard import ADMIN_TOKEN_HEADER, ExplainGate, authorized
from extproc.app import App
from extproc.cli import main as cli_main
from extproc.config import ConfigError, load_config, load_config_text
from extproc.types import TooManyRequests
from tests.app._engines import free_port, serve_metrics

TOKEN = "t0ken-" + "9f" * 16
PRIVATE = (
    ("GET", "/debug/endpoints"),
    ("GET", "/debug/kv"),
    ("GET", "/debug/sync"),
    ("GET", "/debug/latency-model"),
    ("GET", "/debug/capture"),
    ("GET", "/debug/tuning"),
    ("POST", "/debug/tuning"),
    ("GET", "/debug/memory"),
    ("POST", "/debug/explain"),
    ("GET", "/status.json"),
    ("GET", "/"),
    ("GET", "/no-such-path"),
)
CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


@dataclass
class Running:
    app: App
    url: str


@pytest.fixture
async def engine() -> AsyncIterator[int]:
    async def metrics(_r: web.Request) -> web.Response:
        return web.Response(text='vllm:num_requests_running{model_name="m"} 1.0\n')

    runner, port = await serve_metrics(metrics)
    try:
        yield port
    finally:
        await runner.cleanup()


def config_text(engine: int, admin: int, extra: str = "") -> str:
    return (
        f"server: {{grpc_port: {free_port()}, metrics_port: {admin}, status_page: true}}\n"
        "routing: {default_strategy: least-request, session_secret: the-session-key-0123}\n"
        f"models:\n  - name: m\n    endpoints: [{{address: '127.0.0.1:{engine}', "
        f"metrics_url: 'http://127.0.0.1:{engine}/metrics'}}]\n" + extra
    )


@pytest.fixture
async def running(engine: int, tmp_path: Path) -> AsyncIterator[Running]:
    token_file = tmp_path / ".run" / "admin.token"  # where `extproc up` writes it
    token_file.parent.mkdir()
    token_file.write_text(TOKEN + "\n")
    admin = free_port()
    path = tmp_path / "config.yaml"
    path.write_text(
        config_text(
            engine,
            admin,
            f"admin: {{token_file: {token_file}, explain_rate_per_s: 1, "
            "explain_max_body_bytes: 4096}\n",
        )
    )
    app = App(load_config(path))
    await app.start()
    try:
        yield Running(app, f"http://127.0.0.1:{admin}")
    finally:
        await app.stop()


def _refused(resp: httpx.Response) -> dict[str, str]:
    assert resp.status_code == 401, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    assert resp.headers["www-authenticate"].startswith("Basic realm=")
    error: dict[str, str] = resp.json()["error"]
    assert error["code"] == "admin_token_required" and error["type"] == "invalid_request_error"
    return error


async def test_without_the_token_every_private_path_is_refused_and_the_open_ones_serve(
    running: Running,
) -> None:
    async with httpx.AsyncClient(base_url=running.url, timeout=10) as client:
        for method, path in PRIVATE:
            error = _refused(await client.request(method, path, content=CHAT))
            assert "no admin token" in error["message"] and path in error["message"]
            # The three forms, the browser's login too (what the README tells people to use).
            assert ADMIN_TOKEN_HEADER in error["message"] and "Bearer" in error["message"]
            assert "any user name and the token as the password" in error["message"]
            for wrong in (
                {ADMIN_TOKEN_HEADER: TOKEN[:-1]},
                {"Authorization": f"Bearer {TOKEN}x"},
                {"Authorization": "Basic " + base64.b64encode(b"admin:nope").decode()},
                {"Authorization": "Basic !!not-base64"},
            ):
                resp = await client.request(method, path, headers=wrong, content=CHAT)
                assert (
                    "a wrong admin token" in _refused(resp)["message"]
                    or "no admin" in (resp.json()["error"]["message"])
                )
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200 and "extproc_" in metrics.text
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).status_code in (200, 503)  # open either way


@pytest.mark.parametrize(
    "headers",
    [
        {ADMIN_TOKEN_HEADER: TOKEN},
        {"Authorization": f"Bearer {TOKEN}"},
        {"Authorization": "Basic " + base64.b64encode(f"anyone:{TOKEN}".encode()).decode()},
    ],
    ids=["x-extproc-admin-token", "bearer", "basic"],
)
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_the_token_opens_every_private_path(
    running: Running, headers: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=running.url, headers=headers, timeout=10) as client:
        for method, path in PRIVATE:
            if method == "POST":
                continue  # explains: the gate's test below; tunings: test_tuning_publish.py
            resp = await client.request(method, path)
            # The capture is off in this config: its path says so (404 capture_disabled).
            off = path in ("/no-such-path", "/debug/capture")
            assert resp.status_code == (404 if off else 200), (path, resp.text)


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_status_json_hands_out_no_secret(running: Running) -> None:
    async with httpx.AsyncClient(
        base_url=running.url, headers={ADMIN_TOKEN_HEADER: TOKEN}, timeout=10
    ) as client:
        resp = await client.get("/status.json")
    assert resp.status_code == 200
    assert TOKEN not in resp.text and "the-session-key-0123" not in resp.text
    in_force = resp.json()["config"]["in_force"]
    assert in_force["admin"]["token"] == "<redacted>"
    assert in_force["routing"]["session_secret"] == "<redacted>"


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_explains_beyond_the_bound_get_429_and_big_bodies_413(running: Running) -> None:
    async with httpx.AsyncClient(
        base_url=running.url, headers={ADMIN_TOKEN_HEADER: TOKEN}, timeout=10
    ) as client:
        big = await client.post("/debug/explain", content=b"{" + b" " * 5000 + b"}")
        assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
        # A burst of 12: the bucket holds concurrency + queue (1 + 2) and refills at 1 a
        # second, so at most 3 plus what the burst's own duration refilled get through.
        replies = await asyncio.gather(
            *(client.post("/debug/explain", content=CHAT) for _ in range(12))
        )
    codes = [r.status_code for r in replies]
    limited = [r for r in replies if r.status_code == 429]
    assert codes.count(200) >= 1 and len(limited) >= 4, codes
    assert set(codes) <= {200, 429, 503}  # 503: the engine's scrape had not landed yet
    assert int(limited[0].headers["retry-after"]) >= 1
    err = limited[0].json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "explain_limited"


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_extproc_explain_finds_the_local_token(
    running: Running,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    body = tmp_path / "body.json"
    body.write_bytes(CHAT)
    argv = ["explain", str(body), "--server", running.url, "--json"]
    monkeypatch.delenv("EXTPROC_ADMIN_TOKEN", raising=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no .run/admin.token here: refused
    assert await asyncio.to_thread(cli_main, argv) == 1
    assert orjson.loads(capsys.readouterr().out)["error"]["code"] == "admin_token_required"
    monkeypatch.chdir(tmp_path)  # where the stack wrote it
    await asyncio.to_thread(cli_main, argv)
    shown = orjson.loads(capsys.readouterr().out)
    assert shown.get("error", {}).get("code") != "admin_token_required", shown
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("EXTPROC_ADMIN_TOKEN", TOKEN)
    await asyncio.sleep(1.0)  # the explain bucket refills (1 a second here)
    await asyncio.to_thread(cli_main, argv)
    assert "admin_token_required" not in capsys.readouterr().out


async def test_the_gate_holds_concurrency_and_queue() -> None:
    gate = ExplainGate(concurrency=1, queue=1, rate_per_s=1000.0, clock=lambda: 0.0)
    release = asyncio.Event()
    entered: list[int] = []

    async def explain(i: int) -> None:
        async with gate.slot():
            entered.append(i)
            await release.wait()

    first = asyncio.create_task(explain(1))
    second = asyncio.create_task(explain(2))  # queued behind the first
    await asyncio.sleep(0)
    assert entered == [1]
    with pytest.raises(TooManyRequests):
        async with gate.slot():
            pass
    release.set()
    await asyncio.gather(first, second)
    assert entered == [1, 2] and gate.refused == 1


def test_the_bucket_refills_with_time() -> None:
    now = [0.0]
    gate = ExplainGate(concurrency=1, queue=0, rate_per_s=2.0, clock=lambda: now[0])
    assert gate._take() and not gate._take()
    now[0] += 0.5
    assert gate._take() and not gate._take()


@pytest.mark.parametrize(
    ("path", "remote", "token", "allowed"),
    [
        ("/metrics", "10.1.2.3", TOKEN, True),
        ("/healthz", "10.1.2.3", None, True),
        ("/debug/endpoints", "127.0.0.1", None, True),  # no token: loopback only
        ("/debug/endpoints", "::1", None, True),
        ("/debug/endpoints", "10.1.2.3", None, False),
        ("/status.json", None, None, False),
        ("/debug/endpoints", "127.0.0.1", TOKEN, False),  # a token: everyone presents it
    ],
)
def test_who_may_pass(path: str, remote: str | None, token: str | None, allowed: bool) -> None:
    assert (authorized(path, {}, remote, token) is None) is allowed


def _own_network_address() -> str | None:
    """The address this host would send from (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("198.51.100.1", 9))  # TEST-NET-2: only the route is looked up
        except OSError:
            return None
        address = str(s.getsockname()[0])
    return None if address.startswith("127.") else address


@pytest.fixture
def network_address() -> Iterator[str]:
    address = _own_network_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    yield address


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_without_a_token_a_client_from_the_network_is_refused(
    engine: int, network_address: str
) -> None:
    admin = free_port()
    text = config_text(engine, admin).replace("server: {", "server: {host: 0.0.0.0, ", 1)
    app = App(load_config_text(text))
    await app.start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            stranger = await client.get(f"http://{network_address}:{admin}/debug/endpoints")
            assert "loopback clients only" in _refused(stranger)["message"]
            assert (
                await client.get(f"http://{network_address}:{admin}/metrics")
            ).status_code == 200
            local = await client.get(f"http://127.0.0.1:{admin}/debug/endpoints")
            assert local.status_code == 200
    finally:
        await app.stop()


@pytest.mark.parametrize(
    ("admin", "message"),
    [
        ("{token: short}", "admin.token: must be at least 16 characters"),
        ("{token: 0123456789abcdef0, token_file: /x}", "admin.token_file: set it or admin.token"),
        ("{explain_concurrency: 0}", "explain_concurrency >= 1"),
    ],
)
def test_bad_admin_settings_name_the_key(admin: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config_text(config_text(1, 2, f"admin: {admin}\n"))


def test_a_token_file_that_is_missing_or_short_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    for content in (None, "short\n"):
        token_file = tmp_path / "token"
        if content is not None:
            token_file.write_text(content)
        path.write_text(config_text(1, 2, f"admin: {{token_file: {token_file}}}\n"))
        with pytest.raises(ConfigError, match=r"admin\.token_file"):
            load_config(path)
