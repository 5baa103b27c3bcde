"""Mooncake trace replay: the loader's checks, block text against the real Qwen3 tokenizer,
scaling and the schedule, the sample trace, and trace arrivals against a real simulator."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from bench.loadgen import Arrival, ArrivalKind, Conversation, LoadGenerator, Turn
from bench.sample_trace import DEFAULT_PATH, SampleParams, make_sample, render_jsonl
from bench.scenario import load_scenario
from bench.traces import (
    BLOCK_TOKENS,
    BlockText,
    TraceError,
    TraceRequest,
    TraceScaling,
    load_trace,
    parse_trace,
    scale_trace,
)
from bench.workloads import TextFactory, build_workload
from extproc.sim import SimServer

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ROOT / "bench" / "scenarios"
GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}'


@pytest.fixture(scope="module")
def tok(qwen_tokenizer_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(qwen_tokenizer_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def blocks(tok: Tokenizer) -> BlockText:
    return BlockText(tok)


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return list(tok.encode(text, add_special_tokens=False).ids)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _req(hash_ids: tuple[int, ...], tokens: int, block: int = BLOCK_TOKENS) -> TraceRequest:
    return TraceRequest(0, 0.0, hash_ids, block, tokens, 1)


# -- loader ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"timestamp": 0, "input_length": 600, "hash_ids": [1, 2]}', "missing output_length"),
        ('{"input_length": 600, "output_length": 1}', "missing timestamp, hash_ids"),
        (GOOD.replace('"timestamp": 0', '"timestamp": -5'), "timestamp must be a number"),
        (GOOD.replace('"timestamp": 0', '"timestamp": "0"'), "timestamp must be a number"),
        (GOOD.replace('"timestamp": 0', '"timestamp": true'), "timestamp must be a number"),
        (GOOD.replace('"input_length": 600', '"input_length": 0'), "input_length must be >= 1"),
        (GOOD.replace('"input_length": 600', '"input_length": 6.5'), "input_length must be an int"),
        (GOOD.replace('"output_length": 10', '"output_length": 0'), "output_length must be >= 1"),
        (GOOD.replace("[1, 2]", "[1, -2]"), "hash_ids must be a list of integers"),
        (GOOD.replace("[1, 2]", '"1,2"'), "hash_ids must be a list of integers"),
        (GOOD.replace("[1, 2]", "[1]"), "input_length 600 needs 2 hash_ids"),
        (GOOD.replace("[1, 2]", "[1, 2, 3]"), "input_length 600 needs 2 hash_ids"),
    ],
)
def test_bad_rows_are_rejected_naming_the_line(bad: str, message: str) -> None:
    lines = [GOOD, "", bad]  # the bad row is line 3 (blank lines are skipped, still counted)
    with pytest.raises(TraceError) as err:
        parse_trace(lines, source="t.jsonl")
    assert str(err.value).startswith("t.jsonl:3: ")
    assert message in str(err.value)


def test_rows_out_of_arrival_order_and_empty_traces_are_rejected() -> None:
    late = GOOD.replace('"timestamp": 0', '"timestamp": 900')
    with pytest.raises(TraceError, match=r"t.jsonl:2: timestamp 0 is before line 1's 900"):
        parse_trace([late, GOOD], source="t.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        parse_trace(["", "  "], source="t.jsonl")


def test_a_valid_trace_loads_with_extra_keys_ignored(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    row = json.loads(GOOD) | {"session_id": "x"}
    path.write_text(json.dumps(row) + "\n" + GOOD.replace('"timestamp": 0', '"timestamp": 7.5'))
    rows = load_trace(path)
    assert [(r.line, r.timestamp_ms, r.hash_ids) for r in rows] == [
        (1, 0.0, (1, 2)),
        (2, 7.5, (1, 2)),
    ]


# -- block text against the real tokenizer ---------------------------------------------------


@pytest.mark.parametrize("input_length", [1, 200, 511, 512, 513, 1100, 2048, 5000])
@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_a_prompt_is_exactly_input_length_tokens(
    tok: Tokenizer, blocks: BlockText, input_length: int
) -> None:
    n_blocks = -(-input_length // BLOCK_TOKENS)
    prompt = blocks.prompt(_req(tuple(range(100, 100 + n_blocks)), input_length))
    assert len(_ids(tok, prompt)) == input_length  # tolerance 0 for the trace's own tokens
    # What the engine sees adds a fixed salt in front; the blocks still tokenize the same.
    salted = _ids(tok, "trace.0.replay.envoy-rr" + prompt)
    assert salted[-input_length:] == _ids(tok, prompt)


def test_shared_hash_ids_give_shared_token_prefixes(tok: Tokenizer, blocks: BlockText) -> None:
    # A system prompt of 2 blocks, two sessions, and a later turn of session a.
    a = _ids(tok, "salt" + blocks.prompt(_req((7, 8, 20, 21), 1900)))
    b = _ids(tok, "salt" + blocks.prompt(_req((7, 8, 30), 1300)))
    a2 = _ids(tok, "salt" + blocks.prompt(_req((7, 8, 20, 21, 22, 23), 2900)))
    salt = len(_ids(tok, "salt"))
    assert a != b
    assert _common(a, b) >= salt + 2 * BLOCK_TOKENS  # the 2 shared blocks, token for token
    assert _common(a, b) < salt + 3 * BLOCK_TOKENS  # and not the third (ids 20 and 30 differ)
    # a's last block (21) is partial; a2 has the same block in full: a is a prefix of a2.
    assert a2[: len(a)] == a
    # Same ids, other seed: other text (a run can pick fresh content without changing shape).
    other = _ids(tok, "salt" + BlockText(tok, seed=1).prompt(_req((7, 8, 30), 1300)))
    assert _common(b, other) < salt + 8


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
def test_block_text_is_the_same_in_another_process(
    blocks: BlockText, qwen_tokenizer_dir: Path
) -> None:
    req = _req((3, 1, 4, 1, 5), 2300)
    mine = hashlib.sha256(blocks.prompt(req).encode()).hexdigest()
    code = (
        "import hashlib, sys; from pathlib import Path; from tokenizers import Tokenizer;"
        "from bench.traces import BlockText, TraceRequest;"
        "t = Tokenizer.from_file(str(Path(sys.argv[1]) / 'tokenizer.json'));"
        "r = TraceRequest(0, 0.0, (3, 1, 4, 1, 5), 512, 2300, 1);"
        "print(hashlib.sha256(BlockText(t).prompt(r).encode()).hexdigest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different str hash than ours
    out = subprocess.run(
        [sys.executable, "-c", code, str(qwen_tokenizer_dir)],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert out.stdout.strip() == mine


def test_a_partial_block_is_a_prefix_of_the_full_block(blocks: BlockText) -> None:
    full = blocks.block(9, 512, of=512)
    assert full.startswith(blocks.block(9, 100, of=512))
    assert full != blocks.block(10, 512, of=512)
    with pytest.raises(ValueError):
        blocks.block(9, 513, of=512)


# -- scaling and the schedule ----------------------------------------------------------------


def _trace(*rows: tuple[float, int, int, list[int]]) -> list[str]:
    return [
        json.dumps({"timestamp": t, "input_length": n, "output_length": o, "hash_ids": h})
        for t, n, o, h in rows
    ]


ROWS = _trace(
    (1000, 700, 50, [0, 1]), (1000, 300, 8, [0]), (3500, 1100, 120, [0, 1, 2]), (9000, 10, 1, [5])
)


@pytest.mark.parametrize(
    ("time_scale", "want"),
    [(1.0, [0, 0, 2.5, 8.0]), (0.5, [0, 0, 1.25, 4.0]), (2.0, [0, 0, 5, 16])],
)
def test_time_scaling_sets_the_schedule(time_scale: float, want: list[float]) -> None:
    reqs = scale_trace(parse_trace(ROWS), TraceScaling(time_scale=time_scale))
    assert [r.start_s for r in reqs] == pytest.approx(want)


def test_length_scaling_keeps_the_block_structure_and_the_cap_keeps_the_first_rows(
    tok: Tokenizer, blocks: BlockText
) -> None:
    scaling = TraceScaling(input_scale=0.25, output_scale=0.5, max_requests=3)
    reqs = scale_trace(parse_trace(ROWS), scaling)
    assert [r.line for r in reqs] == [1, 2, 3]
    assert {r.block_tokens for r in reqs} == {128}
    # 700 = 512 + 188 -> 128 + 47; 300 -> 75; 1100 = 2 x 512 + 76 -> 2 x 128 + 19
    assert [r.input_tokens for r in reqs] == [175, 75, 275]
    assert [r.output_tokens for r in reqs] == [25, 4, 60]
    ids = [_ids(tok, blocks.prompt(r)) for r in reqs]
    assert [len(x) for x in ids] == [175, 75, 275]
    assert ids[2][:128] == ids[0][:128] and ids[1] == ids[0][:75]
    with pytest.raises(ValueError, match="time_scale"):
        TraceScaling(time_scale=0)


def test_the_trace_workload_carries_the_schedule_and_lengths(
    tmp_path: Path, tok: Tokenizer
) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(ROWS) + "\n")
    params = {"path": str(path), "time_scale": 0.5, "output_scale": 2.0}
    convs = build_workload("trace", params, text=TextFactory(tok, 0), seed=0, salt="S1")
    assert [c.at_s for c in convs] == pytest.approx([0, 0, 1.25, 4.0])
    assert [c.turns[0].max_tokens for c in convs] == [100, 16, 240, 2]
    for conv, n in zip(convs, (700, 300, 1100, 10), strict=True):
        assert len(_ids(tok, conv.turns[0].user)) == len(_ids(tok, "S1")) + n
    again = build_workload("trace", params, text=TextFactory(tok, 0), seed=0, salt="S2")
    assert {c.turns[0].user for c in convs}.isdisjoint(c.turns[0].user for c in again)
    with pytest.raises(ValueError, match="unknown params"):
        build_workload("trace", {**params, "speed": 2}, text=TextFactory(tok, 0), seed=0, salt="")


# -- the sample trace ------------------------------------------------------------------------


def test_the_sample_trace_is_what_its_script_writes_from_the_seed() -> None:
    assert DEFAULT_PATH.read_text() == render_jsonl(make_sample(SampleParams()))
    assert render_jsonl(make_sample(SampleParams(seed=1))) != DEFAULT_PATH.read_text()


def test_the_sample_trace_has_multi_turn_reuse_and_shared_system_prompts(
    tok: Tokenizer, blocks: BlockText
) -> None:
    rows = load_trace(DEFAULT_PATH)
    assert 200 <= len(rows) <= 500
    # Shared system prompts: every prompt opens with one of a few applications' blocks.
    by_app: dict[int, list[tuple[int, ...]]] = {}
    for r in rows:
        by_app.setdefault(r.hash_ids[0], []).append(r.hash_ids)
    assert 3 <= len(by_app) <= 6
    assert max(len(v) for v in by_app.values()) >= 50
    # Multi-turn reuse: a row shares more than its application's system blocks with an
    # earlier row (the turn before it in the same session).
    system = {app: min(_common(list(v[0]), list(x)) for x in v) for app, v in by_app.items()}
    turns = 0
    for i, r in enumerate(rows):
        s = system[r.hash_ids[0]]
        turns += any(_common(list(p.hash_ids), list(r.hash_ids)) > s for p in rows[:i])
    assert turns >= 80
    # Every prompt is exactly its input_length in real tokens (the first 40, to keep it quick).
    for req in scale_trace(rows, TraceScaling(max_requests=40)):
        assert len(_ids(tok, blocks.prompt(req))) == req.input_tokens


# -- trace arrivals against a real simulator -------------------------------------------------


@pytest.mark.slow  # >= 1 s in test-fast (issue 27 #12)
async def test_trace_arrivals_start_in_schedule_order_and_reuse_the_prefix(
    sim: SimServer, tok: Tokenizer, blocks: BlockText
) -> None:
    reqs = [  # listed out of order: the generator sorts by at_s
        (0.30, _req((1, 2, 3), 1300)),
        (0.00, _req((1, 2), 700)),
        (0.15, _req((1, 9), 900)),
    ]
    convs = [
        Conversation(f"r{i}", (Turn("salt" + blocks.prompt(r), 3),), at_s=at)
        for i, (at, r) in enumerate(reqs)
    ]
    gen = LoadGenerator(sim.url, model=sim.config.model, max_duration_s=20)
    result = await gen.run(convs, Arrival(ArrivalKind.TRACE, concurrency=0))
    assert all(r.ok for r in result.records), [r.error for r in result.records]
    order = sorted(result.records, key=lambda r: r.start_s)
    assert [r.conversation_id for r in order] == ["r1", "r2", "r0"]
    due = {c.conversation_id: c.at_s or 0.0 for c in convs}
    for rec in order:
        assert rec.start_s >= due[rec.conversation_id] - 0.005  # never sent before its time
    cached = {r.conversation_id: r.cached_tokens or 0 for r in result.records}
    # r0 starts with all of r1 (block 1, and block 2 of which r1 had the first 188 tokens);
    # the engine caches whole 16-token blocks of it.
    assert 700 - 16 <= cached["r0"] < 700 + 16
    with pytest.raises(ValueError, match="at_s"):
        await gen.run([Conversation("x", (Turn("hi", 1),))], Arrival(ArrivalKind.TRACE))


# -- scenarios -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["trace", "higress"])
def test_the_new_scenarios_load_full_and_quick(name: str) -> None:
    for quick in (False, True):
        sc = load_scenario(SCENARIOS / f"{name}.yaml", quick=quick)
        assert sc.loads and sc.baseline == "envoy-rr"
    higress = load_scenario(SCENARIOS / "higress.yaml")
    assert higress.workload_params == {
        "sessions": 60, "turns": 5, "user_tokens": 200, "output_tokens": 800,
        "output_spread": 0.25,  # against the lockstep of deterministic simulators (3.6)
    }  # fmt: skip
    assert higress.loads[0].arrival.concurrency == 20


def test_skip_requests_replays_a_later_window_from_its_first_row() -> None:
    rows = parse_trace(
        json.dumps({"timestamp": t, "input_length": 10, "output_length": 1, "hash_ids": [t]})
        for t in (0, 100, 250, 400)
    )
    out = scale_trace(rows, TraceScaling(skip_requests=1, max_requests=2))
    assert [r.hash_ids for r in out] == [(100,), (250,)]
    assert [r.start_s for r in out] == [0.0, 0.15]
    with pytest.raises(ValueError, match="skip_requests"):
        TraceScaling(skip_requests=-1)
