"""The plugin contract, run over everything registered: a new scorer or strategy gets these
checks by being registered (extproc/routing/builtin.py), with no test of its own needed here.

Every plugin decodes default params and rejects an unknown key with its key path. Every
strategy (and every scorer, inside a one-scorer profile) decides on a table of snapshots:
it ranks exactly the candidates, is deterministic for a seed, explains itself (reason, scores,
per-plugin timing), and reads nothing it does not declare in `capabilities`.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable

import pytest

from extproc.routing.base import (
    Capabilities,
    Decision,
    PluginRef,
    PodState,
    PodStats,
    RoutingMemory,
    RoutingRequest,
    Snapshot,
    Strategy,
)
from extproc.routing.builtin import default_plugins, default_registry
from extproc.routing.framework import (
    MaxScorePicker,
    PluginConfigError,
    PluginKind,
    Profile,
    decode_params,
)
from extproc.types import EndpointRole
from tests.routing._builders import FakeFairness, pod, req, snap

PLUGINS = default_plugins()
KINDS: tuple[PluginKind, ...] = ("filter", "scorer", "picker", "strategy")
ALL_PLUGINS = [(kind, t) for kind in KINDS for t in PLUGINS.type_names(kind)]
STRATEGY_TYPES = PLUGINS.type_names("strategy")
SCORER_TYPES = PLUGINS.type_names("scorer")

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
BUSY = PodStats(requests_total=9, throughput_tokens_per_s=300.0, busy_time_s=4.0,
                ttft_avg_s=0.2, tpot_avg_s=0.02, latency_avg_s=2.0)  # fmt: skip
IDLE = PodStats(requests_total=3, throughput_tokens_per_s=50.0, busy_time_s=0.5,
                ttft_avg_s=0.05, tpot_avg_s=0.01, latency_avg_s=0.6)  # fmt: skip

# (label, request, snapshot): the situations every strategy must handle.
TABLE: list[tuple[str, RoutingRequest, Snapshot]] = [
    ("one pod", req(prompt_tokens=64), snap(pod(A, running=1, waiting=0, kv=0.2, match=32))),
    (
        "mixed load and cache",
        req(prompt_tokens=256, max_tokens=64),
        snap(
            pod(
                A,
                running=4,
                waiting=2,
                kv=0.7,
                in_flight=5,
                in_flight_tokens=900,
                match=256,
                cached_blocks=40,
                stats=BUSY,
            ),
            pod(
                B,
                running=1,
                waiting=0,
                kv=0.2,
                in_flight=1,
                in_flight_tokens=100,
                match=64,
                cached_blocks=8,
                stats=IDLE,
            ),
            pod(C, running=2, waiting=9, kv=0.9, in_flight=2, in_flight_tokens=300),
        ),
    ),
    (
        "no engine metrics",
        req(prompt_tokens=100),
        snap(pod(A, no_metrics=True, in_flight=3), pod(B, no_metrics=True, match=48)),
    ),
    (
        "prefill and decode roles",
        req(prompt_tokens=512),
        snap(
            pod(A, role=EndpointRole.PREFILL, running=1, waiting=0, kv=0.1, match=256),
            pod(B, role=EndpointRole.DECODE, running=3, waiting=1, kv=0.5, in_flight=2),
            pod(C, role=EndpointRole.BOTH, running=0, waiting=0, kv=0.3),
        ),
    ),
    (
        "lora adapters",
        req(prompt_tokens=32, lora="ad"),
        snap(
            pod(A, running=1, waiting=0, kv=0.3, loras=("ad",), max_lora=2),
            pod(B, running=0, waiting=0, kv=0.1, max_lora=2),
            pod(C, running=0, waiting=0, kv=0.1, loras=("x", "y"), max_lora=2),
        ),
    ),
    (
        "user, session and sheddable",
        req(
            prompt_tokens=80,
            user="u1",
            session_id=B,
            priority=-1,
            headers={"x-aibrix-session-key": "k"},
        ),
        snap(
            pod(A, running=2, waiting=1, kv=0.4, stats=BUSY),
            pod(B, running=1, waiting=0, kv=0.2, match=16, stats=IDLE),
            pod(C, running=0, waiting=6, kv=0.85),
            fairness=FakeFairness({"u1": 40_000.0, "u2": 10.0}, minimum=5_000.0),
        ),
    ),
]
TABLE_IDS = [label for label, _, _ in TABLE]


def _strategy(type_name: str) -> Strategy:
    """A fresh instance of the type."""
    made: Strategy = PLUGINS.create("strategy", type_name)
    return made


def _scorer_profile(type_name: str) -> Strategy:
    return Profile(type_name, [], [(PLUGINS.create("scorer", type_name), 1.0)], MaxScorePicker())


MAKERS: list[tuple[str, Callable[[], Strategy]]] = [
    *((f"strategy:{t}", lambda t=t: _strategy(t)) for t in STRATEGY_TYPES),
    *((f"scorer:{t}", lambda t=t: _scorer_profile(t)) for t in SCORER_TYPES),
    *(
        (f"named:{n}", lambda n=n: default_registry().resolve(n))
        for n in default_registry().names()
        if n not in STRATEGY_TYPES
    ),
]
MAKER_IDS = [label for label, _ in MAKERS]


def _outcome(d: Decision) -> tuple[object, ...]:
    scores = {a: dict(s) for a, s in d.scores.items()}
    return (d.ranked, scores, d.reason, d.profiles, d.session_id, d.strategy)


def _decide(make: Callable[[], Strategy], r: RoutingRequest, s: Snapshot, seed: int) -> Decision:
    """A fresh instance and a fresh routing memory (round-robin's turn): same seed, same decision."""
    return make().route(r, dataclasses.replace(s, memory=RoutingMemory()), random.Random(seed))


# ---------------------------------------------------------------- params


@pytest.mark.parametrize(("kind", "type_name"), ALL_PLUGINS)
def test_default_params_decode_and_build(kind: PluginKind, type_name: str) -> None:
    params_type = PLUGINS.params_type(kind, type_name)
    assert dataclasses.is_dataclass(params_type)
    assert params_type.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert decode_params(params_type, {}, "x") == params_type()
    plugin = PLUGINS.create(kind, type_name)
    assert plugin.name == type_name
    assert type(plugin).type_name == type_name
    assert isinstance(plugin.capabilities, Capabilities)


@pytest.mark.parametrize(("kind", "type_name"), ALL_PLUGINS)
def test_unknown_param_key_is_rejected_with_its_path(kind: PluginKind, type_name: str) -> None:
    with pytest.raises(PluginConfigError) as err:
        PLUGINS.create(kind, type_name, {"no_such_key": 1}, where="routing.profiles.p.item")
    assert str(err.value).startswith("routing.profiles.p.item.params.no_such_key: unknown key")


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_type_names_the_kind_and_the_known_types(kind: PluginKind) -> None:
    with pytest.raises(PluginConfigError) as err:
        PLUGINS.create(kind, "prefx", where="w")
    known = ", ".join(PLUGINS.type_names(kind))
    assert str(err.value) == f"w.type: unknown {kind} 'prefx' (known: {known})"


# ---------------------------------------------------------------- decisions


@pytest.mark.parametrize(("label", "make"), MAKERS, ids=MAKER_IDS)
@pytest.mark.parametrize(("case", "r", "s"), TABLE, ids=TABLE_IDS)
def test_ranks_exactly_the_candidates(
    label: str, make: Callable[[], Strategy], case: str, r: RoutingRequest, s: Snapshot
) -> None:
    d = _decide(make, r, s, seed=1)
    candidates = sorted(p.address for p in s.pods)
    assert sorted(e.address for e in d.ranked) == candidates  # each once: pick + fallbacks
    assert d.endpoint.address in candidates
    for profile in d.profiles:
        assert {e.address for e in profile.ranked} <= set(candidates)
    if d.prefill is not None:
        assert d.prefill.address in candidates


@pytest.mark.parametrize(("label", "make"), MAKERS, ids=MAKER_IDS)
@pytest.mark.parametrize(("case", "r", "s"), TABLE, ids=TABLE_IDS)
def test_state_lives_only_in_the_routing_memory(
    label: str, make: Callable[[], Strategy], case: str, r: RoutingRequest, s: Snapshot
) -> None:
    """What explain relies on: decisions on copies of the memory change nothing, so a rule
    keeps no state of its own between decisions (round-robin's turn is in RoutingMemory)."""
    strategy, memory = make(), RoutingMemory()
    live = dataclasses.replace(s, memory=memory)
    first = _outcome(strategy.route(r, live, random.Random(3)))
    for seed in range(4):  # explains: other draws, copied memory
        strategy.route(r, dataclasses.replace(s, memory=memory.copy()), random.Random(seed))
    second = _outcome(strategy.route(r, live, random.Random(4)))
    fresh = make()
    assert (
        _outcome(fresh.route(r, dataclasses.replace(s, memory=RoutingMemory()), random.Random(3)))
        == first
    )
    fresh.route(r, dataclasses.replace(s, memory=(m := RoutingMemory())), random.Random(3))
    assert _outcome(fresh.route(r, dataclasses.replace(s, memory=m), random.Random(4))) == second


@pytest.mark.parametrize(("label", "make"), MAKERS, ids=MAKER_IDS)
@pytest.mark.parametrize(("case", "r", "s"), TABLE, ids=TABLE_IDS)
def test_deterministic_for_a_seed(
    label: str, make: Callable[[], Strategy], case: str, r: RoutingRequest, s: Snapshot
) -> None:
    first = [_outcome(_decide(make, r, s, seed)) for seed in range(5)]
    again = [_outcome(_decide(make, r, s, seed)) for seed in range(5)]
    assert first == again


@pytest.mark.parametrize(("label", "make"), MAKERS, ids=MAKER_IDS)
@pytest.mark.parametrize(("case", "r", "s"), TABLE, ids=TABLE_IDS)
def test_explains_itself(
    label: str, make: Callable[[], Strategy], case: str, r: RoutingRequest, s: Snapshot
) -> None:
    strategy = make()
    d = strategy.route(r, s, random.Random(2))
    assert d.strategy == strategy.name
    assert d.reason.strip()
    assert d.timings, "each plugin says how long it took"
    assert all(isinstance(ref, PluginRef) and ns >= 0 for ref, ns in d.timings)
    for address, scores in d.scores.items():
        assert address in {p.address for p in s.pods}
        assert all(math.isfinite(v) for v in scores.values())
    kind, _, type_name = label.partition(":")
    if kind == "strategy":
        assert [ref for ref, _ in d.timings] == [PluginRef("strategy", type_name, type_name)]
    elif kind == "scorer":
        assert PluginRef("scorer", type_name, type_name) in [ref for ref, _ in d.timings]
        for p in s.pods:  # no filter: every candidate scored, each score in [0, 1]
            assert 0.0 <= d.scores[p.address][type_name] <= 1.0


# ---------------------------------------------------------------- declared capabilities


def _without_prefix(r: RoutingRequest, s: Snapshot) -> tuple[RoutingRequest, Snapshot]:
    pods = tuple(
        dataclasses.replace(p, prefix_match_tokens=0, prefix_exact=False, cached_blocks=0)
        for p in s.pods
    )
    return r, dataclasses.replace(s, pods=pods)


def _other_prompt(r: RoutingRequest, s: Snapshot) -> tuple[RoutingRequest, Snapshot]:
    n = r.prompt_tokens * 3 + 7
    return dataclasses.replace(r, prompt_tokens=n, token_ids=list(range(n)), block_hashes=(1, 2)), s


def _without_accounting(r: RoutingRequest, s: Snapshot) -> tuple[RoutingRequest, Snapshot]:
    pods: tuple[PodState, ...] = tuple(dataclasses.replace(p, stats=PodStats()) for p in s.pods)
    return r, dataclasses.replace(s, pods=pods)


def _without_fairness(r: RoutingRequest, s: Snapshot) -> tuple[RoutingRequest, Snapshot]:
    return r, dataclasses.replace(s, fairness=None)


UNDECLARED = [
    ("prefix_matches", _without_prefix),
    ("prompt_tokens", _other_prompt),
    ("accounting", _without_accounting),
    ("fairness", _without_fairness),
]


@pytest.mark.parametrize(("label", "make"), MAKERS, ids=MAKER_IDS)
@pytest.mark.parametrize(("capability", "change"), UNDECLARED, ids=[c for c, _ in UNDECLARED])
def test_reads_nothing_it_does_not_declare(
    label: str,
    make: Callable[[], Strategy],
    capability: str,
    change: Callable[[RoutingRequest, Snapshot], tuple[RoutingRequest, Snapshot]],
) -> None:
    if getattr(make().capabilities, capability):
        pytest.skip(f"declares {capability}")
    for _, r, s in TABLE:
        r2, s2 = change(r, s)
        for seed in range(3):
            assert _outcome(_decide(make, r, s, seed)) == _outcome(_decide(make, r2, s2, seed))


def test_the_contract_covers_every_named_strategy() -> None:
    # Every name a client or config can use is a registered type or a built-in profile, and
    # both are in MAKERS above: nothing routable escapes the contract.
    covered = {label.partition(":")[2] for label, _ in MAKERS if not label.startswith("scorer:")}
    assert set(default_registry().names()) == covered
    assert {"least-request", "prefix-cache", "kv-aware", "pd", "gaie"} <= covered


ODD = [math.nan, math.inf, -math.inf, -1.0, 0.0, 1e308, 3.0]


@pytest.mark.parametrize(
    "type_name",
    [t for t in SCORER_TYPES if getattr(PLUGINS.create("scorer", t), "bounded", False)],
)
def test_a_bounded_scorer_keeps_its_word_on_odd_signals(type_name: str) -> None:
    """The profile does not clamp a scorer that says `bounded`: its scores are finite and in
    [0, 1] whatever the signals (non-finite, negative, huge)."""
    scorer = PLUGINS.create("scorer", type_name)
    rng = random.Random(type_name)
    for _ in range(40):
        pods = [
            pod(
                f"10.0.0.{i}:8000",
                running=rng.choice(ODD),
                waiting=rng.choice(ODD),
                kv=rng.choice(ODD),
                in_flight=rng.choice([0, 3, 10**9]),
                match=rng.choice([0, 10, 10**9]),
                loras=rng.choice([(), ("ad",)]),
                max_lora=rng.choice([None, 1]),
                no_metrics=rng.random() < 0.2,
            )
            for i in range(rng.randint(1, 6))
        ]
        r = req(prompt_tokens=rng.choice([0, 1, 100]), lora=rng.choice([None, "ad"]),
                session_id=rng.choice([None, "10.0.0.1:8000"]))  # fmt: skip
        scores, _ = scorer.score(r, pods)
        assert len(scores) == len(pods)
        assert all(0.0 <= s <= 1.0 for s in scores), (type_name, list(scores))
