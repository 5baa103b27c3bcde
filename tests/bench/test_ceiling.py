"""The reuse ceiling (bench/ceiling.py): hand-made traces whose answer is known, and the
ceiling of a real run against what one simulator with room for everything reached."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.ceiling import (
    CeilingRequest,
    ChatEncoder,
    block_chain,
    partition_groups,
    requests_from_records,
    reuse_ceiling,
)
from bench.loadgen import Arrival, ArrivalKind, Conversation, LoadGenerator, Turn
from bench.scenario import pool_caches
from bench.stats import summarize_records
from extproc.sim import SimServer
from tests._tokenizers import fresh_tokenizer

BS = 4  # block size of the hand-made traces


def req(prompt: list[int], group: str = "g", answer: list[int] | None = None) -> CeilingRequest:
    return CeilingRequest.of(prompt, answer or [], group, BS)


A = list(range(100, 109))  # 9 tokens: 2 full blocks, both can hit ((9 - 1) // 4 = 2)
B = list(range(200, 209))


def test_block_chain_shares_exactly_the_shared_full_blocks() -> None:
    x = block_chain([1, 2, 3, 4, 5, 6, 7, 8, 9], BS)
    y = block_chain([1, 2, 3, 4, 5, 6, 7, 0, 9], BS)
    assert len(x) == 2  # the partial third block is not a block
    assert x[0] == y[0] and x[1] != y[1]
    # The same block after a different prefix is a different block (a chain, not a set).
    assert block_chain([0, 0, 0, 0, 5, 6, 7, 8], BS)[1] != block_chain([5, 6, 7, 8], BS)[0]


@pytest.mark.parametrize(
    ("prompts", "want"),
    [
        ([A, A], 8 / 18),  # the repeat hits its 2 blocks
        ([A, B], 0.0),  # nothing shared
        ([A[:8], A[:8]], 4 / 16),  # 8 tokens: the last token is recomputed, 1 block can hit
        ([A[:3], A[:3]], 0.0),  # shorter than a block
        (
            [A, A[:4] + B],
            4 / 22,
        ),  # 9 + 13 tokens; diverges in the second block: only the first hits
        ([A[:4] + B, A], 4 / 22),
    ],
)
def test_seen_counts_leading_blocks_stored_before(prompts: list[list[int]], want: float) -> None:
    c = reuse_ceiling([req(p) for p in prompts], capacity_blocks=[100], block_size=BS)
    assert c.seen == pytest.approx(want)
    assert c.capacity == pytest.approx(want)  # room for everything: capacity changes nothing


def test_answer_blocks_count_for_the_next_turn() -> None:
    # Turn 2 resends turn 1's prompt and answer: the engine cached the answer's blocks too.
    answer = [300, 301, 302, 303, 304, 305, 306]
    turn2 = A + answer + [400, 401, 402, 403, 404]
    c = reuse_ceiling([req(A, answer=answer), req(turn2)], capacity_blocks=[100], block_size=BS)
    # stored after turn 1: 16 tokens = 4 blocks; turn 2 has 21 tokens, (21 - 1) // 4 = 5 can hit.
    assert c.seen == pytest.approx(4 * BS / (9 + 21))


def test_capacity_partitions_groups_where_one_lru_thrashes() -> None:
    # A and B alternate; each stores 2 blocks.
    reqs = [req(A, "a"), req(B, "b")] * 3
    one_small = reuse_ceiling(reqs, capacity_blocks=[3], block_size=BS)
    assert one_small.seen == pytest.approx(4 * 8 / 54)  # every repeat was seen before
    assert one_small.partitioned == 0.0  # 3 blocks on one pod: each evicts the other
    assert one_small.capacity == 0.0
    two_small = reuse_ceiling(reqs, capacity_blocks=[2, 2], block_size=BS)
    assert two_small.partitioned == pytest.approx(two_small.seen)  # a pod per group
    assert two_small.pooled == pytest.approx(two_small.seen)  # 4 blocks hold both
    assert two_small.capacity == pytest.approx(two_small.seen)


def test_pooled_wins_when_groups_do_not_fit_their_pods() -> None:
    # One big group (3 prompts of 2 blocks sharing nothing but their group) and one small one:
    # partitioned, the big group's pod (4 blocks) cannot hold its 6; one pool of 8 can.
    big = [list(range(k * 10, k * 10 + 9)) for k in range(3)]
    reqs = [req(p, "big") for p in big] * 2 + [req(B, "small")] * 2
    c = reuse_ceiling(reqs, capacity_blocks=[4, 4], block_size=BS)
    assert c.partitioned < c.pooled
    assert c.capacity == c.pooled
    assert c.seen == pytest.approx(4 * 8 / (8 * 9))


def test_partition_is_largest_group_first_onto_the_lightest_pod() -> None:
    reqs = [req(A, "x")] * 3 + [req(A, "y")] * 2 + [req(A, "z")] * 2 + [req(A, "w")]
    where = partition_groups(reqs, 2)
    assert where["x"] == 0 and where["y"] == 1 and where["z"] == 1 and where["w"] == 0


def test_bad_pool_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one pod"):
        reuse_ceiling([req(A)], capacity_blocks=[], block_size=BS)


def test_pool_caches_reads_the_simulator_flags() -> None:
    cluster = {
        "sims": 3,
        "sim_args": ["--time-scale", "1.0", "--cache-blocks", "1500"],
        "sim_args_each": [[], ["--cache-blocks=700"]],
    }
    assert pool_caches(cluster) == ([1500, 700, 1500], 16)
    assert pool_caches({"sims": 2}) == ([8192, 8192], 16)
    with pytest.raises(ValueError, match="one block size"):
        pool_caches({"sims": 2, "sim_args_each": [["--block-size", "32"]]})


async def test_ceiling_of_a_real_run_is_what_one_roomy_simulator_reached(
    sim: SimServer, qwen_tokenizer_dir: Path
) -> None:
    """One pod, a cache with room for everything, one request at a time: nothing the ceiling
    leaves out (eviction, load, timing) applies, so the engine's hit rate is the ceiling."""
    system = "You are a helpful assistant for customer seven. " * 12
    convs = [
        Conversation(f"s{i}", (Turn(f"question {i} " * 15, 9), Turn("and then?", 5)), system=system)
        for i in range(3)
    ]
    gen = LoadGenerator(sim.url, model=sim.config.model, max_duration_s=30)
    result = await gen.run(convs, Arrival(ArrivalKind.CLOSED, concurrency=1))
    assert all(r.ok for r in result.records) and len(result.records) == 6
    engine = summarize_records(result.records, result.duration_s)["cache_hit_rate"]
    reqs = requests_from_records(
        result.records,
        ChatEncoder(fresh_tokenizer(qwen_tokenizer_dir)),
        group_of=lambda cid: cid,
        block_size=sim.config.block_size,
    )
    assert [r.prompt_tokens for r in reqs] == [r.prompt_tokens for r in result.records]
    c = reuse_ceiling(reqs, capacity_blocks=[sim.config.num_gpu_blocks], block_size=16)
    assert engine is not None and engine > 0.3  # the system prompt and the histories hit
    assert c.seen == pytest.approx(engine, abs=1e-3)
    assert c.capacity == pytest.approx(engine, abs=1e-3)
