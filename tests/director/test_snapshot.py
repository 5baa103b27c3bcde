"""The director's snapshot over many pods (`SnapshotTable`) holds the same pods as the one-pass
`PodRows`, row by row and column by column, and the same decision comes out of either."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from extproc.accounting.inflight import InflightTracker, Load
from extproc.accounting.podstats import PodStatsTracker
from extproc.director.snapshot import TABLE_MIN_PODS, SnapshotTable, _pod_rows, pod_at, pod_states
from extproc.kvcache.approx import ApproximateIndex
from extproc.kvcache.exact import ExactIndex
from extproc.kvcache.prefix import IndexMode, PrefixIndex
from extproc.routing.base import Capabilities, PodState, RoutingRequest, Snapshot
from extproc.routing.builtin import BUILTIN_PROFILES, default_plugins
from extproc.routing.columns import PodRows, PodTable, columns_of
from extproc.routing.registry import StrategyRegistry
from extproc.types import Endpoint, EngineMetrics

BS = 4
ALL = Capabilities(prompt_tokens=True, prefix_matches=True, accounting=True)


class World:
    """Real trackers and indexes for `n` pods, with some of everything: leases, peers' shares,
    measured and unmeasured pods, exact and approximate prefix matches."""

    def __init__(self, n: int, seed: int = 1) -> None:
        rng = random.Random(seed)
        self.now = 100.0
        self.endpoints = [
            Endpoint(address=f"10.1.{i // 200}.{i % 200}:8000", model="m") for i in range(n)
        ]
        self.candidates = [
            (
                ep,
                EngineMetrics(
                    updated_at=99.0,
                    waiting=float(rng.randint(0, 5)) if i % 7 else None,
                    kv_cache_usage=rng.random(),
                    running=float(rng.randint(0, 9)),
                ),
            )
            for i, ep in enumerate(self.endpoints)
        ]
        self.podstats = PodStatsTracker(tau=30.0)
        self.inflight = InflightTracker(clock=lambda: self.now, stats=self.podstats)
        self.leases = []
        for i, ep in enumerate(self.endpoints):
            for _ in range(rng.randint(0, 3)):  # some routed within the pod's TTFT, some not
                self.now = 100.0 - rng.random() / 2
                self.leases.append(self.inflight.start(ep, rng.randint(10, 900)))
            self.now = 100.0
            if i % 3:  # a third of the pods were never measured: `PodStats()`
                self.podstats.observe_response(
                    ep.address, now=90.0 + i % 5, latency_s=rng.random(), ttft_s=rng.random() / 4,
                    decode_s=rng.random(), tokens=rng.randint(1, 4000), completion_tokens=rng.randint(1, 50),
                )  # fmt: skip
        for lease in self.leases[::4]:
            lease.finish()
        self.inflight.set_remote("peer", {ep.address: Load(2, 300) for ep in self.endpoints[::5]})
        self.tokens = [rng.randrange(50_000) for _ in range(64)]
        from extproc.kvcache.hashing import block_hashes

        self.hashes = block_hashes(self.tokens, BS)
        exact = ExactIndex(block_size=BS)
        approx = ApproximateIndex()
        for i, ep in enumerate(self.endpoints):
            held = rng.choice([0, 0, 2, 5, len(self.hashes)])
            if held and i % 2:
                exact.stored(
                    ep.address, [i * 1000 + b for b in range(held)], None, self.tokens[: held * BS]
                )
            elif held:
                approx.record(ep.address, self.hashes[:held], 50.0)
        # AUTO: odd pods' KV events flow (exact), even pods' do not (approximate).
        self.prefix = PrefixIndex(
            mode=IndexMode.AUTO, block_size=BS, exact=exact, approximate=approx,
            events_healthy=lambda a: int(a.rsplit(".", 1)[1].split(":")[0]) % 2 == 1,
        )  # fmt: skip

    def build(self, caps: Capabilities, *, table: bool) -> Sequence[PodState]:
        return build_pods(self, caps, self.candidates, table=table)


def build_pods(
    world: Any, caps: Capabilities, candidates: Sequence[Any], *, table: bool
) -> Sequence[PodState]:
    """`world`'s snapshot of `candidates` as a `SnapshotTable` or as one-pass rows."""
    kw: dict[str, Any] = dict(
        prefix=world.prefix,
        block_hashes=world.hashes if caps.needs_tokens else (),
        now=world.now,
        inflight=world.inflight,
        podstats=world.podstats,
        capabilities=caps,
    )
    if table:
        return SnapshotTable(candidates, **kw)
    return _pod_rows(candidates, **kw)


def _same_pod(a: PodState, b: PodState) -> None:
    assert (a.endpoint, a.metrics, a.in_flight, a.in_flight_tokens) == (
        b.endpoint, b.metrics, b.in_flight, b.in_flight_tokens,
    )  # fmt: skip
    assert (a.prefix_match_tokens, a.prefix_exact, a.cached_blocks, a.prefill_tokens) == (
        b.prefix_match_tokens, b.prefix_exact, b.cached_blocks, b.prefill_tokens,
    )  # fmt: skip
    sa, sb = a.stats, b.stats
    assert sa.requests_total == sb.requests_total
    assert sa.throughput_tokens_per_s == pytest.approx(sb.throughput_tokens_per_s, rel=1e-12)
    assert sa.busy_time_s == pytest.approx(sb.busy_time_s, rel=1e-12)
    for field in ("ttft_avg_s", "tpot_avg_s", "latency_avg_s"):
        assert getattr(sa, field) == getattr(sb, field)


CAPS = [
    Capabilities(),
    Capabilities(prompt_tokens=True, prefix_matches=True),
    Capabilities(accounting=True),
    ALL,
]


@pytest.mark.parametrize("caps", CAPS, ids=["load", "prefix", "accounting", "all"])
def test_table_rows_equal_one_pass_rows(caps: Capabilities) -> None:
    world = World(130)
    rows = world.build(caps, table=False)
    table = world.build(caps, table=True)
    assert len(table) == len(rows) == 130
    assert any(p.prefix_match_tokens for p in rows) or not caps.prefix_matches
    assert any(p.stats.requests_total for p in rows) or not caps.accounting
    prefill = [p.prefill_tokens for p in rows]
    if caps.accounting:  # measured pods: some of their load routed within TTFT, some not
        assert (
            None in prefill
            and any(prefill)
            and any(
                p.prefill_tokens is not None and 0 < p.prefill_tokens < p.in_flight_tokens
                for p in rows
            )
        )
    else:
        assert set(prefill) == {None}
    for i in (0, 7, 129, -1, -130):  # single reads, before the whole table is built
        _same_pod(table[i], rows[i])
    first = table[0]
    assert next(iter(table)) is first  # a row read once is the row every reader sees
    for a, b in zip(table, rows, strict=True):
        _same_pod(a, b)
    assert [p.address for p in table[3:9]] == [p.address for p in rows[3:9]]
    with pytest.raises(IndexError):
        table[130]


@pytest.mark.parametrize("caps", CAPS, ids=["load", "prefix", "accounting", "all"])
def test_table_columns_equal_row_columns(caps: Capabilities) -> None:
    world = World(130, seed=3)
    rows = columns_of(PodRows(world.build(caps, table=False)))
    cols = columns_of(world.build(caps, table=True))
    for name in (
        "in_flight", "in_flight_tokens", "prefix_match_tokens", "cached_blocks", "waiting",
        "kv_usage", "has_metrics", "requests_total", "throughput", "busy_time", "stats_ttft",
        "stats_tpot", "stats_latency", "prefill_tokens",
    ):  # fmt: skip
        np.testing.assert_allclose(
            getattr(cols, name), getattr(rows, name), rtol=1e-12, err_msg=name
        )
    assert cols.addresses == rows.addresses
    assert cols.address(5) == rows.address(5)


def test_pod_states_switches_to_a_table_at_the_threshold() -> None:
    small = World(TABLE_MIN_PODS - 1)
    big = World(TABLE_MIN_PODS)
    kw: dict[str, Any] = dict(block_hashes=(), now=100.0, capabilities=Capabilities())
    assert isinstance(
        pod_states(
            small.candidates,
            prefix=small.prefix,
            inflight=small.inflight,
            podstats=small.podstats,
            **kw,
        ),
        PodRows,
    )
    assert isinstance(
        pod_states(
            big.candidates, prefix=big.prefix, inflight=big.inflight, podstats=big.podstats, **kw
        ),
        PodTable,
    )


def test_the_table_follows_pods_measured_and_forgotten() -> None:
    """Tables over the same candidates read the pod stats tracker's rows as they are now: a
    pod forgotten, or measured for the first time, since the last table."""
    world = World(TABLE_MIN_PODS)
    pod = world.endpoints[1].address
    assert world.build(ALL, table=True)[1].stats.requests_total > 0
    world.podstats.forget(pod)
    assert world.build(ALL, table=True)[1].stats.requests_total == 0
    world.podstats.observe_response(
        pod, now=99.0, latency_s=1.0, ttft_s=0.1, decode_s=0.9, tokens=10, completion_tokens=5
    )
    table = world.build(ALL, table=True)
    rows = world.build(ALL, table=False)
    assert table[1].stats.requests_total == 1
    for i in (0, 1, 2):
        _same_pod(table[i], rows[i])


def test_the_table_follows_leases_and_peers() -> None:
    world = World(TABLE_MIN_PODS)
    ep = world.endpoints[1]
    before = world.build(Capabilities(), table=True)[1].in_flight
    lease = world.inflight.start(ep, 50)
    world.inflight.set_remote("other", {ep.address: Load(3, 10)})
    assert world.build(Capabilities(), table=True)[1].in_flight == before + 4
    lease.finish()
    world.inflight.drop_remote("other")
    assert world.build(Capabilities(), table=True)[1].in_flight == before


class _Fairness:
    def tokens(self, user: str) -> float:
        return 500.0

    def active_min(self) -> float:
        return 100.0


def _decide(name: str, pods: Sequence[PodState], world: World, seed: int) -> object:
    reg = StrategyRegistry(default_plugins(), builtin=BUILTIN_PROFILES)
    strategy = reg.resolve(name)
    req = RoutingRequest(
        request_id="r",
        model="m",
        prompt_tokens=64,
        block_hashes=tuple(world.hashes),
        block_size=BS,
        user="u",
    )
    d = strategy.route(
        req, Snapshot(now=world.now, pods=pods, fairness=_Fairness()), random.Random(seed)
    )
    return (d.ranked, d.reason, {a: dict(s) for a, s in d.scores.items()}, d.profiles)


NAMES = sorted(StrategyRegistry(default_plugins(), builtin=BUILTIN_PROFILES).names())


@pytest.mark.parametrize("name", NAMES)
def test_every_rule_decides_the_same_on_the_table(name: str) -> None:
    world = World(TABLE_MIN_PODS + 4, seed=5)
    reg = StrategyRegistry(default_plugins(), builtin=BUILTIN_PROFILES)
    caps = reg.resolve(name).capabilities
    for seed in (1, 2):
        rows = _decide(name, world.build(caps, table=False), world, seed)
        table = _decide(name, world.build(caps, table=True), world, seed)
        assert table == rows


def test_pod_at_builds_only_the_row_it_finds() -> None:
    world = World(TABLE_MIN_PODS)
    table = world.build(ALL, table=True)
    rows = world.build(ALL, table=False)
    address = world.endpoints[TABLE_MIN_PODS - 3].address
    found = pod_at(table, address)
    assert found is not None
    _same_pod(found, rows[TABLE_MIN_PODS - 3])
    assert isinstance(table, SnapshotTable)
    assert sum(r is not None for r in table._rows) == 1
    assert pod_at(table, "10.9.9.9:1") is None
    assert pod_at(rows, address) is rows[TABLE_MIN_PODS - 3]
    assert pod_at(rows, "10.9.9.9:1") is None


def test_a_search_that_stops_early_builds_few_rows() -> None:
    world = World(TABLE_MIN_PODS)
    table = world.build(Capabilities(), table=True)
    assert isinstance(table, SnapshotTable)
    wanted = world.endpoints[2].address
    assert next(p for p in table if p.address == wanted).address == wanted
    assert sum(r is not None for r in table._rows) == 3
    assert [p.address for p in table] == [ep.address for ep in world.endpoints]
    assert None not in table._rows
