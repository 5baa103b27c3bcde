"""`PrefixIndex.lookup` (arrays over many pods) answers what `match` and `cached_blocks` do.

Random histories of stores, removals, clears, drops, records, expiry and eviction, in every
mode; then, for prompts sharing prefixes of different lengths with what the pods hold, the
arrays must equal the per-pod answers, including pods the indexes never saw.
"""

from __future__ import annotations

import random

import pytest

from extproc.kvcache import ApproximateIndex, ExactIndex, IndexMode, PrefixIndex, block_hashes

BS = 4
DOCS = [[d * 1000 + t for t in range(256)] for d in range(3)]  # 64 blocks each


def _history(
    rng: random.Random, exact: ExactIndex, approx: ApproximateIndex, pods: list[str]
) -> None:
    """Random events on both indexes; engine hashes are (pod, doc, block) so removals hit."""
    for step in range(300):
        pod = rng.choice(pods)
        p = pods.index(pod)
        doc = rng.randrange(len(DOCS))
        n = rng.choice([1, 3, 8, 9, 17, 30, 64])
        action = rng.random()
        if action < 0.45:
            engine = [(p * 10 + doc) * 100 + b for b in range(n)]
            exact.stored(pod, engine, None, DOCS[doc][: n * BS])
        elif action < 0.6:
            k = rng.randint(1, n)
            exact.removed(pod, [(p * 10 + doc) * 100 + b for b in range(n - k, n)])
        elif action < 0.65:
            exact.cleared(pod)
        elif action < 0.68:
            exact.drop_pod(pod)
            approx.drop_pod(pod)
        else:
            approx.record(pod, block_hashes(DOCS[doc][: n * BS], BS), now=float(step))


@pytest.mark.parametrize("mode", list(IndexMode))
@pytest.mark.parametrize("seed", range(6))
def test_lookup_equals_match_and_cached_blocks(mode: IndexMode, seed: int) -> None:
    rng = random.Random(seed)
    pods = [f"10.0.0.{i}:8000" for i in range(1, 80)]  # more than 64 slots: masks span words
    exact = ExactIndex(block_size=BS, max_blocks=2000)  # small enough to evict
    approx = ApproximateIndex(ttl_s=120.0, max_blocks=500, sweep_every_s=0.0)
    healthy = set(rng.sample(pods, len(pods) // 2))
    index = PrefixIndex(
        mode=mode,
        block_size=BS,
        exact=None if mode is IndexMode.APPROXIMATE else exact,
        approximate=None if mode is IndexMode.EXACT else approx,
        events_healthy=healthy.__contains__,
    )
    _history(rng, exact, approx, pods)
    asked = [*rng.sample(pods, 60), "10.9.9.9:8000"]  # a subset, in random order, and a stranger
    now = 330.0  # records from before 210 have expired
    for doc in DOCS:
        for length in (0, 1, 7, 9, 16, 33, 64):
            hashes = block_hashes(doc[: length * BS], BS)
            found = index.lookup(asked, hashes, now)
            matches = index.match(asked, hashes, now)
            assert found.tokens.tolist() == [matches[a].tokens for a in asked]
            assert found.exact.tolist() == [matches[a].exact for a in asked]
            assert found.cached_blocks.tolist() == [index.cached_blocks(a) for a in asked]
    assert any(index.lookup(asked, block_hashes(d, BS), now).tokens.any() for d in DOCS)


def test_lookup_counts_follow_each_change() -> None:
    exact = ExactIndex(block_size=BS)
    index = PrefixIndex(mode=IndexMode.EXACT, block_size=BS, exact=exact, approximate=None)
    doc = DOCS[0]
    pods = ["a", "b"]
    exact.stored("a", [1, 2, 3], None, doc[: 3 * BS])
    exact.stored("b", [7], None, doc[:BS])
    hashes = block_hashes(doc, BS)
    found = index.lookup(pods, hashes, 0.0)
    assert found.tokens.tolist() == [3 * BS, BS]
    assert found.cached_blocks.tolist() == [3, 1]
    exact.removed("a", [2])  # block 2 gone: a's match stops after block 1
    found = index.lookup(pods, hashes, 0.0)
    assert found.tokens.tolist() == [BS, BS]
    assert found.cached_blocks.tolist() == [2, 1]
    exact.drop_pod("a")
    exact.stored("c", [9, 10], None, doc[: 2 * BS])  # reuses a's slot
    found = index.lookup(["a", "b", "c"], hashes, 0.0)
    assert found.tokens.tolist() == [0, BS, 2 * BS]
    assert found.cached_blocks.tolist() == [0, 1, 2]


def test_the_same_pod_list_sees_new_and_dropped_pods() -> None:
    """A lookup over the same list of pods as the last one reuses its slots; a pod that gets
    or loses its slot in between must still be seen as it is now."""
    exact = ExactIndex(block_size=BS)
    index = PrefixIndex(mode=IndexMode.EXACT, block_size=BS, exact=exact, approximate=None)
    doc = DOCS[1]
    hashes = block_hashes(doc, BS)
    pods = ["a", "b", "c"]
    exact.stored("a", [1], None, doc[:BS])
    assert index.lookup(pods, hashes, 0.0).cached_blocks.tolist() == [1, 0, 0]
    exact.stored("c", [5, 6], None, doc[: 2 * BS])  # c gets a slot
    found = index.lookup(pods, hashes, 0.0)
    assert (found.tokens.tolist(), found.cached_blocks.tolist()) == ([BS, 0, 2 * BS], [1, 0, 2])
    exact.drop_pod("a")
    exact.stored("b", [7, 8, 9], None, doc[: 3 * BS])  # b takes a's old slot
    found = index.lookup(pods, hashes, 0.0)
    assert (found.tokens.tolist(), found.cached_blocks.tolist()) == ([0, 3 * BS, 2 * BS], [0, 3, 2])
