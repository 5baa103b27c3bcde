"""The response-complete steps alone: each gets a `Completed` and does its one job."""

from __future__ import annotations

from dataclasses import replace

import pytest

from extproc.accounting.fairness import FairnessCounters
from extproc.accounting.inflight import FAILING_COOLDOWN_S, InflightTracker
from extproc.director.api import AccessRecord, Outcome, RoutedRequest
from extproc.director.lifecycle import Completed
from extproc.director.response import ChargeUser, CountResponse, PodSamples, RecordAccounting
from extproc.types import Endpoint, TokenUsage
from tests._clock import ManualClock
from tests.director._prepared import Parts

POD = "10.0.0.1:8000"
ROUTED = RoutedRequest(
    model="qwen3", endpoint=POD, strategy="least-request", user="ann", prompt_tokens=10
)


def record(
    *,
    status: int = 200,
    outcome: Outcome = Outcome.COMPLETE,
    usage: TokenUsage | None = None,
    start_time: float = 0.0,
    done_s: float | None = 0.4,
    routed: RoutedRequest | None = ROUTED,
    received_s: float | None = None,
) -> AccessRecord:
    return AccessRecord(
        request_id="r",
        status=status,
        outcome=outcome,
        routed=routed,
        upstream=POD,
        usage=usage if usage is not None else TokenUsage(14, 5, 0),
        start_time=start_time,
        received_s=received_s,
        upstream_sent_s=0.001,
        upstream_first_byte_s=0.002,
        first_token_s=0.101,
        upstream_done_s=done_s,
        attempts=1,
    )


def pod_samples(parts: Parts, clock: ManualClock) -> PodSamples:
    return PodSamples(
        metrics=parts.metrics, podstats=parts.podstats, inflight=parts.inflight,
        clock=clock.now, wall_clock=clock.wall,
    )  # fmt: skip


def completed(rec: AccessRecord) -> Completed:
    assert rec.routed is not None
    return Completed(rec, rec.routed, endpoint=POD, status=rec.status)


@pytest.mark.parametrize(
    ("status", "outcome", "usage", "want_status", "aborted", "unknown"),
    [
        pytest.param(200, Outcome.COMPLETE, TokenUsage(14, 5, 0), "200", 0, 0, id="ok"),
        pytest.param(200, Outcome.COMPLETE, TokenUsage(), "200", 0, 1, id="ok-usage-unknown"),
        pytest.param(0, Outcome.UPSTREAM_FAILED, TokenUsage(), "502", 1, 0, id="no-status-502"),
        pytest.param(500, Outcome.COMPLETE, TokenUsage(), "500", 0, 0, id="error-not-unknown"),
    ],
)
def test_count_response(
    status: int, outcome: Outcome, usage: TokenUsage, want_status: str, aborted: int, unknown: int
) -> None:
    parts = Parts()
    CountResponse(parts.metrics).complete(
        completed(record(status=status, outcome=outcome, usage=usage))
    )
    assert parts.sample("extproc_requests_total", status=want_status, strategy="least-request") == 1
    assert parts.sample("extproc_aborted_responses_total", model="qwen3") == aborted
    assert parts.sample("extproc_usage_unknown_total", model="qwen3") == unknown
    tokens = parts.sample("extproc_completion_tokens_total", model="qwen3", endpoint=POD)
    assert tokens == (usage.completion_tokens or 0)


@pytest.mark.parametrize(
    ("usage", "user", "want"),
    [
        # The engine counted 14 prompt tokens where the gateway charged 10 at admission.
        pytest.param(TokenUsage(14, 5, 0), "ann", 4 * 1 + 5 * 2, id="prompt-correction-and-output"),
        pytest.param(TokenUsage(None, 5, 0), "ann", 5 * 2, id="no-engine-prompt-count"),
        pytest.param(TokenUsage(8, 5, 0), "ann", 5 * 2, id="never-a-negative-correction"),
        pytest.param(TokenUsage(14, 5, 0), "", 0, id="no-user-no-charge"),
    ],
)
def test_charge_user(usage: TokenUsage, user: str, want: float) -> None:
    fairness = FairnessCounters(input_weight=1.0, output_weight=2.0)
    routed = RoutedRequest(model="qwen3", endpoint=POD, strategy="s", user=user, prompt_tokens=10)
    ChargeUser(fairness).complete(completed(record(usage=usage, routed=routed)))
    assert fairness.tokens("ann") == want


@pytest.mark.parametrize(
    ("answered_ago_s", "stalled"),
    [
        pytest.param(5.0, False, id="answered-recently"),
        pytest.param(15.0, True, id="answered-long-ago"),
    ],
)
def test_pod_samples_turn_the_records_wall_time_into_the_trackers_clock(
    answered_ago_s: float, stalled: bool
) -> None:
    clock = ManualClock()
    parts = Parts()
    inflight = InflightTracker(stats=parts.podstats, metrics=parts.metrics, clock=clock.now)
    inflight.start(Endpoint(address=POD, model="qwen3"), 10)  # held, never answered
    clock.advance(30.0)
    step = PodSamples(
        metrics=parts.metrics, podstats=parts.podstats, inflight=inflight,
        clock=clock.now, wall_clock=clock.wall,
    )  # fmt: skip
    # Another request on the pod ended `answered_ago_s` ago (its last upstream byte).
    done_s = 0.4
    rec = record(start_time=clock.wall() - answered_ago_s - done_s, done_s=done_s)
    step.complete(completed(rec))
    assert inflight.stalled(POD, 10.0) is stalled


@pytest.mark.parametrize(
    ("status", "outcome", "sampled"),
    [
        (200, Outcome.COMPLETE, True),
        (500, Outcome.COMPLETE, False),
        (200, Outcome.CLIENT_ABORTED, False),
        (200, Outcome.UPSTREAM_FAILED, False),
    ],
)
def test_pod_samples_only_complete_successes(status: int, outcome: Outcome, sampled: bool) -> None:
    clock = ManualClock()
    parts = Parts()
    step = pod_samples(parts, clock)
    step.complete(completed(record(status=status, outcome=outcome, start_time=clock.wall() - 1)))
    stats = parts.podstats.stats(POD, clock.now())
    assert stats.requests_total == (1 if sampled else 0)
    if sampled:
        assert stats.ttft_avg_s == pytest.approx(0.1)  # first token - sent upstream
        assert stats.latency_avg_s == pytest.approx(0.399)  # last byte - sent upstream


def test_record_accounting_runs_its_steps_in_order_and_maps_client_aborts_to_499() -> None:
    seen: list[tuple[str, int, str]] = []

    class Spy:
        def __init__(self, name: str) -> None:
            self.name = name

        def complete(self, done: Completed) -> None:
            seen.append((self.name, done.status, done.endpoint))

    parts = Parts()
    accounting = RecordAccounting((Spy("a"), Spy("b")), metrics=parts.metrics)
    accounting.account(record(outcome=Outcome.CLIENT_ABORTED))
    accounting.account(record(routed=None))  # unrouted: no step runs
    assert seen == [("a", 499, POD), ("b", 499, POD)]
    assert parts.sample("extproc_access_records_total", result="accounted") == 1
    assert parts.sample("extproc_access_records_total", result="unrouted") == 1


@pytest.mark.parametrize(("received_s", "count"), [(0.0004, 1), (None, 0)])
def test_pod_samples_observe_how_long_envoy_held_the_request(
    received_s: float | None, count: int
) -> None:
    """From the request's last byte in to its first byte upstream, as Envoy timed it."""
    clock = ManualClock()
    parts = Parts()
    step = pod_samples(parts, clock)
    step.complete(completed(record(start_time=clock.wall() - 1, received_s=received_s)))
    assert parts.sample("extproc_request_hold_seconds_count", model="qwen3") == count
    if count:
        hold = parts.sample("extproc_request_hold_seconds_sum", model="qwen3")
        assert hold == pytest.approx(0.0006)  # sent upstream at 1 ms


OTHER = "10.0.0.2:8000"


@pytest.mark.parametrize(
    ("records", "failing"),
    [
        pytest.param([(POD, 200, 1)] * 5, False, id="served"),
        pytest.param([(POD, 503, 1)] * 3, True, id="three-5xx-in-a-row"),
        pytest.param([(OTHER, 200, 2)] * 3, True, id="three-retried-elsewhere"),
        pytest.param([(POD, 503, 1), (POD, 503, 1), (POD, 200, 1), (POD, 503, 1)], False,
                     id="a-served-pick-clears-it"),
        pytest.param([(POD, 503, 1)] * 2, False, id="two-are-not-enough"),
        pytest.param([(POD, 404, 1)] * 4, False, id="client-errors-are-not-the-pods"),
    ],
)  # fmt: skip
def test_pod_samples_find_a_pod_whose_picks_keep_failing(
    records: list[tuple[str, int, int]], failing: bool
) -> None:
    clock = ManualClock()
    parts = Parts()
    inflight = InflightTracker(stats=parts.podstats, metrics=parts.metrics, clock=clock.now)
    step = PodSamples(
        metrics=parts.metrics, podstats=parts.podstats, inflight=inflight,
        clock=clock.now, wall_clock=clock.wall,
    )  # fmt: skip
    for upstream, status, attempts in records:
        rec = replace(record(status=status), upstream=upstream, attempts=attempts)
        step.complete(Completed(rec, ROUTED, endpoint=upstream, status=status))
    assert (POD in inflight.failing_addresses()) is failing
    assert OTHER not in inflight.failing_addresses()  # the fallback that served is fine
    clock.advance(FAILING_COOLDOWN_S + 0.1)
    assert POD not in inflight.failing_addresses()  # then it gets a request again
