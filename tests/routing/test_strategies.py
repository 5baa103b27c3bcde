"""Table-driven tests of every named strategy on constructed snapshots."""

from __future__ import annotations

import math
import random
from collections import Counter

import numpy as np
import pytest

from extproc.routing.base import PodState, PodStats, ProfileResult, RoutingRequest, Snapshot
from extproc.routing.builtin import default_registry
from extproc.routing.registry import StrategyRegistry
from extproc.types import EndpointRole
from tests.routing._builders import FakeFairness, pod, req, snap

A, B, C, D = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.4:8000"
ALL_STRATEGIES = sorted(default_registry().names())


@pytest.fixture
def registry() -> StrategyRegistry:
    return default_registry()


def route(registry: StrategyRegistry, name: str, r: RoutingRequest, s: Snapshot, seed: int = 0):  # type: ignore[no-untyped-def]
    return registry.resolve(name).route(r, s, random.Random(seed))


# (strategy, pods, request, expected pick, substring expected in reason)
CASES: list[tuple[str, list[PodState], RoutingRequest, str, str]] = [
    (
        "least-request",
        [pod(A, in_flight=3), pod(B, in_flight=1), pod(C, in_flight=2)],
        req(),
        B,
        "min in_flight",
    ),
    (
        "least-kv-cache",
        [pod(A, kv=0.5), pod(B, kv=0.9), pod(C, kv=0.2)],
        req(),
        C,
        "kv_cache_usage",
    ),
    (
        "least-kv-cache",
        [pod(A, kv=0.5), pod(B, kv=None), pod(C, kv=0.7)],
        req(),
        A,
        "unknown on 10.0.0.2",
    ),
    (
        "least-kv-cache",
        [pod(A, no_metrics=True, in_flight=2), pod(B, no_metrics=True, in_flight=0)],
        req(),
        B,
        "unknown on every pod; used least-request",
    ),
    (
        "least-busy-time",
        [
            pod(A, stats=PodStats(requests_total=5, busy_time_s=4.0)),
            pod(B, stats=PodStats(requests_total=5, busy_time_s=1.0)),
        ],
        req(),
        B,
        "busy_time",
    ),
    (
        "least-busy-time",
        [pod(A, in_flight=1), pod(B, in_flight=0)],
        req(),
        B,
        "no request finished yet",
    ),
    (
        "throughput",
        [
            pod(A, stats=PodStats(requests_total=9, throughput_tokens_per_s=900.0)),
            pod(B, stats=PodStats(requests_total=9, throughput_tokens_per_s=300.0)),
        ],
        req(),
        B,
        "throughput",
    ),
    (
        "least-latency",
        [pod(A, ttft=0.5, itl=0.01), pod(B, ttft=0.1, itl=0.05)],
        req(max_tokens=10),
        B,
        "latency",
    ),
    (
        "least-latency",
        [pod(A, ttft=0.5, itl=0.01), pod(B, ttft=0.1, itl=0.05)],
        req(max_tokens=1000),
        A,
        "latency",
    ),
    # gateway EWMAs win over engine lifetime means
    (
        "least-latency",
        [
            pod(A, ttft=0.1, itl=0.01, stats=PodStats(ttft_avg_s=2.0, tpot_avg_s=0.1)),
            pod(B, ttft=0.5, itl=0.05),
        ],
        req(max_tokens=10),
        B,
        "latency",
    ),
    ("least-latency", [pod(A, in_flight=4), pod(B, in_flight=1)], req(), B, "unknown on every pod"),
    # prefix-cache: deepest match within load bound
    (
        "prefix-cache",
        [pod(A, match=64, in_flight=1), pod(B, match=32, in_flight=0), pod(C, in_flight=1)],
        req(prompt_tokens=128),
        A,
        "prefix match 50%",
    ),
    (
        "prefix-cache",
        [pod(A), pod(B, in_flight=2), pod(C, in_flight=1)],
        req(prompt_tokens=128),
        A,
        "no prefix match",
    ),
    (
        "prefix-cache",
        [pod(A, match=128, in_flight=5)],
        req(prompt_tokens=128),
        A,
        "prefix match 100%",
    ),
    # prefix-cache-preble
    (
        "prefix-cache-preble",
        [pod(A, match=100, in_flight=1, in_flight_tokens=500), pod(B, in_flight=0)],
        req(prompt_tokens=128),
        A,
        "exploit",
    ),
    (
        "prefix-cache-preble",
        [pod(A, match=32, in_flight_tokens=50), pod(B, in_flight_tokens=0)],
        req(prompt_tokens=128),
        B,
        "explore",
    ),
    (
        "prefix-cache-preble",
        [pod(A, match=32, in_flight_tokens=0), pod(B, in_flight_tokens=60)],
        req(prompt_tokens=128),
        A,
        "explore",
    ),
    (
        "prefix-cache-preble",
        [
            pod(A, match=120, in_flight=6, in_flight_tokens=6000),
            pod(B, in_flight=1, in_flight_tokens=100),
        ],
        req(prompt_tokens=128),
        B,
        "rebalance",
    ),
    # kv-aware: cost = prefill blocks + decode blocks
    (
        "kv-aware",
        [
            pod(A, match=96, in_flight_tokens=320),
            pod(B, match=0, in_flight_tokens=0),
            pod(C, match=64, in_flight_tokens=32),
        ],
        req(prompt_tokens=128),
        C,
        "min cost",
    ),
    (
        "kv-aware",
        [pod(A, in_flight_tokens=64), pod(B, in_flight_tokens=16)],
        req(prompt_tokens=32),
        B,
        "no cached prefix on any pod",
    ),
    # higress-gpu (GAIE v0 tree)
    (
        "higress-gpu",
        [pod(A, waiting=3, kv=0.2), pod(B, waiting=0, kv=0.9), pod(C, waiting=0, kv=0.1)],
        req(),
        C,
        "low-queue",
    ),
    (
        "higress-gpu",
        [pod(A, waiting=80, kv=0.2), pod(B, waiting=60, kv=0.5)],
        req(),
        B,
        "least-queue branch",
    ),
    (
        "higress-gpu",
        [pod(A, waiting=0, kv=0.1, loras=()), pod(B, waiting=1, kv=0.5, loras=("ad",), max_lora=1)],
        req(lora="ad"),
        B,
        "low-queue",
    ),
    (
        "higress-gpu",
        [pod(A, no_metrics=True, in_flight=3), pod(B, no_metrics=True)],
        req(),
        B,
        "unknown on every pod",
    ),
    # gaie profile: queue 2, kv 2, prefix 3
    (
        "gaie",
        [pod(A, waiting=0, kv=0.1), pod(B, waiting=0, kv=0.1, match=128)],
        req(prompt_tokens=128),
        B,
        "prefix:3",
    ),
    (
        "gaie",
        [pod(A, waiting=10, kv=0.9, match=128), pod(B, waiting=0, kv=0.1, match=0)],
        req(prompt_tokens=128),
        B,
        "queue:2",
    ),
    # lora-affinity: active > free slot > waiting > none
    (
        "lora-affinity",
        [pod(A, loras=("x",), max_lora=1), pod(B, loras=("ad",), max_lora=2, waiting=5)],
        req(lora="ad"),
        B,
        "lora-affinity",
    ),
    (
        "lora-affinity",
        [pod(A, loras=("x",), max_lora=1), pod(B, loras=("y",), max_lora=2)],
        req(lora="ad"),
        B,
        "lora-affinity",
    ),
]


@pytest.mark.parametrize(("name", "pods", "r", "want", "why"), CASES)
def test_strategy_table(
    registry: StrategyRegistry,
    name: str,
    pods: list[PodState],
    r: RoutingRequest,
    want: str,
    why: str,
) -> None:
    d = route(registry, name, r, snap(*pods))
    assert d.endpoint.address == want, d.reason
    assert why in d.reason
    assert d.strategy == name
    assert sorted(e.address for e in d.ranked) == sorted(p.address for p in pods)


SHAPES = {
    "single": [pod(A)],
    "no-metrics": [pod(A, no_metrics=True), pod(B, no_metrics=True), pod(C, no_metrics=True)],
    "none-fields": [pod(A), pod(B), pod(C)],
    "mixed-stale": [
        pod(A, waiting=1, kv=0.3, running=2),
        pod(B, no_metrics=True, in_flight=4),
        pod(C, kv=0.1),
    ],
    "pd-roles": [
        pod(A, role=EndpointRole.PREFILL),
        pod(B, role=EndpointRole.DECODE),
        pod(C, role=EndpointRole.BOTH),
    ],
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("name", ALL_STRATEGIES)
def test_every_strategy_ranks_all_candidates_once(
    registry: StrategyRegistry, name: str, shape: str
) -> None:
    pods = SHAPES[shape]
    r = req(prompt_tokens=64, user="u", request_id="abc")
    d = route(registry, name, r, snap(*pods, fairness=FakeFairness({"u": 10.0})))
    ranked = [e.address for e in d.ranked]
    assert sorted(ranked) == sorted(p.address for p in pods)
    assert len(set(ranked)) == len(ranked)
    assert d.reason  # every decision explains itself


@pytest.mark.parametrize("name", ALL_STRATEGIES)
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_seeded_rng_is_deterministic(name: str) -> None:
    pods = [pod(a, in_flight=1, kv=0.5, waiting=1, running=1) for a in (A, B, C, D)]
    r = req(prompt_tokens=64, user="u")
    s = snap(*pods, fairness=FakeFairness({"u": 5000.0}))
    first = [
        default_registry().resolve(name).route(r, s, random.Random(seed)).ranked
        for seed in range(20)
    ]
    again = [
        default_registry().resolve(name).route(r, s, random.Random(seed)).ranked
        for seed in range(20)
    ]
    assert first == again


@pytest.mark.parametrize(
    "name",
    [
        "random",
        "least-request",
        "least-kv-cache",
        "power-of-two",
        "prefix-cache",
        "kv-aware",
        "higress-gpu",
        "gaie",
        "least-busy-time",
        "throughput",
        "prefix-cache-preble",
        "session-affinity",
    ],
)
def test_ties_are_broken_at_random(registry: StrategyRegistry, name: str) -> None:
    pods = [pod(a, kv=0.3, waiting=0, running=0) for a in (A, B, C, D)]
    counts = Counter(
        route(registry, name, req(prompt_tokens=32), snap(*pods), seed).endpoint.address
        for seed in range(400)
    )
    assert set(counts) == {A, B, C, D}
    assert min(counts.values()) > 40  # uniform would be 100 each


def test_round_robin_cycles_in_address_order(registry: StrategyRegistry) -> None:
    s = snap(pod(C), pod(A), pod(B))
    rr = registry.resolve("round-robin")
    picks = [rr.route(req(), s, random.Random(0)).endpoint.address for _ in range(6)]
    assert picks == [A, B, C, A, B, C]


def test_power_of_two_picks_less_loaded_of_sample(registry: StrategyRegistry) -> None:
    pods = [pod(A, in_flight=9), pod(B, in_flight=0), pod(C, in_flight=9)]
    picks = Counter(
        route(registry, "power-of-two", req(), snap(*pods), seed).endpoint.address
        for seed in range(300)
    )
    # B wins whenever it is sampled (2 of 3 pairs); A or C only when the pair is (A, C).
    assert picks[B] > 150
    assert picks[A] + picks[C] > 30


def test_prefix_cache_load_guard_stops_hot_prefix_pinning(registry: StrategyRegistry) -> None:
    # A holds the whole prefix but is far above mean + 1 stddev of in-flight requests.
    pods = [
        pod(A, match=128, in_flight=8),
        pod(B, in_flight=1),
        pod(C, in_flight=0),
        pod(D, in_flight=1),
    ]
    d = route(registry, "prefix-cache", req(prompt_tokens=128), snap(*pods))
    assert d.endpoint.address == C
    assert "every match over load bound" in d.reason


def test_prefix_cache_imbalance_restricts_to_least_loaded(registry: StrategyRegistry) -> None:
    pods = [pod(A, match=128, in_flight=3), pod(B, in_flight=12), pod(C, in_flight=3, match=16)]
    d = route(registry, "prefix-cache", req(prompt_tokens=128), snap(*pods))
    assert "load imbalance" in d.reason
    assert d.endpoint.address == A
    assert d.ranked[-1].address == B


def test_prefix_cache_threshold_param() -> None:
    reg = default_registry(params={"prefix-cache": {"match_threshold_percent": 50.0}})
    pods = [pod(A, match=32, in_flight=1), pod(B, in_flight=0)]
    d = reg.resolve("prefix-cache").route(req(prompt_tokens=128), snap(*pods), random.Random(0))
    assert d.endpoint.address == B  # 25% match is under the 50% threshold


def test_kv_aware_temperature_spreads_but_zero_does_not() -> None:
    pods = [pod(A, in_flight_tokens=0), pod(B, in_flight_tokens=16), pod(C, in_flight_tokens=32)]
    cold = default_registry().resolve("kv-aware")
    hot = default_registry(params={"kv-aware": {"temperature": 1.0}}).resolve("kv-aware")
    r = req(prompt_tokens=32)
    cold_picks = Counter(
        cold.route(r, snap(*pods), random.Random(s)).endpoint.address for s in range(300)
    )
    hot_picks = Counter(
        hot.route(r, snap(*pods), random.Random(s)).endpoint.address for s in range(300)
    )
    assert cold_picks == Counter({A: 300})
    assert set(hot_picks) == {A, B, C}
    assert hot_picks[A] > hot_picks[C]  # still prefers the cheap pod


def test_kv_aware_tie_prefers_smaller_cache(registry: StrategyRegistry) -> None:
    pods = [pod(A, cached_blocks=500), pod(B, cached_blocks=10)]
    assert route(registry, "kv-aware", req(prompt_tokens=32), snap(*pods)).endpoint.address == B


def test_kv_aware_records_cost_terms(registry: StrategyRegistry) -> None:
    d = route(
        registry, "kv-aware", req(prompt_tokens=128), snap(pod(A, match=64, in_flight_tokens=32))
    )
    assert d.scores[A] == {
        "overlap_blocks": 4.0,
        "prefill_blocks": 4.0,
        "decode_blocks": 6.0,
        "slowness": 1.0,  # no engine step times: no pod is slower
        "cost": 10.0,
        "prefill_tokens": -1.0,  # no TTFT measured yet: the whole in-flight work counts
    }
    assert "1 of 1 pods without a measured TTFT: whole load" in d.reason


# A customer's 1500-token prompt cached on A, which has 6 requests in flight (12k tokens of
# uncached prompt and output); B is idle. TTFT is measured on both.
MEASURED = PodStats(requests_total=50, ttft_avg_s=0.2, latency_avg_s=1.6)


@pytest.mark.parametrize(
    ("prefill", "pick", "decode_blocks"),
    [
        # All six are decoding (routed longer ago than A's TTFT): 12,000 * 0.05 = 600 tokens,
        # 38 blocks, and the 94 cached blocks keep the request on A.
        (0, A, 38 + 19),
        # Two were routed within A's TTFT (4,000 tokens still before their first token): a new
        # prefill waits behind them; 4,000 + 0.05 * 8,000 = 4,400 tokens, 275 blocks.
        (4_000, B, 275 + 19),
        # All six just arrived (a burst onto the cached pod): the whole load.
        (12_000, B, 750 + 19),
    ],
)
def test_kv_aware_counts_what_is_still_before_its_first_token_whole(
    registry: StrategyRegistry, prefill: int, pick: str, decode_blocks: int
) -> None:
    pods = [
        pod(A, match=1504, in_flight=6, in_flight_tokens=12_000, stats=MEASURED,
            prefill_tokens=prefill),
        pod(B, stats=MEASURED, prefill_tokens=0),
    ]  # fmt: skip
    r = req(prompt_tokens=1800)
    d = route(registry, "kv-aware", r, snap(*pods))
    assert d.endpoint.address == pick
    assert d.scores[A]["decode_blocks"] == decode_blocks
    assert d.scores[A]["prefill_tokens"] == prefill
    assert "whole load" not in d.reason
    # Dynamo's rule counts A's whole 750 in-flight blocks whatever their age, and leaves.
    assert route(registry, "kv-aware-dynamo", r, snap(*pods)).endpoint.address == B


def test_kv_aware_without_a_measured_ttft_is_dynamos_rule(registry: StrategyRegistry) -> None:
    bare = [pod(A, match=1504, in_flight=6, in_flight_tokens=12_000), pod(B)]
    d = route(registry, "kv-aware", req(prompt_tokens=1800), snap(*bare))
    assert d.endpoint.address == B and d.scores[A]["decode_blocks"] == 750 + 19


@pytest.mark.parametrize(
    ("in_flight", "prefill", "load"),
    [(12_000, 0, 600.0), (12_000, 4_000, 4_400.0), (12_000, 12_000, 12_000.0),
     (12_000, None, 12_000.0), (100, 500, 500.0)],
)  # fmt: skip
def test_load_tokens_weighs_decoding_work_at_the_decoding_weight(
    in_flight: int, prefill: int | None, load: float
) -> None:
    from extproc.routing.affinity import load_tokens

    young = math.nan if prefill is None else float(prefill)
    loads = load_tokens(np.array([float(in_flight), 0.0]), np.array([young, math.nan]))
    assert loads.tolist() == pytest.approx([load, 0.0])


def test_kv_aware_load_share_param_is_checked() -> None:
    from extproc.routing.framework import PluginConfigError

    whole = default_registry(params={"kv-aware": {"load_share": "whole"}}).resolve("kv-aware")
    pods = [
        pod(A, match=1504, in_flight_tokens=12_000, stats=MEASURED, prefill_tokens=0),
        pod(B, stats=MEASURED, prefill_tokens=0),
    ]
    assert route(default_registry(), "kv-aware", req(prompt_tokens=1800), snap(*pods)) \
        .endpoint.address == A  # fmt: skip
    assert whole.route(req(prompt_tokens=1800), snap(*pods), random.Random(0)).endpoint.address == B
    with pytest.raises(PluginConfigError, match="load_share must be one of measured, whole"):
        default_registry(params={"kv-aware": {"load_share": "half"}})


def test_vtc_maps_heavy_users_to_later_pods(registry: StrategyRegistry) -> None:
    pods = [pod(a, running=0) for a in (D, C, B, A)]  # order in the snapshot must not matter
    fair = FakeFairness({"light": 0.0, "heavy": 100_000.0})
    light = route(registry, "vtc-basic", req(user="light"), snap(*pods, fairness=fair))
    heavy = route(registry, "vtc-basic", req(user="heavy"), snap(*pods, fairness=fair))
    assert light.endpoint.address == A
    assert heavy.endpoint.address == D


def test_vtc_counter_lift_for_returning_user(registry: StrategyRegistry) -> None:
    pods = [pod(a, running=0) for a in (A, B, C, D)]
    # Idle user with 0 tokens is lifted to the active minimum (9000 -> bucket 8500 -> index ~1.06).
    fair = FakeFairness({"idle": 0.0}, minimum=9000.0)
    d = route(registry, "vtc-basic", req(user="idle"), snap(*pods, fairness=fair))
    assert d.endpoint.address == B


def test_vtc_utilization_and_missing_user(registry: StrategyRegistry) -> None:
    fair = FakeFairness({"u": 0.0})
    busy = route(
        registry,
        "vtc-basic",
        req(user="u"),
        snap(pod(A, running=100), pod(B, running=0), fairness=fair),
    )
    # A is the fairness target (+0), but saturated (+1); B is one index away (+1) and idle: tie within noise
    assert busy.scores[A]["utilization"] == 1.0
    anon = route(registry, "vtc-basic", req(), snap(pod(A, in_flight=2), pod(B), fairness=fair))
    assert anon.endpoint.address == B
    assert "no user" in anon.reason


def test_pd_splits_prefill_and_decode(registry: StrategyRegistry) -> None:
    pods = [
        pod(A, role=EndpointRole.PREFILL, match=0, in_flight=0),
        pod(B, role=EndpointRole.PREFILL, match=120, in_flight=1),
        pod(C, role=EndpointRole.DECODE, running=5, kv=0.5),
        pod(D, role=EndpointRole.DECODE, running=1, kv=0.5),
    ]
    d = route(registry, "pd", req(prompt_tokens=128), snap(*pods))
    assert d.prefill is not None and d.prefill.address == B  # cache hit outweighs one request
    assert d.endpoint.address == D
    assert [e.address for e in d.ranked][:2] == [D, C]
    # Two profiles, each ranked best first: prefill pods only, decode pods only.
    assert [p.name for p in d.profiles] == ["prefill", "decode"] and d.disaggregated
    prefill, decode = d.profiles
    assert [e.address for e in prefill.ranked] == [B, A]
    assert [e.address for e in decode.ranked] == [D, C]


def test_pd_without_prefill_pod_says_so(registry: StrategyRegistry) -> None:
    d = route(
        registry,
        "pd",
        req(),
        snap(pod(C, role=EndpointRole.DECODE), pod(D, role=EndpointRole.BOTH)),
    )
    assert d.prefill is None
    assert d.endpoint.address == C
    assert "no prefill pod" in d.reason
    # Still a P/D answer (the director counts the fallback): an empty prefill profile.
    assert d.disaggregated and d.profile("prefill") == ProfileResult("prefill", ())


def test_pd_only_prefill_pods(registry: StrategyRegistry) -> None:
    d = route(registry, "pd", req(), snap(pod(A, role=EndpointRole.PREFILL)))
    assert d.prefill is None and d.endpoint.address == A
    assert "no decode or both pod" in d.reason


def test_only_pd_answers_with_profiles(registry: StrategyRegistry) -> None:
    pods = snap(pod(A, role=EndpointRole.PREFILL), pod(B, role=EndpointRole.DECODE))
    for name in registry.names():
        d = route(registry, name, req(prompt_tokens=16), pods)
        assert d.disaggregated is (name == "pd"), name
        assert d.disaggregated is registry.resolve(name).capabilities.disaggregated


def test_profile_times_each_plugin_in_order(registry: StrategyRegistry) -> None:
    spec = {
        "filters": [{"type": "low-queue"}],
        "scorers": [{"type": "queue", "weight": 2}, {"type": "prefix", "name": "cache"}],
        "picker": {"type": "softmax"},
    }
    registry.add_profile("timed", spec)
    d = route(registry, "timed", req(prompt_tokens=16), snap(pod(A, waiting=1), pod(B)))
    assert [(r.kind, r.type_name, r.name) for r, _ in d.timings] == [
        ("filter", "low-queue", "low-queue"),
        ("scorer", "queue", "queue"),
        ("scorer", "prefix", "cache"),
        ("picker", "softmax", "softmax"),
    ]
    assert all(ns >= 0 for _, ns in d.timings)


def test_session_affinity_honours_known_and_replaces_unknown(registry: StrategyRegistry) -> None:
    pods = [pod(A, in_flight=5), pod(B, in_flight=0)]
    kept = route(registry, "session-affinity", req(session_id=A), snap(*pods))
    assert kept.endpoint.address == A and kept.session_id == A
    forged = route(registry, "session-affinity", req(session_id="203.0.113.9:80"), snap(*pods))
    assert forged.endpoint.address == B
    assert forged.session_id == B
    assert "unknown session" in forged.reason


def test_session_key_uses_rendezvous_hashing(registry: StrategyRegistry) -> None:
    pods = [pod(a) for a in (A, B, C, D)]
    picks = {
        route(
            registry,
            "session-affinity",
            req(headers={"x-aibrix-session-key": f"k{i}"}),
            snap(*pods),
            i,
        ).endpoint.address
        for i in range(40)
    }
    assert len(picks) > 1  # keys spread
    same = {
        route(
            registry,
            "session-affinity",
            req(headers={"x-aibrix-session-key": "k1"}),
            snap(*pods),
            s,
        ).endpoint.address
        for s in range(10)
    }
    assert len(same) == 1  # one key is stable regardless of rng
    # removing another pod does not move the key (rendezvous property)
    (home,) = same
    others = [p for p in pods if p.address != home][:2]
    d = route(
        registry,
        "session-affinity",
        req(headers={"x-aibrix-session-key": "k1"}),
        snap(pod(home), *others),
    )
    assert d.endpoint.address == home


def test_single_pod_every_strategy(registry: StrategyRegistry) -> None:
    for name in ALL_STRATEGIES:
        d = route(
            registry, name, req(prompt_tokens=16, user="u"), snap(pod(A), fairness=FakeFairness())
        )
        assert d.endpoint.address == A, name
