"""The last tuning on the admin port (issue 37 #4), in process: real Apps with their admin ports
over real HTTP. `POST /debug/tuning` wants the admin token and JSON, bounds the body (413),
checks the report's shape strictly (400 naming what is wrong, the last good one kept), and
the report comes back from `GET /debug/tuning` and in `/status.json`. `extproc tune --publish`
finds every server process of a local stack (its stack.json and admin.token) and says which
took it. The page drawing it in Chromium: test_status_page_tuning.py."""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.admin.guard import ADMIN_TOKEN_HEADER
from extproc.admin.tuning import (
    MAX_RULES,
    MAX_TUNING_BYTES,
    TuningRejected,
    finite,
    parse_tuning,
)
from extproc.app import App
from extproc.cli import _publish_tuning
from extproc.cli import main as cli_main
from extproc.config import load_config_text
from extproc.stack.local import ADMIN_TOKEN_FILE, STATE_FILE
from extproc.twin import Candidate, FitReport, PodProfile, TuneReport
from extproc.twin.tune import RuleResult, Stats
from tests.app._engines import free_port
from tests.app._tuning import APPLY, BEST, TINY_TUNE, tuning_report, write_tiny_trace

TOKEN = "t0ken-" + "7a" * 16
AUTH = {ADMIN_TOKEN_HEADER: TOKEN}


@dataclass
class Running:
    app: App
    url: str


async def start_app() -> Running:
    admin = free_port()
    engine = free_port()  # nothing listens: the admin port serves all the same
    app = App(
        load_config_text(
            f"server: {{grpc_port: {free_port()}, metrics_port: {admin}, status_page: true}}\n"
            f"admin: {{token: {TOKEN}}}\n"
            "routing: {default_strategy: least-request}\n"
            f"models:\n  - name: m\n    endpoints: [{{address: '127.0.0.1:{engine}', "
            f"metrics_url: 'http://127.0.0.1:{engine}/metrics'}}]\n"
        )
    )
    await app.start()
    return Running(app, f"http://127.0.0.1:{admin}")


@pytest.fixture
async def running() -> AsyncIterator[Running]:
    server = await start_app()
    try:
        yield server
    finally:
        await server.app.stop()


@pytest.fixture
async def client(running: Running) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=running.url, headers=AUTH, timeout=10) as c:
        yield c


@pytest.mark.slow  # >= 1 s in test-fast (an App's stop drains for 1 s)
async def test_a_published_tuning_comes_back_whole_and_in_status_json(
    client: httpx.AsyncClient, running: Running
) -> None:
    assert (await client.get("/debug/tuning")).json() is None
    assert (await client.get("/status.json")).json()["tuning"] is None
    report = tuning_report()
    resp = await client.post("/debug/tuning", json=report)
    assert resp.status_code == 200, resp.text
    took = resp.json()
    assert took["replica"] == running.app.replica and took["best"] == BEST

    kept = (await client.get("/debug/tuning")).json()
    assert kept["report"] == report
    assert kept["received_at"] == took["received_at"]
    assert kept["from"] == "127.0.0.1"
    shown = (await client.get("/status.json")).json()["tuning"]
    # The page polls every second: it gets everything but the fitted pods.
    assert shown["report"] == {k: v for k, v in report.items() if k != "fit"}
    assert shown["report"]["best"]["apply"] == APPLY
    assert shown["received_at"] == took["received_at"]

    newer = tuning_report()
    newer["requests"] = 7
    assert (await client.post("/debug/tuning", json=newer)).status_code == 200
    assert (await client.get("/debug/tuning")).json()["report"]["requests"] == 7


@pytest.mark.slow  # >= 1 s in test-fast (an App's stop drains for 1 s)
async def test_the_tuning_endpoints_want_the_admin_token(running: Running) -> None:
    wrong = [{}, {ADMIN_TOKEN_HEADER: TOKEN[:-1]}, {"Authorization": "Bearer nope"}]
    async with httpx.AsyncClient(base_url=running.url, timeout=10) as anon:
        for method in ("GET", "POST"):
            for headers in wrong:
                resp = await anon.request(
                    method, "/debug/tuning", json=tuning_report(), headers=headers
                )
                assert resp.status_code == 401, (method, headers, resp.text)
                assert resp.json()["error"]["code"] == "admin_token_required"
    async with httpx.AsyncClient(base_url=running.url, headers=AUTH, timeout=10) as c:
        assert (await c.get("/debug/tuning")).json() is None  # nothing was kept


@pytest.mark.slow  # >= 1 s in test-fast (an App's stop drains for 1 s)
async def test_a_report_over_256_kib_is_refused_with_413_and_the_last_one_kept(
    client: httpx.AsyncClient,
) -> None:
    assert (await client.post("/debug/tuning", json=tuning_report())).status_code == 200
    big = tuning_report()
    big["fit"]["unfitted"] = ["p" * 256] * 1024  # 1,024 pod names of 256 characters
    body = json.dumps(big).encode()
    assert len(body) > MAX_TUNING_BYTES
    parse_tuning(body)  # a good shape: only its size is refused
    headers = {"content-type": "application/json"}
    declared = await client.post("/debug/tuning", content=body, headers=headers)

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it arrives
        for i in range(0, len(body), 16384):
            yield body[i : i + 16384]

    streamed = await client.post("/debug/tuning", content=chunks(), headers=headers)
    for resp in (declared, streamed):
        assert resp.status_code == 413, resp.text
        error = resp.json()["error"]
        assert error["code"] == "request_too_large" and str(MAX_TUNING_BYTES) in error["message"]
    assert (await client.get("/debug/tuning")).json()["report"] == tuning_report()


def _set(path: tuple[str | int, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


def _drop(path: tuple[str | int, ...]) -> Callable[[dict[str, Any]], None]:
    def change(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return change


BAD: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing-best", _drop(("best",)), "$.best: missing"),
    ("missing-rule-key", _drop(("rules", 1, "ttft_p90_ms")), "$.rules[1].ttft_p90_ms: missing"),
    ("unknown-key", _set(("surprise",), 1), "$.surprise: unknown key"),
    ("unknown-rule-key", _set(("rules", 0, "colour"), "red"), "$.rules[0].colour: unknown key"),
    ("requests-as-text", _set(("requests",), "4812"), "$.requests: must be a non-negative"),
    ("negative-requests", _set(("requests",), -1), "$.requests: must be a non-negative"),
    ("boolean-as-number", _set(("rules", 2, "ttft_p50_ms"), True), "ttft_p50_ms: must be a num"),
    ("rules-not-a-list", _set(("rules",), {"a": 1}), "$.rules: must be a list"),
    ("no-rules", _set(("rules",), []), "$.rules: no rule was compared"),
    ("too-many-rules", lambda d: d.update(rules=d["rules"] * 17), f"more than {MAX_RULES}"),
    ("best-not-a-rule", _set(("best", "name"), "round-robin"), "is not one of $.rules"),
    ("apply-not-text", _set(("best", "apply"), ["routing"]), "$.best.apply: must be a string"),
    ("apply-too-long", _set(("best", "apply"), "x" * 9000), "$.best.apply: longer than"),
    ("bad-margin", _set(("best", "margin"), {"ttft_p50_ms": 3}), "$.best.margin"),
    ("beyond-noise-text", _set(("best", "beyond_noise"), "yes"), "must be true or false"),
    ("nested-param", _set(("rules", 0, "params"), {"w": {"x": 1}}), "$.rules[0].params.w"),
]


@pytest.mark.parametrize(("change", "named"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_report_is_refused_naming_what_is_wrong(
    change: Callable[[dict[str, Any]], None], named: str
) -> None:
    doc = copy.deepcopy(tuning_report())
    change(doc)
    with pytest.raises(TuningRejected) as refused:
        parse_tuning(json.dumps(doc).encode())
    assert named in refused.value.message


@pytest.mark.slow  # >= 1 s in test-fast (an App's stop drains for 1 s)
async def test_a_bad_report_gets_a_400_json_error_and_the_last_good_one_stays(
    client: httpx.AsyncClient,
) -> None:
    assert (await client.post("/debug/tuning", json=tuning_report())).status_code == 200
    for name, change, named in BAD:
        doc = copy.deepcopy(tuning_report())
        change(doc)
        resp = await client.post("/debug/tuning", json=doc)
        assert resp.status_code == 400, (name, resp.text)
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_tuning"
        assert named in error["message"], (name, error["message"])
    not_json = [
        (b"{not json", "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        # What a cross-site form can send, with a browser's saved login: refused unread.
        (json.dumps(tuning_report()).encode(), "text/plain", 415),
        (json.dumps(tuning_report()).encode(), "application/x-www-form-urlencoded", 415),
    ]
    for body, content_type, status in not_json:
        resp = await client.post(
            "/debug/tuning", content=body, headers={"content-type": content_type}
        )
        assert resp.status_code == status, (content_type, resp.text)
        assert resp.json()["error"]["message"]
    assert (await client.get("/debug/tuning")).json()["report"] == tuning_report()


@pytest.mark.slow  # >= 1 s in test-fast (an App's stop drains for 1 s)
async def test_nan_as_tune_json_writes_it_reads_as_null(client: httpx.AsyncClient) -> None:
    report = tuning_report()
    report["captured"]["goodput_rps"] = float("nan")
    report["rules"][0]["hit_rate"] = float("inf")
    body = json.dumps(report).encode()  # what `extproc tune --json FILE` holds
    assert b"NaN" in body and b"Infinity" in body
    resp = await client.post(
        "/debug/tuning", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 200, resp.text
    kept = (await client.get("/debug/tuning")).json()["report"]
    assert kept["captured"]["goodput_rps"] is None and kept["rules"][0]["hit_rate"] is None


def test_the_twins_own_report_passes_the_check() -> None:
    """The shape the twin writes and the shape the admin port reads must not drift apart."""

    def stats(p50: float) -> Stats:
        return Stats(
            requests=10, errors=0, ttft_p50_ms=p50, ttft_p90_ms=2 * p50, ttft_p99_ms=3 * p50,
            tpot_p50_ms=9.0, hit_rate=0.5, goodput_rps=float("nan"), spread=1.1,
        )  # fmt: skip

    running = RuleResult(Candidate("least-request", "least-request"), [stats(90.0), stats(95.0)])
    best = RuleResult(
        Candidate("kv-aware overlap 2", "kv-aware", {"overlap_weight": 2.0}),
        [stats(50.0), stats(52.0)],
    )
    cold = RuleResult(  # `extproc tune`'s own candidates have one (a restart: shown, not chosen)
        Candidate("predicted-latency, cold start", "predicted-latency", cold=True),
        [stats(40.0), stats(41.0)],
    )
    report = TuneReport(
        requests=10, duration_s=5.0, running="least-request",
        fit=FitReport(pods=(PodProfile("10.0.0.1:8000", "m"),), rounds=1,
                      check={"10.0.0.1:8000": {"ttft_p50_ms": 1.0}}),
        captured=stats(91.0), fidelity=stats(93.0), ceiling=0.6, results=[running, best, cold],
        seeds=2, models_from="capture",
    )  # fmt: skip
    doc = report.to_json()
    parsed = parse_tuning(json.dumps(doc).encode())  # as `--json FILE` writes it, NaN and all
    assert parsed["best"]["name"] == "kv-aware overlap 2" and parsed["best"]["beyond_noise"]
    assert parsed == json.loads(json.dumps(finite(doc)))  # nothing but NaN -> null changed
    assert parsed["rules"][2]["cold"] is True and parsed["models_from"] == "capture"


def _write_stack(workdir: Path, servers: list[Running]) -> None:
    """A local stack's state as `extproc up` writes it: its supervisor (this test, alive),
    its children and the admin token."""
    workdir.mkdir()
    children = [
        {"name": f"extproc-{i}", "pid": os.getpid(), "address": s.url.removeprefix("http://")}
        for i, s in enumerate(servers)
    ]
    children.append({"name": "sim-0", "pid": os.getpid(), "address": "127.0.0.1:1"})
    (workdir / STATE_FILE).write_text(
        json.dumps({"supervisor_pid": os.getpid(), "children": children})
    )
    (workdir / ADMIN_TOKEN_FILE).write_text(TOKEN + "\n")


def _publish_args(workdir: Path, servers: list[str] | None = None) -> argparse.Namespace:
    return argparse.Namespace(publish=True, server=servers, workdir=str(workdir), token_file=None)


@pytest.mark.slow  # >= 1 s in test-fast (an App's stop drains for 1 s)
async def test_tune_publish_sends_the_report_to_every_process_of_the_local_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`extproc tune CAPTURE --publish`, the whole command on a small trace (a few seconds of
    twin): the local stack's processes and token are found as `extproc capture` finds them."""
    monkeypatch.delenv("EXTPROC_ADMIN_TOKEN", raising=False)
    trace = write_tiny_trace(tmp_path / "trace.jsonl")
    servers = [await start_app(), await start_app()]
    try:
        workdir = tmp_path / ".run"
        _write_stack(workdir, servers)
        argv = ["tune", str(trace), *TINY_TUNE, "--json", str(tmp_path / "tune.json")]
        code = await asyncio.to_thread(cli_main, [*argv, "--publish", "--workdir", str(workdir)])
        said = capsys.readouterr().err
        assert code == 0, said
        written = json.loads((tmp_path / "tune.json").read_text())
        for server in servers:
            assert f"{server.url} (process {server.app.replica}) took it" in said
            async with httpx.AsyncClient(base_url=server.url, headers=AUTH) as c:
                kept = (await c.get("/debug/tuning")).json()["report"]
            assert kept["best"] == written["best"] and kept["requests"] == 20

        # --server: those only (--publish implied); one that does not answer is named, and the
        # exit status says so.
        gone = f"http://127.0.0.1:{free_port()}"
        args = [*argv, "--server", servers[0].url + "/", "--server", gone]
        code = await asyncio.to_thread(cli_main, [*args, "--workdir", str(workdir)])
        said = capsys.readouterr().err
        assert code == 1
        assert f"{servers[0].url} (process {servers[0].app.replica}) took it" in said
        assert f"extproc tune --publish: {gone}: " in said and servers[1].url not in said

        # A wrong token: refused, with where the token came from.
        (workdir / ADMIN_TOKEN_FILE).write_text("not-the-token\n")
        code = await asyncio.to_thread(_publish_tuning, _publish_args(workdir), tuning_report())
        said = capsys.readouterr().err
        assert code == 1 and "HTTP 401" in said and str(workdir / ADMIN_TOKEN_FILE) in said
    finally:
        for server in servers:
            await server.app.stop()


def test_publish_without_a_stack_says_how_to_name_the_servers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _publish_tuning(_publish_args(tmp_path / "nothing"), tuning_report()) == 1
    said = capsys.readouterr().err
    assert "no local stack" in said and "--server URL" in said
