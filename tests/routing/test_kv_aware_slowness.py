"""kv-aware weighs a pod's cost by how much slower its engine steps are than the fastest
candidate's (`slowness`, `slow_after`), on constructed snapshots (issue 32 #5)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from extproc.routing.affinity import slowness
from extproc.routing.base import PodState, PodStats
from extproc.routing.builtin import default_registry
from extproc.routing.framework import PluginConfigError
from tests.routing._builders import pod, req, snap

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
NAN = math.nan
STEP = 0.0075  # a healthy engine's inter-token latency (the simulator's H100 profile)


@pytest.mark.parametrize(
    ("recent", "baseline", "slow_after", "expected"),
    [
        # Equal pods, or a spread under the threshold: nobody is slower.
        ([STEP, STEP, STEP], [STEP, STEP, STEP], 2.0, [1, 1, 1]),
        ([1.5 * STEP, STEP, STEP], [STEP, STEP, STEP], 2.0, [1, 1, 1]),
        # One pod's recent steps 10x: 10.
        ([10 * STEP, STEP, STEP], [STEP, STEP, STEP], 2.0, [10, 1, 1]),
        # Peers idle (no recent gaps): their baselines say how fast they were.
        ([10 * STEP, NAN, NAN], [STEP, STEP, STEP], 2.0, [10, 1, 1]),
        # The only pod ever measured turned slow: compared with its own baseline.
        ([10 * STEP, NAN, NAN], [2 * STEP, NAN, NAN], 2.0, [5, 1, 1]),
        # A slow pod left alone (its recent value forgotten): nothing says it is slow now.
        ([NAN, STEP, STEP], [3 * STEP, STEP, STEP], 2.0, [1, 1, 1]),
        # Nothing known, or the rule off: all 1.
        ([NAN, NAN, NAN], [NAN, NAN, NAN], 2.0, [1, 1, 1]),
        ([10 * STEP, STEP, STEP], [STEP, STEP, STEP], 0.0, [1, 1, 1]),
        # A lower threshold counts a smaller gap.
        ([1.5 * STEP, STEP, STEP], [STEP, STEP, STEP], 1.2, [1.5, 1, 1]),
    ],
)
def test_slowness_against_the_fastest_candidate(
    recent: list[float], baseline: list[float], slow_after: float, expected: list[float]
) -> None:
    got = slowness(np.array(recent), np.array(baseline), slow_after)
    assert got.tolist() == pytest.approx(expected)


# The fault matrix's shape: every prompt starts with the same 640 tokens (40 of its 42 blocks),
# cached on A only; A has 8 short requests just routed there (240 tokens, whole: within its TTFT).
MEASURED = PodStats(requests_total=50, ttft_avg_s=0.02, latency_avg_s=0.03)
SHARED = req(prompt_tokens=672)


def _holder(recent: float | None, *, busy: bool = True, baseline: float = STEP) -> PodState:
    load = 240 if busy else 0
    return pod(A, match=640, in_flight=8 if busy else 0, in_flight_tokens=load,
               prefill_tokens=load, stats=MEASURED, itl_baseline=baseline,
               itl_recent=recent)  # fmt: skip


def _idle(address: str, baseline: float | None = STEP, *, queued: int = 0) -> PodState:
    return pod(address, stats=MEASURED, in_flight_tokens=queued, prefill_tokens=queued,
               itl_baseline=baseline)  # fmt: skip


@pytest.mark.parametrize(
    ("pods", "moves", "why"),
    [
        # Healthy holder: 2 + (15 + 2) = 19 blocks against 42 + 42 = 84 on a cold pod.
        ([_holder(STEP), _idle(B), _idle(C)], False, "the cache saves more than its queue costs"),
        # 1.5x slower: under slow_after, an equal.
        ([_holder(1.5 * STEP), _idle(B), _idle(C)], False, "a small spread is noise"),
        # 10x slower: 10 * (19 + 42) - 42 = 568 against 84.
        ([_holder(10 * STEP), _idle(B), _idle(C)], True, "its blocks take 10x as long"),
        # 10x slower and idle: 10 * (4 + 42) - 42 = 418 against 84: still slower.
        ([_holder(10 * STEP, busy=False), _idle(B), _idle(C)], True, "idle, still slower"),
        # ... unless the others have long queues: 84 + 400 blocks just routed = 484.
        ([_holder(10 * STEP, busy=False), _idle(B, queued=6400), _idle(C, queued=6400)], False,
         "the fast pods' queues take longer"),
        # Peers never measured: nothing says the holder is slower than them (its steps have
        # taken this long all along).
        ([_holder(10 * STEP, baseline=10 * STEP), _idle(B, None), _idle(C, None)], False,
         "no peer to compare with"),
    ],
)  # fmt: skip
def test_kv_aware_leaves_a_slow_cache_holder_when_it_is_slower_overall(
    pods: list[PodState], moves: bool, why: str
) -> None:
    d = default_registry().resolve("kv-aware").route(SHARED, snap(*pods), random.Random(0))
    assert (d.endpoint.address != A) is moves, why
    assert ("slower steps" in d.reason) is (d.scores[A]["slowness"] > 1)


def test_the_slow_pod_cost_and_reason_say_by_how_much() -> None:
    pods = [_holder(10 * STEP), _idle(B), _idle(C)]
    d = default_registry().resolve("kv-aware").route(SHARED, snap(*pods), random.Random(0))
    assert d.scores[A]["slowness"] == pytest.approx(10.0)
    assert d.scores[A]["cost"] == pytest.approx(10 * (19 + 42) - 42)
    assert d.scores[B]["slowness"] == 1.0 and d.scores[B]["cost"] == 84.0  # as without the rule
    assert f"slower steps: x10.0 on {A}" in d.reason
    assert d.ranked[-1].address == A  # still a fallback, last


@pytest.mark.parametrize(
    ("times", "keeps"),
    [
        # 2x slower: 26 + 1 * (26 + 500) = 552 against 500 + 500 = 1000 on a cold fast pod.
        (2.0, True),
        # 3x slower: 26 + 2 * 526 = 1078: the fast pod's prefill is quicker.
        (3.0, False),
    ],
)
def test_a_long_session_on_a_slower_gpu_keeps_its_cache_while_that_is_quicker(
    times: float, keeps: bool
) -> None:
    """Hetero pool: a conversation whose 7792-token history A holds, 8000 tokens this turn."""
    rule = default_registry().resolve("kv-aware")
    slow = pod(A, match=7792, stats=MEASURED, prefill_tokens=0, itl_baseline=times * STEP,
               itl_recent=times * STEP)  # fmt: skip
    d = rule.route(req(prompt_tokens=8000), snap(slow, _idle(B)), random.Random(0))
    assert (d.endpoint.address == A) is keeps


def test_a_new_session_goes_to_a_fast_pod() -> None:
    slow = pod(A, stats=MEASURED, prefill_tokens=0, itl_baseline=3 * STEP, itl_recent=3 * STEP)
    rule = default_registry().resolve("kv-aware")
    for seed in range(20):
        picked = rule.route(req(prompt_tokens=1800), snap(slow, _idle(B)), random.Random(seed))
        assert picked.endpoint.address == B


def test_kv_aware_dynamo_and_slow_after_zero_ignore_speed() -> None:
    pods = [_holder(10 * STEP), _idle(B), _idle(C)]
    for rule in (
        default_registry().resolve("kv-aware-dynamo"),
        default_registry(params={"kv-aware": {"slow_after": 0.0}}).resolve("kv-aware"),
    ):
        assert rule.route(SHARED, snap(*pods), random.Random(0)).endpoint.address == A


@pytest.mark.parametrize("bad", [0.5, -1.0])
def test_slow_after_is_checked(bad: float) -> None:
    with pytest.raises(PluginConfigError, match="slow_after must be 0"):
        default_registry(params={"kv-aware": {"slow_after": bad}})
