"""The vectorised path (many pods) decides exactly as the per-pod path (few pods).

Every registered strategy and profile is run twice on the same snapshot and seed: once with
the columns forced on, once forced off. Ranking, scores (as explain reads them), reason,
profiles and session must be identical, on snapshots with unknown signals, ties, P/D roles,
LoRA adapters and users.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import overload

import numpy as np
import pytest

from extproc.routing import columns
from extproc.routing.base import NO_CAPABILITIES, PodState, PodStats, RoutingRequest, Snapshot
from extproc.routing.builtin import default_registry
from extproc.routing.columns import PodColumns, PodRows, PodTable, columns_of, rank_order
from extproc.routing.framework import MaxScorePicker, Profile
from extproc.routing.signals import rank_by
from extproc.types import EndpointRole
from tests.routing._builders import FakeFairness, pod, req

REGISTRY = default_registry()
NAMES = [
    *sorted(n for n in REGISTRY.names() if n != "predicted-latency"),  # that one reads pods
    "prefix-cache:3,least-request:1",
    "queue:2,kv-cache-utilization:2,prefix:3,latency:1",
]


def _pods(n: int, rng: random.Random, *, roles: bool, sparse: bool) -> list[PodState]:
    """`n` pods with small integer signals (many ties) and, when `sparse`, missing ones."""
    out = []
    for i in range(n):
        missing = sparse and rng.random() < 0.25
        stats = (
            PodStats()
            if sparse and rng.random() < 0.3
            else PodStats(
                requests_total=rng.randint(0, 3),
                throughput_tokens_per_s=float(rng.randint(0, 4) * 100),
                busy_time_s=float(rng.randint(0, 3)),
                ttft_avg_s=rng.choice([None, 0.1, 0.2]),
                tpot_avg_s=rng.choice([None, 0.01, 0.02]),
                latency_avg_s=rng.choice([None, 1.0, 2.0]),
            )
        )
        role = rng.choice(list(EndpointRole)) if roles else EndpointRole.BOTH
        out.append(
            pod(
                f"10.0.{i // 200}.{i % 200 + 1}:8000",
                running=None if missing else float(rng.randint(0, 5)),
                waiting=None if missing else float(rng.randint(0, 6)),
                kv=None if missing else rng.choice([0.1, 0.5, 0.85, 0.9]),
                in_flight=rng.randint(0, 12),
                in_flight_tokens=rng.randint(0, 5) * 500,
                match=rng.choice([0, 0, 16, 64, 256]),
                role=role,
                loras=rng.choice([(), ("ad",), ("x", "y")]),
                max_lora=rng.choice([None, 2]),
                ttft=rng.choice([None, 0.3]),
                itl=rng.choice([None, 0.03]),
                stats=stats,
                cached_blocks=rng.randint(0, 3) * 10,
                no_metrics=sparse and rng.random() < 0.1,
            )
        )
    return out


FAIRNESS = FakeFairness({"u1": 40_000.0, "u2": 10.0}, minimum=5_000.0)


def _requests() -> list[RoutingRequest]:
    return [
        req(prompt_tokens=256, max_tokens=64, user="u1", lora="ad"),
        req(prompt_tokens=0, session_id="10.0.0.3:8000", priority=-1),
        req(prompt_tokens=100, user="u2", headers={"x-aibrix-session-key": "k"}, block_size=32),
    ]


def _outcome(name: str, r: RoutingRequest, s: Snapshot, seed: int) -> tuple[object, ...]:
    d = default_registry().resolve(name).route(r, s, random.Random(seed))
    scores = {a: dict(v) for a, v in d.scores.items()}
    return (d.ranked, scores, d.reason, d.profiles, d.session_id)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("n", "roles", "sparse"), [(40, False, False), (40, True, True), (70, False, True)]
)
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_columns_decide_as_the_per_pod_path(
    monkeypatch: pytest.MonkeyPatch, name: str, n: int, roles: bool, sparse: bool
) -> None:
    rng = random.Random(n + roles + 2 * sparse)
    pods = _pods(n, rng, roles=roles, sparse=sparse)
    fairness = FAIRNESS
    for r in _requests():
        for seed in range(3):
            s = Snapshot(now=1.0, pods=tuple(pods), fairness=fairness)
            monkeypatch.setattr(columns, "VECTOR_MIN_PODS", 10**9)
            per_pod = _outcome(name, r, s, seed)
            monkeypatch.setattr(columns, "VECTOR_MIN_PODS", 1)
            vector = _outcome(
                name, r, Snapshot(now=1.0, pods=PodRows(pods), fairness=fairness), seed
            )
            assert vector == per_pod, (name, r, seed)


def test_unknown_signals_are_nan_and_columns_are_kept_on_rows() -> None:
    pods = PodRows(
        [pod("10.0.0.1:8000", waiting=2.0), pod("10.0.0.2:8000", no_metrics=True, in_flight=3)]
    )
    cols = columns_of(pods)
    assert cols is columns_of(pods)  # built once per rows
    assert cols.waiting[0] == 2.0 and np.isnan(cols.waiting[1])
    assert np.isnan(cols.kv_usage).all()
    assert cols.in_flight.tolist() == [0.0, 3.0]
    assert columns_of(tuple(pods)) is not columns_of(tuple(pods))  # a plain tuple keeps nothing


@pytest.mark.parametrize("seed", range(5))
def test_rank_order_is_rank_by_with_the_same_draws(seed: int) -> None:
    rng = random.Random(seed)
    pods = _pods(50, rng, roles=False, sparse=False)
    cols = PodColumns(pods)
    by_pods = rank_by(
        pods, lambda p: (float(p.in_flight), float(p.in_flight_tokens)), random.Random(seed)
    )
    by_cols = cols.take(rank_order([cols.in_flight, cols.in_flight_tokens], random.Random(seed)))
    assert by_cols == by_pods


class _CountingTable(PodTable):
    """A `PodTable` over ready rows that counts the rows read (the director's table builds a
    `PodState` per row read); its columns come from the rows without reading them here."""

    def __init__(self, pods: list[PodState]) -> None:
        self._pods = pods
        self._columns = PodColumns(PodRows(pods))
        self.read: set[int] = set()

    @property
    def columns(self) -> PodColumns:
        return self._columns

    def __len__(self) -> int:
        return len(self._pods)

    @overload
    def __getitem__(self, i: int) -> PodState: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[PodState]: ...

    def __getitem__(self, i: int | slice) -> PodState | Sequence[PodState]:
        if isinstance(i, slice):
            return [self[j] for j in range(len(self._pods))[i]]
        self.read.add(i % len(self._pods))
        return self._pods[i]


# Rules whose decision over a table reads at most a few rows (the pick and what the reason
# names); the others read none. Explain reads the rest, lazily.
_ROWS_READ = {"power-of-two": 2}


@pytest.mark.parametrize("name", NAMES)
def test_a_table_decides_as_rows_and_reads_no_row_it_does_not_need(
    monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    rng = random.Random(11)
    pods = _pods(70, rng, roles=False, sparse=False)  # every signal known: no reason names pods
    monkeypatch.setattr(columns, "VECTOR_MIN_PODS", 1)
    for r in _requests():
        for seed in range(2):
            rows = (
                default_registry()
                .resolve(name)
                .route(
                    r, Snapshot(now=1.0, pods=PodRows(pods), fairness=FAIRNESS), random.Random(seed)
                )
            )
            table = _CountingTable(pods)
            d = (
                default_registry()
                .resolve(name)
                .route(r, Snapshot(now=1.0, pods=table, fairness=FAIRNESS), random.Random(seed))
            )
            assert (d.ranked, d.reason, d.profiles, d.session_id) == (
                rows.ranked, rows.reason, rows.profiles, rows.session_id,
            ), (name, r, seed)  # fmt: skip
            assert len(table.read) <= _ROWS_READ.get(name, 0), (name, sorted(table.read))
            scores = {a: dict(v) for a, v in d.scores.items()}  # explain reads rows lazily
            assert scores == {a: dict(v) for a, v in rows.scores.items()}


class _Fixed:
    """A scorer answering fixed values (out of range and non-finite among them)."""

    type_name = "fixed"
    capabilities = NO_CAPABILITIES

    def __init__(self, values: list[float]) -> None:
        self.name = "fixed"
        self.values = values

    def score(self, r: RoutingRequest, pods: Sequence[PodState]) -> tuple[list[float], None]:
        return self.values[: len(pods)], None


@pytest.mark.parametrize("seed", range(3))
def test_a_profile_clamps_scores_alike_on_both_paths(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    rng = random.Random(seed)
    pods = _pods(60, rng, roles=False, sparse=False)
    odd = [math.nan, math.inf, -math.inf, -3.0, 2.0, 1.0, 0.0, -0.0, 0.25]
    values = [rng.choice(odd) for _ in pods]
    prof = Profile("p", [], [(_Fixed(values), 2.0), (_Fixed(values[::-1]), 0.5)], MaxScorePicker())
    out = []
    for floor in (10**9, 1):
        monkeypatch.setattr(columns, "VECTOR_MIN_PODS", floor)
        d = prof.route(
            req(), Snapshot(now=1.0, pods=PodRows(pods), fairness=FAIRNESS), random.Random(seed)
        )
        out.append((d.ranked, {a: dict(v) for a, v in d.scores.items()}))
    assert out[0] == out[1]
    assert all(0.0 <= s["fixed"] <= 1.0 for s in out[1][1].values())
