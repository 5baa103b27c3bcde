"""`kubectl extproc tune` against the fake API server, whose pod port-forward (the plugin's
default) and pod proxy reach real Apps' admin ports in this process: the report (tuned here on
a small capture, or one `extproc tune --json` wrote) reaches every ready replica and only
those, and what the plugin or a replica refuses is said and published nowhere."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from extproc.admin.guard import ADMIN_TOKEN_HEADER
from extproc.app import App
from extproc.config import load_config_text
from extproc.kubectl import main
from tests.app._engines import free_port
from tests.app._tuning import BEST, TINY_TUNE, tuning_report, write_tiny_trace
from tests.k8s.fake_apiserver import PODS, SECRETS, FakeApiServer
from tests.k8s.helpers import write_kubeconfig

pytestmark = pytest.mark.slow  # Apps whose stop drains for 1 s; one test runs the twin

NS = "extproc"
TOKEN = "t0ken-" + "b3" * 16


def router_pod(name: str, port: int, *, ready: bool) -> dict[str, Any]:
    return {
        "metadata": {
            "name": name, "namespace": NS, "labels": {"app.kubernetes.io/name": "extproc"},
        },
        "spec": {"containers": [{"name": "extproc", "ports": [
            {"name": "metrics", "containerPort": port},
        ]}]},
        "status": {
            "podIP": "127.0.0.1", "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }  # fmt: skip


@dataclass
class Cluster:
    apps: list[App]
    urls: list[str]
    kubeconfig: Path

    async def kubectl(self, *argv: str) -> int:
        return await asyncio.to_thread(main, ["--kubeconfig", str(self.kubeconfig), *argv])

    async def tunings(self) -> list[dict[str, Any] | None]:
        out = []
        for url in self.urls:
            async with httpx.AsyncClient(headers={ADMIN_TOKEN_HEADER: TOKEN}) as client:
                out.append((await client.get(f"{url}/debug/tuning")).json())
        return out


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    """Three router pods, the third not ready; the admin token in its Secret."""
    apps, urls = [], []
    api = FakeApiServer()
    api.start()
    try:
        for i in range(3):
            admin, engine = free_port(), free_port()
            app = App(
                load_config_text(
                    f"server: {{grpc_port: {free_port()}, metrics_port: {admin}}}\n"
                    f"admin: {{token: {TOKEN}}}\n"
                    f"models:\n  - name: m\n    endpoints: [{{address: '127.0.0.1:{engine}', "
                    f"metrics_url: 'http://127.0.0.1:{engine}/metrics'}}]\n"
                )
            )
            await app.start()
            apps.append(app)
            urls.append(f"http://127.0.0.1:{admin}")
            api.apply(PODS, router_pod(f"extproc-{i}", admin, ready=i < 2))
        api.apply(
            SECRETS,
            {
                "metadata": {"name": "extproc-admin", "namespace": NS},
                "type": "Opaque",
                "data": {"token": base64.b64encode(TOKEN.encode()).decode()},
            },
        )
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", api.url, token="t", namespace=NS)
        yield Cluster(apps, urls, kubeconfig)
    finally:
        api.close()
        for app in apps:
            await app.stop()


@pytest.mark.parametrize("via", ["port-forward", "proxy"])
async def test_a_report_reaches_every_ready_replica(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str], via: str
) -> None:
    report = tuning_report()
    report["captured"]["goodput_rps"] = float("nan")  # as `extproc tune --json` writes it
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps(report))
    assert await cluster.kubectl("--via", via, "tune", "--report", str(path)) == 0
    err = capsys.readouterr().err
    assert f"extproc-0 took it (best: {BEST})" in err and "extproc-1 took it" in err
    kept = await cluster.tunings()
    for tuning in kept[:2]:
        assert tuning is not None and tuning["report"]["best"]["name"] == BEST
        assert tuning["report"]["captured"]["goodput_rps"] is None
    assert kept[2] is None  # not ready: not published to
    assert "extproc-2" not in err


async def test_tune_on_a_capture_here_then_publish(
    cluster: Cluster, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """The whole command: `extproc tune` runs here on a small Mooncake trace (two rules, one
    seed: a few seconds), its table shows, and its report lands on the replicas."""
    trace = write_tiny_trace(tmp_path / "trace.jsonl")
    mine = tmp_path / "mine.json"
    code = await cluster.kubectl(
        "tune", "--pod", "extproc-1", str(trace), *TINY_TUNE, "--json", str(mine)
    )
    out, err = capfd.readouterr()  # the child's table too
    assert code == 0, err
    assert "least-request" in out and "best: " in out  # `extproc tune`'s own table
    written = json.loads(mine.read_text())  # the user's --json is kept
    kept = await cluster.tunings()
    assert kept[0] is None and kept[2] is None  # --pod: that one only
    assert kept[1] is not None and kept[1]["report"]["best"] == written["best"]
    assert f"extproc-1 took it (best: {written['best']['name']})" in err


async def test_what_cannot_be_published_is_said_and_published_nowhere(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tuning_report()
    del bad["best"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    cases = [
        (("tune", "--report", str(path)), "$.best: missing"),
        (("tune", "--report", str(tmp_path / "none.json")), "cannot read --report"),
        (("tune", str(path), "--publish"), "--publish: the plugin publishes"),
        (("tune", str(path), "--server=http://x"), "--server: the plugin publishes"),
        (("tune",), "a CAPTURE to tune on"),
        (("tune", "--report", str(path), str(path)), "CAPTURE or --report FILE, not both"),
        # `extproc tune` itself refuses (not a capture): its status, and nothing published.
        (("tune", str(tmp_path / "none.jsonl")), "exited with status 1: nothing published"),
    ]
    for argv, said in cases:
        assert await cluster.kubectl(*argv) == 1, argv
        err = capsys.readouterr().err
        assert said in err, (argv, err)
    assert await cluster.tunings() == [None, None, None]
