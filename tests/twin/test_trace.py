"""Reading captures and plain Mooncake traces, and the prompts the twin builds from them."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from extproc.twin.fit import pods_of
from extproc.twin.trace import (
    WINDOW_TOKENS,
    CaptureError,
    PromptIds,
    load_pod_facts,
    load_requests,
    parse_requests,
)


def _line(**kw: object) -> str:
    row = {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}
    row.update(kw)
    return json.dumps(row)


def test_capture_fields_are_read_and_rows_sorted_by_arrival() -> None:
    lines = [
        _line(timestamp=2500, model="m", served_by="10.0.0.2:8000", status=200, ttft_ms=40.0,
              tpot_ms=8.0, cached_tokens=512, session="ab12", priority=3, strategy="kv-aware",
              session_answer="cd34", tokenize_ms=3.5),
        _line(timestamp=1000, hash_ids=[0, 2], endpoint="10.0.0.1:8000", tokenize_ms=-1.0),
        "",
    ]  # fmt: skip
    first, second = parse_requests(lines)
    assert (first.tokenize_s, second.tokenize_s) == pytest.approx((0.0, 0.0035))  # < 0: none
    assert (first.session_answer, second.session_answer) == (None, "cd34")
    assert (first.at_s, first.hash_ids, first.pod, first.measured) == (
        0.0, (0, 2), "10.0.0.1:8000", False,
    )  # fmt: skip
    assert second.at_s == pytest.approx(1.5)
    assert second.pod == "10.0.0.2:8000"  # served_by before the pick
    assert (second.ttft_s, second.tpot_s) == pytest.approx((0.040, 0.008))
    assert (second.session, second.priority, second.strategy) == ("ab12", 3, "kv-aware")
    assert second.measured


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{", "not JSON"),
        ("[1]", "JSON object"),
        (json.dumps({"timestamp": 0, "input_length": 5}), "missing output_length, hash_ids"),
        (_line(hash_ids=[0]), "2 non-negative integers"),
        (_line(hash_ids=[0, -1]), "non-negative"),
        (_line(input_length=0, hash_ids=[]), "input_length"),
        (_line(timestamp="soon"), "timestamp"),
    ],
)
def test_a_bad_line_is_named(row: str, message: str) -> None:
    with pytest.raises(CaptureError, match=message) as err:
        parse_requests([_line(), row], source="cap.jsonl")
    assert "cap.jsonl:2" in str(err.value)


def test_equal_windows_give_equal_tokens_and_a_partial_window_is_a_prefix() -> None:
    a, b, c = parse_requests(
        [
            _line(timestamp=0, input_length=700, hash_ids=[7, 8]),
            _line(timestamp=1, input_length=1024, hash_ids=[7, 8]),
            _line(timestamp=2, input_length=700, hash_ids=[9, 8]),
        ]
    )
    ids = PromptIds()
    pa, pb, pc = ids(a), ids(b), ids(c)
    assert (len(pa), len(pb), len(pc)) == (700, 1024, 700)
    assert pb[:700] == pa  # the partial window is the full one's prefix
    assert pc[:WINDOW_TOKENS] != pa[:WINDOW_TOKENS]  # another first window: nothing shared
    assert pc[WINDOW_TOKENS:] == pa[WINDOW_TOKENS:]  # equal ids, equal tokens
    assert PromptIds()(a) == pa  # the same on every run


def test_the_pods_cache_config_on_the_first_line_sizes_their_engines(tmp_path: Path) -> None:
    cap = tmp_path / "cap.jsonl"
    pods = {
        "10.0.0.1:8000": {"model": "m", "block_size": 32, "num_gpu_blocks": 1000},
        "10.0.0.2:8000": {"model": "m", "block_size": None, "num_gpu_blocks": True},
    }
    cap.write_text(
        _line(served_by="10.0.0.1:8000", pods=pods) + "\n" + _line(served_by="10.0.0.2:8000")
    )
    facts = load_pod_facts(cap)
    assert facts == {
        "10.0.0.1:8000": {"block_size": 32, "num_gpu_blocks": 1000},
        "10.0.0.2:8000": {},
    }
    one, two = pods_of(load_requests(cap), "m", facts)
    assert (one.block_size, one.num_gpu_blocks) == (32, 1000)
    assert (two.block_size, two.num_gpu_blocks) == (16, 8192)  # unknown: the defaults
    plain = tmp_path / "plain.jsonl"
    plain.write_text(_line() + "\n")
    assert load_pod_facts(plain) == {}
    packed = tmp_path / "cap.jsonl.gz"  # a gzipped capture reads the same
    packed.write_bytes(gzip.compress(cap.read_bytes()))
    assert load_pod_facts(packed) == facts
    assert load_requests(packed) == load_requests(cap)


def test_a_next_turn_continues_its_last_turn_prompt_and_answer() -> None:
    """Turn 2 starts with every whole window of turn 1 and names the same session: it is
    replayed as turn 1's prompt, turn 1's answer, then its own windows."""
    one, two, other = parse_requests(
        [
            _line(timestamp=0, input_length=600, output_length=50, hash_ids=[1, 2],
                  session="s1"),
            _line(timestamp=9, input_length=900, output_length=5, hash_ids=[1, 3], session="s1"),
            # Same first window, another session, the engine found only that window cached.
            _line(timestamp=20, input_length=900, output_length=5, hash_ids=[1, 4],
                  session="s2", cached_tokens=512),
        ]
    )  # fmt: skip
    assert (two.parent, two.continues) == (one.index, 650)
    assert other.parent is None and one.parent is None
    ids = PromptIds([one, two, other])
    p1, p2 = ids(one), ids(two)
    assert p2[:600] == p1 and p2[600:650] == ids.answer(one)  # the resent turn and answer
    assert len(p2) == 900 and ids(other)[:512] == p1[:512]


def test_without_a_session_the_engines_cached_count_is_the_evidence() -> None:
    def fine(*ids: int) -> dict[str, object]:
        return {"fine_ids": list(ids), "fine_tokens": 64}

    head = list(range(10))  # 10 whole 64-token windows of the first prompt (700 tokens)
    first, cont, shared = parse_requests(
        [
            _line(timestamp=0, input_length=700, output_length=80, **fine(*head, 50)),
            # Past the whole windows (640) by more than one window: its tail and its answer.
            _line(timestamp=1, input_length=1100, output_length=5, hash_ids=[0, 1, 2],
                  cached_tokens=770, **fine(*head, *range(60, 68))),
            # Only a part of the next window: a shared prefix ending mid-window, no more.
            _line(timestamp=2, input_length=1100, output_length=5, hash_ids=[0, 3, 4],
                  cached_tokens=690, **fine(*head, *range(70, 78))),
        ]
    )  # fmt: skip
    assert first.unit == 64
    assert cont.parent == first.index and cont.continues == 780
    assert shared.parent is None


def _clients_traffic(clients: int, n: int, *, gap_ms: float, seed: int) -> list[str]:
    """`clients` closed-loop clients: each sends its next request `gap_ms` after its last
    one's captured end (latencies drawn at random)."""
    import random

    rng = random.Random(seed)
    free = [(rng.uniform(0, 50), c) for c in range(clients)]  # (time it sends next, client)
    lines = []
    for i in range(n):
        free.sort()
        at, c = free.pop(0)
        latency = rng.uniform(80, 900)
        lines.append(_line(timestamp=at, latency_ms=latency, hash_ids=[i, i + 1]))
        free.append((at + latency + gap_ms * rng.uniform(0.2, 1.0), c))
    return lines


def test_closed_loop_clients_send_each_request_after_the_answer_they_waited_for() -> None:
    requests = parse_requests(_clients_traffic(12, 300, gap_ms=3.0, seed=1))
    linked = [r for r in requests if r.after is not None]
    assert len(linked) == 300 - 12  # every request but each client's first
    for r in linked:  # each waited for an earlier answer that ended just before it came
        last = requests[r.after]  # type: ignore[index]
        assert last.index < r.index and last.latency_s is not None
        assert -0.005 <= r.at_s - (last.at_s + last.latency_s) <= 0.020
    assert len({r.after for r in linked}) == len(linked)  # one next request per answer


@pytest.mark.parametrize("rate", [5.0, 40.0, 120.0])
def test_arrivals_at_random_are_not_taken_for_clients(rate: float) -> None:
    import random

    rng = random.Random(7)
    t, lines = 0.0, []
    for i in range(600):  # Poisson arrivals; at 120/s an end precedes many by under 20 ms
        t += rng.expovariate(rate) * 1000
        lines.append(_line(timestamp=t, latency_ms=rng.uniform(80, 900), hash_ids=[i, i + 1]))
    assert all(r.after is None for r in parse_requests(lines))
