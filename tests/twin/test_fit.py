"""Fitting each pod's engine to a capture: a capture made by engines of a known profile (one
pod with a 3x prefill cost, one with a 2x decode cost, a fixed path cost on every first
token) is fitted back from the simulator's defaults."""

from __future__ import annotations

import dataclasses

import pytest

from extproc.sim.config import StepTimeModel
from extproc.twin.fit import fit_pods, pods_of
from extproc.twin.replay import PodProfile, TwinSetup, replay
from tests.twin._traffic import sessions_traffic

BASE = StepTimeModel()
PATH_S = 0.004
TRUTH = (
    PodProfile("10.0.0.1:8000", "m", overhead_s=PATH_S),
    PodProfile(
        "10.0.0.2:8000", "m", overhead_s=PATH_S,
        step=dataclasses.replace(BASE, prefill_per_token_s=3 * BASE.prefill_per_token_s),
    ),
    PodProfile(
        "10.0.0.3:8000", "m", overhead_s=PATH_S,
        step=dataclasses.replace(
            BASE, overhead_s=2 * BASE.overhead_s, weights_read_s=2 * BASE.weights_read_s,
            kv_read_per_token_s=2 * BASE.kv_read_per_token_s,
        ),
    ),
)  # fmt: skip


def test_a_known_engine_profile_is_recovered() -> None:
    traffic = sessions_traffic(240, rate=6.0)
    served = replay(TwinSetup(pods=TRUTH, default_model="m"), traffic, strategy="kv-aware")
    capture = [
        dataclasses.replace(
            r, pod=s.pod, status=s.status, ttft_s=s.ttft_s, tpot_s=s.tpot_s,
            cached_tokens=s.cached_tokens, strategy="kv-aware",
        )
        for r, s in zip(traffic, served, strict=True)
    ]  # fmt: skip
    start = TwinSetup(pods=pods_of(capture, "m"), default_model="m")
    assert all(p.step == BASE and p.overhead_s == 0.0 for p in start.pods)
    report = fit_pods(capture, start)
    assert report.unfitted == []
    fitted = {p.address: p for p in report.pods}
    slow_prefill = fitted["10.0.0.2:8000"].step
    assert slow_prefill.prefill_per_token_s == pytest.approx(3 * BASE.prefill_per_token_s, rel=0.15)
    assert slow_prefill.weights_read_s == pytest.approx(BASE.weights_read_s, rel=0.15)
    slow_decode = fitted["10.0.0.3:8000"].step
    assert slow_decode.weights_read_s == pytest.approx(2 * BASE.weights_read_s, rel=0.15)
    assert slow_decode.prefill_per_token_s == pytest.approx(BASE.prefill_per_token_s, rel=0.25)
    same = fitted["10.0.0.1:8000"]
    assert same.step.prefill_per_token_s == pytest.approx(BASE.prefill_per_token_s, rel=0.1)
    assert same.overhead_s == pytest.approx(PATH_S, abs=0.002)
    for check in report.check.values():  # the fitted twin answers as the capture did
        assert check["twin_ttft_p50_ms"] == pytest.approx(check["capture_ttft_p50_ms"], rel=0.1)
        assert check["twin_tpot_p50_ms"] == pytest.approx(check["capture_tpot_p50_ms"], rel=0.1)


def test_a_pod_with_too_few_timed_requests_keeps_the_defaults() -> None:
    traffic = sessions_traffic(30, rate=2.0)
    capture = [
        dataclasses.replace(r, pod="10.0.0.1:8000", status=200, ttft_s=0.05, tpot_s=0.01)
        if r.index < 20 else dataclasses.replace(r, pod="10.0.0.2:8000")  # untimed
        for r in traffic
    ]  # fmt: skip
    report = fit_pods(
        capture, TwinSetup(pods=pods_of(capture, "m"), default_model="m"), max_rounds=1
    )
    assert report.unfitted == ["10.0.0.2:8000"]
    assert {p.address: p.step for p in report.pods}["10.0.0.2:8000"] == BASE


def test_a_pod_a_rule_shunned_gets_one_speed_from_its_few_requests() -> None:
    traffic = sessions_traffic(240, rate=6.0)
    served = replay(TwinSetup(pods=TRUTH, default_model="m"), traffic, strategy="kv-aware")
    slow = "10.0.0.3:8000"  # decode 2x: keep 5 of its timed requests only
    kept = 0
    capture = []
    for r, s in zip(traffic, served, strict=True):
        timed = s.pod != slow or kept < 5
        kept += s.pod == slow and timed
        capture.append(
            dataclasses.replace(
                r, pod=s.pod, status=s.status if timed else None, ttft_s=s.ttft_s,
                tpot_s=s.tpot_s, strategy="kv-aware",
            )
        )  # fmt: skip
    report = fit_pods(capture, TwinSetup(pods=pods_of(capture, "m"), default_model="m"))
    assert report.speed_only == [slow] and report.unfitted == []
    step = {p.address: p.step for p in report.pods}[slow]
    assert step.weights_read_s == pytest.approx(2 * BASE.weights_read_s, rel=0.3)
