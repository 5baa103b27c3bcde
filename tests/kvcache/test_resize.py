"""Index bounds changed at run time (a pool's indexes follow what its pods can cache)."""

from __future__ import annotations

import pytest

from extproc.kvcache.approx import ApproximateIndex
from extproc.kvcache.exact import ExactIndex

BS = 4


def store_chain(index: ExactIndex, pod: str, start: int, blocks: int) -> None:
    hashes = list(range(start, start + blocks))
    index.stored(pod, hashes, None, [t % 1000 for t in range(start * BS, (start + blocks) * BS)])


def test_exact_index_shrunk_evicts_at_the_next_store_and_grown_keeps_more() -> None:
    index = ExactIndex(block_size=BS, max_blocks=1000)
    store_chain(index, "a", 0, 300)
    index.resize(100)
    assert index.stats().entries == 300  # nothing happens until an insert
    store_chain(index, "a", 1000, 10)
    assert index.stats().entries <= 100
    evicted = index.stats().evicted
    assert evicted >= 210
    index.resize(500)
    store_chain(index, "b", 5000, 300)
    assert index.stats().entries == 400  # 100 kept + 300 new: within the larger bound
    assert index.stats().max_blocks == 500


def test_approximate_index_shrunk_keeps_within_the_new_bound() -> None:
    index = ApproximateIndex(ttl_s=600, max_blocks=1000)
    index.record("a", range(300), now=1.0)
    index.resize(50)
    index.record("a", range(1000, 1005), now=2.0)
    assert index.stats().entries <= 50


@pytest.mark.parametrize("bad", [0, -1])
def test_a_bound_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        ExactIndex(block_size=BS).resize(bad)
    with pytest.raises(ValueError, match="positive"):
        ApproximateIndex().resize(bad)
