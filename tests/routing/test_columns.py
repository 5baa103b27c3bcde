"""The pods as columns: what every rule reads.

Unknown signals are NaN and a `PodRows` keeps its columns; `rank_order` sorts by its keys with
one random draw per pod as the last key; a rule over a `PodTable` (rows built on read) decides
as over rows and reads no row it does not need; a profile clamps every score into [0, 1].
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import numpy as np
import pytest

from extproc.routing.base import NO_CAPABILITIES, PodState, RoutingRequest, Snapshot
from extproc.routing.builtin import default_registry
from extproc.routing.columns import PodColumns, PodRows, columns_of, rank_order
from extproc.routing.framework import MaxScorePicker, Profile
from tests.routing._builders import FakeFairness, RowTable, pod, random_pods, req

REGISTRY = default_registry()
NAMES = [
    *sorted(n for n in REGISTRY.names() if n != "predicted-latency"),  # that one reads pods
    "prefix-cache:3,least-request:1",
    "queue:2,kv-cache-utilization:2,prefix:3,latency:1",
]


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
def test_rank_order_sorts_by_its_keys_and_one_draw_per_pod(seed: int) -> None:
    rng = random.Random(seed)
    pods = random_pods(50, rng, roles=False, sparse=False)
    cols = PodColumns(pods)
    order = rank_order([cols.in_flight, cols.in_flight_tokens], random.Random(seed))
    draw = random.Random(seed)
    keyed = sorted((p.in_flight, p.in_flight_tokens, draw.random(), i) for i, p in enumerate(pods))
    assert order.tolist() == [i for *_, i in keyed]
    # Equal keys come out in every order across seeds (no positional bias).
    tied = [pod(f"10.0.0.{i}:8000") for i in range(4)]
    firsts = {int(rank_order([PodColumns(tied).in_flight], random.Random(s))[0]) for s in range(60)}
    assert firsts == {0, 1, 2, 3}


# Rules whose decision over a table reads at most a few rows (the pick and what the reason
# names); the others read none. Explain reads the rest, lazily.
_ROWS_READ = {"power-of-two": 2}


@pytest.mark.parametrize("name", NAMES)
def test_a_table_decides_as_rows_and_reads_no_row_it_does_not_need(name: str) -> None:
    rng = random.Random(11)
    pods = random_pods(
        70, rng, roles=False, sparse=False
    )  # every signal known: no reason names pods
    for r in _requests():
        for seed in range(2):
            rows = (
                default_registry()
                .resolve(name)
                .route(
                    r, Snapshot(now=1.0, pods=PodRows(pods), fairness=FAIRNESS), random.Random(seed)
                )
            )
            table = RowTable(pods)
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

    def __init__(self, values: list[float], name: str = "fixed") -> None:
        self.name = name
        self.values = values

    def score(self, r: RoutingRequest, pods: Sequence[PodState]) -> tuple[list[float], None]:
        return self.values[: len(pods)], None


@pytest.mark.parametrize("seed", range(3))
def test_a_profile_clamps_every_score_into_0_1(seed: int) -> None:
    rng = random.Random(seed)
    pods = random_pods(60, rng, roles=False, sparse=False)
    odd = [math.nan, math.inf, -math.inf, -3.0, 2.0, 1.0, 0.0, -0.0, 0.25]
    values = [rng.choice(odd) for _ in pods]
    prof = Profile(
        "p", [], [(_Fixed(values), 2.0), (_Fixed(values[::-1], "reversed"), 0.5)], MaxScorePicker()
    )
    d = prof.route(req(), Snapshot(now=1.0, pods=tuple(pods)), random.Random(seed))
    clamp = {math.nan: 0.0, math.inf: 0.0, -math.inf: 0.0, -3.0: 0.0, 2.0: 1.0}
    for p, raw, back in zip(pods, values, values[::-1], strict=True):
        got = d.scores[p.address]
        assert got["fixed"] == (clamp.get(raw, raw) if raw == raw else 0.0)
        assert got["reversed"] == (clamp.get(back, back) if back == back else 0.0)
        assert got["total"] == 2.0 * got["fixed"] + 0.5 * got["reversed"]
    totals = [d.scores[e.address]["total"] for e in d.ranked]
    assert totals == sorted(totals, reverse=True)  # max-score: highest total first
