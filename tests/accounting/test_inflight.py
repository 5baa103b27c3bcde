"""In-flight leases: counts per address, idempotent finish, no leak under cancellation."""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from extproc.accounting import GatewayMetrics, InflightTracker, Load, PodStatsTracker
from extproc.accounting.inflight import STALL_LATENCY_MULTIPLE
from extproc.types import Endpoint

A = Endpoint("10.0.0.1:8000", "m")
A_OTHER_MODEL = Endpoint("10.0.0.1:8000", "lora")  # same server, another model
B = Endpoint("10.0.0.2:8000", "m")
C = Endpoint("10.0.0.3:8000", "m")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_counts_and_tokens_per_address() -> None:
    t = InflightTracker()
    l1 = t.start(A, 100)
    l2 = t.start(A_OTHER_MODEL, 50)
    l3 = t.start(B, 7)
    assert t.load(A.address) == Load(2, 150)
    assert t.load(B.address) == Load(1, 7)
    assert t.total() == 3
    l1.finish()
    assert t.load(A.address) == Load(1, 50)
    l2.finish()
    l3.finish()
    assert t.snapshot() == {}
    assert t.load(A.address) == Load(0, 0)


def test_finish_is_idempotent() -> None:
    t = InflightTracker()
    lease = t.start(A, 10)
    other = t.start(A, 5)
    for _ in range(3):
        lease.finish()
    assert lease.finished
    assert t.load(A.address) == Load(1, 5)
    other.finish()
    other.finish()
    assert t.total() == 0


def test_negative_tokens_are_clamped() -> None:
    t = InflightTracker()
    t.start(A, -5)
    assert t.load(A.address) == Load(1, 0)


async def test_cancelled_streams_never_leak(no_leaked_tasks: None) -> None:
    t = InflightTracker()
    started = asyncio.Event()

    async def stream(ep: Endpoint) -> None:
        with t.start(ep, 10):
            started.set()
            await asyncio.sleep(3600)  # a response that never ends

    tasks = [asyncio.create_task(stream(ep)) for ep in (A, A, B)]
    await started.wait()
    await asyncio.sleep(0)
    assert t.total() == 3
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, asyncio.CancelledError) for r in results)
    assert t.total() == 0
    assert t.snapshot() == {}


async def test_finish_before_context_exit_counts_once() -> None:
    t = InflightTracker()
    with t.start(A, 1) as lease:
        lease.finish()
        assert t.total() == 0
    assert t.total() == 0


def test_feeds_busy_time_and_gauge() -> None:
    clock = FakeClock()
    stats = PodStatsTracker(tau=10.0, alpha=0.5)
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry)
    t = InflightTracker(clock=clock, stats=stats, metrics=metrics)
    lease = t.start(A, 10)
    gauge = "extproc_in_flight_requests"
    assert registry.get_sample_value(gauge, {"endpoint": A.address}) == 1.0
    clock.now += 1.0
    lease.finish()
    assert registry.get_sample_value(gauge, {"endpoint": A.address}) == 0.0
    s = stats.stats(A.address, clock.now)
    # Busy for 1 s with tau 10: 10 * (1 - e^-0.1). Samples come from records, not leases.
    assert s.busy_time_s == pytest.approx(10.0 * (1 - math.exp(-0.1)))
    assert s.requests_total == 0
    clock.now += 5.0
    assert stats.stats(A.address, clock.now).busy_time_s < s.busy_time_s  # idle: it decays


def test_failed_request_releases_but_records_no_latency() -> None:
    clock = FakeClock()
    stats = PodStatsTracker(tau=10.0)
    t = InflightTracker(clock=clock, stats=stats)
    with pytest.raises(RuntimeError), t.start(A, 10):
        clock.now += 5.0
        raise RuntimeError("upstream reset")
    s = stats.stats(A.address, clock.now)
    assert t.total() == 0
    assert s.requests_total == 0
    assert s.latency_avg_s is None
    assert s.busy_time_s > 0  # it was busy while the request was in flight


def test_stall_needs_an_old_request_and_no_recent_answer() -> None:
    clock = FakeClock()
    t = InflightTracker(clock=clock)
    t.start(A)
    assert not t.stalled(A.address, 5.0)
    clock.now += 60
    # No answer seen yet anywhere (accounting off?): nothing can be called stalled.
    assert not t.stalled(A.address, 5.0)
    t.answered(B.address, clock.now)  # B answers: responses are watched from now on
    assert t.stalled(A.address, 5.0)  # A holds a 60 s old request and never answered
    assert not t.stalled(B.address, 5.0)
    assert not t.stalled(A.address, 0.0)  # 0 turns it off
    t.answered(A.address, clock.now - 1)  # a record shows A answering a second ago
    assert not t.stalled(A.address, 5.0)


def test_a_busy_pod_that_keeps_answering_is_not_stalled() -> None:
    clock = FakeClock()
    t = InflightTracker(clock=clock)
    t.answered(B.address, clock.now)
    slow = t.start(A)  # a long request
    for _ in range(30):
        clock.now += 1
        quick = t.start(A)
        quick.finish()
        t.answered(A.address, clock.now)  # meanwhile A completes other requests every second
    assert clock.now - slow.started_at == 30
    assert not t.stalled(A.address, 5.0)
    clock.now += 6  # now A goes silent while still holding the slow request
    assert t.stalled(A.address, 5.0)
    slow.finish()  # the client gave up: nothing waits on A any more
    assert not t.stalled(A.address, 5.0)


def test_an_old_answer_never_moves_the_last_answer_back() -> None:
    clock = FakeClock()
    t = InflightTracker(clock=clock)
    t.start(A)
    t.answered(A.address, clock.now)
    t.answered(A.address, clock.now - 50)  # a late record of an old response
    clock.now += 4
    assert not t.stalled(A.address, 5.0)


def test_finished_leases_leave_no_waiting_state() -> None:
    t = InflightTracker()
    leases = [t.start(A) for _ in range(100)]
    for lease in leases:
        lease.finish()
    assert t._waiting == {}
    assert t.total() == 0


def test_unwatched_requests_never_make_a_pod_stalled() -> None:
    clock = FakeClock()
    t = InflightTracker(clock=clock)
    t.answered(B.address, clock.now)  # responses are watched somewhere
    long_unobserved = t.start(A, watched=False)  # e.g. a route with accounting off
    clock.now += 60
    assert not t.stalled(A.address, 5.0)
    assert t.load(A.address).requests == 1  # still counted as load
    long_unobserved.finish()
    assert t.total() == 0


def test_columns_are_load_of_every_address_with_peers() -> None:
    clock = FakeClock()
    t = InflightTracker(clock=clock)
    C = "10.0.0.3:8000"  # never routed to
    leases = [t.start(A, 100), t.start(A_OTHER_MODEL, 50), t.start(B, 7)]
    addresses = [B.address, A.address, C]

    def check() -> None:
        requests, tokens = t.columns(addresses)
        assert requests.tolist() == [float(t.load(a).requests) for a in addresses]
        assert tokens.tolist() == [float(t.load(a).tokens) for a in addresses]

    check()
    assert t.columns(addresses)[0].tolist() == [1.0, 2.0, 0.0]
    t.set_remote("r2", {A.address: Load(3, 30), C: Load(1, 9)})
    check()
    assert t.columns(addresses)[1].tolist() == [7.0, 180.0, 9.0]
    leases[0].finish()
    t.drop_remote("r2")
    check()
    assert t.columns(addresses)[0].tolist() == [1.0, 1.0, 0.0]


@pytest.mark.parametrize("seed", range(20))
def test_stalled_addresses_is_stalled_for_every_address(seed: int) -> None:
    """Both rules (answers; the engine's progress, on for odd seeds)."""
    rng = random.Random(seed)
    clock, progress = FakeClock(), Progress()
    t = InflightTracker(clock=clock, progress=progress, hang_after_s=2.0 * (seed % 2))
    pods = [Endpoint(address=f"10.0.0.{i}:8000", model="m") for i in range(6)]
    progress.at = {p.address: clock.now for p in pods[:-1]}  # scraped once before any request
    leases = []
    for _ in range(200):
        roll = rng.random()
        if roll < 0.4:
            leases.append(t.start(rng.choice(pods), watched=rng.random() < 0.8))
        elif roll < 0.6 and leases:
            leases.pop(rng.randrange(len(leases))).finish()
        elif roll < 0.7:
            t.answered(rng.choice(pods).address, clock.now - rng.uniform(0, 3))
        elif roll < 0.8:  # a scrape that moved (late by up to 3 s, never before the last)
            address = rng.choice(pods[:-1]).address  # the last pod's engine exports nothing
            progress.at[address] = max(clock.now - rng.uniform(0, 3), progress.at[address])
        elif roll < 0.82 and seed % 2:  # a config reload
            t.hang_after_s = rng.choice([0.0, 0.5, 2.0, 3.0])
        elif roll < 0.85:  # a peer's counts (an empty one: it left)
            held = rng.sample(pods, rng.randrange(3))
            t.set_remote(f"r{rng.randrange(2)}", {p.address: Load(1, 10) for p in held})
        else:
            clock.now += rng.uniform(0, 2)
        after = rng.choice([0.0, 1.0, 4.0, 10.0])
        want = {p.address for p in pods if t.stalled(p.address, after)}
        assert t.stalled_addresses(after) == want


def test_a_pod_whose_answers_take_long_needs_as_many_times_longer_to_look_stalled() -> None:
    """Streams of 12 s that began together: no pod completes anything for 12 s. The limit is
    STALL_LATENCY_MULTIPLE times the pod's mean response time (the pool's longest for a pod
    with none yet), never less than `after_s`; a hung pod is still found, later."""
    clock = FakeClock()
    stats = PodStatsTracker()
    t = InflightTracker(clock=clock, stats=stats)
    held = [t.start(A), t.start(C)]
    clock.now += 12
    stats.observe_response(
        B.address, now=clock.now, latency_s=12.0, ttft_s=0.1, decode_s=11.9, tokens=900,
        completion_tokens=800,
    )  # fmt: skip
    t.answered(B.address, clock.now)
    assert not t.stalled(A.address, 10.0)  # 12 s old, but answers here take 12 s
    # A's own answers take 2 s (its last one 11 s ago): `after_s` is the limit again.
    stats.observe_response(
        A.address, now=clock.now, latency_s=2.0, ttft_s=0.1, decode_s=1.9, tokens=300,
        completion_tokens=200,
    )  # fmt: skip
    t.answered(A.address, clock.now - 11)
    assert STALL_LATENCY_MULTIPLE * 2.0 < 10.0 and t.stalled(A.address, 10.0)
    clock.now += 36 - 12 + 1
    assert t.stalled(C.address, 10.0)  # past 3 x 12 s with nothing answered: hung
    assert t.stalled(A.address, 10.0)
    for lease in held:
        lease.finish()
    assert not t.stalled(C.address, 10.0)


def test_recent_tokens_are_what_was_routed_within_the_window() -> None:
    clock = FakeClock()
    t = InflightTracker(clock=clock)
    old = t.start(A, 1000)
    clock.now += 1.0
    t.start(A, 300)
    clock.now += 0.2
    young = t.start(A, 200)
    assert t.recent_tokens(A.address, 0.1) == 200
    assert t.recent_tokens(A.address, 0.5) == 500
    assert t.recent_tokens(A.address, 5.0) == 1500
    assert t.recent_tokens(A.address, 0.0) == 0 and t.recent_tokens(B.address, 5.0) == 0
    young.finish()  # an early finish still counts for its window, never above the load
    assert t.recent_tokens(A.address, 5.0) == 1300 and t.recent_tokens(A.address, 0.5) == 500
    old.finish()
    assert t.recent_tokens(A.address, 0.5) == 300  # capped: only 300 tokens are in flight


def test_an_address_that_holds_nothing_forgets_its_arrivals() -> None:
    clock = FakeClock()
    t = InflightTracker(clock=clock)
    t.start(A, 400).finish()
    lease = t.start(A, 100)
    assert t.recent_tokens(A.address, 1.0) == 100
    lease.finish()
    assert A.address not in t._arrivals  # nothing in flight: nothing waits there
    clock.now += 120
    t.start(A, 50)
    clock.now += 0.1
    assert len(t._arrivals[A.address]) == 1 and t.recent_tokens(A.address, 1.0) == 50


def test_a_peers_growing_count_is_an_arrival_when_it_is_heard() -> None:
    clock = FakeClock()
    t = InflightTracker(clock=clock)
    t.set_remote("r2", {A.address: Load(2, 800)})
    clock.now += 1.0
    t.set_remote("r2", {A.address: Load(2, 800)})  # a heartbeat: nothing new arrived
    t.set_remote("r2", {A.address: Load(3, 1100)})
    assert t.recent_tokens(A.address, 0.5) == 300
    assert t.recent_tokens(A.address, 5.0) == 1100
    clock.now += 1.0
    t.set_remote("r2", {A.address: Load(1, 200)})  # finishes are not arrivals
    assert t.recent_tokens(A.address, 0.5) == 0 and t.recent_tokens(A.address, 5.0) == 200
    t.drop_remote("r2")
    assert t.recent_tokens(A.address, 5.0) == 0 and A.address not in t._arrivals


@pytest.mark.parametrize("seed", range(10))
def test_recent_tokens_do_not_depend_on_which_replica_routed(seed: int) -> None:
    """Two replicas share their counts (as state sync does, here at once): the tokens routed
    within a window read the same on both, whichever of them routed each request."""
    rng = random.Random(seed)
    clock = FakeClock()
    one, two = InflightTracker(clock=clock), InflightTracker(clock=clock)
    pods = [A, B, C]
    leases: list[Any] = []
    for _ in range(300):
        roll = rng.random()
        if roll < 0.45:
            leases.append(rng.choice([one, two]).start(rng.choice(pods), rng.randint(1, 500)))
        elif roll < 0.7 and leases:
            leases.pop(rng.randrange(len(leases))).finish()
        else:
            clock.now += rng.uniform(0, 0.3)
        one.set_remote("two", two.snapshot())
        two.set_remote("one", one.snapshot())
        for p in pods:
            for within in (0.1, 0.5, 2.0):
                assert one.recent_tokens(p.address, within) == two.recent_tokens(
                    p.address, within
                ), (p.address, within)
    cols = one.recent_columns([A.address, "10.9.9.9:1", B.address], [0.5, 0.5, math.nan])
    assert cols[0] == one.recent_tokens(A.address, 0.5) and cols[1] == 0 and math.isnan(cols[2])


@pytest.mark.parametrize("seed", range(5))
def test_arrivals_since_equals_a_plain_sum_through_forgetting_and_compaction(seed: int) -> None:
    from extproc.accounting.inflight import ARRIVALS_KEPT_S, ARRIVALS_MAX, _Arrivals

    rng = random.Random(seed)
    arrivals, kept = _Arrivals(), []
    now = 0.0
    for _ in range(3000):
        now += rng.choice([0.0, 0.01, 0.5, 3.0])
        tokens = rng.randint(1, 900)
        arrivals.add(now, tokens)
        kept.append((now, tokens))
        kept = [(t, n) for t, n in kept if t >= now - ARRIVALS_KEPT_S][-ARRIVALS_MAX:]
        assert len(arrivals) == len(kept)
        for within in (0.0, 0.2, 5.0, 100.0):
            want = sum(n for t, n in kept if t > now - within)
            assert arrivals.since(now - within) == want


class Progress:
    """When each address's engine was last seen doing work (what `EndpointStore.progressed_at`
    answers from its scrapes)."""

    def __init__(self) -> None:
        self.at: dict[str, float] = {}

    def __call__(self, address: str) -> float | None:
        return self.at.get(address)


def hang_tracker(hang_after_s: float = 2.0) -> tuple[FakeClock, Progress, InflightTracker]:
    clock, progress = FakeClock(), Progress()
    tracker = InflightTracker(
        clock=clock, progress=progress, hang_after_s=hang_after_s, quiet_after_s=1.0
    )
    return clock, progress, tracker


def test_a_pod_whose_engine_shows_no_progress_is_stalled_within_the_hang_limit() -> None:
    """No answer was ever seen here (the access records land on another process), so the
    answer rule cannot act; the engine's scrapes can."""
    clock, progress, t = hang_tracker()
    progress.at[A.address] = progress.at[B.address] = clock.now
    t.start(A), t.start(B)
    clock.now += 1.5
    progress.at[B.address] = clock.now  # B's counters moved at this scrape; A's did not
    assert not t.stalled(A.address, 10.0)  # 1.5 s: not yet
    clock.now += 1.0
    assert t.stalled(A.address, 10.0)  # 2.5 s held, 2.5 s without progress: hung
    assert not t.stalled(B.address, 10.0)  # progressed 1 s ago
    assert t.stalled_addresses(10.0) == {A.address}
    progress.at[A.address] = clock.now  # it moves again: back at once
    assert not t.stalled(A.address, 10.0) and t.stalled_addresses(10.0) == frozenset()


@pytest.mark.parametrize(
    ("progress_ago", "answered_ago", "held_for", "hang", "stalled"),
    [
        (3.0, None, 3.0, 2.0, True),  # held and quiet past the limit
        (3.0, 0.5, 3.0, 2.0, False),  # an answer is progress too
        (3.0, None, 1.0, 2.0, False),  # quiet, but its request is young
        (0.2, None, 30.0, 2.0, False),  # an old request on a pod at work (a long stream)
        (3.0, None, 3.0, 0.0, False),  # hang_after_s 0: off
        (None, None, 30.0, 2.0, False),  # its engine exports nothing that moves: cannot tell
    ],
)
def test_the_progress_rule(
    progress_ago: float | None,
    answered_ago: float | None,
    held_for: float,
    hang: float,
    stalled: bool,
) -> None:
    clock, progress, t = hang_tracker(hang)
    t.start(A)
    clock.now += held_for
    if progress_ago is not None:
        progress.at[A.address] = clock.now - progress_ago
    if answered_ago is not None:
        t.answered(A.address, clock.now - answered_ago)
        t.answered(B.address, clock.now)  # arms the answer rule, which must not fire here
    assert t.stalled(A.address, 60.0) is stalled
    assert (A.address in t.stalled_addresses(60.0)) is stalled


def test_a_peers_requests_on_a_pod_without_progress_make_it_hung_here_too() -> None:
    """Every request the hung pod holds was routed by another replica (whose streams Envoy
    happened to send there): this one holds none, yet it must not send the next client there.
    Its peers' published counts and the pod's scrapes are all it needs; a request it cannot
    watch (accounting off, or adopted from a peer that stopped) counts the same."""
    clock, progress, t = hang_tracker()
    progress.at[A.address] = progress.at[B.address] = clock.now
    t.set_remote("r2", {A.address: Load(3, 300)})
    t.start(B, watched=False)
    clock.now += 1.5
    t.start(A)  # a young request of its own does not reset the clock
    progress.at[B.address] = clock.now
    assert t.stalled_addresses(60.0) == frozenset()  # 1.5 s: not yet
    clock.now += 1.0
    assert t.stalled(A.address, 60.0) and t.stalled_addresses(60.0) == {A.address}
    clock.now += 1.0  # B: held 3.5 s (unwatched), no progress for 2 s: not yet past 2 s
    assert not t.stalled(B.address, 60.0)
    clock.now += 0.1
    assert t.stalled(B.address, 60.0) and t.stalled_addresses(60.0) == {A.address, B.address}


def test_a_pod_that_held_nothing_for_a_moment_starts_the_hang_clock_again() -> None:
    """An idle engine's scrapes do not move: a request routed to a pod idle for minutes is not
    a hang until it has been held for `hang_after_s` (the pod's load must not have dropped to
    none in between: the clock is since the pod last held nothing, by every replica's count)."""
    clock, progress, t = hang_tracker()
    progress.at[A.address] = clock.now - 300
    t.set_remote("r2", {A.address: Load(1, 10)})
    clock.now += 1.9
    t.set_remote("r2", {})  # done
    t.start(A, watched=False)
    clock.now += 1.9
    assert not t.stalled(A.address, 60.0)
    clock.now += 0.2
    assert t.stalled(A.address, 60.0)


def test_a_quiet_pod_counts_what_it_holds_as_still_before_its_first_token() -> None:
    """kv-aware counts a request past its pod's TTFT as a cheap decode; on a pod whose engine
    has shown no progress since it was routed there, nothing says it got that far."""
    clock, progress, t = hang_tracker()
    progress.at[A.address] = progress.at[B.address] = clock.now - 0.01  # a scrape, then:
    t.start(A, 400), t.start(B, 400)
    clock.now += 0.5
    t.start(A, 300), t.start(B, 300)
    clock.now += 0.4
    # Within 1 s of progress: the TTFT window (0.1 s) as before.
    assert t.recent_tokens(A.address, 0.1) == 0
    clock.now += 0.3
    progress.at[B.address] = clock.now  # B's engine moved; A's has not for 1.21 s
    assert t.recent_tokens(A.address, 0.1) == 700  # everything since A's last progress
    assert t.recent_tokens(B.address, 0.1) == 0
    cols = t.recent_columns([A.address, B.address], [0.1, 0.1])
    assert cols.tolist() == [700.0, 0.0]
    progress.at[A.address] = clock.now  # A's engine moves again: the TTFT window again
    assert t.recent_tokens(A.address, 0.1) == 0 and t.recent_tokens(A.address, 0.8) == 300


def test_where_answers_are_seen_a_fast_pod_is_quiet_sooner() -> None:
    """Answers of 30 ms, records 0.05 s late: a pod that shows nothing for 0.1 s (three times
    its mean response time, twice the records' lag, the floor) is quiet; where records come in
    1-s batches (Envoy Gateway) it waits for the scrapes' second instead."""
    for lag, quiet_after in ((0.05, 0.1), (1.0, 1.0)):
        clock, progress, stats = FakeClock(), Progress(), PodStatsTracker()
        t = InflightTracker(
            clock=clock, stats=stats, progress=progress, hang_after_s=2.0, quiet_after_s=1.0
        )
        for address in (A.address, B.address):
            stats.observe_response(
                address, now=clock.now, latency_s=0.03, ttft_s=0.01, decode_s=0.02, tokens=20,
                completion_tokens=4,
            )  # fmt: skip
            progress.at[address] = clock.now - 0.01
            t.answered(address, clock.now - lag)
        t.start(A, 500)
        clock.now += quiet_after - 0.03  # 0.01 after the last scrape that moved: 0.02 short
        assert t.recent_tokens(A.address, 0.01) == 0, lag  # not yet: a decode, cheap
        clock.now += 0.04
        assert t.recent_tokens(A.address, 0.01) == 500, lag  # nothing since: counted whole
        t.answered(A.address, clock.now)
        assert t.recent_tokens(A.address, 0.01) == 0, lag
