from __future__ import annotations

import pytest

from extproc.kvcache import (
    ApproximateIndex,
    ExactIndex,
    IndexMode,
    PrefixIndex,
    PrefixMatch,
    block_hashes,
)

BS = 16
DOC = list(range(64))


def test_approximate_records_and_matches() -> None:
    idx = ApproximateIndex(ttl_s=100)
    idx.record("a", block_hashes(DOC, BS), now=0.0)
    idx.record("b", block_hashes(DOC[:32], BS), now=0.0)
    assert idx.longest_prefix(block_hashes(DOC, BS), now=1.0) == {"a": 4, "b": 2}
    assert idx.longest_prefix(block_hashes(DOC, BS), now=1.0, pods=["b"]) == {"b": 2}


def test_approximate_ttl_expires_unrefreshed_entries() -> None:
    idx = ApproximateIndex(ttl_s=10, sweep_every_s=0)
    idx.record("a", block_hashes(DOC, BS), now=0.0)
    idx.record("a", block_hashes(DOC[:16], BS), now=8.0)  # refreshes block 0 only
    assert idx.longest_prefix(block_hashes(DOC, BS), now=9.0) == {"a": 4}
    assert idx.longest_prefix(block_hashes(DOC, BS), now=12.0) == {"a": 1}
    assert idx.stats().expired == 3
    assert idx.longest_prefix(block_hashes(DOC, BS), now=30.0) == {}
    assert idx.stats().entries == 0


def test_approximate_capacity_evicts_least_recent() -> None:
    idx = ApproximateIndex(ttl_s=1000, max_blocks=8)
    idx.record("a", block_hashes(DOC, BS), now=0.0)
    other = list(range(1000, 1000 + 6 * BS))
    idx.record("a", block_hashes(other, BS), now=1.0)
    stats = idx.stats()
    assert stats.entries <= 8 and stats.evicted == 10 - stats.entries
    assert idx.longest_prefix(block_hashes(other, BS), now=2.0) == {"a": 6}
    assert idx.longest_prefix(block_hashes(DOC, BS), now=2.0) == {}


def test_approximate_drop_pod() -> None:
    idx = ApproximateIndex()
    idx.record("a", block_hashes(DOC, BS), now=0.0)
    idx.drop_pod("a")
    assert idx.longest_prefix(block_hashes(DOC, BS), now=0.0) == {}
    assert idx.stats().entries == 0 and idx.stats().blocks == 0


def make(mode: IndexMode, healthy: set[str]) -> tuple[PrefixIndex, ExactIndex, ApproximateIndex]:
    exact = ExactIndex(block_size=BS)
    approx = ApproximateIndex()
    index = PrefixIndex(
        mode=mode,
        block_size=BS,
        exact=exact,
        approximate=approx,
        events_healthy=healthy.__contains__,
    )
    return index, exact, approx


@pytest.mark.parametrize(
    ("mode", "healthy", "expected"),
    [
        (IndexMode.EXACT, set(), {"a": PrefixMatch(48, True), "b": PrefixMatch(0, True)}),
        (
            IndexMode.APPROXIMATE,
            {"a", "b"},
            {"a": PrefixMatch(0, False), "b": PrefixMatch(64, False)},
        ),
        (IndexMode.AUTO, {"a", "b"}, {"a": PrefixMatch(48, True), "b": PrefixMatch(0, True)}),
        (IndexMode.AUTO, {"a"}, {"a": PrefixMatch(48, True), "b": PrefixMatch(64, False)}),
        (IndexMode.AUTO, set(), {"a": PrefixMatch(0, False), "b": PrefixMatch(64, False)}),
    ],
)
def test_prefix_index_modes(
    mode: IndexMode, healthy: set[str], expected: dict[str, PrefixMatch]
) -> None:
    index, exact, _ = make(mode, healthy)
    exact.stored("a", [1, 2, 3], None, DOC[:48])  # events say: a holds 3 blocks
    index.record("b", block_hashes(DOC, BS), now=0.0)  # we routed the whole doc to b
    assert index.match(["a", "b"], block_hashes(DOC, BS), now=1.0) == expected


def test_prefix_index_requires_the_indexes_its_mode_needs() -> None:
    with pytest.raises(ValueError):
        PrefixIndex(mode=IndexMode.AUTO, block_size=BS, exact=None, approximate=ApproximateIndex())
    with pytest.raises(ValueError):
        PrefixIndex(mode=IndexMode.APPROXIMATE, block_size=BS, exact=None, approximate=None)
    with pytest.raises(ValueError):
        PrefixIndex(
            mode=IndexMode.EXACT, block_size=32, exact=ExactIndex(block_size=16), approximate=None
        )


@pytest.mark.parametrize(
    ("mode", "healthy", "expected"),
    [
        (IndexMode.EXACT, set(), {"a": 3, "b": 0}),
        (IndexMode.APPROXIMATE, {"a", "b"}, {"a": 0, "b": 4}),
        (IndexMode.AUTO, {"a", "b"}, {"a": 3, "b": 0}),
        (IndexMode.AUTO, {"a"}, {"a": 3, "b": 4}),
    ],
)
def test_cached_blocks_come_from_the_side_that_answers(
    mode: IndexMode, healthy: set[str], expected: dict[str, int]
) -> None:
    index, exact, _ = make(mode, healthy)
    exact.stored("a", [1, 2, 3], None, DOC[:48])
    index.record("b", block_hashes(DOC, BS), now=0.0)
    assert {p: index.cached_blocks(p) for p in ("a", "b")} == expected


def test_records_are_shared_only_where_the_approximate_side_answers() -> None:
    shared: list[tuple[str, list[int]]] = []
    index = PrefixIndex(
        mode=IndexMode.AUTO, block_size=BS, exact=ExactIndex(block_size=BS),
        approximate=ApproximateIndex(), events_healthy={"a"}.__contains__,
        on_record=lambda pod, hashes: shared.append((pod, list(hashes))),
    )  # fmt: skip
    hashes = block_hashes(DOC, BS)
    index.record("a", hashes, now=0.0)  # a's events flow: peers read them themselves
    index.record("b", hashes, now=0.0)
    assert shared == [("b", list(hashes))]
