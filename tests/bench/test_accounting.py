"""The accounting benchmark's own arithmetic: idle subtraction, per-100-chunk normalisation,
medians over rounds with paired differences, the checks and the table; and the scenario files
name only accounting modes that exist."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.accounting import (
    ACCOUNTING_CLUSTER,
    FULL_SIZES,
    QUICK_SIZES,
    aggregate,
    checks,
    derive,
    markdown,
    per_100_chunks_ms,
    split_bootstrap,
)
from bench.scenario import load_scenario
from extproc.stack.envoy_config import EXTPROC_CLUSTER, EnvoyOptions, HostPort, ResponseAccounting

SCENARIOS = Path(__file__).resolve().parents[2] / "bench" / "scenarios"


def test_per_100_chunks_is_milliseconds_per_hundred_chunks() -> None:
    assert per_100_chunks_ms(0.05, 800) == pytest.approx(6.25)  # 50 ms over 800 chunks
    assert per_100_chunks_ms(0.05, 0) is None  # non-streamed: nothing chunked
    assert per_100_chunks_ms(None, 800) is None  # no such process


def test_derive_subtracts_the_idle_share_over_the_run() -> None:
    d = derive(
        {
            "ok": 40, "chunks": 4000, "elapsed_s": 10.0,
            "server_cpu_s": 0.5, "server_idle": 0.01,  # 0.1 s of the 0.5 s is background
            "envoy_cpu_s": 0.42, "envoy_idle": 0.002,
            "tokens_client": 4000, "tokens_server": 4000,
        }
    )  # fmt: skip
    assert d["server_cpu_ms_per_resp"] == pytest.approx(10.0)
    assert d["envoy_cpu_ms_per_resp"] == pytest.approx(10.0)
    assert d["envoy_cpu_ms_per_100_chunks"] == pytest.approx(10.0)
    assert d["chunks_per_resp"] == 100
    assert d["tokens_ok"]
    baseline = derive({"ok": 40, "chunks": 0, "elapsed_s": 10.0, "server_cpu_s": None,
                       "envoy_cpu_s": 0.1, "tokens_client": 10, "tokens_server": None})  # fmt: skip
    assert baseline["server_cpu_ms_per_resp"] is None
    assert baseline["envoy_cpu_ms_per_100_chunks"] is None
    assert not baseline["tokens_ok"]


def _run(variant: str, rnd: int, server: float | None, envoy: float, itl99: float,
         tokens_server: int | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "variant": variant, "size": "800 tok stream", "round": rnd, "ok": 10, "errors": 0,
        "chunks": 8000, "tokens_client": 8000, "tokens_server": tokens_server,
        "server_cpu_ms_per_resp": server, "envoy_cpu_ms_per_resp": envoy,
        "envoy_cpu_ms_per_100_chunks": envoy / 8, "ttft_p50_ms": 30.0, "itl_p50_ms": 3.0,
        "itl_p99_ms": itl99, "e2e_p50_ms": 2500.0, "chunks_per_resp": 800.0,
    }  # fmt: skip


def _runs() -> list[dict[str, Any]]:
    runs = []
    # Round 1 is noisy for everybody alike: paired differences cancel it, medians skip it.
    for rnd, noise in ((0, 0.0), (1, 5.0), (2, 0.0)):
        runs += [
            _run("envoy", rnd, None, 40.0 + noise, 10.0 + noise + 0.1 * rnd),
            _run("none", rnd, 2.0 + noise, 44.0 + noise, 10.2 + noise),
            _run("access-log", rnd, 2.05 + noise, 80.0 + noise, 10.3 + noise, 8000),
            _run("old", rnd, 30.0 + noise, 70.0 + noise, 12.0 + noise, 8000 - (rnd == 2)),
        ]
    return runs


def test_aggregate_takes_medians_and_pairs_differences_within_a_round() -> None:
    rows = {r["variant"]: r for r in aggregate(_runs(), ["envoy", "none", "access-log", "old"])}
    als = rows["access-log"]
    assert als["rounds"] == 3 and als["responses"] == 30
    assert als["server_cpu_ms_per_resp"] == pytest.approx(2.05)
    assert als["accounting_cpu_ms_per_resp"] == pytest.approx(0.05)
    assert als["added_envoy_cpu_ms_per_resp"] == pytest.approx(40.0)
    assert als["added_envoy_cpu_ms_per_100_chunks"] == pytest.approx(5.0)
    assert als["added_itl_p99_ms"] == pytest.approx(0.2)  # 0.3, 0.2, 0.1: median 0.2
    assert als["itl_p99_min_ms"] == pytest.approx(10.3)
    assert als["itl_p99_max_ms"] == pytest.approx(15.3)
    assert als["tokens_server"] == als["tokens_client"] == 24000
    assert rows["old"]["tokens_server"] == 23999
    assert rows["none"]["tokens_server"] is None  # no accounting: nothing to compare
    assert rows["none"]["accounting_cpu_ms_per_resp"] == 0.0
    assert rows["envoy"]["accounting_cpu_ms_per_resp"] is None  # no server at all


def test_checks_apply_the_issue_bounds() -> None:
    rows = aggregate(_runs(), ["envoy", "none", "access-log", "old"])
    (als,) = checks(rows)
    assert als["cpu_ok"] and als["tokens_ok"]
    assert als["envoy_itl_p99_spread_ms"] == pytest.approx(5.1)
    assert als["itl_ok"]
    (old,) = checks(rows, "old")
    assert old["cpu_ok"] is False and old["tokens_ok"] is False
    # With the split variant, the CPU of the process that only accounts decides.
    split = [
        {**r, "variant": "access-log split", "acct_process_cpu_ms_per_resp": 0.3}
        for r in rows
        if r["variant"] == "access-log"
    ]
    (als,) = checks([*rows, *split])
    assert als["accounting_process_cpu_ms_per_resp"] == 0.3
    assert als["accounting_cpu_ms_per_resp"] == pytest.approx(0.05)
    assert als["cpu_ok"] is False


def test_derive_reads_the_accounting_process_on_its_own() -> None:
    d = derive({"ok": 50, "chunks": 0, "elapsed_s": 4.0, "server_cpu_s": 0.3, "envoy_cpu_s": 0.1,
                "acct_cpu_s": 0.006, "acct_idle": 0.0005})  # fmt: skip
    assert d["acct_process_cpu_ms_per_resp"] == pytest.approx(0.08)
    assert derive({"ok": 5, "chunks": 0, "elapsed_s": 1.0})["acct_process_cpu_ms_per_resp"] is None


def _find(node: Any, key: str) -> list[Any]:
    if isinstance(node, dict):
        return ([node[key]] if key in node else []) + [
            x for v in node.values() for x in _find(v, key)
        ]
    if isinstance(node, list):
        return [x for v in node for x in _find(v, key)]
    return []


def test_split_bootstrap_sends_the_access_log_to_its_own_server() -> None:
    opts = EnvoyOptions(extproc=(HostPort("127.0.0.1", 9002),))
    boot = split_bootstrap(opts, HostPort("127.0.0.1", 9003))
    clusters = {c["name"]: c for c in boot["static_resources"]["clusters"]}
    ports = {n: _find(c, "port_value") for n, c in clusters.items()}
    assert ports[ACCOUNTING_CLUSTER] == [9003]
    assert ports[EXTPROC_CLUSTER] == [9002]
    (log_config,) = _find(boot, "common_config")
    assert log_config["grpc_service"]["envoy_grpc"]["cluster_name"] == ACCOUNTING_CLUSTER
    (routing,) = [f for f in _find(boot, "http_filters")[0] if f["name"].endswith("ext_proc")]
    assert routing["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] == EXTPROC_CLUSTER


def test_markdown_has_a_row_per_variant_and_flags_mismatches() -> None:
    names = ["envoy", "none", "access-log", "old"]
    rows = aggregate(_runs(), names)
    text = markdown(
        {"config": {"rounds": 3}, "summary": rows, "checks": checks(rows), "notes": ["a note"]}
    )
    assert "**accounting / 800 tok stream** (median of 3 rounds)" in text
    lines = [ln for ln in text.splitlines() if ln.startswith("| ")]
    header = lines[0].split(" | ")
    for name in names:
        (row,) = [ln for ln in lines if ln.startswith(f"| {name} |")]
        assert len(row.split(" | ")) == len(header)
    assert "23999/24000 MISMATCH |" in text
    late = [{**r, "tokens_server_late": 8000} if r["variant"] == "old" and r["round"] == 2 else r
            for r in _runs()]  # fmt: skip
    (old,) = [r for r in aggregate(late, names) if r["variant"] == "old"]
    assert old["tokens_server"] == 23999 and old["tokens_server_late"] == 24000
    assert "23999/24000 MISMATCH (24000 5 s later)" in markdown(
        {"config": {"rounds": 3}, "summary": [old], "checks": []}
    )
    assert "24000/24000 |" in text
    assert "| 800 tok stream | 0.050 | - | yes |" in text
    assert text.rstrip().endswith("a note")


def test_sizes_cover_the_issue() -> None:
    for sizes in (FULL_SIZES, QUICK_SIZES):
        assert {s.tokens for s in sizes if s.stream} == {10, 100, 800}
        assert any(not s.stream for s in sizes)
        assert all(s.requests > 0 for s in sizes)


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.stem)
def test_scenarios_name_existing_accounting_modes(path: Path) -> None:
    for quick in (False, True):
        sc = load_scenario(path, quick=quick)  # raises on an unknown accounting mode
        assert all(isinstance(v.accounting, ResponseAccounting) for v in sc.variants)
