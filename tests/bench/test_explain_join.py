"""The explain join (bench/explain_join.py) reads the header our director writes: a real
kv-aware decision's `x-routing-explain` text, joined with made-up cached-token counts."""

from __future__ import annotations

import random

import pytest

from bench.explain_join import join, parse_explain
from extproc.director.explain import explain_header
from extproc.routing.affinity import KvAwareStrategy
from extproc.routing.base import PodState, RoutingRequest, Snapshot
from extproc.types import Endpoint, EngineMetrics


def pods(loads: list[tuple[int, int, int]]) -> tuple[PodState, ...]:
    return tuple(
        PodState(
            endpoint=Endpoint(address=f"127.0.0.1:{8000 + i}", model="m"),
            metrics=EngineMetrics(updated_at=1.0),
            in_flight=n,
            in_flight_tokens=tokens,
            prefix_match_tokens=match,
        )
        for i, (n, tokens, match) in enumerate(loads)
    )


def decide(loads: list[tuple[int, int, int]]) -> str:
    snap = Snapshot(now=1.0, pods=pods(loads))
    req = RoutingRequest(request_id="r", model="m", prompt_tokens=1800, max_tokens=32)
    decision = KvAwareStrategy().route(req, snap, random.Random(0))
    return explain_header(decision, snap.pods)


def test_parse_reads_the_directors_header() -> None:
    e = parse_explain(decide([(0, 0, 1504), (0, 0, 0)]))
    assert e.strategy == "kv-aware" and e.pick == "127.0.0.1:8000"
    assert e.pods["127.0.0.1:8000"].prefix == 1504
    assert e.pods["127.0.0.1:8001"].scores["overlap_blocks"] == 0
    assert set(e.pods["127.0.0.1:8000"].scores) == {
        "overlap_blocks", "prefill_blocks", "decode_blocks", "cost", "prefill_tokens", "slowness",
    }  # fmt: skip


def test_parse_reads_exponents_in_scores() -> None:
    e = parse_explain(decide([(0, 20_000, 0), (0, 0, 0)]))  # 1,250 in-flight blocks: "1.36e+03"
    assert e.pods["127.0.0.1:8000"].scores["decode_blocks"] == pytest.approx(1363, rel=0.01)


def test_join_puts_lost_tokens_where_they_were_lost() -> None:
    # 1: the holder is busy (6 in flight, 12k tokens): kv-aware goes to the idle pod, away.
    away = decide([(6, 12_000, 1504), (0, 0, 0)])
    assert parse_explain(away).pick == "127.0.0.1:8001"
    # 2: it follows the cache, but the engine had evicted it (stale match).
    stale = decide([(0, 0, 1504), (0, 0, 0)])
    # 3: no match anywhere, and the engine hit 1504 (blind).
    blind = decide([(0, 0, 0), (0, 0, 0)])
    recs = [
        {"status": 200, "prompt_tokens": 1800, "cached_tokens": 0, "explain": away},
        {"status": 200, "prompt_tokens": 1800, "cached_tokens": 0, "explain": stale},
        {"status": 200, "prompt_tokens": 1800, "cached_tokens": 1504, "explain": blind},
        {"status": 500, "prompt_tokens": 1800, "cached_tokens": 0, "explain": stale},
    ]
    s = join(recs)
    assert s.requests == 3 and s.prompt_tokens == 5400 and s.cached_tokens == 1504
    assert s.away_requests == 1 and s.away_tokens == 1504
    assert s.away_inflight_diff == [-6]
    # 12,000 in-flight tokens / 16 on the holder (the header keeps 3 digits: 112.5 reads 112)
    assert s.away_block_diff == [pytest.approx(-750.0, abs=1.0)]
    assert s.stale_tokens == 1504 and s.blind_tokens == 1504
    assert s.piled == 0
    assert "| x | 3 |" in s.row("x")
