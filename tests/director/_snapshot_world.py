"""A world of real trackers and indexes, and the snapshot the director builds from it (the
`SnapshotTable`) beside the rows an oracle reads pod by pod from the same trackers."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from extproc.accounting.inflight import InflightTracker, Load
from extproc.accounting.podstats import PodStatsTracker
from extproc.director.snapshot import pod_states
from extproc.kvcache.approx import ApproximateIndex
from extproc.kvcache.exact import ExactIndex
from extproc.kvcache.hashing import block_hashes
from extproc.kvcache.prefix import IndexMode, PrefixIndex
from extproc.routing.base import Capabilities, PodState, PodStats
from extproc.routing.columns import PodRows
from extproc.types import Endpoint, EngineMetrics

BS = 4
ALL = Capabilities(prompt_tokens=True, prefix_matches=True, accounting=True)


class Fairness:
    def tokens(self, user: str) -> float:
        return 500.0

    def active_min(self) -> float:
        return 100.0


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
    """`world`'s snapshot of `candidates`: the director's `SnapshotTable`, or the oracle rows."""
    kw: dict[str, Any] = dict(
        prefix=world.prefix,
        block_hashes=world.hashes if caps.needs_tokens else (),
        now=world.now,
        inflight=world.inflight,
        podstats=world.podstats,
        capabilities=caps,
    )
    if table:
        return pod_states(candidates, **kw)
    return oracle_rows(candidates, **kw)


_NO_STATS = PodStats()


def oracle_rows(
    candidates: Sequence[tuple[Endpoint, EngineMetrics]],
    *,
    prefix: PrefixIndex,
    block_hashes: Sequence[int],
    now: float,
    inflight: InflightTracker,
    podstats: PodStatsTracker,
    capabilities: Capabilities,
) -> PodRows:
    """What the table must hold, one `PodState` per candidate read pod by pod from the
    trackers' per-address answers (`load`, `stats`, `recent_tokens`, `match`)."""
    addresses = [ep.address for ep, _ in candidates]
    matches = prefix.match(addresses, block_hashes, now)
    out = []
    for ep, metrics in candidates:
        held = inflight.load(ep.address)
        match = matches[ep.address]
        stats = podstats.stats(ep.address, now) if capabilities.accounting else _NO_STATS
        ttft = stats.ttft_avg_s
        out.append(
            PodState(
                ep,
                metrics,
                held.requests,
                held.tokens,
                match.tokens,
                match.exact,
                prefix.cached_blocks(ep.address) if capabilities.prefix_matches else 0,
                stats,
                None if ttft is None else inflight.recent_tokens(ep.address, ttft),
            )
        )
    return PodRows(out)


def same_pod(a: PodState, b: PodState) -> None:
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
