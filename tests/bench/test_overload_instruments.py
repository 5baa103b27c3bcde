"""bench/overload.py's own instruments: variants, the flows' schedule, summaries and the table."""

from __future__ import annotations

import pytest

from bench.loadgen import RequestRecord
from bench.overload import FLOWS, schedule, summarize, table, variant


def test_variants_compose() -> None:
    v = variant("fc-slots+prio+token+eq0+res2+flush1")
    assert v.server == {
        "flow_control": {"enabled": True, "dispatch": "slots", "fairness": "token",
                         "engine_queue": 0, "reserved_slots": 2}
    }  # fmt: skip
    assert v.engine_priority and v.flush_s == 1.0
    assert variant("off").server == {} and not variant("off").engine_priority
    with pytest.raises(SystemExit):
        variant("fc-lifo")
    with pytest.raises(SystemExit):
        variant("off+token")  # no flow control: no fairness to choose
    with pytest.raises(SystemExit):
        variant("off+res2")  # nor slots to reserve


def test_the_schedule_mixes_the_flows_by_weight() -> None:
    convs = schedule(100.0, 30.0, seed=1)
    counts = {f: sum(c.conversation_id.startswith(f + "|") for c in convs) for f in FLOWS}
    assert 2700 < len(convs) < 3300
    assert counts["heavy"] / counts["light"] == pytest.approx(5.0, rel=0.2)
    high = next(c for c in convs if c.conversation_id.startswith("high|"))
    assert ("x-request-priority", "10") in high.headers
    assert schedule(100.0, 30.0, seed=1) == convs  # seeded


def _record(flow: str, i: int, ttft: float | None, status: int = 200) -> RequestRecord:
    return RequestRecord(conversation_id=f"{flow}|{i}", turn=0, start_s=float(i), status=status,
                         ttft_s=ttft, prompt_tokens=100, cached_tokens=90)  # fmt: skip


def test_summary_and_ratios_to_the_unloaded_reference() -> None:
    ref = summarize([_record(f, i, 0.05) for i, f in enumerate(FLOWS)], 10.0, [0.0])
    ref.update(variant="ref-off", rep=0, factor=1 / 3, processes=1, run="r")
    loaded = summarize(
        [_record("high", 0, 0.1), _record("light", 1, 0.2), _record("heavy", 2, 3.0),
         _record("heavy", 3, None, status=429), _record("heavy", 4, None, status=0)],
        10.0, [1.0, 3.0],
    )  # fmt: skip
    loaded.update(variant="fc", rep=0, factor=2.0, processes=1, run="r")
    assert loaded["ends"] == {"served": 3, "answered_429": 1, "lost": 1}
    assert loaded["goodput_rps"] == 0.2  # two first tokens within 2 s, over 10 s
    assert loaded["engine_waiting"]["mean"] == 2.0
    md = table([ref, loaded])
    assert "| 1 | 2x | fc | 0.1 (2) | 0.2 (4) | 3 |" in md
