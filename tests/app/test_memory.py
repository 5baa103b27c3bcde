"""/debug/memory: RSS and object counts always; growth by allocation site when tracemalloc runs."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator

import httpx
import pytest

from extproc.app import App
from extproc.config import load_config_text
from extproc.memdiag import MemoryDiagnostics, rss_bytes
from tests.app._engines import free_port


class Retained:
    """A type of its own, so its count in the report can only come from this test."""

    def __init__(self, i: int) -> None:
        self.payload = bytes(200) + i.to_bytes(4, "little")


@pytest.fixture
def tracing() -> Iterator[None]:
    was = tracemalloc.is_tracing()
    if not was:
        tracemalloc.start(2)
    try:
        yield
    finally:
        if not was:
            tracemalloc.stop()


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_growth_names_the_type_and_the_line_that_allocated(tracing: None) -> None:
    diag = MemoryDiagnostics()
    first = diag.report(types=True)
    assert first["tracemalloc"] is True
    assert "growth_since_baseline" not in first  # the first report is the baseline
    kept = [Retained(i) for i in range(5000)]  # ~1.5 MB held on purpose
    second = diag.report(types=True, top=10)
    assert second["object_type_growth"]["Retained"] == 5000
    top_site = second["growth_since_baseline"][0]
    assert top_site["size_diff"] >= 5000 * 200
    assert any(w.startswith(__file__) for w in top_site["where"]), top_site
    del kept
    third = diag.report(types=True, reset=True)  # reset: growth is measured from here on
    assert third["object_type_growth"].get("Retained", 0) <= 0
    assert "Retained" not in diag.report(types=True)["object_type_growth"]


def test_without_tracemalloc_the_report_says_how_to_get_sites() -> None:
    if tracemalloc.is_tracing():
        pytest.skip("this interpreter runs with tracemalloc (PYTHONTRACEMALLOC)")
    report = MemoryDiagnostics().report()
    assert report["tracemalloc"] is False
    assert "PYTHONTRACEMALLOC" in report["hint"]
    assert report["rss_bytes"] == pytest.approx(rss_bytes(), rel=0.5)
    assert report["gc_objects"] > 1000


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_admin_endpoint_serves_the_report_and_rejects_a_bad_top() -> None:
    metrics_port = free_port()
    cfg = load_config_text(f"""
server: {{grpc_port: {free_port()}, metrics_port: {metrics_port}}}
models:
  - name: m
    endpoints: [{{address: "127.0.0.1:9"}}]
""")
    app = App(cfg)
    await app.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}") as client:
            ok = await client.get("/debug/memory", params={"types": "1", "top": "5"})
            assert ok.status_code == 200
            body = ok.json()
            assert body["rss_bytes"] > 0
            assert len(body["object_types"]) == 5
            bad = await client.get("/debug/memory", params={"top": "many"})
            assert bad.status_code == 400
            assert "top" in bad.json()["error"]
    finally:
        await app.stop()
