"""A `SnapshotTable` over the metrics store's `ReadyEndpoints` reads the store's columns (engine
signals, endpoints, adapter-set ids): it must hold the same pods and give the same decision as
rows built from the same candidates, and as a table built from the metrics objects."""

from __future__ import annotations

import random
from collections.abc import Sequence

import numpy as np
import pytest

from extproc.accounting.inflight import InflightTracker
from extproc.accounting.podstats import PodStatsTracker
from extproc.director.snapshot import SnapshotTable
from extproc.kvcache.exact import ExactIndex
from extproc.kvcache.hashing import block_hashes
from extproc.kvcache.prefix import IndexMode, PrefixIndex
from extproc.metrics.store import EndpointStore, ReadyEndpoints
from extproc.routing.base import Capabilities, PodState, RoutingRequest, Snapshot
from extproc.routing.builtin import BUILTIN_PROFILES, default_plugins
from extproc.routing.columns import PodRows, columns_of
from extproc.routing.registry import StrategyRegistry
from extproc.types import Endpoint, EndpointRole, EngineMetrics
from tests.director._snapshot_world import Fairness, build_pods

BS = 4
ALL = Capabilities(prompt_tokens=True, prefix_matches=True, accounting=True)
REGISTRY = StrategyRegistry(default_plugins(), builtin=BUILTIN_PROFILES)
NAMES = [
    *sorted(REGISTRY.names()),
    "prefix-cache:3,least-request:1",
    "queue:2,kv-cache-utilization:2,prefix:3,latency:1",
]


class StoreWorld:
    """`n` endpoints in a real `EndpointStore` (scraped with fields missing, LoRA adapter sets,
    some without a metrics URL, some stale or failing), with real trackers and an index."""

    def __init__(self, n: int, seed: int) -> None:
        rng = random.Random(seed)
        self.now = 100.0
        roles = list(EndpointRole)
        self.endpoints = [
            Endpoint(
                address=f"10.2.{i // 200}.{i % 200}:8000",
                model="m",
                role=roles[i % 3],
                metrics_url=None if i % 17 == 5 else f"http://10.2.0.{i}/metrics",
            )
            for i in range(n)
        ]
        self.store = EndpointStore(stale_after=10.0, clock=lambda: self.now)
        self.store.set_endpoints({"m": self.endpoints})
        for i, ep in enumerate(self.endpoints):
            if i % 11 == 3:
                continue  # never scraped: not ready
            self.store.record_success(
                ep,
                EngineMetrics(
                    updated_at=85.0 if i % 13 == 4 else 99.0,  # some stale at 100
                    waiting=float(rng.randint(0, 5)) if i % 7 else None,
                    running=float(rng.randint(0, 9)) if i % 5 else None,
                    kv_cache_usage=rng.choice([0.1, 0.5, 0.9]) if i % 6 else None,
                    ttft_avg_s=rng.choice([None, 0.2, 0.3]),
                    itl_avg_s=rng.choice([None, 0.02]),
                    running_lora_adapters=rng.choice([(), ("ad",), ("x", "y")]),
                    waiting_lora_adapters=rng.choice([(), ("ad",)]),
                    max_lora=rng.choice([None, 2, 3]),
                ),
            )
            if i % 19 == 2:
                self.store.record_failure(ep, "refused", unreachable=True)
        self.podstats = PodStatsTracker(tau=30.0)
        self.inflight = InflightTracker(clock=lambda: self.now, stats=self.podstats)
        self.leases = [
            self.inflight.start(ep, rng.randint(10, 900))
            for ep in self.endpoints
            for _ in range(rng.randint(0, 3))
        ]
        for i, ep in enumerate(self.endpoints):
            if i % 3:
                self.podstats.observe_response(
                    ep.address, now=95.0, latency_s=rng.random(), ttft_s=rng.random() / 4,
                    decode_s=rng.random(), tokens=rng.randint(1, 4000), completion_tokens=9,
                )  # fmt: skip
        tokens = [rng.randrange(50_000) for _ in range(64)]
        self.hashes = block_hashes(tokens, BS)
        exact = ExactIndex(block_size=BS)
        for i, ep in enumerate(self.endpoints):
            held = rng.choice([0, 2, 5, len(self.hashes)])
            if held:
                exact.stored(
                    ep.address, [i * 1000 + b for b in range(held)], None, tokens[: held * BS]
                )
        self.prefix = PrefixIndex(
            mode=IndexMode.EXACT, block_size=BS, exact=exact, approximate=None
        )

    def candidates(self) -> ReadyEndpoints:
        ready = self.store.ready("m")
        assert isinstance(ready, ReadyEndpoints)
        return ready

    def build(
        self,
        caps: Capabilities,
        candidates: Sequence[tuple[Endpoint, EngineMetrics]],
        *,
        table: bool,
    ) -> Sequence[PodState]:
        return build_pods(self, caps, candidates, table=table)


def _decide(name: str, pods: Sequence[PodState], req: RoutingRequest, seed: int) -> object:
    strategy = StrategyRegistry(default_plugins(), builtin=BUILTIN_PROFILES).resolve(name)
    d = strategy.route(  # a fresh Snapshot, so a fresh routing memory: round-robin at turn 0
        req, Snapshot(now=100.0, pods=pods, fairness=Fairness()), random.Random(seed)
    )
    return (d.ranked, d.reason, {a: dict(s) for a, s in d.scores.items()}, d.profiles)


def _requests(world: StoreWorld) -> list[RoutingRequest]:
    base = dict(request_id="r", model="m", block_hashes=tuple(world.hashes), block_size=BS)
    return [
        RoutingRequest(prompt_tokens=64, user="u", lora="ad", **base),  # type: ignore[arg-type]
        RoutingRequest(prompt_tokens=64, user="u", priority=-1, max_tokens=30, **base),  # type: ignore[arg-type]
        RoutingRequest(prompt_tokens=64, lora="zz", **base),  # type: ignore[arg-type]
    ]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_every_rule_decides_the_same_on_the_store_columns(name: str) -> None:
    world = StoreWorld(90, seed=7)
    caps = REGISTRY.resolve(name).capabilities
    ready = world.candidates()
    assert 40 < len(ready) < 90  # some pods stale, failing or never scraped
    subset = ready.keep([i % 4 != 1 for i in range(len(ready))])  # a filtered list (a gather)
    for candidates in (ready, subset):
        for req in _requests(world):
            for seed in (1, 2):
                rows = _decide(name, world.build(caps, candidates, table=False), req, seed)
                table = _decide(name, world.build(caps, candidates, table=True), req, seed)
                objects = _decide(name, world.build(caps, tuple(candidates), table=True), req, seed)
                assert table == rows
                assert objects == rows


@pytest.mark.parametrize("subset", [False, True])
def test_store_columns_equal_row_columns(subset: bool) -> None:
    world = StoreWorld(120, seed=3)
    candidates = world.candidates()
    if subset:
        candidates = candidates.keep([i % 3 != 0 for i in range(len(candidates))])
    table = world.build(ALL, candidates, table=True)
    assert isinstance(table, SnapshotTable)
    cols = columns_of(table)
    rows = columns_of(PodRows(world.build(ALL, candidates, table=False)))
    for name in ("waiting", "running", "kv_usage", "engine_ttft", "engine_itl", "has_metrics"):
        np.testing.assert_array_equal(getattr(cols, name), getattr(rows, name), err_msg=name)
    for lora in ("ad", "x", "none"):
        np.testing.assert_array_equal(cols.lora_states(lora), rows.lora_states(lora), err_msg=lora)
    assert cols.addresses == rows.addresses
    assert cols.endpoints == rows.endpoints
    order = np.array(random.Random(1).sample(range(cols.n), cols.n), dtype=np.intp)
    assert cols.endpoints_at(order) == rows.endpoints_at(order)
    for i in (0, 5, len(table) - 1):
        assert table[i] == rows.pods[i]
