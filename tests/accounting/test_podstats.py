"""PodStatsTracker maths: continuous-time decay of busy time and throughput, sample EWMAs."""

from __future__ import annotations

import math

import pytest

from extproc.accounting import PodStatsTracker
from extproc.routing.base import PodStats

ADDR = "10.0.0.1:8000"


def finish(
    t: PodStatsTracker,
    *,
    started: float,
    now: float,
    first_byte: float | None = None,
    tokens: int | None = None,
    completion: int | None = None,
) -> None:
    """One request: its routing stream ends, then its record's samples arrive."""
    t.request_ended(ADDR, now)
    t.observe_response(
        ADDR,
        now=now,
        latency_s=now - started,
        ttft_s=None if first_byte is None else first_byte - started,
        decode_s=None if first_byte is None else now - first_byte,
        tokens=tokens,
        completion_tokens=completion,
    )


def test_unknown_pod_has_empty_stats() -> None:
    assert PodStatsTracker().stats(ADDR, 5.0) == PodStats()


@pytest.mark.parametrize("duration", [0.5, 5.0, 30.0, 300.0])
def test_busy_time_of_one_long_request(duration: float) -> None:
    tau = 10.0
    t = PodStatsTracker(tau=tau)
    t.request_started(ADDR, 0.0)
    # Integral of exp(-(T-s)/tau) over [0, T] = tau (1 - exp(-T/tau)).
    expected = tau * (1 - math.exp(-duration / tau))
    assert t.stats(ADDR, duration).busy_time_s == pytest.approx(expected)
    t.request_ended(ADDR, duration)
    # Idle afterwards: only decay.
    after = t.stats(ADDR, duration + tau).busy_time_s
    assert after == pytest.approx(expected * math.exp(-1))


def test_busy_time_counts_overlap_once() -> None:
    one = PodStatsTracker(tau=10.0)
    one.request_started(ADDR, 0.0)
    two = PodStatsTracker(tau=10.0)
    two.request_started(ADDR, 0.0)
    two.request_started(ADDR, 1.0)  # overlapping: the pod is busy, not twice as busy
    assert two.stats(ADDR, 4.0).busy_time_s == pytest.approx(one.stats(ADDR, 4.0).busy_time_s)


def test_busy_time_is_path_independent_of_sampling() -> None:
    a = PodStatsTracker(tau=7.0)
    b = PodStatsTracker(tau=7.0)
    a.request_started(ADDR, 0.0)
    b.request_started(ADDR, 0.0)
    for k in range(1, 40):  # reading often must not change the result
        b.stats(ADDR, k * 0.1)
    assert a.stats(ADDR, 4.0).busy_time_s == pytest.approx(b.stats(ADDR, 4.0).busy_time_s)


def test_throughput_is_a_decayed_rate() -> None:
    tau = 10.0
    t = PodStatsTracker(tau=tau)
    # A steady 100 tokens every 0.1 s (1000 tokens/s) for a long time converges to the rate.
    now = 0.0
    for _ in range(2000):
        t.request_started(ADDR, now)
        now += 0.1
        finish(t, started=now - 0.1, now=now, tokens=100)
    rate = t.stats(ADDR, now).throughput_tokens_per_s
    assert rate == pytest.approx(1000.0, rel=0.01)
    assert t.stats(ADDR, now + tau).throughput_tokens_per_s == pytest.approx(rate / math.e)


def test_sample_ewmas() -> None:
    t = PodStatsTracker(alpha=0.25)
    samples = [(1.0, 0.1, 11), (3.0, 0.5, 21), (2.0, 0.3, 2)]
    ttft = latency = tpot = None
    start = 0.0
    for lat, ttfb, completion in samples:
        t.request_started(ADDR, start)
        finish(
            t,
            started=start,
            now=start + lat,
            first_byte=start + ttfb,
            tokens=completion,
            completion=completion,
        )
        sample_tpot = (lat - ttfb) / (completion - 1)
        ttft = ttfb if ttft is None else ttft + 0.25 * (ttfb - ttft)
        latency = lat if latency is None else latency + 0.25 * (lat - latency)
        tpot = sample_tpot if tpot is None else tpot + 0.25 * (sample_tpot - tpot)
        start += 10.0
    s = t.stats(ADDR, start)
    assert s.requests_total == 3
    assert s.ttft_avg_s == pytest.approx(ttft)
    assert s.latency_avg_s == pytest.approx(latency)
    assert s.tpot_avg_s == pytest.approx(tpot)


def test_single_token_response_gives_no_tpot() -> None:
    t = PodStatsTracker()
    t.request_started(ADDR, 0.0)
    finish(t, started=0.0, now=1.0, first_byte=0.5, tokens=5, completion=1)
    s = t.stats(ADDR, 1.0)
    assert s.tpot_avg_s is None and s.ttft_avg_s == pytest.approx(0.5)


def test_a_sample_without_timings_counts_the_request_and_tokens_only() -> None:
    t = PodStatsTracker(tau=10.0)
    t.observe_response(
        ADDR, now=1.0, latency_s=None, ttft_s=None, decode_s=None, tokens=50, completion_tokens=40
    )
    s = t.stats(ADDR, 1.0)
    assert s.requests_total == 1
    assert s.throughput_tokens_per_s == pytest.approx(5.0)
    assert s.latency_avg_s is None and s.ttft_avg_s is None and s.tpot_avg_s is None


def test_time_never_runs_backwards() -> None:
    t = PodStatsTracker(tau=10.0)
    t.request_started(ADDR, 5.0)
    busy = t.stats(ADDR, 8.0).busy_time_s
    assert t.stats(ADDR, 6.0).busy_time_s == busy  # an older `now` changes nothing


def test_forget_and_bad_params() -> None:
    t = PodStatsTracker()
    t.request_started(ADDR, 0.0)
    t.forget(ADDR)
    assert t.stats(ADDR, 1.0) == PodStats()
    with pytest.raises(ValueError):
        PodStatsTracker(tau=0)
    with pytest.raises(ValueError):
        PodStatsTracker(alpha=0)


def test_columns_equal_stats_and_advance_nothing() -> None:
    t = PodStatsTracker(tau=10.0)
    other, unseen = "10.0.0.2:8000", "10.0.0.9:8000"
    t.request_started(ADDR, 0.0)
    finish(t, started=0.0, now=4.0, first_byte=0.5, tokens=900, completion=31)
    t.request_started(ADDR, 5.0)  # still in flight: busy time grows
    t.request_started(other, 2.0)
    t.request_ended(other, 3.0)
    addresses = [other, unseen, ADDR]
    cols = t.columns(addresses, 12.0)
    for i, address in enumerate(addresses):
        row = cols.row(i)
        want = t.stats(address, 12.0)
        assert row.requests_total == want.requests_total
        assert row.throughput_tokens_per_s == pytest.approx(want.throughput_tokens_per_s, rel=1e-12)
        assert row.busy_time_s == pytest.approx(want.busy_time_s, rel=1e-12)
        assert (row.ttft_avg_s, row.tpot_avg_s, row.latency_avg_s) == (
            want.ttft_avg_s, want.tpot_avg_s, want.latency_avg_s,
        )  # fmt: skip
    assert cols.row(1) == PodStats()
    assert cols.rows() == [cols.row(i) for i in range(len(addresses))]
    assert cols.busy_time_s[2] > cols.busy_time_s[0] > 0
    assert math.isnan(cols.ttft_avg_s[1]) and not math.isnan(cols.ttft_avg_s[2])
    # Reading columns at a later time moves no pod's clock: stats at 12 s are unchanged.
    t.columns(addresses, 50.0)
    assert t.stats(ADDR, 12.0).busy_time_s == pytest.approx(cols.busy_time_s[2], rel=1e-12)


def test_columns_follow_forgotten_and_new_pods() -> None:
    t = PodStatsTracker(tau=10.0)
    addresses = [f"10.0.1.{i}:8000" for i in range(100)]  # more than the first table holds
    for i, address in enumerate(addresses):
        t.observe_response(
            address, now=1.0, latency_s=0.1 * i, ttft_s=None, decode_s=None, tokens=i, completion_tokens=None
        )  # fmt: skip
    t.forget(addresses[3])
    t.request_started("10.0.2.1:8000", 2.0)  # takes the forgotten pod's row
    cols = t.columns([addresses[3], "10.0.2.1:8000", addresses[99]], 2.0)
    assert cols.row(0) == PodStats()
    assert cols.row(1).requests_total == 0 and cols.row(1).latency_avg_s is None
    assert cols.row(2).requests_total == 1
    assert cols.row(2).latency_avg_s == pytest.approx(9.9)
