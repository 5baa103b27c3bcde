"""StrategyRegistry resolution, opaque session ids, saturation and admission helpers."""

from __future__ import annotations

import base64
import random
import time
from dataclasses import dataclass
from typing import ClassVar

import pytest

from extproc.routing.base import Capabilities, Decision, RoutingRequest, Snapshot
from extproc.routing.builtin import default_plugins, default_registry
from extproc.routing.framework import PluginConfigError, Profile
from extproc.routing.registry import StrategyRegistry
from extproc.routing.saturation import SaturationConfig, is_saturated, saturation
from extproc.routing.session import SessionTokens, rendezvous
from extproc.routing.strategies import StrategyPlugin
from extproc.types import BadRequest
from tests.routing._builders import pod, req, snap

A, B = "10.0.0.1:8000", "10.0.0.2:8000"

NAMES = [
    "random",
    "least-request",
    "throughput",
    "prefix-cache",
    "least-busy-time",
    "least-kv-cache",
    "least-latency",
    "prefix-cache-preble",
    "vtc-basic",
    "pd",
    "session-affinity",
    "round-robin",
    "power-of-two",
    "lora-affinity",
    "kv-aware",
    "gaie",
    "higress-gpu",
]


@pytest.mark.parametrize("name", NAMES)
def test_every_known_name_resolves(name: str) -> None:
    reg = default_registry()
    assert reg.resolve(f"  {name} ").name == name


@pytest.mark.parametrize(
    "value", ["least_request", "LEAST-REQUEST", "", "prefix-cache:2,nope:1", "queue:abc"]
)
def test_unknown_or_bad_is_400_on_routing_strategy(value: str) -> None:
    with pytest.raises(BadRequest) as exc:
        default_registry().resolve(value)
    assert exc.value.status == 400
    assert exc.value.param == "routing-strategy"


def test_weighted_spec_builds_and_caches_profile() -> None:
    reg = default_registry()
    p1 = reg.resolve("prefix-cache:3,least-request:1")
    assert isinstance(p1, Profile)
    assert reg.resolve("prefix-cache:3,least-request:1") is p1
    d = p1.route(
        req(prompt_tokens=100), snap(pod(A, match=100, in_flight=1), pod(B)), random.Random(0)
    )
    assert d.endpoint.address == A


def test_pd_is_exclusive_in_a_spec() -> None:
    reg = default_registry()
    assert reg.resolve("prefix-cache:2,pd:1") is reg.resolve("pd")


def test_config_profiles_are_named_strategies() -> None:
    reg = default_registry(profiles={"cache-heavy": {"scorers": [{"type": "prefix", "weight": 5}]}})
    assert "cache-heavy" in reg.names()
    assert reg.resolve("cache-heavy").name == "cache-heavy"


@pytest.mark.parametrize(
    ("profiles", "needle"),
    [
        ({"gaie": {"scorers": [{"type": "queue"}]}}, "routing.profiles.gaie: name 'gaie' is"),
        ({"pd": {"scorers": [{"type": "queue"}]}}, "routing.profiles.pd: name 'pd' is"),
        ({"a,b": {"scorers": [{"type": "queue"}]}}, "routing.profiles.a,b: a profile name must"),
        (
            {"x": {"scorers": [{"type": "queue", "params": {"depth": 1}}]}},
            "routing.profiles.x.scorers[0].params.depth: unknown key (allowed: none)",
        ),
    ],
)
def test_bad_config_profiles(profiles: dict[str, dict[str, object]], needle: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        default_registry(profiles=profiles)
    assert str(err.value).startswith(needle)


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        (
            {"prefix-cache": {"imbalance": 3}},
            "routing.strategy_params.prefix-cache.imbalance: unknown key",
        ),
        ({"kv-aware": {"temperature": -1.0}}, "routing.strategy_params.kv-aware: overlap_weight"),
        ({"random": {"seed": 1}}, "routing.strategy_params.random.seed: unknown key"),
        ({"prefx-cache": {}}, "routing.strategy_params.prefx-cache: unknown strategy"),
        ({"gaie": {}}, "routing.strategy_params.gaie: unknown strategy"),  # a profile: no params
        (
            {"vtc-basic": {"max_pod_load": "lots"}},
            "routing.strategy_params.vtc-basic.max_pod_load: must be float",
        ),
    ],
)
def test_bad_strategy_params(params: dict[str, dict[str, object]], needle: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        default_registry(params=params)
    assert str(err.value).startswith(needle)


def test_strategy_params_reach_the_strategy() -> None:
    reg = default_registry(params={"kv-aware": {"temperature": 0.5}, "random": {}})
    pods = snap(pod(A, match=32), pod(B))
    d = reg.resolve("kv-aware").route(req(prompt_tokens=32), pods, random.Random(0))
    assert "T=0.5" in d.reason


PODS = [f"10.0.0.{i}:8000" for i in range(1, 9)]
SECRET = b"a shared secret"


@pytest.mark.parametrize(
    "address", ["10.0.0.1:8000", "127.0.0.1:1", "[::1]:9000", "[2001:db8::5]:65535"]
)
def test_a_token_names_its_pod_without_showing_it(address: str) -> None:
    mine, peer = SessionTokens(SECRET), SessionTokens(SECRET)  # two processes, one secret
    sid = mine.token("qwen3", address)
    assert sid.startswith("s1.") and len(sid) <= 32
    assert address not in sid and base64.b64encode(address.encode()).decode() not in sid
    raw = base64.urlsafe_b64decode(sid[3:] + "==")
    assert address.encode() not in raw
    assert peer.resolve("qwen3", sid, [*PODS, address]) == address  # any process reads it
    assert SessionTokens(b"another").token("qwen3", address) != sid  # keyed
    assert mine.token("other-model", address) != sid


def test_a_stale_forged_or_foreign_token_only_ever_picks_a_candidate() -> None:
    tokens = SessionTokens(SECRET)
    gone = tokens.token("qwen3", "10.9.9.9:8000")  # its pod left the pool
    foreign = SessionTokens(b"other gateway").token("qwen3", PODS[0])
    other_model = tokens.token("other", PODS[0])
    for value in (gone, foreign, other_model, "s1.AAAAAAAAAAAAAAAAAAAAAA", "s1."):
        pick = tokens.resolve("qwen3", value, PODS[1:])
        assert pick in PODS[1:]
        assert pick == tokens.resolve("qwen3", value, PODS[1:])  # a key like any other
    assert tokens.resolve("qwen3", _b64(PODS[0]), PODS[1:]) in PODS[1:]  # AIBrix's form


def test_an_invented_id_sticks_to_one_pod_on_every_process() -> None:
    picks = {}
    for i in range(400):
        sid = f"client-session-{i}"
        pick = SessionTokens(SECRET).resolve("qwen3", sid, PODS)
        # another process, another secret, another candidate order: the same pod
        assert SessionTokens(b"x").resolve("qwen3", sid, PODS[::-1]) == pick
        picks[sid] = pick
    assert set(picks.values()) == set(PODS)  # spread over the pool
    assert min(list(picks.values()).count(p) for p in PODS) > 20
    # A pod leaves: only its sessions move.
    left = PODS[:-1]
    for sid, pick in picks.items():
        moved = rendezvous(sid, left)
        assert moved == pick or pick == PODS[-1]


@pytest.mark.parametrize("value", [None, "", "   ", "x" * 257])
def test_no_usable_session_id(value: str | None) -> None:
    assert SessionTokens(SECRET).resolve("qwen3", value, PODS) is None
    assert SessionTokens(SECRET).resolve("qwen3", "abc", []) is None


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def test_saturation_all_over_thresholds() -> None:
    over = [pod(A, waiting=5, kv=0.1), pod(B, waiting=0, kv=0.85)]
    assert is_saturated(over)
    assert not is_saturated([*over, pod("10.0.0.3:8000", waiting=4, kv=0.79)])
    assert is_saturated(
        [pod(A, no_metrics=True), pod(B, waiting=None, kv=0.1)]
    )  # unknown counts as full
    assert is_saturated([])
    assert not is_saturated(over, SaturationConfig(queue_threshold=10, kv_threshold=0.9))


def test_saturation_level_is_gaie_mean() -> None:
    level = saturation(
        [
            pod(A, waiting=5, kv=0.4),
            pod(B, waiting=0, kv=0.2),
            pod("10.0.0.3:8000", no_metrics=True),
        ]
    )
    assert level == pytest.approx((1.0 + 0.25 + 1.0) / 3)


@dataclass(frozen=True, slots=True)
class _LatencyParams:
    horizon_s: float = 60.0


class _LatencyStore:
    """What a learned-latency strategy would read: predictions per pod, fed elsewhere."""

    def __init__(self, predicted: dict[str, float]) -> None:
        self.predicted = predicted


class _PredictedLatency(StrategyPlugin):
    type_name: ClassVar[str] = "learned-latency"
    Params: ClassVar[type] = _LatencyParams
    capabilities: ClassVar[Capabilities] = Capabilities(accounting=True)

    def __init__(self, name: str, params: _LatencyParams, store: _LatencyStore) -> None:
        super().__init__(name, params)
        self.params = params
        self.store = store

    def route(self, req: RoutingRequest, snap: Snapshot, rng: random.Random) -> Decision:
        t0 = time.perf_counter_ns()
        ranked = sorted(snap.pods, key=lambda p: self.store.predicted.get(p.address, 1e9))
        return self.decision(t0, ranked, f"min predicted latency over {self.params.horizon_s:g}s")


def test_a_strategy_with_an_injected_store_is_registered_with_a_factory() -> None:
    store = _LatencyStore({A: 0.9, B: 0.2})
    plugins = default_plugins()
    plugins.register(
        "strategy",
        _PredictedLatency,
        factory=lambda name, params: _PredictedLatency(name, params, store),
    )
    reg = StrategyRegistry(plugins, strategy_params={"learned-latency": {"horizon_s": 30}})
    strategy = reg.resolve("learned-latency")
    assert isinstance(strategy, _PredictedLatency) and strategy.store is store
    d = strategy.route(req(), snap(pod(A), pod(B)), random.Random(0))
    assert d.endpoint.address == B and d.reason == "min predicted latency over 30s"
    store.predicted[A] = 0.1  # the store learns; the same instance decides with it
    assert strategy.route(req(), snap(pod(A), pod(B)), random.Random(0)).endpoint.address == A
    with pytest.raises(PluginConfigError, match=r"learned-latency\.horizon: unknown key"):
        StrategyRegistry(plugins, strategy_params={"learned-latency": {"horizon": 30}})


def test_no_profile_may_take_the_metrics_name_of_ad_hoc_specs() -> None:
    with pytest.raises(PluginConfigError, match="'adhoc' is already used"):
        default_registry(profiles={"adhoc": {"scorers": [{"type": "queue"}]}})
