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


def _allocate_here(n: int) -> list[Retained]:
    return [Retained(i) for i in range(n)]


def _allocate_there(n: int) -> list[Retained]:
    return [Retained(i) for i in range(n)]


def test_growth_by_file_adds_up_call_paths_and_omits_the_baseline_itself(tracing: None) -> None:
    """Growth spread over call paths adds up by module (group=filename); the baseline snapshot
    (one object or more per traced block, kept in the process) is not counted as growth."""
    held = _allocate_here(30_000)  # ~30k traced blocks: a baseline snapshot of ~60k objects
    diag = MemoryDiagnostics()
    diag.report(reset=True)
    kept = _allocate_here(2000) + _allocate_there(2000)
    by_path = diag.report(group="traceback", top=50)["growth_since_baseline"]
    by_file = diag.report(group="filename", top=50)
    mine = [g for g in by_file["growth_since_baseline"] if g["where"][0].startswith(__file__)]
    assert by_file["growth_group"] == "filename"
    assert len(mine) == 1
    assert mine[0]["size_diff"] >= 4000 * 200
    assert mine[0]["size_diff"] > max(g["size_diff"] for g in by_path)  # two paths, one file
    assert by_file["traced_growth_bytes"] >= 4000 * 200
    assert by_file["allocated_blocks_growth"] < 30_000  # the kept 4000 objects, not the snapshot
    with pytest.raises(ValueError, match="group"):
        diag.report(group="module")
    del held, kept


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
            bad = await client.get("/debug/memory", params={"group": "module"})
            assert bad.status_code == 400
            assert "group" in bad.json()["error"]
    finally:
        await app.stop()
