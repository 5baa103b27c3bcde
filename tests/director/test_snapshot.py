"""The director's snapshot (`SnapshotTable`, columns first, at every pool size) holds the same
pods as rows read pod by pod from the same trackers, row by row and column by column, and the
same decision comes out of either."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from extproc.accounting.inflight import Load
from extproc.director.snapshot import SnapshotTable, pod_at
from extproc.routing.base import Capabilities, PodState, RoutingRequest, Snapshot
from extproc.routing.builtin import BUILTIN_PROFILES, default_plugins
from extproc.routing.columns import PodRows, columns_of
from extproc.routing.registry import StrategyRegistry
from tests.director._snapshot_world import ALL, BS, Fairness, World, same_pod

CAPS = [
    Capabilities(),
    Capabilities(prompt_tokens=True, prefix_matches=True),
    Capabilities(accounting=True),
    ALL,
]


SIZES = [1, 3, 16, 130]


@pytest.mark.parametrize("n", SIZES[:-1])
@pytest.mark.parametrize("caps", CAPS, ids=["load", "prefix", "accounting", "all"])
def test_a_small_table_holds_the_oracle_rows(caps: Capabilities, n: int) -> None:
    world = World(n, seed=n)
    table = world.build(caps, table=True)
    assert isinstance(table, SnapshotTable)
    for a, b in zip(table, world.build(caps, table=False), strict=True):
        same_pod(a, b)


@pytest.mark.parametrize("caps", CAPS, ids=["load", "prefix", "accounting", "all"])
def test_table_rows_equal_oracle_rows(caps: Capabilities) -> None:
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
        same_pod(table[i], rows[i])
    first = table[0]
    assert next(iter(table)) is first  # a row read once is the row every reader sees
    for a, b in zip(table, rows, strict=True):
        same_pod(a, b)
    assert [p.address for p in table[3:9]] == [p.address for p in rows[3:9]]
    with pytest.raises(IndexError):
        table[130]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("caps", CAPS, ids=["load", "prefix", "accounting", "all"])
def test_table_columns_equal_row_columns(caps: Capabilities, n: int) -> None:
    world = World(n, seed=3)
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
    assert cols.address(n - 1) == rows.address(n - 1)


def test_the_table_follows_pods_measured_and_forgotten() -> None:
    """Tables over the same candidates read the pod stats tracker's rows as they are now: a
    pod forgotten, or measured for the first time, since the last table."""
    world = World(32)
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
        same_pod(table[i], rows[i])


def test_the_table_follows_leases_and_peers() -> None:
    world = World(32)
    ep = world.endpoints[1]
    before = world.build(Capabilities(), table=True)[1].in_flight
    lease = world.inflight.start(ep, 50)
    world.inflight.set_remote("other", {ep.address: Load(3, 10)})
    assert world.build(Capabilities(), table=True)[1].in_flight == before + 4
    lease.finish()
    world.inflight.drop_remote("other")
    assert world.build(Capabilities(), table=True)[1].in_flight == before


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
        req, Snapshot(now=world.now, pods=pods, fairness=Fairness()), random.Random(seed)
    )
    return (d.ranked, d.reason, {a: dict(s) for a, s in d.scores.items()}, d.profiles)


NAMES = sorted(StrategyRegistry(default_plugins(), builtin=BUILTIN_PROFILES).names())


@pytest.mark.parametrize("n", [2, 5, 36])
@pytest.mark.parametrize("name", NAMES)
def test_every_rule_decides_the_same_on_the_table(name: str, n: int) -> None:
    world = World(n, seed=5)
    reg = StrategyRegistry(default_plugins(), builtin=BUILTIN_PROFILES)
    caps = reg.resolve(name).capabilities
    for seed in (1, 2):
        rows = _decide(name, world.build(caps, table=False), world, seed)
        table = _decide(name, world.build(caps, table=True), world, seed)
        assert table == rows


def test_pod_at_builds_only_the_row_it_finds() -> None:
    world = World(32)
    table = world.build(ALL, table=True)
    rows = world.build(ALL, table=False)
    address = world.endpoints[29].address
    found = pod_at(table, address)
    assert found is not None
    same_pod(found, rows[29])
    assert isinstance(table, SnapshotTable)
    assert sum(r is not None for r in table._rows) == 1
    assert pod_at(table, "10.9.9.9:1") is None
    assert pod_at(rows, address) is rows[29]
    assert pod_at(rows, "10.9.9.9:1") is None


def test_a_search_that_stops_early_builds_few_rows() -> None:
    world = World(32)
    table = world.build(Capabilities(), table=True)
    assert isinstance(table, SnapshotTable)
    wanted = world.endpoints[2].address
    assert next(p for p in table if p.address == wanted).address == wanted
    assert sum(r is not None for r in table._rows) == 3
    assert [p.address for p in table] == [ep.address for ep in world.endpoints]
    assert None not in table._rows
