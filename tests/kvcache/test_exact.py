from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.kvcache import ExactIndex, block_hashes, lora_extra_key

from ._engine import EngineCache, Stored

BS = 16


def feed(index: ExactIndex, pod: str, event: Stored | None) -> None:
    if event is not None:
        index.stored(
            pod,
            event.engine_hashes,
            event.parent,
            event.token_ids,
            block_size=BS,
            lora_name=event.lora_name,
        )


def test_store_then_lookup_longest_prefix_per_pod() -> None:
    index = ExactIndex(block_size=BS)
    a, b = EngineCache(BS), EngineCache(BS)
    doc = list(range(100, 164))  # 4 blocks
    feed(index, "a:1", a.serve(doc))
    feed(index, "b:1", b.serve(doc[:32]))
    # Continuing a cached prefix: the event carries only the new blocks and a parent.
    feed(index, "b:1", b.serve(doc[:48] + [7] * 16))
    found = index.longest_prefix(block_hashes(doc + [5] * 10, BS))
    assert found == {"a:1": 4, "b:1": 3}
    assert index.longest_prefix(block_hashes(doc, BS), pods=["b:1"]) == {"b:1": 3}
    assert index.longest_prefix(block_hashes([1] * 64, BS)) == {}
    assert index.blocks_of("a:1") == set(a.cached)
    assert index.blocks_of("b:1") == set(b.cached)


def test_removed_and_cleared() -> None:
    index = ExactIndex(block_size=BS)
    eng = EngineCache(BS)
    doc = list(range(64))
    feed(index, "p", eng.serve(doc))
    removed = eng.evict(1)  # the first block: the prefix breaks at block 0
    assert index.removed("p", removed) == 1
    assert index.longest_prefix(block_hashes(doc, BS)) == {}
    assert index.blocks_of("p") == set(eng.cached)
    assert index.cleared("p") == 3
    assert index.blocks_of("p") == set()
    assert index.stats().entries == 0 and index.stats().blocks == 0


def test_unknown_parent_is_an_orphan_not_a_wrong_entry() -> None:
    index = ExactIndex(block_size=BS)
    eng = EngineCache(BS)
    eng.serve(list(range(32)))  # index never saw this
    event = eng.serve(list(range(48)))
    assert event is not None and event.parent is not None
    result = index.stored("p", event.engine_hashes, event.parent, event.token_ids)
    assert (result.stored, result.orphans) == (0, 1)
    assert index.stats().orphans == 1
    assert index.blocks_of("p") == set()


def test_lora_blocks_never_match_base_model_requests() -> None:
    index = ExactIndex(block_size=BS)
    eng = EngineCache(BS)
    doc = list(range(64))
    feed(index, "p", eng.serve(doc, lora="sql-lora"))
    assert index.longest_prefix(block_hashes(doc, BS)) == {}
    assert index.longest_prefix(block_hashes(doc, BS, lora_extra_key("other"))) == {}
    assert index.longest_prefix(block_hashes(doc, BS, lora_extra_key("sql-lora"))) == {"p": 4}


def test_non_lora_extra_keys_never_match_plain_requests() -> None:
    index = ExactIndex(block_size=BS)
    doc = list(range(32))
    index.stored("p", [11, 12], None, doc, extra_keys=[None, [["img", 0]]])
    assert index.longest_prefix(block_hashes(doc, BS)) == {"p": 1}
    index.stored("q", [21, 22], None, doc, lora_name="l", extra_keys=[["l"], ["l"]])
    assert index.longest_prefix(block_hashes(doc, BS, lora_extra_key("l"))) == {"q": 2}


def test_malformed_stores_are_rejected_and_counted() -> None:
    index = ExactIndex(block_size=BS)
    assert index.stored("p", [1, 2], None, list(range(31))).rejected == 2  # token count
    assert index.stored("p", [1], None, list(range(32)), block_size=32).rejected == 1
    assert index.stored("p", [1], None, [-5] * 16).rejected == 1
    assert index.stats().rejected == 4
    assert index.stats().entries == 0


def test_drop_pod_frees_its_bit_for_a_new_pod() -> None:
    index = ExactIndex(block_size=BS)
    doc = list(range(32))
    index.stored("old", [1, 2], None, doc)
    assert index.drop_pod("old") == 2
    index.stored("new", [3], None, doc[:16])
    assert index.longest_prefix(block_hashes(doc, BS)) == {"new": 1}
    assert index.pods() == ["new"]


def test_two_engine_hashes_for_one_router_block_need_two_removals() -> None:
    index = ExactIndex(block_size=BS)
    doc = list(range(16))
    index.stored("p", [1], None, doc)
    index.stored("p", [2], None, doc)  # e.g. an engine-side key the router does not hash
    index.removed("p", [1])
    assert index.longest_prefix(block_hashes(doc, BS)) == {"p": 1}
    index.removed("p", [2])
    assert index.longest_prefix(block_hashes(doc, BS)) == {}


def test_memory_bound_evicts_oldest_and_reports() -> None:
    index = ExactIndex(block_size=BS, max_blocks=100)
    rng = random.Random(1)
    for i in range(30):
        tokens = [rng.randrange(50_000) for _ in range(16 * 8)]
        index.stored("p", [i * 1000 + k for k in range(8)], None, tokens)
        assert index.stats().entries <= 100
    stats = index.stats()
    assert stats.evicted == 30 * 8 - stats.entries
    assert stats.bytes_estimate > 0
    # The newest stored block survives; the oldest is gone.
    assert 29 * 1000 + 7 in index.blocks_of("p")
    assert 0 not in index.blocks_of("p")


def test_memory_bound_prefers_the_pod_over_its_fair_share() -> None:
    index = ExactIndex(block_size=BS, max_blocks=64)
    index.stored("small", list(range(8)), None, list(range(8 * BS)))
    for i in range(20):
        index.stored("big", [1000 + i * 8 + k for k in range(8)], None, [i] * (8 * BS))
    assert index.pod_block_count("small") == 8


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["a", "b", "c"]),
            st.lists(st.integers(0, 3), min_size=1, max_size=6),  # token "words" -> prefix sharing
            st.sampled_from([None, None, "lora1"]),
            st.integers(0, 3),  # blocks to evict after serving
        ),
        max_size=25,
    ),
    query=st.lists(st.integers(0, 3), max_size=8),
    query_lora=st.sampled_from([None, "lora1"]),
)
def test_lookup_equals_brute_force(
    ops: list[tuple[str, list[int], str | None, int]], query: list[int], query_lora: str | None
) -> None:
    index = ExactIndex(block_size=BS)
    engines = {pod: EngineCache(BS) for pod in "abc"}
    for pod, words, lora, evict in ops:
        tokens = [w * 16 + j for w in words for j in range(16)]
        feed(index, pod, engines[pod].serve(tokens, lora))
        index.removed(pod, engines[pod].evict(evict))
    q_tokens = [w * 16 + j for w in query for j in range(16)]
    expected = {
        pod: n
        for pod, eng in engines.items()
        if (n := eng.cached_prefix_blocks(q_tokens, query_lora))
    }
    got = index.longest_prefix(block_hashes(q_tokens, BS, lora_extra_key(query_lora)))
    assert got == expected
    for pod, eng in engines.items():
        assert index.blocks_of(pod) == set(eng.cached)
    assert index.stats().orphans == 0
